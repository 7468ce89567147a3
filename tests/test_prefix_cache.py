"""The host prefix cache: content lookup, pins, LRU eviction, all-or-nothing refusals."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlife.offload import HostPrefixCache, PageAllocator, PrefixCacheError
from tests.builds import refused, takes_bool_as_number


def _filled(pages: int = 4) -> tuple[HostPrefixCache, PageAllocator]:
    allocator = PageAllocator(pages)
    cache = HostPrefixCache()
    taken = allocator.alloc(pages)
    assert taken is not None
    for page in taken:
        assert cache.insert(f"h{page}", page)
    return cache, allocator


def test_a_lookup_returns_the_cached_prefix_and_counts_hits_and_misses() -> None:
    cache, _ = _filled()
    assert cache.lookup(["h0", "h1", "x", "h2"]) == [0, 1]  # stops at the first miss
    assert cache.lookup(["h3"]) == [3]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.inserts) == (3, 1, 4)
    assert cache.insert("h0", 9) is False  # the content is cached already: not taken
    with pytest.raises(PrefixCacheError, match="page 1 is cached already"):
        cache.insert("other", 1)


def test_eviction_is_least_recently_used_and_never_takes_a_pinned_page() -> None:
    cache, allocator = _filled()
    cache.pin([0, 1])  # two loads read h0 and h1
    assert cache.pinned == {0, 1} and cache.evictable == 2
    assert cache.evict(3) is None and len(cache) == 4  # too few evictable: nothing
    assert cache.take(allocator, 3) is None and allocator.available == 0
    cache.unpin([0])  # h0 is evictable again, as the most recently used
    assert cache.evict(2) == [2, 3]
    assert cache.stats.evictions == 2 and "h2" not in cache and "h0" in cache
    allocator.free([2, 3])
    taken = cache.take(allocator, 3)  # the two free pages, and h0 evicted for the third
    assert taken is not None and sorted(taken) == [0, 2, 3] and "h0" not in cache
    assert cache.pinned == {1} and cache.pins(1) == 1


def test_an_eviction_of_a_negative_count_is_refused_and_changes_nothing() -> None:
    cache, _ = _filled()
    with pytest.raises(PrefixCacheError, match="evict needs a page count >= 0, got -1"):
        cache.evict(-1)  # before: [] (nothing changed, nothing said)
    assert len(cache) == 4 and cache.evictable == 4 and cache.stats.evictions == 0
    assert cache.evict(0) == []


def test_pins_count_and_refusals_change_nothing() -> None:
    cache, _ = _filled(2)
    cache.pin([0])
    cache.pin([0])
    with pytest.raises(PrefixCacheError, match="page 5 is not cached"):
        cache.pin([1, 5])
    assert cache.pins(1) == 0 and cache.pins(0) == 2
    with pytest.raises(PrefixCacheError, match="page 0 is not pinned 3 time"):
        cache.unpin([0, 0, 0])
    cache.unpin([0, 0])
    assert not cache.pinned and cache.evictable == 2


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "insert_all", "lookup", "pin", "unpin", "take", "touch"]),
            st.integers(0, 7),
        ),
        max_size=80,
    )
)
def test_the_cache_behaves_as_a_plain_model(ops: list[tuple[str, int]]) -> None:
    allocator = PageAllocator(8)
    cache = HostPrefixCache()
    lru: OrderedDict[str, int] = OrderedDict()  # the model: unpinned, oldest first
    pins: dict[int, int] = {}
    key_of: dict[int, str] = {}
    owned: set[int] = set()  # pages the test holds (allocated, not cached)
    for op, n in ops:
        if op == "insert" and owned:
            page = min(owned)
            owned.discard(page)
            key = f"k{n}"
            if key in lru or key in key_of.values():
                assert cache.insert(key, page) is False
                allocator.free([page])
            else:
                assert cache.insert(key, page)
                lru[key] = page
                key_of[page] = key
        elif op == "insert_all" and owned:
            pages = sorted(owned)[: n % 3 + 1]
            keys = [f"k{(n + i) % 8}" for i in range(len(pages))]
            expected_spare = []
            for key, page in zip(keys, pages, strict=True):
                owned.discard(page)
                if key in key_of.values():
                    expected_spare.append(page)
                else:
                    lru[key] = page
                    key_of[page] = key
            assert cache.insert_all(keys, pages) == expected_spare
            allocator.free(expected_spare)
        elif op == "touch":
            keys = [f"k{(n + i) % 8}" for i in range(3)]
            cache.touch(keys)
            for key in keys:
                if key in lru:
                    lru.move_to_end(key)
        elif op == "lookup":
            keys = [f"k{i}" for i in range(n)]
            expected = []
            for key in keys:
                page = next((p for p, k in key_of.items() if k == key), None)
                if page is None:
                    break
                expected.append(page)
            assert cache.lookup(keys) == expected
        elif op == "pin" and key_of:
            page = sorted(key_of)[n % len(key_of)]
            cache.pin([page])
            if not pins.get(page):
                del lru[key_of[page]]
            pins[page] = pins.get(page, 0) + 1
        elif op == "unpin" and pins:
            page = sorted(pins)[n % len(pins)]
            cache.unpin([page])
            pins[page] -= 1
            if not pins[page]:
                del pins[page]
                lru[key_of[page]] = page
        elif op == "take":
            count = n % 4 + 1
            short = count - allocator.available
            taken = cache.take(allocator, count)
            if short > len(lru):
                assert taken is None
                continue
            victims = []
            for _ in range(max(short, 0)):
                _, page = lru.popitem(last=False)
                del key_of[page]
                victims.append(page)
            assert taken is not None and len(taken) == count
            assert list(taken[len(taken) - len(victims) :]) == victims  # oldest first
            owned |= set(taken)
        assert (
            cache.pinned == set(pins) and cache.evictable == len(lru) and len(cache) == len(key_of)
        )
        assert allocator.available + len(owned) + len(key_of) == 8


def test_take_hands_free_pages_first_then_evicted_ones_still_allocated() -> None:
    allocator = PageAllocator(4)
    cache = HostPrefixCache()
    taken = allocator.alloc(3)
    assert taken == (0, 1, 2)
    for page in taken:
        assert cache.insert(f"h{page}", page)
    pages = cache.take(allocator, 3)  # page 3 is free; two cached pages are evicted
    assert pages == (3, 0, 1) and allocator.available == 0
    assert all(allocator.is_allocated(page) for page in pages)  # now the caller's
    assert "h0" not in cache and "h2" in cache and cache.stats.evictions == 2


def test_missing_names_each_absent_key_once_and_leaves_out_skipped_ones() -> None:
    cache, _ = _filled(2)
    absent, held = cache.missing(["h0", "x", "y", "x", "h1", "z"], skip={"y"})
    assert absent == [1, 5] and held == ["h0", "h1"]
    assert (cache.stats.hits, cache.stats.misses) == (0, 0)  # counts nothing


def test_bad_pages_and_keys_are_refused_and_insert_nothing() -> None:
    cache, _ = _filled(2)
    before = (len(cache), cache.evictable, cache.stats.inserts)
    with refused(PrefixCacheError, "-1 is not a page number"):
        cache.insert_all(["a", "b"], [5, -1])
    with pytest.raises(PrefixCacheError, match="page 7 is listed twice"):
        cache.insert_all(["a", "b", "c"], [6, 7, 7])
    with pytest.raises(TypeError, match="unhashable"):
        cache.insert_all(["a", ["not", "hashable"]], [6, 7])
    assert (len(cache), cache.evictable, cache.stats.inserts) == before
    assert "a" not in cache and cache.lookup(["a"]) == []
    assert cache.insert_all(["a", "b"], [6, 7]) == []  # the pages were left free
    assert cache.evict(4) == [0, 1, 6, 7]


def test_pages_far_apart_and_a_touch_reorder_eviction() -> None:
    cache = HostPrefixCache()
    assert cache.insert_all(["a", "b", "c"], [1000, 3, 40]) == []
    cache.touch(["a", "missing"])
    cache.pin([3])
    cache.touch(["b"])  # pinned: passed over
    assert cache.evict(2) == [40, 1000] and cache.evict(1) is None
    cache.unpin([3])
    assert cache.evict(1) == [3] and len(cache) == 0 and cache.evictable == 0


@takes_bool_as_number
def test_a_bool_is_not_a_page_number() -> None:
    cache, _ = _filled(2)
    with pytest.raises(PrefixCacheError, match="True is not a page number"):
        cache.insert("a", True)
    assert len(cache) == 2 and "a" not in cache

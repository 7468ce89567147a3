"""A host prefix cache: host pages of finished requests, found by content.

Each cached page holds one page of KV whose content is named by a key (a page hash that
chains the prefix before it, as vLLM's block hashes and SGLang's page hashes do), so a
later request with the same prefix finds its pages by looking up its own keys in order.
A page that a load reads is *pinned* and never evicted until it is unpinned; the others
are evicted least recently used first when new stores need pages.

The cache holds page *numbers*; who owns the memory is the caller's business (a
[`HostPagePool`][kvlife.offload.host_pool.HostPagePool] on a worker, a
[`PageAllocator`][kvlife.offload.pages.PageAllocator] on a scheduler). Every
operation is O(1) per page: the pinned pages are kept out of the eviction order, so an
eviction never scans past them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvlife.offload.errors import PrefixCacheError
from kvlife.offload.pages import PageAllocator


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made."""

    #: Pages found by ``lookup`` (the prefix that was cached).
    hits: int = 0
    #: Lookups that stopped at a key the cache did not hold.
    misses: int = 0
    #: Pages inserted / evicted.
    inserts: int = 0
    evictions: int = 0


class HostPrefixCache:
    """Content-addressed host pages with pins and least-recently-used eviction."""

    def __init__(self) -> None:
        self._lru: OrderedDict[Hashable, int] = OrderedDict()  # unpinned, oldest first
        self._pinned: dict[Hashable, int] = {}  # key -> page, while a load reads it
        self._key: dict[int, Hashable] = {}  # page -> key, for every cached page
        self._pins: dict[int, int] = {}  # page -> loads reading it
        self.stats = PrefixCacheStats()
        #: When a list, every evicted key is appended to it, in order (for an owner that
        #: tells others what the cache holds); ``None`` (the default): nothing is kept.
        self.evicted: list[Hashable] | None = None

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, key: object) -> bool:
        return key in self._lru or key in self._pinned

    @property
    def evictable(self) -> int:
        """Cached pages that no load reads."""
        return len(self._lru)

    @property
    def pinned(self) -> frozenset[int]:
        """Cached pages that loads read now."""
        return frozenset(self._pins)

    def pins(self, page: int) -> int:
        """Loads reading ``page`` now (0 for a page that is not pinned or not cached)."""
        return self._pins.get(page, 0)

    def insert(self, key: Hashable, page: int) -> bool:
        """Cache ``page`` under ``key``, most recently used. Returns ``False`` (and takes
        nothing: the caller keeps the page) when ``key`` is cached already.

        Raises:
            PrefixCacheError: ``page`` is cached already (under any key).
        """
        return not self.insert_all((key,), (page,))

    def insert_all(self, keys: Sequence[Hashable], pages: Sequence[int]) -> list[int]:
        """``insert`` each of ``pages`` under the key at the same place of ``keys``;
        returns the pages not taken (their key was cached already, or listed before).

        Raises:
            PrefixCacheError: a page is cached already, or the lengths differ. Nothing
                was inserted.
        """
        key_of, lru, pinned = self._key, self._lru, self._pinned
        if len(keys) != len(pages):
            raise PrefixCacheError(f"{len(pages)} pages for {len(keys)} keys; nothing inserted")
        if not key_of.keys().isdisjoint(pages):
            cached = next(page for page in pages if page in key_of)
            raise PrefixCacheError(f"page {cached} is cached already; nothing inserted")
        spare = []
        for key, page in zip(keys, pages, strict=True):
            if key in lru or key in pinned:
                spare.append(page)
            else:
                lru[key] = page
                key_of[page] = key
        self.stats.inserts += len(pages) - len(spare)
        return spare

    def missing(
        self, keys: Sequence[Hashable], skip: Container[Hashable] = ()
    ) -> tuple[list[int], list[Hashable]]:
        """Which of ``keys`` the cache does not hold, as positions in ``keys`` (each key
        once, at its first position; keys in ``skip`` left out), and which it holds (the
        keys). Counts nothing and changes nothing."""
        lru, pinned = self._lru, self._pinned
        absent: dict[Hashable, int] = {}
        held: list[Hashable] = []
        for index, key in enumerate(keys):
            if key in lru or key in pinned:
                held.append(key)
            elif key not in skip:
                absent.setdefault(key, index)
        return list(absent.values()), held

    def lookup(self, keys: Iterable[Hashable]) -> list[int]:
        """The pages of the longest cached prefix of ``keys``, in order. Counts a hit per
        page and a miss when it stops at a key the cache does not hold; changes nothing
        else (pin the pages to load them)."""
        pages = []
        for key in keys:
            page = self._lru.get(key)
            if page is None:
                page = self._pinned.get(key)
            if page is None:
                self.stats.misses += 1
                break
            pages.append(page)
        self.stats.hits += len(pages)
        return pages

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Make the cached pages of ``keys`` the most recently used (they are needed
        again), in the order given; keys not cached, or pinned, are passed over."""
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)

    def pin(self, pages: Sequence[int]) -> None:
        """Mark ``pages`` as read by one more load each (they move out of the eviction
        order) and as the most recently used.

        Raises:
            PrefixCacheError: a page is not cached. Nothing was pinned.
        """
        key_of = self._key
        for page in pages:
            if page not in key_of:
                raise PrefixCacheError(f"page {page} is not cached; nothing pinned")
        lru, pinned, pins = self._lru, self._pinned, self._pins
        for page in pages:
            count = pins.get(page, 0)
            if not count:
                key = key_of[page]
                pinned[key] = lru.pop(key)
            pins[page] = count + 1

    def unpin(self, pages: Sequence[int]) -> None:
        """One load of each of ``pages`` is over; a page no load reads any more is
        evictable again, as the most recently used.

        Raises:
            PrefixCacheError: a page is not pinned (as often as listed). Nothing changed.
        """
        need: dict[int, int] = {}
        for page in pages:
            need[page] = need.get(page, 0) + 1
        for page, count in need.items():
            if self._pins.get(page, 0) < count:
                raise PrefixCacheError(f"page {page} is not pinned {count} time(s)")
        lru, pinned, pins = self._lru, self._pinned, self._pins
        for page in pages:
            count = pins[page] - 1
            if count:
                pins[page] = count
            else:
                del pins[page]
                key = self._key[page]
                lru[key] = pinned.pop(key)

    def evict(self, count: int) -> list[int] | None:
        """Take ``count`` least recently used pages that no load reads out of the cache
        and return them (the caller frees them), or ``None`` (nothing evicted) when fewer
        are evictable."""
        lru = self._lru
        if count > len(lru):
            return None
        pages = []
        evicted = self.evicted
        for _ in range(count):
            key, page = lru.popitem(last=False)
            del self._key[page]
            pages.append(page)
            if evicted is not None:
                evicted.append(key)
        self.stats.evictions += count
        return pages

    def take(self, allocator: PageAllocator, count: int) -> tuple[int, ...] | None:
        """``count`` pages: the free pages of ``allocator`` first, then least recently
        used cached pages taken out of the cache (they stay allocated: they pass from the
        cache to the caller); ``None`` (nothing allocated, nothing evicted) when free and
        evictable pages together are too few."""
        free = allocator.available
        if free >= count:
            return allocator.alloc(count)
        short = count - free
        if short > len(self._lru):
            return None
        victims = self.evict(short)
        assert victims is not None
        head = allocator.alloc(free) if free else None
        return (head or ()) + tuple(victims)

    def __repr__(self) -> str:
        return f"<HostPrefixCache {len(self)} pages, {len(self._pinned)} pinned>"


__all__ = ["HostPrefixCache", "PrefixCacheError", "PrefixCacheStats"]

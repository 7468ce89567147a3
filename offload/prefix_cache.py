"""A host prefix cache: host pages of finished requests, found by content.

Each cached page holds one page of KV whose content is named by a key (a page hash that
chains the prefix before it, as vLLM's block hashes and SGLang's page hashes do), so a
later request with the same prefix finds its pages by looking up its own keys in order.
A page that a load reads is *pinned* and never evicted until it is unpinned; the others
are evicted least recently used first when new stores need pages.

The cache holds page *numbers* (non-negative ints); who owns the memory is the caller's
business (a [`HostPagePool`][kvlife.offload.host_pool.HostPagePool] on a worker, a
[`PageAllocator`][kvlife.offload.pages.PageAllocator] on a scheduler). Every
operation is O(1) per page: the pinned pages are kept out of the eviction order, so an
eviction never scans past them.

One dict maps a key to its page; everything else is kept per page number, in lists: the
key of each page, and the eviction order as a doubly linked list threaded through two
lists of page numbers. A look-up is one dict probe, an eviction or a touch a few list
stores, with no per-call ``OrderedDict`` method (the compiled build turns the list work
into C).
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

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


_NO_KEY: Final[Hashable] = object()  # the key of a page the cache does not hold
_CLAIMED: Final[Hashable] = object()  # the key of a page insert_all is inserting
_END: Final = -1  # no page: either end of the eviction order
_UNLINKED: Final = -2  # the "previous page" of a page out of the order (pinned, not cached)


class HostPrefixCache:
    """Content-addressed host pages with pins and least-recently-used eviction."""

    def __init__(self) -> None:
        self._page: dict[Hashable, int] = {}  # key -> page, for every cached page
        self._key: list[Hashable] = []  # page -> key (_NO_KEY: not cached)
        self._pins: dict[int, int] = {}  # page -> loads reading it
        # The eviction order of the cached pages no load reads: oldest at _head, newest at
        # _tail, linked through _prev and _next (indexed by page; _UNLINKED in _prev for a
        # page out of the order). Invariant: _linked == len(_page) - len(_pins).
        self._prev: list[int] = []
        self._next: list[int] = []
        self._head = _END
        self._tail = _END
        self._linked = 0
        self.stats = PrefixCacheStats()
        #: When a list, every evicted key is appended to it, in order (for an owner that
        #: tells others what the cache holds); ``None`` (the default): nothing is kept.
        self.evicted: list[Hashable] | None = None

    def __len__(self) -> int:
        return len(self._page)

    def __contains__(self, key: object) -> bool:
        return key in self._page

    @property
    def evictable(self) -> int:
        """Cached pages that no load reads."""
        return self._linked

    @property
    def pinned(self) -> frozenset[int]:
        """Cached pages that loads read now."""
        return frozenset(self._pins)

    def pins(self, page: int) -> int:
        """Loads reading ``page`` now (0 for a page that is not pinned or not cached)."""
        return self._pins.get(page, 0)

    def _cached(self, page: object) -> bool:
        return type(page) is int and 0 <= page < len(self._key) and self._key[page] is not _NO_KEY

    def _append(self, page: int) -> None:
        """Link ``page`` (out of the order) as the most recently used."""
        tail = self._tail
        self._prev[page] = tail
        self._next[page] = _END
        if tail == _END:
            self._head = page
        else:
            self._next[tail] = page
        self._tail = page
        self._linked += 1

    def _unlink(self, page: int) -> None:
        """Take ``page`` (in the order) out of the order."""
        before, after = self._prev[page], self._next[page]
        if before == _END:
            self._head = after
        else:
            self._next[before] = after
        if after == _END:
            self._tail = before
        else:
            self._prev[after] = before
        self._prev[page] = _UNLINKED
        self._linked -= 1

    def insert(self, key: Hashable, page: int) -> bool:
        """Cache ``page`` under ``key``, most recently used. Returns ``False`` (and takes
        nothing: the caller keeps the page) when ``key`` is cached already.

        Raises:
            PrefixCacheError: ``page`` is cached already (under any key), or is not a
                page number (a non-negative int).
        """
        return not self.insert_all((key,), (page,))

    def insert_all(self, keys: Sequence[Hashable], pages: Sequence[int]) -> list[int]:
        """``insert`` each of ``pages`` under the key at the same place of ``keys``;
        returns the pages not taken (their key was cached already, or listed before).

        Raises:
            PrefixCacheError: a page is cached already, is listed twice, or is not a page
                number (a non-negative int), or the lengths differ. Nothing was inserted.
            TypeError: a key is not hashable. Nothing was inserted.
        """
        count = len(pages)
        if len(keys) != count:
            raise PrefixCacheError(f"{count} pages for {len(keys)} keys; nothing inserted")
        key_of = self._key
        top = -1
        for page in pages:
            if type(page) is not int or page < 0:
                raise PrefixCacheError(f"{page!r} is not a page number; nothing inserted")
            top = max(top, page)  # compiled, max() of two is a comparison (of a list, a call)
        if top >= len(key_of):
            grow = top + 1 - len(key_of)
            key_of.extend([_NO_KEY] * grow)
            self._prev.extend([_UNLINKED] * grow)
            self._next.extend([_END] * grow)
        for i in range(count):  # each page free and listed once: claimed while checked
            page = pages[i]
            held = key_of[page]
            if held is not _NO_KEY:
                for claimed in pages[:i]:
                    key_of[claimed] = _NO_KEY
                why = "is listed twice" if held is _CLAIMED else "is cached already"
                raise PrefixCacheError(f"page {page} {why}; nothing inserted")
            key_of[page] = _CLAIMED
        page_of, prev, after = self._page, self._prev, self._next
        tail = self._tail
        spare = []
        i = 0
        try:
            while i < count:
                key, page = keys[i], pages[i]
                if key in page_of:
                    key_of[page] = _NO_KEY
                    spare.append(page)
                else:
                    page_of[key] = page
                    key_of[page] = key
                    prev[page] = tail  # linked as the most recently used (_append, inline)
                    after[page] = _END
                    if tail == _END:
                        self._head = page
                    else:
                        after[tail] = page
                    tail = page
                i += 1
        except BaseException:  # an unhashable key: the pages inserted before it go out
            self._tail = tail
            self._linked += i - len(spare)
            for page in pages[:i]:
                if page not in spare:
                    self._unlink(page)
                    del page_of[key_of[page]]
                    key_of[page] = _NO_KEY
            for page in pages[i:]:
                key_of[page] = _NO_KEY
            raise
        self._tail = tail
        self._linked += count - len(spare)
        self.stats.inserts += count - len(spare)
        return spare

    def missing(
        self, keys: Sequence[Hashable], skip: Container[Hashable] = ()
    ) -> tuple[list[int], list[Hashable]]:
        """Which of ``keys`` the cache does not hold, as positions in ``keys`` (each key
        once, at its first position; keys in ``skip`` left out), and which it holds (the
        keys). Counts nothing and changes nothing."""
        page_of = self._page
        absent: dict[Hashable, int] = {}
        held: list[Hashable] = []
        for index, key in enumerate(keys):
            if key in page_of:
                held.append(key)
            elif key not in skip:
                absent.setdefault(key, index)
        return list(absent.values()), held

    def lookup(self, keys: Iterable[Hashable]) -> list[int]:
        """The pages of the longest cached prefix of ``keys``, in order. Counts a hit per
        page and a miss when it stops at a key the cache does not hold; changes nothing
        else (pin the pages to load them)."""
        page_of = self._page
        pages = []
        for key in keys:
            page = page_of.get(key)
            if page is None:
                self.stats.misses += 1
                break
            pages.append(page)
        self.stats.hits += len(pages)
        return pages

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Make the cached pages of ``keys`` the most recently used (they are needed
        again), in the order given; keys not cached, or pinned, are passed over."""
        page_of, prev = self._page, self._prev
        for key in keys:
            page = page_of.get(key)
            if page is not None and prev[page] != _UNLINKED and page != self._tail:
                self._unlink(page)
                self._append(page)

    def pin(self, pages: Sequence[int]) -> None:
        """Mark ``pages`` as read by one more load each (they move out of the eviction
        order) and as the most recently used.

        Raises:
            PrefixCacheError: a page is not cached. Nothing was pinned.
        """
        for page in pages:
            if not self._cached(page):
                raise PrefixCacheError(f"page {page!r} is not cached; nothing pinned")
        pins = self._pins
        for page in pages:
            count = pins.get(page, 0)
            if not count:
                self._unlink(page)
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
        pins = self._pins
        for page, count in need.items():
            if pins.get(page, 0) < count:
                raise PrefixCacheError(f"page {page!r} is not pinned {count} time(s)")
        for page in pages:
            count = pins[page] - 1
            if count:
                pins[page] = count
            else:
                del pins[page]
                self._append(page)

    def evict(self, count: int) -> list[int] | None:
        """Take ``count`` least recently used pages that no load reads out of the cache
        and return them (the caller frees them), or ``None`` (nothing evicted) when fewer
        are evictable.

        Raises:
            PrefixCacheError: ``count`` is negative. Nothing evicted.
        """
        if count < 0:
            raise PrefixCacheError(f"evict needs a page count >= 0, got {count}; nothing evicted")
        if count > self._linked:
            return None
        page_of, key_of, prev, after = self._page, self._key, self._prev, self._next
        pages = []
        evicted = self.evicted
        head = self._head
        for _ in range(count):  # the oldest first: each is the head (_unlink, inline)
            page = head
            head = after[page]
            prev[page] = _UNLINKED
            key = key_of[page]
            key_of[page] = _NO_KEY
            del page_of[key]
            pages.append(page)
            if evicted is not None:
                evicted.append(key)
        self._head = head
        if head == _END:
            self._tail = _END
        else:
            prev[head] = _END
        self._linked -= len(pages)
        self.stats.evictions += len(pages)
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
        if short > self._linked:
            return None
        victims = self.evict(short)
        assert victims is not None
        head = allocator.alloc(free) if free else None
        return (head or ()) + tuple(victims)

    def __repr__(self) -> str:
        return f"<HostPrefixCache {len(self)} pages, {len(self._pins)} pinned>"


__all__ = ["HostPrefixCache", "PrefixCacheError", "PrefixCacheStats"]

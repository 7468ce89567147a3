"""Host page numbers without memory: the accounting of a host page pool, for a scheduler
that decides which host pages its workers fill (no torch).

[`PageAllocator`][kvlife.offload.pages.PageAllocator] hands page numbers out and takes them
back, all or nothing; [`HostPagePool`][kvlife.offload.host_pool.HostPagePool] is one with
the memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvlife.offload.errors import DoubleFreeError, ForeignPageError, HostPageError


def page_runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive page numbers as ``(first page, count)``, in order."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


class PageAllocator:
    """Page numbers ``0 .. pages-1``, handed out and taken back: the accounting of a
    [`HostPagePool`][kvlife.offload.host_pool.HostPagePool] without its memory, for a
    scheduler that decides which host pages its workers fill.

    ``alloc(n)`` hands out ``n`` pages or none; a fresh allocator hands pages out in order
    and freed pages are reused first, so allocations come in long runs of consecutive
    pages. ``free`` is all or nothing: a double free or a page out of range raises and
    frees none of the pages given.
    """

    __slots__ = ("_allocated", "_free")

    def __init__(self, pages: int) -> None:
        if not isinstance(pages, int) or isinstance(pages, bool) or pages <= 0:
            raise ValueError(f"pages must be a positive int, got {pages!r}")
        self._free: list[int] = list(range(pages - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._allocated = bytearray(pages)  # 1 while a page is handed out

    @property
    def capacity(self) -> int:
        """Pages in all."""
        return len(self._allocated)

    @property
    def available(self) -> int:
        """Pages free now."""
        return len(self._free)

    def alloc(self, n: int) -> tuple[int, ...] | None:
        """``n`` pages, or ``None`` if fewer than ``n`` are free (nothing allocated then)."""
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"alloc needs a positive page count, got {n!r}")
        free = self._free
        if len(free) < n:
            return None
        taken = free[-n:]
        del free[-n:]
        taken.reverse()
        for index in taken:
            self._allocated[index] = 1
        return tuple(taken)

    def free(self, indices: Sequence[int]) -> None:
        """Take pages back. All or nothing: on an error no page was freed.

        Raises:
            ForeignPageError: an index is out of range.
            DoubleFreeError: a page is already free or listed twice.
        """
        allocated = self._allocated
        if len(set(indices)) != len(indices):
            raise DoubleFreeError(f"pages {list(indices)[:8]} list a page twice; nothing freed")
        for index in indices:
            if not 0 <= index < len(allocated):
                raise ForeignPageError(f"page {index} is out of range; nothing freed")
            if not allocated[index]:
                raise DoubleFreeError(f"page {index} is already free; nothing freed")
        for index in indices:
            allocated[index] = 0
        self._free.extend(sorted(indices, reverse=True))

    def is_allocated(self, index: int) -> bool:
        """Whether page ``index`` is handed out.

        Raises:
            ForeignPageError: ``index`` is out of range (a negative one included).
        """
        allocated = self._allocated
        if not 0 <= index < len(allocated):
            raise ForeignPageError(f"page {index} is out of range (0..{len(allocated) - 1})")
        return bool(allocated[index])


__all__ = ["DoubleFreeError", "ForeignPageError", "HostPageError", "PageAllocator", "page_runs"]

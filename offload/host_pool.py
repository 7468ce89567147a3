"""Host memory for offloaded KV: one tensor shaped after the layout, carved into pages.

The pool's tensor is ``[pages, components, page_size, elems]``; page ``i`` is one
contiguous block. It is pinned when CUDA is available (pageable D2H copies run at a fifth
of the link's speed and are not asynchronous).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar, final

import torch

from kvlife.fsm.construction import NoPublicConstructor
from kvlife.offload.layout import KVLayout
from kvlife.offload.pages import (
    DoubleFreeError,
    ForeignPageError,
    HostPageError,
    PageAllocator,
    page_runs,
)

__all__ = [
    "DoubleFreeError",
    "ForeignPageError",
    "HostPageError",
    "HostPagePool",
    "HostPages",
    "PageAllocator",
    "page_runs",
]


@final
class HostPages(metaclass=NoPublicConstructor):
    """A set of pages of one [`HostPagePool`][kvlife.offload.host_pool.HostPagePool], in
    allocation order.

    Immutable; made only by the pool:
    [`HostPagePool.alloc()`][kvlife.offload.host_pool.HostPagePool.alloc], or
    [`HostPagePool.pages()`][kvlife.offload.host_pool.HostPagePool.pages] for pages
    allocated elsewhere. Calling ``HostPages(...)`` or subclassing it raises ``TypeError``.
    """

    __slots__ = ("_indices", "_pool")
    _made_by: ClassVar[str] = "HostPagePool.alloc() and HostPagePool.pages()"

    def __init__(self, pool: HostPagePool, indices: tuple[int, ...]) -> None:
        self._pool = pool
        self._indices = indices

    @property
    def pool(self) -> HostPagePool:
        """The pool the pages came from."""
        return self._pool

    @property
    def indices(self) -> tuple[int, ...]:
        """Page indices into the pool's tensor."""
        return self._indices

    def tail(self, first: int) -> HostPages:
        """The same pool's pages from the ``first``-th on (a view of part of them: freeing
        is still done once, with the whole)."""
        return HostPages._create(self._pool, self._indices[first:])

    def __len__(self) -> int:
        return len(self._indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs of consecutive pages as ``(first page, count)``, in order: each run
        is one contiguous block of host memory, so one copy."""
        return page_runs(self._indices)

    def __repr__(self) -> str:
        return f"<HostPages {len(self._indices)} pages, runs={self.runs()[:4]}>"


class HostPagePool:
    """Fixed-size pool of host pages with O(1) allocation and free.

    Args:
        layout: the device KV layout the pages mirror.
        pages: number of pages.
        pin_memory: pin the tensor; ``None`` pins when CUDA is available.

    ``alloc(n)`` hands out ``n`` pages or nothing (never a partial allocation). A fresh
    pool hands pages out in order and freed pages are reused first, so allocations come
    in long runs of consecutive pages (large copies). ``free`` is all or nothing: a double
    free or a foreign page raises and frees none of the pages given.
    """

    def __init__(self, layout: KVLayout, pages: int, *, pin_memory: bool | None = None) -> None:
        self._pages = PageAllocator(pages)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.layout = layout
        self.tensor = torch.empty(
            (pages, layout.components, layout.page_size, layout.elems),
            dtype=layout.dtype,
            pin_memory=pin_memory,
        )

    @property
    def allocator(self) -> PageAllocator:
        """The pool's page accounting (shared with a planner that hands its pages out)."""
        return self._pages

    @property
    def capacity(self) -> int:
        """Pages in the pool."""
        return self._pages.capacity

    @property
    def available(self) -> int:
        """Pages free now."""
        return self._pages.available

    @property
    def in_use(self) -> int:
        """Pages handed out now."""
        return self._pages.capacity - self._pages.available

    @property
    def pinned(self) -> bool:
        """Whether the host tensor is pinned (page-locked)."""
        return bool(self.tensor.is_pinned())

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page."""
        return self.layout.bytes_per_page

    def alloc(self, n: int) -> HostPages | None:
        """``n`` pages, or ``None`` if fewer than ``n`` are free (nothing allocated then)."""
        taken = self._pages.alloc(n)
        return None if taken is None else HostPages._create(self, taken)

    def pages(self, indices: Iterable[int]) -> HostPages:
        """The pages ``indices`` of this pool, allocated by someone else: a worker whose
        scheduler decides which host pages it fills (with a
        [`PageAllocator`][kvlife.offload.pages.PageAllocator]). Nothing is allocated or
        freed here.

        Raises:
            ForeignPageError: an index is not a page of this pool (nothing made).
            HostPageError: a page is listed twice: a store would write two blocks into
                it, a load read it into two (nothing made).
        """
        taken = tuple(indices)
        capacity = self._pages.capacity
        bad = [i for i in taken if not (isinstance(i, int) and 0 <= i < capacity)]
        if bad:
            raise ForeignPageError(
                f"pages {bad[:8]} are not pages of this pool (0..{capacity - 1})"
            )
        if len(set(taken)) != len(taken):
            twice = sorted(i for i in set(taken) if taken.count(i) > 1)
            raise HostPageError(f"pages {twice[:8]} are listed twice in {len(taken)} pages")
        return HostPages._create(self, taken)

    def free(self, pages: HostPages) -> None:
        """Return pages to the pool. All or nothing: on an error no page was freed.

        Raises:
            ForeignPageError: ``pages`` did not come from this pool.
            DoubleFreeError: a page is already free or listed twice.
        """
        if not isinstance(pages, HostPages) or pages.pool is not self:
            raise ForeignPageError(f"{pages!r} was not allocated from this pool")
        self._pages.free(pages.indices)

    def is_allocated(self, index: int) -> bool:
        """Whether page ``index`` is handed out.

        Raises:
            ForeignPageError: ``index`` is not a page of this pool.
        """
        return self._pages.is_allocated(index)

    def page_view(self, first: int, count: int) -> torch.Tensor:
        """The pool's tensor for pages ``first .. first+count-1`` (one contiguous block).

        Raises:
            ForeignPageError: those are not all pages of this pool (a view never comes
                back shorter than asked).
        """
        capacity = self._pages.capacity
        if first < 0 or count < 0 or first + count > capacity:
            raise ForeignPageError(
                f"pages {first}..{first + count - 1} are not pages of this pool (0..{capacity - 1})"
            )
        return self.tensor[first : first + count]

    def read_tokens(self, pages: Sequence[int] | HostPages, tokens: int) -> torch.Tensor:
        """Copy out the first ``tokens`` tokens held by ``pages`` as ``[components, tokens,
        elems]`` (for checks and restores)."""
        indices = list(pages.indices if isinstance(pages, HostPages) else pages)
        data = self.tensor[indices]  # [pages, components, page_size, elems]
        components, elems = self.layout.components, self.layout.elems
        flat = data.permute(1, 0, 2, 3).reshape(components, -1, elems)
        return flat[:, :tokens]

    def __repr__(self) -> str:
        return (
            f"<HostPagePool {self.available}/{self.capacity} free, "
            f"{self.bytes_per_page} B/page, pinned={self.pinned}>"
        )

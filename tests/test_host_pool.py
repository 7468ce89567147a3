"""The host page pool: all-or-nothing alloc, typed refusals on bad frees."""

from __future__ import annotations

import pytest
import torch

from kvlife.offload import (
    DoubleFreeError,
    ForeignPageError,
    HostPageError,
    HostPagePool,
    HostPages,
    KVLayout,
)
from tests.builds import refused, takes_bool_as_number

LAYOUT = KVLayout(
    "per_layer", layers=2, slots=64, heads=2, head_dim=4, dtype=torch.float32, page_size=4
)


def test_alloc_is_all_or_nothing() -> None:
    pool = HostPagePool(LAYOUT, 10, pin_memory=False)
    a = pool.alloc(7)
    assert a is not None and a.indices == tuple(range(7)) and a.runs() == [(0, 7)]
    assert pool.alloc(4) is None
    assert pool.available == 3 and pool.in_use == 7
    b = pool.alloc(3)
    assert b is not None and pool.available == 0
    pool.free(a)
    assert pool.available == 7 and not pool.is_allocated(0) and pool.is_allocated(8)


def test_freed_pages_come_back_in_runs() -> None:
    pool = HostPagePool(LAYOUT, 16, pin_memory=False)
    first = pool.alloc(8)
    assert first is not None and pool.alloc(8) is not None
    pool.free(first)
    again = pool.alloc(8)
    assert again is not None and again.runs() == [(0, 8)]


def test_double_free_and_foreign_pages_change_nothing() -> None:
    pool = HostPagePool(LAYOUT, 8, pin_memory=False)
    other = HostPagePool(LAYOUT, 8, pin_memory=False)
    pages = pool.alloc(3)
    keep = pool.alloc(2)
    assert pages is not None and keep is not None
    pool.free(pages)
    with pytest.raises(DoubleFreeError, match="already free"):
        pool.free(pages)
    foreign = other.alloc(1)
    assert foreign is not None
    with pytest.raises(ForeignPageError):
        pool.free(foreign)
    with pytest.raises(ForeignPageError, match=r"not pages of this pool"):
        pool.pages((99,))
    mixed = pool.pages((keep.indices[0], 0))  # one allocated, one free
    with pytest.raises(DoubleFreeError):
        pool.free(mixed)
    twice = keep.indices[0]
    with pytest.raises(HostPageError, match=rf"pages \[{twice}\] are listed twice in 3 pages"):
        pool.pages((twice, 0, twice))  # a store would write two blocks into one page
    assert pool.is_allocated(keep.indices[0]) and pool.available == 6
    with pytest.raises(ForeignPageError):
        pool.free("pages")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, -1, 1.0, pytest.param(True, marks=takes_bool_as_number)])
def test_bad_alloc_counts(n: object) -> None:
    pool = HostPagePool(LAYOUT, 4, pin_memory=False)
    with refused(ValueError, match="positive"):
        pool.alloc(n)  # type: ignore[arg-type]
    assert pool.available == 4


def test_pool_shape_and_pinning() -> None:
    pool = HostPagePool(LAYOUT, 5, pin_memory=False)
    assert pool.tensor.shape == (5, LAYOUT.components, 4, LAYOUT.elems)
    assert pool.bytes_per_page == LAYOUT.bytes_per_page
    assert pool.pinned is False
    assert pool.page_view(1, 2).is_contiguous()
    with pytest.raises(ValueError, match="pages"):
        HostPagePool(LAYOUT, 0)


def test_a_page_allocator_is_the_pools_accounting_without_memory() -> None:
    from kvlife.offload import PageAllocator  # noqa: PLC0415

    pages = PageAllocator(4)
    assert pages.alloc(3) == (0, 1, 2) and pages.available == 1 and pages.capacity == 4
    assert pages.alloc(2) is None and pages.available == 1  # nothing taken
    with pytest.raises(DoubleFreeError, match="page 3 is already free"):
        pages.free([1, 3])
    assert pages.is_allocated(1)  # all or nothing
    with pytest.raises(ForeignPageError, match="out of range"):
        pages.free([9])
    pages.free([1, 0])
    assert pages.alloc(2) == (0, 1)  # freed pages come back first, in order
    with pytest.raises(ValueError, match="positive"):
        PageAllocator(0)
    for index in (4, -1):  # before: -1 answered for the last page, 4 raised IndexError
        with pytest.raises(ForeignPageError, match=rf"page {index} is out of range \(0..3\)"):
            pages.is_allocated(index)


@pytest.mark.parametrize(("first", "count"), [(-1, 2), (7, 2), (0, -1), (9, 0)])
def test_a_view_of_pages_outside_the_pool_is_refused(first: int, count: int) -> None:
    pool = HostPagePool(LAYOUT, 8, pin_memory=False)
    with pytest.raises(ForeignPageError, match="are not pages of this pool"):
        pool.page_view(first, count)  # before: a shorter view, or an empty one
    assert pool.page_view(6, 2).shape[0] == 2 and pool.page_view(8, 0).shape[0] == 0


def test_host_pages_are_made_by_their_pool_only() -> None:
    pool = HostPagePool(LAYOUT, 4, pin_memory=False)
    with pytest.raises(TypeError, match=r"made only by HostPagePool\.alloc\(\)"):
        HostPages(pool, (0,))
    with pytest.raises(TypeError, match="cannot be subclassed"):

        class MyPages(HostPages):  # type: ignore[misc]
            pass

    named = pool.pages([2, 3])  # allocated elsewhere (a scheduler's PageAllocator)
    assert named.indices == (2, 3) and named.runs() == [(2, 2)] and pool.available == 4
    tail = named.tail(1)  # part of them, made by the pages themselves
    assert type(tail) is HostPages and tail.indices == (3,) and tail.pool is pool

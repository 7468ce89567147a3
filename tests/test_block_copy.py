"""Whole blocks copied with no kernel (kvlife.offload.block_copy): which caches form one run
of bytes per block, the runs of an order, and stores and loads byte for byte in every one of
vLLM's six layouts (built here with plain torch in vLLM's stride orders; the engine tests
build them with vLLM's own allocator)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlife.offload import (
    CopyEngine,
    HostPagePool,
    KVLayout,
    LayoutError,
    LoadOrder,
    OffloadWorker,
    StoreOrder,
    block_views,
)
from kvlife.offload.block_copy import BlockRuns, block_span, runs

# vLLM 0.33's KVCacheLayout: the physical order of the logical [L, B, H, N, C] axes
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
L, B, H, N, C = 3, 10, 2, 4, 6
BLOCK_BYTES = L * H * N * C * 2  # float16


def _caches(order: tuple[int, ...], seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-layer logical ``[B, H, N, C]`` views of one buffer laid out in ``order``, random
    bytes everywhere; returns the views and the buffer's bytes."""
    logical = (L, B, H, N, C)
    raw = torch.randint(0, 256, (L * B * H * N * C * 2,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))  # fmt: skip
    physical = raw.view(torch.int16).view(*(logical[d] for d in order))
    view = physical.permute(*(order.index(d) for d in range(5)))
    return {f"layer.{layer}": view[layer] for layer in range(L)}, raw


@pytest.mark.parametrize("name", list(ORDERS))
def test_a_span_is_found_exactly_for_the_block_outermost_layouts(name: str) -> None:
    caches, raw = _caches(ORDERS[name])
    span = block_span(block_views(caches, B))
    if not name.startswith("B"):
        assert span is None  # each layer's blocks in a region of their own
        return
    assert span is not None and span.packed and span.size == span.stride == BLOCK_BYTES
    for block in (0, 7):  # block b of every layer: bytes [b * size, (b + 1) * size)
        assert torch.equal(span.raw[block], raw[block * BLOCK_BYTES : (block + 1) * BLOCK_BYTES])


@pytest.mark.parametrize("name", list(ORDERS))
def test_every_layout_stores_and_loads_blocks_byte_for_byte(name: str) -> None:
    caches, raw = _caches(ORDERS[name], seed=len(name) + ORDERS[name][2])
    worker = OffloadWorker(block_views(caches, B), 6)
    assert worker.copier.path == ("direct" if name.startswith("B") else "gather")
    before = {key: view.clone() for key, view in caches.items()}
    stored, pages = (3, 4, 5, 9, 0), (1, 2, 3, 4, 0)
    worker.store([StoreOrder(1, stored, pages, 0)])
    assert worker.poll() == ([1], [])
    host = worker.host.tensor.view(-1).view(torch.uint8).view(6, BLOCK_BYTES)
    for block, page in zip(stored, pages, strict=True):
        if name.startswith("B"):  # the block's bytes as the device holds them
            assert torch.equal(host[page], raw[block * BLOCK_BYTES : (block + 1) * BLOCK_BYTES])
        else:  # one layer after another, each block's interior in its memory order
            assert sorted(host[page].tolist()) == sorted(
                torch.cat(
                    [v[block].reshape(-1).view(torch.uint8) for v in caches.values()]
                ).tolist()
            )
    targets = (6, 7, 8, 1, 2)
    worker.load([LoadOrder(2, targets, pages, 0)])
    assert worker.poll() == ([2], [])
    for key, view in caches.items():
        for source, target in zip(stored, targets, strict=True):
            assert torch.equal(view[target], before[key][source]), (key, target)
        untouched = [b for b in range(B) if b not in targets]
        assert torch.equal(view[untouched], before[key][untouched])


def test_consecutive_blocks_into_consecutive_pages_are_one_copy() -> None:
    caches, _ = _caches(ORDERS["BLNHC"])
    views = block_views(caches, B)
    layout = KVLayout.blocks(L, B, tuple(views[0].shape[1:]), torch.int16)
    engine = CopyEngine(layout, views, HostPagePool(layout, 8))
    direct = engine._direct
    assert direct is not None
    blocks = torch.tensor([2, 3, 4, 8, 9, 0])
    assert direct.runs(blocks, (0, 1, 2, 3, 4, 7))[2].tolist() == [3, 2, 1]  # 2-4, 8-9, 0
    assert direct.runs(blocks, (0, 1, 5, 6, 7, 3))[2].tolist() == [2, 1, 2, 1]
    # on the CPU a store takes one call per run of host pages, a load one per run
    assert direct.copy_cpu(blocks, (0, 1, 2, 3, 4, 7), to_host=True) == 2
    assert direct.copy_cpu(blocks, (0, 1, 2, 3, 4, 7), to_host=False) == 3
    listed = direct.descriptors(blocks, (0, 1, 2, 3, 4, 7), to_host=True)
    assert listed[2].tolist() == [3 * BLOCK_BYTES, 2 * BLOCK_BYTES, BLOCK_BYTES]
    assert listed[1, 0] == views[0][2].data_ptr()  # the source: device block 2
    assert listed[0, 2] == engine.host.tensor[7].data_ptr()
    assert "consecutive blocks merge into one run" in engine.describe()


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30),
    st.booleans(),
)
def test_runs_cover_every_block_once_and_are_maximal(
    pairs: list[tuple[int, int]], packed: bool
) -> None:
    blocks = np.array([b for b, _ in pairs], dtype=np.int64)
    pages = np.array([p for _, p in pairs], dtype=np.int64)
    firsts, page_firsts, counts = runs(blocks, pages, packed)
    expanded = [
        (b + i, p + i)
        for b, p, k in zip(firsts.tolist(), page_firsts.tolist(), counts.tolist(), strict=True)
        for i in range(k)
    ]
    assert expanded == pairs
    if not packed:
        assert counts.tolist() == [1] * len(pairs)
        return
    for (b, p, k), (b2, p2) in zip(
        zip(firsts.tolist(), page_firsts.tolist(), counts.tolist(), strict=True),
        zip(firsts.tolist()[1:], page_firsts.tolist()[1:], strict=True),
        strict=False,
    ):
        assert (b2, p2) != (b + k, p + k)  # a run that could go on would have


def test_padding_between_blocks_gives_one_run_per_block() -> None:
    """Blocks of every layer side by side, then unused bytes before the next block: still a
    span (each block one run), but runs never merge."""
    buffer = torch.randint(0, 1000, (B, L + 1, H, N, C), dtype=torch.int16)
    caches = {f"layer.{layer}": buffer[:, layer] for layer in range(L)}
    views = block_views(caches, B)
    span = block_span(views)
    assert span is not None and not span.packed
    assert span.stride == (L + 1) * H * N * C * 2 and span.size == BLOCK_BYTES
    worker = OffloadWorker(views, 4)
    worker.store([StoreOrder(1, (1, 2, 3), (0, 1, 2), 0)])
    worker.load([LoadOrder(2, (5, 6, 7), (0, 1, 2), 0)])
    assert worker.poll() == ([2, 1], [])
    assert torch.equal(buffer[5:8, :L], buffer[1:4, :L])
    assert worker.copier._direct is not None
    assert worker.copier._direct.runs(torch.tensor([1, 2]), (0, 1))[2].tolist() == [1, 1]


def test_caches_that_are_not_one_run_per_block_get_no_span() -> None:
    caches, _ = _caches(ORDERS["BLNHC"])
    views = block_views(caches, B)
    assert block_span(views[:2]) is not None  # two layers of three: a run of their own
    assert block_span([views[0], views[2]]) is None  # a gap inside the block
    assert block_span([views[0], views[0]]) is None  # the same bytes twice
    elsewhere = block_views({"other": torch.zeros(B, H, N, C, dtype=torch.int16)}, B)
    assert block_span([views[0], *elsewhere]) is None  # another allocation
    assert block_span([]) is None


def test_direct_is_required_or_refused_on_request() -> None:
    per_layer, _ = _caches(ORDERS["LBNHC"])
    views = block_views(per_layer, B)
    layout = KVLayout.blocks(L, B, tuple(views[0].shape[1:]), torch.int16)
    with pytest.raises(LayoutError, match="not one run of bytes"):
        CopyEngine(layout, views, HostPagePool(layout, 2), direct=True)
    outer, _ = _caches(ORDERS["BLNHC"])
    views = block_views(outer, B)
    engine = CopyEngine(layout, views, HostPagePool(layout, 2), direct=False)
    assert engine.path == "gather" and "gather" in engine.describe()


def test_host_pages_that_do_not_hold_a_block_are_refused() -> None:
    caches, _ = _caches(ORDERS["BLNHC"])
    span = block_span(block_views(caches, B))
    assert span is not None
    with pytest.raises(ValueError, match="do not hold blocks of"):
        BlockRuns(span, torch.zeros(4, BLOCK_BYTES // 2 + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous: False"):
        BlockRuns(span, torch.zeros(BLOCK_BYTES, 4, dtype=torch.uint8).t())


def test_a_refused_direct_order_changes_nothing() -> None:
    caches, _ = _caches(ORDERS["BHLNC"])
    worker = OffloadWorker(block_views(caches, B), 4)
    before = {key: view.clone() for key, view in caches.items()}
    host_before = worker.host.tensor.clone()
    worker.store([StoreOrder(1, (1, B), (0, 1), 0)])  # block 10 of 10
    worker.load([LoadOrder(2, (3,), (7,), 0)])  # page 7 of 4
    assert worker.poll() == ([], [1, 2])
    assert worker.take_load_errors() == {3}
    assert torch.equal(worker.host.tensor, host_before)
    assert all(torch.equal(view, before[key]) for key, view in caches.items())


def test_launch_many_gives_a_job_or_the_refusal_per_item() -> None:
    caches, _ = _caches(ORDERS["BLNHC"])
    views = block_views(caches, B)
    layout = KVLayout.blocks(L, B, tuple(views[0].shape[1:]), torch.int16)
    host = HostPagePool(layout, 4)
    engine = CopyEngine(layout, views, host)
    first, second = host.pages((0, 1)), host.pages((2,))
    made = engine.launch_many([([3, 4], first), ([B], second), ([5], second)])
    assert [type(m).__name__ for m in made] == ["CopyJob", "ValueError", "CopyJob"]
    loaded = engine.launch_many([([7, 8], first), ([9], second)], load=True)
    assert all(not isinstance(m, BaseException) and m.error is None for m in loaded)
    assert torch.equal(views[1][7], views[1][3]) and torch.equal(views[2][9], views[2][5])


def _cuda_blnhc(
    seed: int,
) -> tuple[dict[str, torch.Tensor], OffloadWorker, dict[str, torch.Tensor]]:
    """A BLNHC cache on the device (views of one buffer), a worker over it with 6 host
    pages, and a copy of every layer's blocks before anything ran."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, raw = _caches(ORDERS["BLNHC"], seed=seed)
    logical = raw.cuda().view(torch.int16).view(B, L, N, H, C).permute(1, 0, 3, 2, 4)
    device = {f"layer.{layer}": logical[layer] for layer in range(L)}
    worker = OffloadWorker(block_views(device, B), 6)
    return device, worker, {key: view.clone() for key, view in device.items()}


@pytest.mark.cuda
def test_cuda_a_steps_orders_are_one_submission_with_one_event() -> None:
    device, worker, before = _cuda_blnhc(seed=4)
    worker.store([StoreOrder(1, (1, 2), (0, 1), 0), StoreOrder(2, (B,), (2,), 0),
                  StoreOrder(3, (5,), (3,), 0)])  # fmt: skip
    jobs = worker._stores
    assert sorted(jobs) == [1, 3] and jobs[1].event is jobs[3].event
    torch.cuda.synchronize()  # a load reads only pages whose store is over (as the planner)
    worker.load([LoadOrder(4, (7, 8, 9), (0, 1, 3), 0), LoadOrder(5, (0,), (9,), 0)])
    torch.cuda.synchronize()
    reported: list[int] = []
    failed: list[int] = []
    while worker.inflight or not failed:
        done, bad = worker.poll()
        reported += done
        failed += bad
    assert sorted(reported) == [1, 3, 4] and sorted(failed) == [2, 5]
    for key, view in device.items():
        for source, target in zip((1, 2, 5), (7, 8, 9), strict=True):
            assert torch.equal(view[target], before[key][source])


@pytest.mark.cuda
def test_cuda_direct_copies_move_blocks_by_the_copy_engines_byte_for_byte() -> None:
    device, worker, before = _cuda_blnhc(seed=3)
    assert worker.copier.path == "direct" and worker.host.pinned
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
    worker.store([StoreOrder(1, (3, 4, 5, 9), (0, 1, 2, 5), 0)])
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated
    torch.cuda.synchronize()  # a load reads only pages whose store is over (as the planner)
    worker.load([LoadOrder(2, (6, 7, 8, 0), (0, 1, 2, 5), 0)])
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated
    torch.cuda.synchronize()
    done: list[int] = []
    while worker.inflight:
        done += worker.poll()[0]
    assert sorted(done) == [1, 2]
    for key, view in device.items():
        for source, target in zip((3, 4, 5, 9), (6, 7, 8, 0), strict=True):
            assert torch.equal(view[target], before[key][source])

"""The worker half on its own (CPU): orders copied byte for byte, polled once each,
refused orders reported failed with their blocks, and block views of engine caches."""

from __future__ import annotations

import pytest
import torch

from kvlife.offload import (
    CopyEngine,
    CopyJob,
    HostPagePool,
    KVLayout,
    LayoutError,
    LoadOrder,
    OffloadWorker,
    StoreOrder,
    block_views,
)

BLOCKS = 8


def _caches(layers: int = 2) -> dict[str, torch.Tensor]:
    """Per-layer [blocks, heads, tokens, content] caches with a distinct value per block."""
    caches = {}
    for layer in range(layers):
        cache = torch.empty(BLOCKS, 2, 4, 3)
        for block in range(BLOCKS):
            cache[block] = 100 * layer + block
        caches[f"layer.{layer}"] = cache
    return caches


def _worker(caches: dict[str, torch.Tensor], pages: int = 4) -> OffloadWorker:
    return OffloadWorker(block_views(caches, BLOCKS), pages)


def test_a_store_then_a_load_moves_blocks_byte_for_byte() -> None:
    caches = _caches()
    worker = _worker(caches)
    worker.store([StoreOrder(1, (5, 2), (0, 1), 0)])
    assert worker.poll() == ([1], [])
    assert worker.poll() == ([], [])  # each order is reported once
    worker.load([LoadOrder(2, (7, 6), (0, 1), 0)])  # into other blocks
    assert worker.poll() == ([2], []) and worker.inflight == 0
    for layer, cache in enumerate(caches.values()):
        assert torch.equal(cache[7], torch.full((2, 4, 3), 100.0 * layer + 5))
        assert torch.equal(cache[6], torch.full((2, 4, 3), 100.0 * layer + 2))
        assert torch.equal(cache[0], torch.full((2, 4, 3), 100.0 * layer))  # untouched


def test_a_second_order_under_a_copy_number_in_flight_is_not_copied() -> None:
    """Before: the second job took the first one's place, and the second completion
    raised ``KeyError`` inside the poll."""
    caches = _caches()
    worker = _worker(caches)
    worker.host.tensor.fill_(-1)
    worker.store([StoreOrder(1, (1,), (0,), 0), StoreOrder(1, (2,), (1,), 0)])  # listed twice
    worker.store([StoreOrder(1, (3,), (2,), 0)])  # in flight already
    worker.load([LoadOrder(1, (4,), (0,), 0)])
    assert worker.inflight == 1
    assert worker.poll() == ([1], []) and worker.poll() == ([], [])
    assert worker.host.tensor[0].unique().tolist() == [1, 101]  # block 1, the first order
    assert worker.host.tensor[1:3].eq(-1).all()  # the others wrote nothing
    assert caches["layer.0"][4].eq(4).all()  # and the load none
    worker.store([StoreOrder(1, (3,), (2,), 0)])  # over: the number may come again
    assert worker.poll() == ([1], [])


def test_an_order_the_copy_engine_refuses_is_reported_failed() -> None:
    caches = _caches()
    worker = _worker(caches)
    before = {name: cache.clone() for name, cache in caches.items()}
    worker.store([StoreOrder(3, (1,), (9,), 0)])  # page 9 of 4
    worker.load([LoadOrder(4, (2, 3), (0, 9), 0)])
    assert worker.poll() == ([], [3, 4])
    assert worker.take_load_errors() == {2, 3} and worker.take_load_errors() == set()
    for name, cache in caches.items():
        assert torch.equal(cache, before[name])  # a refused load wrote nothing


def test_an_order_that_lists_a_host_page_twice_is_reported_failed() -> None:
    """Before: a store wrote blocks 1 and 2 into host page 0 (the second over the first)
    and was reported done; a load read page 0 into both blocks."""
    caches = _caches()
    worker = _worker(caches)
    worker.host.tensor.fill_(-1)
    before = {name: cache.clone() for name, cache in caches.items()}
    worker.store([StoreOrder(1, (1, 2), (0, 0), 0)])
    worker.load([LoadOrder(2, (5, 6), (1, 1), 0)])
    assert worker.poll() == ([], [1, 2])
    assert worker.host.tensor.eq(-1).all()
    for name, cache in caches.items():
        assert torch.equal(cache, before[name])


def test_a_load_into_one_block_twice_is_reported_failed_and_writes_nothing() -> None:
    caches = _caches()
    worker = _worker(caches)
    worker.store([StoreOrder(1, (5, 2), (0, 1), 0)])
    before = {name: cache.clone() for name, cache in caches.items()}
    worker.load([LoadOrder(2, (6, 6), (0, 1), 0), LoadOrder(3, (7,), (1,), 0)])
    assert worker.poll() == ([3, 1], [2])  # loads are reported before stores
    assert worker.take_load_errors() == {6}  # the engine computes block 6 itself
    for name, cache in caches.items():
        assert torch.equal(cache[:7], before[name][:7])  # only block 7 was loaded
        assert torch.equal(cache[7], before[name][2])


def test_wait_and_shutdown_return_on_the_cpu_where_copies_are_done_at_launch() -> None:
    worker = _worker(_caches())
    worker.store([StoreOrder(1, (0,), (0,), 0)])
    worker.wait({1, 99})
    worker.shutdown()
    assert worker.poll() == ([1], [])


def test_block_views_take_kv_split_caches_and_kernel_blocks() -> None:
    split = {"l": torch.arange(2 * BLOCKS * 8, dtype=torch.float32).reshape(2, BLOCKS, 4, 1, 2)}
    key, value = block_views(split, BLOCKS)  # K and V are components of their own
    assert key.shape[0] == value.shape[0] == BLOCKS and key.numel() == 8 * BLOCKS
    assert torch.equal(value[3].flatten(), torch.arange(88, 96, dtype=torch.float32))
    kernel = {"l": torch.zeros(2 * BLOCKS, 1, 4, 3)}  # two kernel blocks per engine block
    (view,) = block_views(kernel, BLOCKS)
    assert view.shape == (BLOCKS, 2, 1, 4, 3)


def test_block_views_refuse_what_they_cannot_copy_naming_the_layer() -> None:
    with pytest.raises(LayoutError, match="no KV cache tensors"):
        block_views({}, BLOCKS)
    with pytest.raises(LayoutError, match="caches must map layer names to tensors"):
        block_views(torch.zeros(2), BLOCKS)  # type: ignore[arg-type]  # before: RuntimeError
    with pytest.raises(LayoutError, match="layer 'l': a KV cache must be a tensor, got None"):
        block_views({"l": None}, BLOCKS)  # type: ignore[dict-item]  # before: AttributeError
    for views in ([], "x", [None]):  # before: IndexError, AttributeError
        with pytest.raises(LayoutError, match="views must be a non-empty list of tensors"):
            OffloadWorker(views, 4)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"layer 'flat': shape \(8, 24\)"):
        block_views({"flat": torch.zeros(BLOCKS, 24)}, BLOCKS)
    with pytest.raises(LayoutError, match="9 blocks is not a multiple of the engine's 8"):
        block_views({"odd": torch.zeros(9, 1, 4, 3)}, BLOCKS)
    with pytest.raises(LayoutError, match=r"one block shape and dtype.*'b'"):
        block_views({"a": torch.zeros(BLOCKS, 1, 4, 3), "b": torch.zeros(BLOCKS, 1, 4, 2)}, BLOCKS)
    heads_inside = torch.zeros(BLOCKS, 4, 2, 3).permute(0, 2, 1, 3)  # [B, H, N, C] as B N H C
    with pytest.raises(LayoutError, match="do not follow the declared memory order"):
        block_views({"l": heads_inside}, BLOCKS, order=(0, 1, 2, 3))
    assert block_views({"l": heads_inside}, BLOCKS, order=(0, 2, 1, 3))  # as declared


def test_a_row_of_several_groups_given_to_one_worker_fails_that_order_only() -> None:
    """Rows are split per KV cache group before a worker sees them; one that reaches a
    single worker anyway is refused by the copy engine and reported failed."""
    caches = _caches()
    worker = _worker(caches)
    before = {name: cache.clone() for name, cache in caches.items()}
    worker.store([StoreOrder(1, ((2, 3),), (0,), 0), StoreOrder(2, (4,), (1,), 0)])
    done, failed = worker.poll()
    assert (done, failed) == ([2], [1])
    assert all(torch.equal(caches[n], before[n]) for n in caches)


def test_a_worker_over_a_token_copy_engine_reports_each_streams_stores_in_order() -> None:
    """What OffloadManager composes: a worker over the engine's own copy engine (token
    slots into pages of 4 tokens). A store is reported only once the stores launched
    before it on its stream are over, each once, with its outcome."""
    layout = KVLayout.mla(layers=1, slots=16, latent_dim=2, dtype=torch.float32, page_size=4)
    cache = torch.arange(16 * 2, dtype=torch.float32).reshape(16, 2)
    host = HostPagePool(layout, 4, pin_memory=False)
    copier = CopyEngine(layout, [cache], host, defer=True)
    jobs: list[CopyJob] = []
    launch = copier.launch

    def recording_launch(slots: object, pages: object, **how: bool) -> CopyJob:
        job = launch(slots, pages, **how)  # type: ignore[arg-type]
        jobs.append(job)
        return job

    copier.launch = recording_launch  # type: ignore[method-assign]
    worker = OffloadWorker.over(copier)
    assert worker.host is host and worker.layout is layout
    worker.store([StoreOrder(7, (0, 1, 2, 3), (0,), 0), StoreOrder(8, (4, 5), (1,), 1)])
    assert worker.inflight == 2 and worker.reports() == []
    jobs[1].run()  # the later copy ran first: not reported before the earlier one
    assert worker.reports() == []
    jobs[0].run()
    assert worker.reports() == [(7, True), (8, True)] and worker.inflight == 0
    assert torch.equal(host.read_tokens([1], 2)[0], cache[4:6])

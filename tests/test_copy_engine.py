"""The copy engine on CPU: exact bytes for every layout, chunking, deferral, failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlife.offload import CopyEngine, CopyError, CopyJob, HostPagePool, KVLayout
from tests.test_layout import LAYOUTS


def _filled(layout: KVLayout) -> list[torch.Tensor]:
    kv = layout.allocate()
    gen = torch.Generator().manual_seed(7)
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return kv


def _expected(layout: KVLayout, kv: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
    views = layout.component_views(kv)
    return torch.stack([v[torch.tensor(slots)] for v in views])  # [C, n, E]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize(("tokens", "chunk_pages"), [(16, 1), (37, 2), (64, 64), (5, 3)])
def test_host_pages_hold_exactly_the_device_bytes(name: str, tokens: int, chunk_pages: int) -> None:
    layout = LAYOUTS[name]
    kv = _filled(layout)
    host = HostPagePool(layout, 32, pin_memory=False)
    engine = CopyEngine(layout, kv, host, chunk_pages=chunk_pages)
    gen = torch.Generator().manual_seed(tokens)
    slots = torch.randperm(layout.slots, generator=gen)[:tokens].tolist()  # scattered
    pages = host.alloc(-(-tokens // layout.page_size))
    assert pages is not None
    host.alloc(1)  # make the next allocation non-contiguous with this one
    job = engine.launch(slots, pages)
    assert job.query() and job.error is None
    assert torch.equal(host.read_tokens(pages, tokens), _expected(layout, kv, slots))


def _paged_slots(layout: KVLayout, tokens: int, seed: int) -> list[int]:
    """Slots as a block-paged engine allocates them: whole aligned device pages, shuffled."""
    page = layout.page_size
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(layout.slots // page, generator=gen)[: -(-tokens // page)]
    return (blocks[:, None] * page + torch.arange(page)).reshape(-1)[:tokens].tolist()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("tokens", [4, 16, 37, 64])
@pytest.mark.parametrize("threads", [None, 1])
def test_whole_aligned_pages_take_the_direct_path_and_hold_exactly_the_device_bytes(
    name: str, tokens: int, threads: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = LAYOUTS[name]
    kv = _filled(layout)
    host = HostPagePool(layout, 32, pin_memory=False)
    engine = CopyEngine(layout, kv, host, chunk_pages=2, threads=threads)
    staged: list[int] = []
    real = engine._copy_cpu_staged
    monkeypatch.setattr(
        engine, "_copy_cpu_staged", lambda i, p, f: staged.append(f) or real(i, p, f)
    )
    slots = _paged_slots(layout, tokens, tokens)
    pages = host.alloc(-(-tokens // layout.page_size))
    assert pages is not None
    before = torch.get_num_threads()
    assert engine.launch(slots, pages).error is None
    assert torch.get_num_threads() == before  # the setting is kvlife's own copies' only
    assert torch.equal(host.read_tokens(pages, tokens), _expected(layout, kv, slots))
    # only a partial last page goes through staging
    assert staged == ([] if tokens % layout.page_size == 0 else [tokens // layout.page_size])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_cuda_page_gather_stages_the_same_bytes_as_the_token_gather(name: str) -> None:
    """The CUDA path gathers whole aligned pages with _gather_pages (no transpose pass);
    on the CPU it must stage exactly what the token gather stages."""
    layout = LAYOUTS[name]
    engine = CopyEngine(layout, _filled(layout), HostPagePool(layout, 8, pin_memory=False))
    engine._ensure_staging()
    slots = torch.tensor(_paged_slots(layout, 3 * layout.page_size, 9))
    device_pages = engine._aligned_pages(slots)
    assert device_pages is not None
    by_token = engine._gather(slots, len(slots), 3, 0).clone()
    staging = engine._staging_pm[0][: len(device_pages)]
    assert torch.equal(engine._gather_pages(device_pages, staging), by_token)


def test_pages_that_are_not_aligned_or_not_whole_take_the_staged_path() -> None:
    layout = LAYOUTS["per_layer"]
    kv = _filled(layout)
    host = HostPagePool(layout, 8, pin_memory=False)
    engine = CopyEngine(layout, kv, host)
    page = layout.page_size
    for slots in (
        list(range(1, 1 + 2 * page)),  # contiguous but shifted by one slot
        [*range(page), *range(3 * page, 4 * page)[::-1]],  # a whole page, reversed
    ):
        pages = host.alloc(2)
        assert pages is not None
        assert engine._aligned_pages(torch.tensor(slots)) is None
        engine.launch(slots, pages)
        assert torch.equal(host.read_tokens(pages, len(slots)), _expected(layout, kv, slots))
        host.free(pages)
    with pytest.raises(ValueError, match="threads"):
        CopyEngine(layout, kv, host, threads=0)


def test_fragmented_host_pages_are_copied_run_by_run() -> None:
    layout = LAYOUTS["per_layer"]
    kv = _filled(layout)
    host = HostPagePool(layout, 8, pin_memory=False)
    engine = CopyEngine(layout, kv, host, chunk_pages=3)
    a, b, c = host.alloc(2), host.alloc(1), host.alloc(2)
    assert a is not None and b is not None and c is not None
    host.free(a)
    host.free(c)
    pages = host.alloc(4)
    assert pages is not None and len(pages.runs()) == 2, pages  # two runs, out of order
    scattered = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    for slots in (scattered, _paged_slots(layout, 64, 2)):  # staged, then direct
        engine.launch(slots, pages)
        assert torch.equal(host.read_tokens(pages, 64), _expected(layout, kv, slots))


def test_deferred_copy_reads_device_memory_when_it_runs() -> None:
    layout = LAYOUTS["mla"]
    kv = _filled(layout)
    host = HostPagePool(layout, 4, pin_memory=False)
    engine = CopyEngine(layout, kv, host, defer=True)
    pages = host.alloc(1)
    assert pages is not None
    job = engine.launch(list(range(16)), pages)
    assert job.deferred and not job.query()
    for t in kv:
        t[:16] = 3  # the engine overwrites the slots while the copy is "in flight"
    job.run()
    assert job.query() and torch.all(host.read_tokens(pages, 16) == 3)
    with pytest.raises(CopyError, match="not a deferred copy"):
        job.run()


def test_a_copy_that_raises_is_a_failed_job() -> None:
    layout = LAYOUTS["per_layer"]
    host = HostPagePool(layout, 4, pin_memory=False)
    engine = CopyEngine(layout, layout.allocate(), host)
    calls: list[int] = []

    def boom() -> None:  # the public fail-path hook the demo uses too
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("DMA error")

    engine.before_cpu_copy = boom
    pages = host.alloc(1)
    assert pages is not None
    job = engine.launch(list(range(16)), pages)
    assert job.query() and isinstance(job.error, RuntimeError)
    again = engine.launch(list(range(16)), pages)  # the hook runs before every copy
    assert again.query() and again.error is None and calls == [1, 1]


@pytest.mark.parametrize(
    ("slots", "n_pages", "message"),
    [
        ([], 1, "do not fill"),
        (list(range(17)), 1, "do not fill"),
        (list(range(16)), 2, "do not fill"),
        ([0] * 15 + [999], 1, "out of range"),
        ([-1] * 16, 1, "out of range"),
    ],
)
def test_bad_launches_are_refused_before_anything_runs(
    slots: list[int], n_pages: int, message: str
) -> None:
    layout = LAYOUTS["per_layer"]
    host = HostPagePool(layout, 4, pin_memory=False)
    engine = CopyEngine(layout, layout.allocate(), host)
    pages = host.alloc(n_pages)
    assert pages is not None
    host.tensor.zero_()
    before = host.tensor.clone()
    with pytest.raises(ValueError, match=message):
        engine.launch(slots, pages)
    assert torch.equal(host.tensor, before)


@pytest.mark.parametrize(
    "slots",
    [
        [float(s) for s in range(16)],
        torch.arange(16, dtype=torch.float16),
        [True] * 16,
        torch.zeros(16, dtype=torch.bool),
    ],
    ids=["floats", "float-tensor", "bools", "bool-tensor"],
)
def test_slots_that_are_not_integers_are_refused_before_anything_runs(slots: object) -> None:
    layout = LAYOUTS["per_layer"]
    host = HostPagePool(layout, 4, pin_memory=False)
    kv = _filled(layout)
    engine = CopyEngine(layout, kv, host)
    pages = host.alloc(1)
    assert pages is not None
    host.tensor.zero_()
    before = [t.clone() for t in kv]
    with pytest.raises(TypeError, match="slots must be integers"):
        engine.launch(slots, pages)  # type: ignore[arg-type]
    assert not host.tensor.any()
    host.tensor.fill_(1)
    with pytest.raises(TypeError, match="slots must be integers"):
        engine.load(pages, slots)  # type: ignore[arg-type]
    assert all(torch.equal(t, b) for t, b in zip(kv, before, strict=True))
    assert engine.launch(torch.arange(16, dtype=torch.int32), pages).error is None


def test_pages_of_another_pool_are_refused() -> None:
    layout = LAYOUTS["per_layer"]
    host, other = (HostPagePool(layout, 4, pin_memory=False) for _ in range(2))
    engine = CopyEngine(layout, layout.allocate(), host)
    pages = other.alloc(1)
    assert pages is not None
    with pytest.raises(ValueError, match="another pool"):
        engine.launch(list(range(16)), pages)


def test_streams_round_robin_and_arguments() -> None:
    layout = LAYOUTS["per_layer"]
    host = HostPagePool(layout, 8, pin_memory=False)
    engine = CopyEngine(layout, layout.allocate(), host, streams=3)
    streams = []
    for _ in range(4):
        pages = host.alloc(1)
        assert pages is not None
        streams.append(engine.launch(list(range(16)), pages).stream)
    assert streams == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="another layout"):
        CopyEngine(LAYOUTS["mla"], LAYOUTS["mla"].allocate(), host)
    with pytest.raises(ValueError, match="positive"):
        CopyEngine(layout, layout.allocate(), host, chunk_pages=0)
    for bad in (1.5, float("nan"), True):  # before: a float chunk or stream count was taken
        with pytest.raises(ValueError, match="must be a positive int"):
            CopyEngine(layout, layout.allocate(), host, streams=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="host must be a HostPagePool, got None"):
        CopyEngine(layout, layout.allocate(), None)  # type: ignore[arg-type]


# --- on a GPU (tests/gpu/check.sh) ------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["scattered", "paged"])
def test_cuda_host_pages_hold_exactly_the_device_bytes(name: str, kind: str) -> None:
    layout = LAYOUTS[name]
    kv = [t.cuda() for t in _filled(layout)]
    host = HostPagePool(layout, 8, pin_memory=True)
    engine = CopyEngine(layout, kv, host, chunk_pages=1, streams=2)
    if kind == "paged":  # whole aligned pages: the page gather, no transpose pass
        slots = _paged_slots(layout, 40, 3)
    else:
        slots = torch.randperm(layout.slots, generator=torch.Generator().manual_seed(3))[:40]
        slots = slots.tolist()
    pages = host.alloc(3)
    assert pages is not None and host.pinned
    job = engine.launch(slots, pages)
    assert job.recorded
    torch.cuda.synchronize()
    assert job.query() and job.error is None
    expected = _expected(layout, [t.cpu() for t in kv], slots)
    assert torch.equal(host.read_tokens(pages, 40), expected)


@pytest.mark.cuda
@cuda
def test_cuda_an_unrecorded_event_reports_done_but_a_job_does_not() -> None:
    event = torch.cuda.Event()
    assert event.query()  # the CUDA fact kvlife guards against (c10/cuda/CUDAEvent.h)
    layout = LAYOUTS["per_layer"]
    host = HostPagePool(layout, 1, pin_memory=True)
    pages = host.alloc(1)
    assert pages is not None
    job = CopyJob(pages, 16, 0, event, run=None)  # an event, but launch() never recorded it
    assert not job.recorded and not job.query()


def _strided_blocks(blocks: int = 12) -> tuple[KVLayout, list[torch.Tensor], torch.Tensor]:
    """Three components whose blocks interleave in one buffer (block-outermost, as vLLM's
    cross-layer layouts are) and whose block interior is permuted: [B, N, H, C] memory,
    [B, H, N, C] views."""
    buffer = torch.randn(blocks, 3, 16, 2, 8, generator=torch.Generator().manual_seed(5))
    views = [buffer[:, c].transpose(1, 2) for c in range(3)]  # [B, H=2, N=16, C=8]
    return KVLayout.blocks(3, blocks, (2, 16, 8), torch.float32), views, buffer


def test_a_block_layout_stores_and_loads_strided_blocks_byte_for_byte() -> None:
    """The gather path (the direct one, which these block-outermost blocks take by default,
    keeps the device's byte order in a host page: tests/test_block_copy.py)."""
    layout, views, _ = _strided_blocks()
    host = HostPagePool(layout, 6, pin_memory=False)
    engine = CopyEngine(layout, views, host, direct=False)
    before = [v.clone() for v in views]
    pages = host.alloc(3)
    assert pages is not None
    job = engine.launch([4, 0, 9], pages)
    assert job.query() and job.error is None
    for page, block in zip(pages, [4, 0, 9], strict=True):
        for c, view in enumerate(views):
            assert torch.equal(host.tensor[page, c].view(2, 16, 8), view[block])
    loaded = engine.load(pages, [1, 11, 7])
    assert loaded.query() and loaded.error is None
    for c, view in enumerate(views):
        for source, target in zip([4, 0, 9], [1, 11, 7], strict=True):
            assert torch.equal(view[target], before[c][source])
        others = [b for b in range(12) if b not in (1, 11, 7)]
        assert torch.equal(view[others], before[c][others])


def test_a_load_writes_whole_aligned_pages_back_for_token_layouts() -> None:
    layout = LAYOUTS["per_layer"]
    kv = _filled(layout)
    host = HostPagePool(layout, 4, pin_memory=False)
    engine = CopyEngine(layout, kv, host)
    pages = host.alloc(2)
    assert pages is not None
    engine.launch(list(range(16, 48)), pages)  # device pages 1 and 2
    expected = _expected(layout, kv, list(range(16, 48)))
    assert engine.load(pages, list(range(32, 64))).error is None  # into pages 2 and 3
    assert torch.equal(_expected(layout, kv, list(range(32, 64))), expected)


def test_bad_loads_are_refused_before_anything_is_written() -> None:
    layout, views, buffer = _strided_blocks()
    host = HostPagePool(layout, 4, pin_memory=False)
    engine = CopyEngine(layout, views, host)
    pages = host.alloc(2)
    assert pages is not None
    before = buffer.clone()
    with pytest.raises(ValueError, match="3 slots are not 2 whole pages"):
        engine.load(pages, [1, 2, 3])
    with pytest.raises(ValueError, match="out of range"):
        engine.load(pages, [1, 12])
    other = HostPagePool(layout, 2, pin_memory=False).alloc(2)
    assert other is not None
    with pytest.raises(ValueError, match="another pool"):
        engine.load(other, [1, 2])
    token_layout = LAYOUTS["per_layer"]
    token_host = HostPagePool(token_layout, 2, pin_memory=False)
    token_pages = token_host.alloc(1)
    assert token_pages is not None
    token_engine = CopyEngine(token_layout, _filled(token_layout), token_host)
    with pytest.raises(ValueError, match="whole aligned device pages"):
        token_engine.load(token_pages, list(range(3, 19)))
    assert torch.equal(buffer, before)


@pytest.mark.parametrize("direct", [True, False])
def test_a_load_that_lists_a_device_page_twice_is_refused_and_writes_nothing(
    direct: bool,
) -> None:
    """Before: both host pages were written into block 5 (on CUDA in no set order) and
    block 3, where the engine expects the second, kept its old KV: wrong KV, no error."""
    layout, views, buffer = _strided_blocks()
    host = HostPagePool(layout, 4, pin_memory=False)
    engine = CopyEngine(layout, views, host, direct=direct)
    pages = host.alloc(3)
    assert pages is not None
    assert engine.launch([0, 1, 2], pages).error is None
    before = buffer.clone()
    with pytest.raises(ValueError, match=r"lists device page 5 twice \(1 repeat\(s\) in 3"):
        engine.load(pages, [5, 3, 5])
    refused, loaded = engine.launch_many([([5, 3, 5], pages), ([7, 8, 9], pages)], load=True)
    assert isinstance(refused, ValueError) and "page 5 twice" in str(refused)
    assert isinstance(loaded, CopyJob) and loaded.error is None  # the other item is copied
    changed = (buffer != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [7, 8, 9]
    token_layout = LAYOUTS["per_layer"]
    token_host = HostPagePool(token_layout, 2, pin_memory=False)
    token_pages = token_host.alloc(2)
    assert token_pages is not None
    kv = _filled(token_layout)
    token_engine = CopyEngine(token_layout, kv, token_host)
    kept = [t.clone() for t in kv]
    with pytest.raises(ValueError, match="device page 1 twice"):
        token_engine.load(token_pages, [*range(16, 32), *range(16, 32)])
    assert all(torch.equal(a, b) for a, b in zip(kv, kept, strict=True))


@pytest.mark.cuda
@cuda
def test_cuda_a_block_layout_stores_and_loads_byte_for_byte() -> None:
    layout, views, buffer = _strided_blocks()
    buffer = buffer.cuda()
    views = [buffer[:, c].transpose(1, 2) for c in range(3)]
    host = HostPagePool(layout, 4, pin_memory=True)
    engine = CopyEngine(layout, views, host, streams=2)
    before = buffer.clone()
    pages = host.alloc(2)
    assert pages is not None
    store = engine.launch([3, 8], pages)
    assert store.event is not None
    store.event.synchronize()  # a load reads only pages whose store is over (direct: any order)
    load = engine.load(pages, [0, 5])
    assert load.event is not None
    torch.cuda.current_stream().wait_event(load.event)
    torch.cuda.synchronize()
    assert store.query() and load.query() and load.error is None
    assert torch.equal(buffer[0], before[3]) and torch.equal(buffer[5], before[8])


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("scenario", ["gate", "compute", "gate-direct", "compute-direct"])
def test_cuda_no_call_waits_on_the_device_in_a_fresh_process(scenario: str) -> None:
    """Under CUDA's default lazy module loading, in a process where nothing ran before:
    stores and loads launched behind a closed gate on the copy stream, or behind a long
    kernel on the compute stream, each return at once, none is done before the device
    is let go, none allocates device memory, and the bytes come out equal."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.cuda_probe", scenario],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert max(seen["calls_s"]) < 0.5, seen
    assert not any(seen["done_before_release"]), seen
    assert seen["errors"] == [] and seen["bytes_equal"], seen
    assert seen["allocations_during_calls"] == 0 and seen["index_overflows"] == 0, seen
    assert not seen["gate_timed_out"], seen

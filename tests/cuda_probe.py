"""A fresh process that builds a CopyEngine and times its calls while the device is busy.

Run by the CUDA tests (``python -m tests.cuda_probe SCENARIO``) under CUDA's default lazy
module loading, so that nothing an earlier test launched has loaded a kernel already:

* ``gate``: the engine's copy stream is held by a host-function gate; stores and loads
  are launched behind it;
* ``compute``: a long kernel runs on the compute stream; stores and loads are launched
  after it;
* ``gate-direct``, ``compute-direct``: the same with a block-outermost cache (vLLM's
  ``BLNHC``), whose whole blocks the engine copies by the copy engines (no kernel).

Prints one JSON object: each call's seconds, whether any copy was done before the device
was let go, whether the bytes came out equal, and the caching allocator's allocation
count around the calls.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvlife.offload.copy_engine import CopyEngine, CopyJob
from kvlife.offload.host_callback import StreamGate
from kvlife.offload.host_pool import HostPagePool
from kvlife.offload.layout import KVLayout

PAGE = 16


def _allocations() -> int:
    return int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))


def _hold(scenario: str, engine: CopyEngine) -> StreamGate | None:
    """Hold the device as ``scenario`` says: a gate on the copy stream, or a long kernel."""
    if scenario.startswith("gate"):
        return StreamGate(engine.copy_streams[0], timeout_s=30)
    torch.cuda._sleep(4_000_000_000)  # about 2 s at 2 GHz on the compute stream
    return None


def _seen(
    scenario: str,
    calls: list[float],
    jobs: list[CopyJob],
    done_early: list[bool],
    equal: bool,
    allocated: int,
    overflows: int,
    gate: StreamGate | None,
) -> dict[str, object]:
    """What a probe prints: each call's seconds, what was done too early, the errors, the
    bytes, the allocations and index overflows during the calls, whether the gate timed
    out."""
    return {
        "scenario": scenario,
        "calls_s": calls,
        "done_before_release": done_early,
        "errors": [repr(job.error) for job in jobs if job.error is not None],
        "bytes_equal": bool(equal),
        "allocations_during_calls": allocated,
        "index_overflows": overflows,
        "gate_timed_out": bool(gate.timed_out) if gate is not None else False,
    }


def probe_direct(scenario: str) -> dict[str, object]:
    """As ``probe``, on a ``BLNHC`` cache of 4 layers (whole blocks, copied directly). A
    direct load may read its host pages in any order, so the loads read pages stored and
    finished before the device is held (as the planner loads only pages whose store is
    over), while the stores behind the hold fill other pages."""
    blocks, layers = 512, 4
    buffer = torch.randn(blocks, layers, PAGE, 2, 64, device="cuda").to(torch.bfloat16)
    views = [buffer[:, layer].transpose(1, 2) for layer in range(layers)]  # [B, H, N, C]
    layout = KVLayout.blocks(layers, blocks, (2, PAGE, 64), torch.bfloat16)
    host = HostPagePool(layout, 256, pin_memory=True)
    engine = CopyEngine(layout, views, host)
    assert engine.path == "direct", engine.describe()
    sizes = [1, 3, 17, 40]
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
    runs = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    sources = [order[runs[i] : runs[i + 1]] for i in range(len(sizes))]
    stored = [order[100 + runs[i] : 100 + runs[i + 1]] for i in range(len(sizes))]
    targets = [order[200 + runs[i] : 200 + runs[i + 1]] for i in range(len(sizes))]
    loaded_pages = []
    for src in sources:  # what the loads read: stored, and over, before the hold
        pages = host.alloc(len(src))
        assert pages is not None
        engine.launch(src, pages)
        loaded_pages.append(pages)
    torch.cuda.synchronize()
    before_bytes = buffer.clone()
    calls: list[float] = []
    jobs = []
    before = _allocations()
    gate = _hold(scenario, engine)
    stored_pages = []
    for src in stored:
        pages = host.alloc(len(src))
        assert pages is not None
        t0 = time.perf_counter()
        jobs.append(engine.launch(src, pages))
        calls.append(time.perf_counter() - t0)
        stored_pages.append(pages)
    for pages, dst in zip(loaded_pages, targets, strict=True):
        t0 = time.perf_counter()
        jobs.append(engine.load(pages, dst))
        calls.append(time.perf_counter() - t0)
    allocated = _allocations() - before
    done_early = [job.query() for job in jobs]
    if gate is not None:
        gate.open()
    torch.cuda.synchronize()
    size = host.bytes_per_page
    raw = before_bytes.view(torch.uint8).view(blocks, size).cpu()
    equal = all(
        torch.equal(buffer[dst], before_bytes[src])
        for src, dst in zip(sources, targets, strict=True)
    ) and all(
        torch.equal(host.tensor[list(pages)].view(torch.uint8).view(-1, size), raw[src])
        for src, pages in zip(stored, stored_pages, strict=True)
    )
    return _seen(scenario, calls, jobs, done_early, equal, allocated, 0, gate)


def probe(scenario: str, rounds: int = 4) -> dict[str, object]:
    """Build an engine, hold the device (``gate`` or ``compute``), time ``rounds`` stores
    of 1, 3, 17 and 40 pages and as many loads, then let the device go and check bytes."""
    layout = KVLayout("per_layer", layers=4, slots=512 * PAGE, heads=2, head_dim=64,
                      dtype=torch.bfloat16, page_size=PAGE)  # fmt: skip
    kv = [t.cuda().normal_() for t in layout.allocate()]
    host = HostPagePool(layout, 256, pin_memory=True)
    engine = CopyEngine(layout, kv, host, chunk_pages=16)
    torch.cuda.synchronize()
    sizes = [1, 3, 17, 40][:rounds]
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(512, generator=gen).tolist()
    sources = [order[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
    targets = [order[200 + sum(sizes[:i]) : 200 + sum(sizes[: i + 1])] for i in range(len(sizes))]
    calls: list[float] = []
    jobs = []
    before = _allocations()
    gate = _hold(scenario, engine)
    stored = []
    for pages_of, src in zip(sizes, sources, strict=True):
        pages = host.alloc(pages_of)
        assert pages is not None
        slots = [p * PAGE + t for p in src for t in range(PAGE)]
        if pages_of == 3:
            slots = slots[:-5]  # a partial last page: the token path
        t0 = time.perf_counter()
        jobs.append(engine.launch(slots, pages))
        calls.append(time.perf_counter() - t0)
        stored.append((pages, slots))
    for (pages, _), dst in zip(stored, targets, strict=True):
        slots = [p * PAGE + t for p in dst for t in range(PAGE)]
        t0 = time.perf_counter()
        jobs.append(engine.load(pages, slots))
        calls.append(time.perf_counter() - t0)
    allocated = _allocations() - before
    done_early = [job.query() for job in jobs]
    if gate is not None:
        gate.open()
    torch.cuda.synchronize()
    views = layout.component_views(kv)
    equal = True
    for (pages, slots), dst in zip(stored, targets, strict=True):
        n = len(slots)
        expected = torch.stack([v[torch.tensor(slots, device="cuda")] for v in views]).cpu()
        equal &= torch.equal(host.read_tokens(pages, n), expected)
        loaded = [p * PAGE + t for p in dst for t in range(PAGE)][:n]
        back = torch.stack([v[torch.tensor(loaded, device="cuda")] for v in views]).cpu()
        equal &= torch.equal(back, expected)
    overflows = engine._indices.overflows
    return _seen(scenario, calls, jobs, done_early, equal, allocated, overflows, gate)


if __name__ == "__main__":
    name = sys.argv[1]
    print(json.dumps(probe_direct(name) if name.endswith("-direct") else probe(name)))

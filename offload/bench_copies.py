"""The offload benchmark's measurements: kvlife's copies beside the peers' ways of making
the same copies, in the same process, interleaved round by round.

Every measurement returns plain rows (dataclasses) that ``kvlife bench offload`` prints and
writes to JSON; none asserts a figure. Each way's bytes are compared with what they should
be on the last round (``equal``), so a fast way that copies the wrong bytes shows.

Ways of copying (see [`kvlife.offload.peer_copies`][kvlife.offload.peer_copies]):

* ``kvlife``: stores through [`OffloadManager`][kvlife.offload.manager.OffloadManager]
  (bookkeeping included), loads through
  [`CopyEngine.load`][kvlife.offload.copy_engine.CopyEngine.load];
* ``per-block``: one ``cudaMemcpyAsync`` per block and layer (vLLM's fallback; one
  ``memmove`` each on the CPU);
* ``batch``: one ``cudaMemcpyBatchAsync`` of the same list (vLLM's CPU offload on CUDA
  12.8 and later; CUDA only);
* ``contiguous``: one copy of the same number of bytes from one contiguous tensor (the
  link's limit, the baseline of every ratio).

Why one module: the measurements share one harness (the ways interleaved round by
round, bytes compared on the last round, rows as plain dataclasses); the block-outermost
part is ``bench_blocks``, the command and its verdicts ``bench``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from kvlife.fsm.registry import Lifecycle
from kvlife.offload.completion import CompletionQueue
from kvlife.offload.copy_engine import CopyEngine, CopyJob
from kvlife.offload.host_callback import HostCallbacks
from kvlife.offload.host_pool import HostPagePool
from kvlife.offload.layout import KVLayout, block_views
from kvlife.offload.manager import OffloadManager, OffloadResult
from kvlife.offload.peer_copies import (
    CopyList,
    PeerCopyError,
    batch_copy_available,
    block_copy_list,
    copy_batch,
    copy_per_block,
)
from kvlife.offload.planner import LoadOrder, StoreOrder
from kvlife.offload.worker import OffloadWorker

PAGE = 16
"""Tokens per device page (block) in every measurement."""


class _Request:
    __slots__ = ("rid", "slots")

    def __init__(self, rid: str, slots: torch.Tensor) -> None:
        self.rid = rid
        self.slots = slots


class BenchSource:
    """A KVSource whose requests carry their slot indices."""

    def committed(self, req: Any) -> int:
        return len(req.slots)

    def token_ids(self, req: Any, start: int, end: int) -> Sequence[int]:
        return range(start, end)

    def slots(self, req: Any, start: int, end: int) -> torch.Tensor:
        return req.slots[start:end]  # type: ignore[no-any-return]

    def release_slots(self, req: Any, lifecycle: Lifecycle) -> None:
        """The benchmark's pool is never reused while copies run."""


def reference_layout(slots: int, layers: int = 32) -> KVLayout:
    """The reference KV shape: ``layers`` layers, 8 heads, dim 128, bf16, 16-token pages."""
    return KVLayout(
        "per_layer",
        layers=layers,
        slots=slots,
        heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        page_size=PAGE,
    )


def sync(device: torch.device) -> None:
    """Wait for the device (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class WayRow:
    """One way of copying, one direction, one size: medians over the rounds.

    ``host_ms``: how long the call that issued the copies took (the scheduler thread's
    cost); ``launches``: the copies and kernels it issued per offload; ``equal``: whether
    the bytes came out right (``None``: not compared); ``error``: why the way did not run.
    """

    layout: str
    direction: str
    way: str
    tokens: int
    bytes: int
    gbs: float = 0.0
    host_ms: float = 0.0
    launches: int = 0
    equal: bool | None = None
    error: str | None = None
    first_ms: float | None = None  # kvlife stores: the first offload after the engine was built
    steady_ms: float | None = None


@dataclass
class _Way:
    name: str
    run: Callable[[], Any]
    launches: int
    check: Callable[[], bool] | None = None
    prepare: Callable[[], None] | None = None
    seconds: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)
    error: str | None = None
    equal: bool | None = None
    first: float | None = None


def _interleave(ways: list[_Way], device: torch.device, reps: int) -> None:
    """Run every way once per round, in turn (round 0 warms up, but its kvlife time is the
    first offload's); the last round checks bytes."""
    for rep in range(reps + 1):
        for way in ways:
            if way.error is not None:
                continue
            if way.prepare is not None and rep == reps:
                way.prepare()
            sync(device)
            t0 = time.perf_counter()
            try:
                way.run()
                t1 = time.perf_counter()
                sync(device)
            except (PeerCopyError, RuntimeError) as exc:
                way.error = f"{type(exc).__name__}: {exc}"
                sync(device)
                continue
            t2 = time.perf_counter()
            if rep == 0:
                way.first = t2 - t0
            else:
                way.seconds.append(t2 - t0)
                way.host.append(t1 - t0)
            if rep == reps and way.check is not None:
                way.equal = way.check()


def _rows(ways: list[_Way], layout: str, direction: str, tokens: int, nbytes: int) -> list[WayRow]:
    rows = []
    for way in ways:
        row = WayRow(layout, direction, way.name, tokens, nbytes, launches=way.launches)
        if way.error is not None or not way.seconds:
            row.error = way.error or "did not run"
        else:
            steady = statistics.median(way.seconds)
            row.gbs = nbytes / steady / 1e9
            row.host_ms = statistics.median(way.host) * 1e3
            row.equal = way.equal
            if way.name == "kvlife" and direction == "store" and way.first is not None:
                row.first_ms, row.steady_ms = way.first * 1e3, steady * 1e3
        rows.append(row)
    return rows


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _peer_runner(
    copies: Callable[[], CopyList], stream: torch.cuda.Stream | None, batch: bool, to_host: bool
) -> Callable[[], None]:
    """Build the list (part of the cost, as the peers do per transfer) and copy it."""

    def run() -> None:
        listed = copies()
        if stream is None:
            copy_per_block(listed, None)
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        if batch:
            copy_batch(listed, stream, to_host=to_host)
        else:
            copy_per_block(listed, stream)

    return run


def _direction(
    kvlife: _Way,
    peers: Callable[[], CopyList],
    contiguous: Callable[[], Any],
    stream: torch.cuda.Stream | None,
    *,
    to_host: bool,
    listed: int,
    check: Callable[[], bool],
    prepare: Callable[[], None],
) -> list[_Way]:
    """One direction's ways in the order printed: kvlife, per-block, batch (CUDA only:
    said unavailable before CUDA 12.8), contiguous. The peers' ways build their list per
    offload, as the peers do, and are checked and prepared as kvlife is."""
    ways = [
        kvlife,
        _Way("per-block", _peer_runner(peers, stream, False, to_host), listed, check, prepare),
    ]
    if stream is not None:
        batch = _Way("batch", _peer_runner(peers, stream, True, to_host), 1, check, prepare)
        if not batch_copy_available():
            batch.error = "cudaMemcpyBatchAsync needs CUDA 12.8+"
        ways.append(batch)
    ways.append(_Way("contiguous", contiguous, 1))
    return ways


def measure_ways(
    tokens: int,
    device: torch.device,
    *,
    reps: int = 7,
    layers: int = 32,
    chunk_pages: int = 64,
    threads: int | None = None,
) -> list[WayRow]:
    """Stores and loads of ``tokens`` tokens of the reference KV (scattered 16-token
    pages) by every way, against a contiguous copy of the same bytes."""
    layout = reference_layout(2 * tokens, layers)
    kv = layout.allocate(device)
    for t in kv:
        t.normal_()
    pages = tokens // PAGE
    cuda = device.type == "cuda"
    host = HostPagePool(layout, 2 * pages, pin_memory=cuda)
    loaded = host.alloc(pages)  # pages 0..P-1: what the loads read
    assert loaded is not None
    copier = CopyEngine(layout, kv, host, chunk_pages=chunk_pages, threads=threads)
    manager = OffloadManager(BenchSource(), copier, stride_pages=1)
    landed: list[int] = []  # the host pages the manager's last store filled, in order

    def released(req: Any, result: OffloadResult) -> None:
        landed[:] = [i for pages in result.pages for i in pages.indices]
        _free(host, result)

    manager.on_release(released)
    device_pages = [c.view(-1, PAGE, layout.elems) for c in layout.component_views(kv)]
    gen = torch.Generator().manual_seed(tokens)
    order = torch.randperm(2 * pages, generator=gen)
    sources, targets = order[:pages], order[pages:]
    src_slots = (sources[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    dst_slots = (targets[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    stored_pages = torch.arange(pages, 2 * pages)  # where the manager's store lands
    # what the loads read: the source pages, stored once by kvlife
    first = copier.launch(src_slots, loaded)
    if first.event is not None:
        first.event.synchronize()
    expected_host = host.tensor[:pages].clone()
    nbytes = tokens * layout.bytes_per_token
    flat_dev = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    flat_store = host.tensor[pages:].view(-1)  # the manager's pages, free between rounds
    flat_load = host.tensor[:pages].view(-1)
    stream = _side_stream(device)
    components = layout.components
    chunks = math.ceil(pages / chunk_pages)
    serial = iter(range(1 << 30))

    def store_kvlife() -> None:
        # block ids on the host, as block-paged engines hand them over: the page path
        req = _Request(f"bench-{next(serial)}", src_slots)
        manager.register(req)
        manager.step(req)
        manager.drain()
        manager.finish(req)
        manager.poll()

    def stored_right() -> bool:
        return torch.equal(host.tensor[pages:].cpu(), expected_host.cpu())

    def manager_stored_right() -> bool:
        return torch.equal(host.tensor[landed].cpu(), expected_host.cpu())

    def clear_stored() -> None:
        host.tensor[pages:].zero_()

    def load_kvlife() -> None:
        job = copier.load(loaded, dst_slots)
        if job.error is not None:
            raise RuntimeError(f"load failed: {job.error}")

    def loaded_right() -> bool:
        return all(torch.equal(d[targets.to(device)], d[sources.to(device)]) for d in device_pages)

    def clear_targets() -> None:
        for d in device_pages:
            d[targets.to(device)] = 0

    def store_list() -> CopyList:
        return block_copy_list(device_pages, host.tensor, sources, stored_pages, to_host=True)

    def load_list() -> CopyList:
        return block_copy_list(
            device_pages, host.tensor, targets, torch.arange(pages), to_host=False
        )

    listed = pages * components
    launches = chunks * components + chunks
    store_ways = _direction(
        _Way("kvlife", store_kvlife, launches, manager_stored_right, clear_stored),
        store_list,
        lambda: flat_store.copy_(flat_dev, non_blocking=True),
        stream,
        to_host=True,
        listed=listed,
        check=stored_right,
        prepare=clear_stored,
    )
    load_ways = _direction(
        _Way("kvlife", load_kvlife, launches, loaded_right, clear_targets),
        load_list,
        lambda: flat_dev.copy_(flat_load, non_blocking=True),
        stream,
        to_host=False,
        listed=listed,
        check=loaded_right,
        prepare=clear_targets,
    )
    _interleave(store_ways, device, reps)
    _interleave(load_ways, device, reps)
    name = f"reference ({layers} layers)"
    return _rows(store_ways, name, "store", tokens, nbytes) + _rows(
        load_ways, name, "load", tokens, nbytes
    )


def _free(host: HostPagePool, result: OffloadResult) -> None:
    for pages in result.pages:
        host.free(pages)


@dataclass
class ConcurrentRow:
    """A store and a load of ``tokens`` tokens each, running at once, by one way."""

    way: str
    tokens: int
    bytes: int
    gbs: float = 0.0
    error: str | None = None


class _Duplex:
    """A store of ``tokens`` tokens (device pages 0..P-1 into host pages 0..P-1) and a load
    as large (host pages P..2P-1 into device pages 2P..3P-1), issued at once on two streams
    by kvlife or by the batch way: both directions of the link busy."""

    def __init__(self, tokens: int, device: torch.device, layers: int) -> None:
        layout = reference_layout(3 * tokens, layers)
        self.device = device
        self.layout = layout
        pages = tokens // PAGE
        self.host = host = HostPagePool(layout, 2 * pages, pin_memory=True)
        store_pages, load_pages = host.alloc(pages), host.alloc(pages)
        assert store_pages is not None
        assert load_pages is not None
        self.store_pages, self.load_pages = store_pages, load_pages
        kv = layout.allocate(device)
        self.copier = CopyEngine(layout, kv, host, streams=2)
        self.src = torch.arange(pages * PAGE)
        self.dst = torch.arange(2 * pages * PAGE, 3 * pages * PAGE)
        device_pages = [c.view(-1, PAGE, layout.elems) for c in layout.component_views(kv)]
        self.out_list = block_copy_list(
            device_pages, host.tensor, torch.arange(pages), torch.arange(pages), to_host=True
        )
        self.in_list = block_copy_list(
            device_pages,
            host.tensor,
            torch.arange(2 * pages, 3 * pages),
            torch.arange(pages, 2 * pages),
            to_host=False,
        )
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

    def kvlife(self) -> None:
        self.copier.launch(self.src, self.store_pages)  # streams in turn: 0 stores, 1 loads
        self.copier.load(self.load_pages, self.dst)

    def batch(self) -> None:
        for s in self.streams:
            s.wait_stream(torch.cuda.current_stream(self.device))
        copy_batch(self.out_list, self.streams[0], to_host=True)
        copy_batch(self.in_list, self.streams[1], to_host=False)


def measure_concurrent(
    tokens: int, device: torch.device, *, reps: int = 5, layers: int = 32
) -> list[ConcurrentRow]:
    """GB/s of a store and a load at once (both directions of the link): kvlife on two
    streams, the batch way on two streams, two contiguous copies on two streams."""
    duplex = _Duplex(tokens, device, layers)
    host, streams = duplex.host, duplex.streams
    pages = tokens // PAGE
    nbytes = 2 * tokens * duplex.layout.bytes_per_token
    flat = torch.empty(nbytes // 4, dtype=torch.bfloat16, device=device)
    flat_back = torch.empty_like(flat)
    host_out = host.tensor[:pages].view(-1)
    host_in = host.tensor[pages:].view(-1)

    def contiguous() -> None:
        with torch.cuda.stream(streams[0]):
            host_out.copy_(flat, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            flat_back.copy_(host_in, non_blocking=True)

    runs = {"kvlife": duplex.kvlife, "contiguous": contiguous}
    if batch_copy_available():
        runs["batch"] = duplex.batch
    rows = {name: ConcurrentRow(name, tokens, nbytes) for name in ("kvlife", "batch", "contiguous")}
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(reps + 1):
        for name, run in runs.items():
            if rows[name].error is not None:
                continue
            sync(device)
            t0 = time.perf_counter()
            try:
                run()
                sync(device)
            except (PeerCopyError, RuntimeError) as exc:
                rows[name].error = f"{type(exc).__name__}: {exc}"
                continue
            if rep:
                samples[name].append(time.perf_counter() - t0)
    for name, row in rows.items():
        if name not in runs:
            row.error = "cudaMemcpyBatchAsync needs CUDA 12.8+"
        elif samples[name]:
            row.gbs = nbytes / statistics.median(samples[name]) / 1e9
    return list(rows.values())


@dataclass
class ComputeRow:
    """How much slower a bf16 matmul loop on the compute stream ran while a way copied."""

    way: str
    matmul_ms: float
    slowdown: float
    copies: int
    error: str | None = None


def measure_compute_slowdown(
    device: torch.device,
    *,
    tokens: int = 4096,
    layers: int = 32,
    size: int = 8192,
    rounds: int = 8,
    more: Sequence[tuple[str, Callable[[], None]]] = (),
) -> list[ComputeRow]:
    """A loop of ``size``² bf16 matmuls on the compute stream alone, then with a store and
    a load of ``tokens`` tokens issued before each group of matmuls, by kvlife on the
    per-layer reference cache (its gather and scatter are kernels: they take SMs), by the
    batch way (DMA only), and by each of ``more`` (name, a store and a load issued)."""
    duplex = _Duplex(tokens, device, layers)
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    per_round = 8

    def loop(copies: Callable[[], None] | None) -> float:
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(rounds):
            if copies is not None:
                copies()  # queued first: it waits only for the matmuls before it
            for _ in range(per_round):
                torch.mm(a, b)
        end.record()
        sync(device)
        return float(start.elapsed_time(end)) / (rounds * per_round)

    loop(None)  # warm the matmul
    alone = statistics.median(loop(None) for _ in range(3))
    rows = [ComputeRow("none", alone, 1.0, 0)]
    ways: list[tuple[str, Callable[[], None]]] = [("kvlife", duplex.kvlife)]
    if batch_copy_available():
        ways.append(("batch", duplex.batch))
    ways += more
    for name, run in ways:
        try:
            with_copies = statistics.median(loop(run) for _ in range(3))
        except (PeerCopyError, RuntimeError) as exc:
            rows.append(ComputeRow(name, 0.0, 0.0, 0, f"{type(exc).__name__}: {exc}"))
            continue
        rows.append(ComputeRow(name, with_copies, with_copies / alone, 2 * rounds))
    return rows


@dataclass
class LayoutRow:
    """Stores and loads of one vLLM cache layout through kvlife's worker half."""

    layout: str
    direction: str
    way: str
    blocks: int
    bytes: int
    gbs: float = 0.0
    equal: bool | None = None
    error: str | None = None


def vllm_layouts(blocks: int, layers: int, device: torch.device) -> dict[str, list[torch.Tensor]]:
    """Per-layer caches shaped as vLLM's CUDA attention backends allocate them (16-token
    blocks, 8 KV heads of 128, bf16; MLA: one 576-wide latent), as the ``[blocks,
    *block]`` views kvlife's worker takes. Nothing is imported from vLLM."""

    def filled(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device).to(torch.bfloat16)

    flash = {f"l{i}": filled(2, blocks, PAGE, 8, 128) for i in range(layers)}  # [2, B, 16, H, D]
    return {
        "FlashAttention NHD": block_views(flash, blocks),
        # FlashInfer's HND: [B, 2, H, 16, D] in memory, one block holds K and V
        "FlashInfer HND": [filled(blocks, 2, 8, PAGE, 128) for _ in range(layers)],
        "MLA": [filled(blocks, PAGE, 576) for _ in range(layers)],  # [B, 16, latent]
    }


def measure_layouts(
    blocks: int, device: torch.device, *, layers: int = 32, reps: int = 5
) -> list[LayoutRow]:
    """Each layout's stores (``blocks`` blocks into host pages) and loads (into other
    blocks) through [`OffloadWorker`][kvlife.offload.worker.OffloadWorker], byte for
    byte both ways, beside the per-block and batch ways and a contiguous copy."""
    rows: list[LayoutRow] = []
    for name, views in vllm_layouts(2 * blocks, layers, device).items():
        rows += _measure_layout(name, views, blocks, device, reps)
    return rows


def _measure_layout(
    name: str, views: list[torch.Tensor], blocks: int, device: torch.device, reps: int
) -> list[LayoutRow]:
    worker = OffloadWorker(views, 2 * blocks)
    host = worker.host
    nbytes = blocks * host.bytes_per_page
    gen = torch.Generator().manual_seed(blocks)
    order = torch.randperm(2 * blocks, generator=gen)
    sources, targets = order[:blocks], order[blocks:]
    src, dst = sources.to(device), targets.to(device)
    op = iter(range(1, 1 << 30))
    stream = _side_stream(device)

    def wait() -> None:
        while worker.inflight:
            worker.poll()

    def store() -> None:
        worker.store([StoreOrder(next(op), tuple(sources.tolist()), tuple(range(blocks)), 0)])
        wait()

    def load() -> None:
        worker.load([LoadOrder(next(op), tuple(targets.tolist()), tuple(range(blocks)), 0)])
        wait()

    def stored_right() -> bool:
        return all(
            torch.equal(
                host.tensor[:blocks, c].reshape(blocks, -1).to(device), v[src].reshape(blocks, -1)
            )
            for c, v in enumerate(views)
        )

    def loaded_right() -> bool:
        return all(torch.equal(v[dst], v[src]) for v in views)

    def clear_host() -> None:
        host.tensor[:blocks].zero_()

    def clear_targets() -> None:
        for v in views:
            v[dst] = 0

    def out_list() -> CopyList:
        return block_copy_list(views, host.tensor, sources, torch.arange(blocks), to_host=True)

    def in_list() -> CopyList:
        return block_copy_list(views, host.tensor, targets, torch.arange(blocks), to_host=False)

    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    flat_host = host.tensor[blocks:].reshape(-1)[: nbytes // host.tensor.element_size()]
    flat_host = flat_host.view(torch.uint8).view(torch.bfloat16)
    listed = blocks * len(views)
    store_ways = _direction(
        _Way("kvlife", store, 0, stored_right, clear_host),
        out_list,
        lambda: flat_host.copy_(flat, non_blocking=True),
        stream,
        to_host=True,
        listed=listed,
        check=stored_right,
        prepare=clear_host,
    )
    load_ways = _direction(
        _Way("kvlife", load, 0, loaded_right, clear_targets),
        in_list,
        lambda: flat.copy_(flat_host, non_blocking=True),
        stream,
        to_host=False,
        listed=listed,
        check=loaded_right,
        prepare=clear_targets,
    )
    _interleave(store_ways, device, reps)
    _interleave(load_ways, device, reps)
    worker.shutdown()
    rows = []
    for direction, ways in (("store", store_ways), ("load", load_ways)):
        for row in _rows(ways, name, direction, blocks * PAGE, nbytes):
            rows.append(
                LayoutRow(name, direction, row.way, blocks, nbytes, row.gbs, row.equal, row.error)
            )
    return rows


@dataclass
class CompletionRow:
    """Back-to-back copies, each one's completion found by polling its event or by a host
    function: the bandwidth, and the time from a copy's end on the device to the poll
    that delivered it (median and p99)."""

    mode: str
    gbs: float
    latency_us_median: float
    latency_us_p99: float
    delivered: int


def _delivered(delivered: dict[int, float], i: int, job: CopyJob) -> None:
    delivered[i] = time.perf_counter()


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def measure_completion(
    device: torch.device, copies: int = 200, mib: int = 64
) -> list[CompletionRow]:
    """``copies`` back-to-back ``mib`` MiB pinned D2H copies, one timing event after each,
    delivered by a [`CompletionQueue`][kvlife.offload.completion.CompletionQueue] polled in
    a loop; ``poll`` asks each event, ``callback`` lets a host function mark each done.
    A copy's end on the host clock: a reference event recorded on the idle stream right
    after a host clock read, plus the events' elapsed time."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = [torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    stream = torch.cuda.Stream(device)
    callbacks = HostCallbacks()
    no_pages = HostPagePool(KVLayout.mla(1, 1, 1, torch.uint8, 1), 1).pages(())
    rows: list[CompletionRow] = []
    for mode in ("poll", "callback", "poll", "callback"):  # the first two warm up
        torch.cuda.synchronize(device)
        queue = CompletionQueue(1)
        delivered: dict[int, float] = {}
        events: list[torch.cuda.Event] = []
        reference = torch.cuda.Event(enable_timing=True)
        t_ref = time.perf_counter()
        reference.record(stream)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for i in range(copies):
                dst[i % 4].copy_(src, non_blocking=True)
                event = torch.cuda.Event(enable_timing=True)
                event.record(stream)
                events.append(event)
                job = CopyJob(no_pages, 0, 0, event)
                if mode == "callback":
                    callbacks.after(stream, job)
                job.recorded = True
                queue.push(job, partial(_delivered, delivered, i))
        while len(delivered) < copies:
            queue.poll()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        latency = [
            (delivered[i] - (t_ref + reference.elapsed_time(events[i]) / 1e3)) * 1e6
            for i in range(copies)
        ]
        rows.append(
            CompletionRow(
                mode,
                copies * mib * 2**20 / elapsed / 1e9,
                statistics.median(latency),
                _p99(latency),
                len(delivered),
            )
        )
    return rows[2:]

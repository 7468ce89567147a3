"""The offload benchmark's block-outermost part: a cache laid out as vLLM's ``BLNHC`` (one
block of every layer side by side), whose whole blocks kvlife copies with no kernel
([`kvlife.offload.block_copy`][kvlife.offload.block_copy]), beside the ways vLLM's own
connectors copy the same cache, in one process, interleaved round by round:

* ``kvlife``: store and load orders through
  [`OffloadWorker`][kvlife.offload.worker.OffloadWorker] (its direct path), polled until
  over;
* ``runs``: the same merged runs listed and copied bare, as vLLM's
  SimpleCPUOffloadConnector builds its batch (one ``cudaMemcpyBatchAsync``; on the CPU one
  ``copy_`` per run): what kvlife's bookkeeping costs on top;
* ``per-block`` and ``batch``: one descriptor per block and layer, as vLLM's
  OffloadingConnector lists them (``cudaMemcpyAsync`` each, or one batch of them; on the CPU
  one ``memmove`` each);
* ``contiguous``: one copy of the same bytes (the limit).

Each row: GB/s, share of the limit, the host time of the call that issued the copies, the
descriptors it submitted, and whether the bytes came out right.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from kvlife.offload.bench_copies import (
    PAGE,
    WayRow,
    _direction,
    _interleave,
    _rows,
    _side_stream,
    _Way,
    sync,
)
from kvlife.offload.block_copy import BlockRuns
from kvlife.offload.copy_engine import CopyEngine
from kvlife.offload.dma import batch_available
from kvlife.offload.host_pool import HostPagePool
from kvlife.offload.layout import KVLayout, block_views
from kvlife.offload.peer_copies import CopyList, block_copy_list, copy_batch
from kvlife.offload.planner import LoadOrder, StoreOrder
from kvlife.offload.worker import OffloadWorker

HEADS, CONTENT = 8, 256
"""Per layer and token: 8 KV heads of K and V side by side (2 x 128), bf16: the reference
KV's 128 KiB per token at 32 layers."""


def outermost_cache(blocks: int, layers: int, device: torch.device) -> list[torch.Tensor]:
    """A ``BLNHC`` cache of ``blocks`` 16-token blocks: one buffer ``[B, L, N, H, C]``,
    random bf16, as one ``[B, H, N, C]`` view per layer (vLLM's logical per-layer view)."""
    buffer = torch.randn(blocks, layers, PAGE, HEADS, CONTENT, device=device).to(torch.bfloat16)
    logical = buffer.permute(1, 0, 3, 2, 4)  # [L, B, H, N, C]
    return [logical[layer] for layer in range(layers)]


class OuterCase:
    """``tokens`` tokens of a block-outermost cache of twice as many blocks: the sources
    scattered, stored into host pages ``0..n-1``; loads from those pages into other
    scattered blocks."""

    def __init__(self, tokens: int, layers: int, device: torch.device) -> None:
        n = tokens // PAGE
        self.n, self.device = n, device
        caches = outermost_cache(2 * n, layers, device)
        self.views = block_views({f"l{i}": v for i, v in enumerate(caches)}, 2 * n)
        self.worker = OffloadWorker(self.views, 2 * n)
        direct = self.worker.copier._direct
        if direct is None:
            raise RuntimeError("a BLNHC cache should take kvlife's direct path")
        self.direct = direct
        self.bare = BlockRuns(direct.span, self.worker.host.tensor)
        order = torch.randperm(2 * n, generator=torch.Generator().manual_seed(tokens))
        self.sources, self.targets = order[:n], order[n:]
        self.pages = tuple(range(n))
        self.raw = direct.span.raw
        self.host = direct.host  # [pages, bytes]
        self.nbytes = n * direct.span.size
        self.op = itertools.count(1)

    def _wait(self) -> None:
        worker = self.worker
        while worker.inflight:
            worker.poll()

    def store(self) -> None:
        self.worker.store([StoreOrder(next(self.op), tuple(self.sources.tolist()), self.pages, 0)])
        self._wait()

    def load(self) -> None:
        self.worker.load([LoadOrder(next(self.op), tuple(self.targets.tolist()), self.pages, 0)])
        self._wait()

    def runs(self, to_host: bool, stream: torch.cuda.Stream | None) -> Callable[[], Any]:
        """The merged runs listed and copied bare (no worker, no bookkeeping)."""
        blocks = self.sources if to_host else self.targets

        def run() -> None:
            if stream is None:
                self.bare.copy_cpu(blocks, self.pages, to_host=to_host)
                return
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            self.bare.copy_cuda(blocks, self.pages, stream, to_host=to_host)

        return run

    def per_block_list(self, to_host: bool) -> CopyList:
        blocks = self.sources if to_host else self.targets
        pages = torch.arange(self.n)
        return block_copy_list(self.views, self.worker.host.tensor, blocks, pages, to_host=to_host)

    def stored_right(self) -> bool:
        return torch.equal(
            self.host[: self.n].to(self.device), self.raw[self.sources.to(self.device)]
        )

    def loaded_right(self) -> bool:
        src, dst = self.sources.to(self.device), self.targets.to(self.device)
        return torch.equal(self.raw[dst], self.raw[src])

    def clear_host(self) -> None:
        self.host[: self.n].zero_()

    def clear_targets(self) -> None:
        self.raw[self.targets.to(self.device)] = 0


def measure_outermost(
    tokens: int, device: torch.device, *, reps: int = 7, layers: int = 32
) -> list[WayRow]:
    """Stores and loads of ``tokens`` tokens of a ``BLNHC`` cache by every way (see the
    module's docstring), against a contiguous copy of the same bytes."""
    case = OuterCase(tokens, layers, device)
    stream = _side_stream(device)
    # both sides of the limit's copy written first (an untouched buffer reads as the zero page)
    flat = torch.randint(0, 256, (case.nbytes,), dtype=torch.uint8, device=device)
    flat_host = case.host[case.n :].reshape(-1)[: case.nbytes]  # pages no way reads
    flat_host.fill_(1)
    listed = case.n * layers
    runs = len(case.direct.runs(case.sources, case.pages)[2])
    ways = {}
    case.store()  # what the loads read: the sources, stored once by kvlife
    for to_host in (True, False):
        # calls per offload: CUDA one batch; CPU a store fills its one run of pages with one
        # call, a load writes each run of blocks with one
        calls = 1 if device.type == "cuda" or to_host else runs
        kvlife = _Way(
            "kvlife",
            case.store if to_host else case.load,
            calls,
            case.stored_right if to_host else case.loaded_right,
            case.clear_host if to_host else case.clear_targets,
        )
        direction = _direction(
            kvlife,
            partial(case.per_block_list, to_host),
            (lambda: flat_host.copy_(flat, non_blocking=True))
            if to_host
            else (lambda: flat.copy_(flat_host, non_blocking=True)),
            stream,
            to_host=to_host,
            listed=listed,
            check=case.stored_right if to_host else case.loaded_right,
            prepare=case.clear_host if to_host else case.clear_targets,
        )
        bare = _Way(
            "runs",
            case.runs(to_host, stream),
            calls,
            case.stored_right if to_host else case.loaded_right,
            case.clear_host if to_host else case.clear_targets,
        )
        if stream is not None and not batch_available():
            bare.error = "cudaMemcpyBatchAsync needs CUDA 12.8+"
        direction.insert(1, bare)
        if not to_host:  # the loads read what the last store round left: store it again
            case.store()
        _interleave(direction, device, reps)
        ways[to_host] = direction
    case.worker.shutdown()
    name = f"BLNHC ({layers} layers)"
    return _rows(ways[True], name, "store", tokens, case.nbytes) + _rows(
        ways[False], name, "load", tokens, case.nbytes
    )


class OuterDuplex:
    """A store and a load of a ``BLNHC`` cache at once, by kvlife's direct path (two
    streams) or by one descriptor per block and layer (vLLM's OffloadingConnector's list,
    one batch each way): for the concurrent and compute-slowdown measurements."""

    def __init__(self, tokens: int, device: torch.device, layers: int) -> None:
        n = tokens // PAGE
        caches = outermost_cache(3 * n, layers, device)
        views = block_views({f"l{i}": v for i, v in enumerate(caches)}, 3 * n)
        first = views[0]
        layout = KVLayout.blocks(layers, 3 * n, tuple(first.shape[1:]), first.dtype)
        host = HostPagePool(layout, 2 * n, pin_memory=device.type == "cuda")
        self.copier = CopyEngine(layout, views, host, streams=2)  # a store and a load at once
        self.store_pages = host.pages(range(n))
        self.load_pages = host.pages(range(n, 2 * n))
        self.src = list(range(n))
        self.dst = list(range(2 * n, 3 * n))
        self.nbytes = 2 * n * host.bytes_per_page
        self.out_list = block_copy_list(
            views, host.tensor, torch.arange(n), torch.arange(n), to_host=True
        )
        self.in_list = block_copy_list(
            views, host.tensor, torch.arange(2 * n, 3 * n), torch.arange(n, 2 * n), to_host=False
        )
        self.device = device
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

    def kvlife(self) -> None:
        self.copier.launch(self.src, self.store_pages)
        self.copier.load(self.load_pages, self.dst)

    def batch(self) -> None:
        for stream in self.streams:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        copy_batch(self.out_list, self.streams[0], to_host=True)
        copy_batch(self.in_list, self.streams[1], to_host=False)

    def done(self) -> None:
        sync(self.device)

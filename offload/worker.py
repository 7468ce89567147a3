"""The worker half of kvlife's offload core: it copies what the scheduler half ordered.

One [`OffloadWorker`][kvlife.offload.worker.OffloadWorker] per device (per tensor-parallel
rank) holds the host pages and the copy engine over the engine's device caches. It takes
the [`StoreOrder`][kvlife.offload.planner.StoreOrder]s and
[`LoadOrder`][kvlife.offload.planner.LoadOrder]s of the
[`OffloadPlanner`][kvlife.offload.planner.OffloadPlanner], launches their copies (side
streams and CUDA events on a GPU, synchronous on the CPU) and tells, when polled, which
orders are over and which failed, by copy number: the reports the planner counts (it waits
for every worker's).

A load must land before the forward pass reads its blocks: on the CPU the copy is done
when ``load`` returns; on CUDA the current stream waits for the copy's event (a wait
enqueued on the stream: "only future operations are affected", the host does not block).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import cast

import torch

from kvlife.offload.copy_engine import CopyEngine, CopyJob
from kvlife.offload.host_pool import HostPagePool
from kvlife.offload.layout import KVLayout
from kvlife.offload.planner import LoadOrder, StoreOrder, block_ids

logger = logging.getLogger(__name__)


def _blocks(order: StoreOrder | LoadOrder) -> Sequence[int]:
    """An order's device blocks: block numbers, for one worker (an engine with several KV
    cache groups splits its rows into one order per group first). Not checked here, on
    the copy path: the copy engine refuses anything else, and the order fails."""
    return cast("Sequence[int]", order.slots)


class OffloadWorker:
    """Host pages and copies for one device's block caches.

    Args:
        views: the device caches as one ``[blocks, *block]`` view per component (see
            [`block_views()`][kvlife.offload.layout.block_views]).
        pages: host pages (one block of every component each); pinned on CUDA.

    Raises:
        LayoutError: the views do not make one block layout (nothing allocated).
    """

    def __init__(self, views: list[torch.Tensor], pages: int) -> None:
        first = views[0]
        self.layout = KVLayout.blocks(
            len(views), first.shape[0], tuple(first.shape[1:]), first.dtype
        )
        self.host = HostPagePool(self.layout, pages, pin_memory=first.is_cuda)
        self.copier = CopyEngine(self.layout, views, self.host)
        self._stores: dict[int, CopyJob] = {}  # in flight, by copy number
        self._loads: dict[int, CopyJob] = {}
        self._failed: set[int] = set()  # refused or failed since the last poll
        self._load_errors: set[int] = set()  # device blocks a failed load left unwritten

    @property
    def inflight(self) -> int:
        """Copies launched and not yet reported by ``poll``."""
        return len(self._stores) + len(self._loads)

    def store(self, orders: Iterable[StoreOrder]) -> None:
        """Launch each order's copy of device blocks into host pages. An order that cannot
        be launched is reported failed by the next ``poll`` (logged with its reason)."""
        copier, host = self.copier, self.host
        for order in orders:
            try:
                self._stores[order.op] = copier.launch(_blocks(order), host.pages(order.pages))
            except Exception:  # reported as failed; the planner frees the pages
                logger.exception("kvlife: store %d could not be launched", order.op)
                self._failed.add(order.op)

    def load(self, orders: Iterable[LoadOrder]) -> None:
        """Copy each order's host pages into its device blocks, ordered before whatever
        the current stream runs next. A load that fails is reported failed by the next
        ``poll`` and its blocks by ``take_load_errors`` (the engine recomputes them)."""
        copier, host = self.copier, self.host
        for order in orders:
            try:
                job = copier.load(host.pages(order.pages), _blocks(order))
                error = job.error  # a copy that failed while running
            except Exception as exc:  # refused before copying
                error = exc
            if error is not None:
                logger.error("kvlife: load %d failed: %s", order.op, error)
                self._failed.add(order.op)
                self._load_errors.update(block_ids(order.slots))
                continue
            if job.event is not None:  # the forward pass reads the blocks after the copy
                torch.cuda.current_stream(job.event.device).wait_event(job.event)
            self._loads[order.op] = job

    def wait(self, ops: Iterable[int]) -> None:
        """Block until the copies ``ops`` are over (their device blocks are about to be
        written: a preemption, or blocks of a finished request handed out again)."""
        for op in ops:
            job = self._stores.get(op) or self._loads.get(op)
            if job is not None and job.event is not None:
                job.event.synchronize()

    def poll(self) -> tuple[list[int], list[int]]:
        """The copy numbers of the orders over since the last poll, and of those that
        failed (each reported once)."""
        done: list[int] = []
        failed = sorted(self._failed)
        self._failed = set()
        for jobs in (self._loads, self._stores):
            for op, job in list(jobs.items()):
                if job.query():
                    del jobs[op]
                    job.release_resources()
                    (done if job.error is None else failed).append(op)
        return done, failed

    def take_load_errors(self) -> set[int]:
        """Device blocks that failed loads left unwritten since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Wait for the copies still in flight (they read or write the engine's blocks)."""
        for job in [*self._stores.values(), *self._loads.values()]:
            if job.event is not None:
                job.event.synchronize()

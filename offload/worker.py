"""The worker half of kvlife's offload core: it copies what the scheduler half ordered.

One [`OffloadWorker`][kvlife.offload.worker.OffloadWorker] per device (per tensor-parallel
rank) holds the host pages and the copy engine over the engine's device caches. It takes
the [`StoreOrder`][kvlife.offload.planner.StoreOrder]s and
[`LoadOrder`][kvlife.offload.planner.LoadOrder]s of the
[`OffloadPlanner`][kvlife.offload.planner.OffloadPlanner], launches their copies (side
streams and CUDA events on a GPU, synchronous on the CPU) and tells, when polled, which
orders are over and which failed, by copy number: the reports the planner counts (it waits
for every worker's).

Tensor parallelism: a worker given a ``torch.distributed`` group reports a store only
when it is over on every rank of the group (a
[`CompletionQueue`][kvlife.offload.completion.CompletionQueue] agrees on it), so every
rank tells the same reports in the same poll; every rank must then take the same orders
in the same order and poll as often.

A load must land before the forward pass reads its blocks: on the CPU the copy is done
when ``load`` returns; on CUDA the current stream waits for the copy's event (a wait
enqueued on the stream: "only future operations are affected", the host does not block).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import torch

from kvlife.offload.completion import CompletionQueue
from kvlife.offload.copy_engine import CopyEngine, CopyJob
from kvlife.offload.host_pool import HostPagePool
from kvlife.offload.layout import KVLayout, LayoutError
from kvlife.offload.planner import LoadOrder, StoreOrder, block_ids

logger = logging.getLogger(__name__)

_O = TypeVar("_O", StoreOrder, LoadOrder)


def _blocks(order: StoreOrder | LoadOrder) -> Sequence[int]:
    """An order's device blocks (or, for a worker over a token layout, token slots), for
    one worker (an engine with several KV cache groups splits its rows into one order
    per group first). Not checked here, on the copy path: the copy engine refuses
    anything else, and the order fails."""
    return cast("Sequence[int]", order.slots)


class OffloadWorker:
    """Host pages and copies for one device's block caches.

    Args:
        views: the device caches as one ``[blocks, *block]`` view per component (see
            [`block_views()`][kvlife.offload.layout.block_views]).
        pages: host pages (one block of every component each); pinned on CUDA.
        group: a ``torch.distributed`` group whose ranks must all finish a store before
            it is reported (see the module's docstring); ``None``: this worker alone.

    Raises:
        LayoutError: the views are not a non-empty list of tensors, or do not make one
            block layout (nothing allocated).
    """

    def __init__(self, views: list[torch.Tensor], pages: int, *, group: Any = None) -> None:
        if (
            not isinstance(views, (list, tuple))
            or not views
            or not all(isinstance(v, torch.Tensor) for v in views)
        ):
            raise LayoutError(f"views must be a non-empty list of tensors, got {views!r:.200}")
        first = views[0]
        layout = KVLayout.blocks(len(views), first.shape[0], tuple(first.shape[1:]), first.dtype)
        host = HostPagePool(layout, pages, pin_memory=first.is_cuda)
        self._start(CopyEngine(layout, views, host), group)

    @classmethod
    def over(cls, copier: CopyEngine, *, group: Any = None) -> OffloadWorker:
        """A worker over a copy engine (and its host pool) its caller built: an order's
        ``slots`` are then whatever that engine's ``launch`` copies (token slots for
        [`OffloadManager`][kvlife.offload.manager.OffloadManager]'s)."""
        worker = cls.__new__(cls)
        worker._start(copier, group)
        return worker

    def _start(self, copier: CopyEngine, group: Any) -> None:
        self.layout = copier.layout
        self.host = copier.host
        self.copier = copier
        self.queue = CompletionQueue(copier.streams, group=group)
        self._stores: dict[int, CopyJob] = {}  # in flight, by copy number
        self._loads: dict[int, CopyJob] = {}
        self._over: list[tuple[int, bool]] = []  # stores the queue delivered, in order
        self._failed: set[int] = set()  # refused since the last poll
        self._load_errors: set[int] = set()  # device blocks a failed load left unwritten

    @property
    def inflight(self) -> int:
        """Copies launched and not yet reported by ``poll``."""
        return len(self._stores) + len(self._loads)

    def store(self, orders: Iterable[StoreOrder], *, checked: bool = False) -> None:
        """Launch each order's copy of device blocks into host pages. An order that cannot
        be launched is reported failed by the next ``poll`` (logged with its reason).
        ``checked``: each order's ``slots`` is the tensor the copy engine's ``check``
        returned for it (not checked again). An order whose copy number is in flight
        already (or listed twice) is not copied: logged, and the first one's report
        stands for it."""
        copier, host, queue = self.copier, self.host, self.queue
        orders = self._new(orders, "store")
        if copier.cuda and copier.path == "direct":  # one batch of every order's runs
            self._store_together(orders)
            return
        for order in orders:
            op = order.op
            try:
                job = copier.launch(_blocks(order), host.pages(order.pages), checked=checked)
            except Exception:  # reported as failed; the planner frees the pages
                logger.exception("kvlife: store %d could not be launched", op)
                self._failed.add(op)
                continue
            self._stores[op] = job
            queue.push(job, partial(self._stored, op))

    def _store_together(self, orders: list[StoreOrder]) -> None:
        """Every order's blocks in one submission (the direct CUDA path): each order still
        its own job, reported when the shared copy is over."""
        host, queue = self.host, self.queue
        items = []
        for order in orders:
            try:
                items.append((order, host.pages(order.pages)))
            except Exception:  # reported as failed; the planner frees the pages
                logger.exception("kvlife: store %d could not be launched", order.op)
                self._failed.add(order.op)
        launched = self.copier.launch_many([(_blocks(o), pages) for o, pages in items])
        for (order, _), job in zip(items, launched, strict=True):
            if isinstance(job, BaseException):
                logger.error("kvlife: store %d could not be launched: %s", order.op, job)
                self._failed.add(order.op)
                continue
            self._stores[order.op] = job
            queue.push(job, partial(self._stored, order.op))

    def _stored(self, op: int, job: CopyJob) -> None:
        del self._stores[op]
        self._over.append((op, job.error is None))

    def load(self, orders: Iterable[LoadOrder]) -> None:
        """Copy each order's host pages into its device blocks, ordered before whatever
        the current stream runs next. A load that fails is reported failed by the next
        ``poll`` and its blocks by ``take_load_errors`` (the engine recomputes them). An
        order whose copy number is in flight already (or listed twice) is not copied:
        logged, and the first one's report stands for it."""
        orders = self._new(orders, "load")
        for order, made in zip(orders, self._launch_loads(orders), strict=True):
            error = made if isinstance(made, BaseException) else made.error
            if error is not None:
                logger.error("kvlife: load %d failed: %s", order.op, error)
                self._failed.add(order.op)
                self._load_errors.update(block_ids(order.slots))
                continue
            job = cast("CopyJob", made)
            if job.event is not None:  # the forward pass reads the blocks after the copy
                torch.cuda.current_stream(job.event.device).wait_event(job.event)
            self._loads[order.op] = job

    def _new(self, orders: Iterable[_O], kind: str) -> list[_O]:
        """``orders`` but those whose copy number is in flight here already or came
        earlier in the list (logged): a second job under one number would take the
        first one's place, and its completion would find no job."""
        stores, loads = self._stores, self._loads
        seen: set[int] = set()
        kept = []
        for order in orders:
            op = order.op
            if op in stores or op in loads or op in seen:
                logger.error(
                    "kvlife: %s %d: a copy under that number is in flight already; not copied",
                    kind,
                    op,
                )
                continue
            seen.add(op)
            kept.append(order)
        return kept

    def _launch_loads(self, orders: list[LoadOrder]) -> list[CopyJob | BaseException]:
        """Each order's load launched, or why it was refused (``launch_many``: on the
        direct CUDA path every order's blocks go in one submission)."""
        host = self.host
        made: list[CopyJob | BaseException | None] = []
        items = []
        for order in orders:
            try:
                items.append((_blocks(order), host.pages(order.pages)))
                made.append(None)
            except Exception as exc:  # pages not of this pool: refused before copying
                made.append(exc)
        launched = iter(self.copier.launch_many(items, load=True))
        return [next(launched) if job is None else job for job in made]

    def wait(self, ops: Iterable[int]) -> None:
        """Block until the copies ``ops`` are over (their device blocks are about to be
        written: a preemption, or blocks of a finished request handed out again)."""
        for op in ops:
            job = self._stores.get(op) or self._loads.get(op)
            if job is not None and job.event is not None:
                job.event.synchronize()

    def reports(self) -> list[tuple[int, bool]]:
        """``(copy number, ok)`` of each order over since the last call (each reported
        once): refused orders, then loads, then stores in the order they completed (on
        every rank of the group)."""
        over = [(op, False) for op in sorted(self._failed)]
        self._failed = set()
        loads = self._loads
        for op, job in list(loads.items()):
            if job.query():
                del loads[op]
                job.release_resources()
                over.append((op, job.error is None))
        self.queue.poll()  # the stores over (on every rank): into self._over
        if self._over:
            over += self._over
            self._over = []
        return over

    def poll(self) -> tuple[list[int], list[int]]:
        """The copy numbers of the orders over since the last poll, and of those that
        failed (each reported once; see ``reports``)."""
        done: list[int] = []
        failed: list[int] = []
        for op, ok in self.reports():
            (done if ok else failed).append(op)
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

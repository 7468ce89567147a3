"""The connector's worker side (each vLLM worker process): vLLM's caches found as blocks,
and the step's orders handed to an [`OffloadWorker`][kvlife.offload.worker.OffloadWorker]."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvlife.offload.engines.vllm.metadata import KVLifeConnectorMetadata, KVLifeWorkerMetadata
from kvlife.offload.host_pool import HostPagePool
from kvlife.offload.layout import LayoutError, block_views
from kvlife.offload.planner import LoadOrder, StoreOrder
from kvlife.offload.worker import OffloadWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.kvlife")


def layer_view_order(layout: str | None) -> tuple[int, ...] | None:
    """The memory order of a per-layer ``[B, H, N, C]`` view in vLLM's ``layout`` (a
    ``KVCacheLayout`` name, vLLM 0.32+), or ``None`` when unknown."""
    if layout is None:
        return None
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415 (0.32+)
    except ImportError:
        return None
    member = KVCacheLayout.__members__.get(layout)
    return None if member is None else tuple(member.layer_view_order)


def resolved_layout(vllm_config: VllmConfig) -> str | None:
    """The KV cache layout name vLLM resolved (0.32+), or ``None`` when it has none."""
    getter = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
    if getter is None:
        return None
    try:
        return str(getter().name)
    except ValueError:  # not resolved in this process (a bare scheduler in tests)
        return None


def vllm_block_views(
    kv_caches: dict[str, torch.Tensor], num_blocks: int, layout: str | None
) -> list[torch.Tensor]:
    """vLLM's per-layer caches as block views (see
    [`block_views()`][kvlife.offload.layout.block_views]), their strides checked against
    vLLM's resolved ``layout``.

    Raises:
        LayoutError: as ``block_views``, the message naming kvlife's vLLM connector and
            the layout.
    """
    try:
        return block_views(kv_caches, num_blocks, layer_view_order(layout))
    except LayoutError as exc:
        raise LayoutError(
            f"kvlife's vLLM connector ({layout or 'unnamed'} layout, {num_blocks} vLLM "
            f"blocks): {exc}"
        ) from None


Order = StoreOrder | LoadOrder


class GroupedWorker:
    """The copies of a model with several KV cache groups (a hybrid model): one
    [`OffloadWorker`][kvlife.offload.worker.OffloadWorker] per group, over that group's
    layers, each with the same number of host pages (page ``p`` of every group together
    hold one block of every layer). An order's slots are rows (each group's device block,
    ``None`` where a group holds none); each group copies its column, and an order is over
    when every group's part is (failed when any part failed).
    """

    def __init__(self, workers: list[OffloadWorker]) -> None:
        self.workers = workers
        self._parts: dict[int, list[int]] = {}  # op -> [parts in flight, parts failed]
        self._over: list[tuple[int, bool]] = []  # orders with no part to copy

    @property
    def host(self) -> HostPagePool:
        """The first group's host pages (see ``hosts`` for every group's)."""
        return self.workers[0].host

    @property
    def hosts(self) -> list[HostPagePool]:
        """Every group's host pages, in group order."""
        return [worker.host for worker in self.workers]

    @staticmethod
    def part(order: Order, group: int) -> Order | None:
        """The part of ``order`` that group ``group`` copies (``None``: nothing)."""
        slots: list[int] = []
        pages: list[int] = []
        for row, page in zip(order.slots, order.pages, strict=True):
            block = row[group] if isinstance(row, tuple) else row
            if block is not None:
                slots.append(block)
                pages.append(page)
        if not slots:
            return None
        return type(order)(order.op, tuple(slots), tuple(pages), order.first)

    def _launch(self, orders: list[Order], load: bool) -> None:
        for order in orders:
            parts = 0
            for group, worker in enumerate(self.workers):
                part = self.part(order, group)
                if part is None:
                    continue
                parts += 1
                if load:
                    worker.load([part])  # type: ignore[list-item]
                else:
                    worker.store([part])  # type: ignore[list-item]
            if parts:
                self._parts[order.op] = [parts, 0]
            else:
                self._over.append((order.op, False))

    def store(self, orders: list[StoreOrder]) -> None:
        self._launch(list(orders), load=False)

    def load(self, orders: list[LoadOrder]) -> None:
        self._launch(list(orders), load=True)

    def wait(self, ops: set[int]) -> None:
        for worker in self.workers:
            worker.wait(ops)

    def poll(self) -> tuple[list[int], list[int]]:
        done: list[int] = []
        failed: list[int] = []
        for op, was_bad in self._over:
            (failed if was_bad else done).append(op)
        self._over = []
        for worker in self.workers:
            over, bad = worker.poll()
            for op, did_fail in [*((op, False) for op in over), *((op, True) for op in bad)]:
                parts = self._parts.get(op)
                if parts is None:
                    continue
                parts[0] -= 1
                parts[1] += did_fail
                if parts[0] == 0:
                    del self._parts[op]
                    (failed if parts[1] else done).append(op)
        return done, failed

    def take_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for worker in self.workers:
            errors |= worker.take_load_errors()
        return errors

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


class WorkerSide:
    """One worker's copies, once vLLM registered its caches.

    ``groups``: the layer names of each KV cache group; with more than one, a
    [`GroupedWorker`][kvlife.offload.engines.vllm.worker.GroupedWorker] copies each group's
    layers.
    """

    def __init__(
        self,
        *,
        pages: int,
        num_blocks: int,
        layout: str | None,
        groups: list[list[str]] | None = None,
    ) -> None:
        self.pages = pages
        self.num_blocks = num_blocks
        self.layout_name = layout
        self.groups = groups or []
        self.worker: OffloadWorker | GroupedWorker | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if len(self.groups) > 1:
            workers = []
            for names in self.groups:
                group = {name: kv_caches[name] for name in names if name in kv_caches}
                views = vllm_block_views(group, self.num_blocks, self.layout_name)
                workers.append(OffloadWorker(views, self.pages))
            self.worker = GroupedWorker(workers)
            per_page = sum(worker.layout.bytes_per_page for worker in workers)
            described = ", ".join(str(worker.layout.layers) for worker in workers)
            logger.info(
                "kvlife: %d KV cache groups of %d blocks (%s layout; components per group: "
                "%s), host cache %d blocks (%d bytes); copies: %s",
                len(workers),
                self.num_blocks,
                self.layout_name or "unnamed",
                described,
                self.pages,
                self.pages * per_page,
                "; ".join(worker.copier.describe() for worker in workers),
            )
            return
        views = vllm_block_views(kv_caches, self.num_blocks, self.layout_name)
        worker = OffloadWorker(views, self.pages)
        self.worker = worker
        first = views[0]
        logger.info(
            "kvlife: %d KV cache components of %d blocks (%s layout, block %s %s), "
            "host cache %d blocks (%d bytes); copies: %s",
            len(views),
            self.num_blocks,
            self.layout_name or "unnamed",
            tuple(first.shape[1:]),
            first.dtype,
            self.pages,
            self.pages * worker.layout.bytes_per_page,
            worker.copier.describe(),
        )

    def ready(self) -> OffloadWorker | GroupedWorker:
        if self.worker is None:
            raise RuntimeError("register_kv_caches() was not called")
        return self.worker

    @property
    def host(self) -> HostPagePool:
        return self.ready().host

    def save(self, stores: list[StoreOrder]) -> None:
        if stores:
            self.ready().store(stores)

    def load(self, meta: KVLifeConnectorMetadata) -> None:
        if meta.loads:
            self.ready().load(meta.loads)

    def wait_for(self, ops: set[int]) -> None:
        if ops:
            self.ready().wait(ops)

    def worker_meta(self) -> KVLifeWorkerMetadata:
        done, failed = self.ready().poll()
        return KVLifeWorkerMetadata(done=dict.fromkeys(done, 1), failed=dict.fromkeys(failed, 1))

    def take_load_errors(self) -> set[int]:
        return self.ready().take_load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

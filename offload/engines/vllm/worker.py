"""The connector's worker side (each vLLM worker process): vLLM's caches found as blocks,
and the step's orders handed to an [`OffloadWorker`][kvlife.offload.worker.OffloadWorker]."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvlife.offload.engines.vllm.metadata import KVLifeConnectorMetadata, KVLifeWorkerMetadata
from kvlife.offload.host_pool import HostPagePool
from kvlife.offload.layout import LayoutError, block_views
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


class WorkerSide:
    """One worker's copies, once vLLM registered its caches."""

    def __init__(self, *, pages: int, num_blocks: int, layout: str | None) -> None:
        self.pages = pages
        self.num_blocks = num_blocks
        self.layout_name = layout
        self.worker: OffloadWorker | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views = vllm_block_views(kv_caches, self.num_blocks, self.layout_name)
        worker = OffloadWorker(views, self.pages)
        self.worker = worker
        first = views[0]
        logger.info(
            "kvlife: %d KV cache components of %d blocks (%s layout, block %s %s), "
            "host cache %d blocks (%d bytes)",
            len(views),
            self.num_blocks,
            self.layout_name or "unnamed",
            tuple(first.shape[1:]),
            first.dtype,
            self.pages,
            self.pages * worker.layout.bytes_per_page,
        )

    def ready(self) -> OffloadWorker:
        if self.worker is None:
            raise RuntimeError("register_kv_caches() was not called")
        return self.worker

    @property
    def host(self) -> HostPagePool:
        return self.ready().host

    def save(self, meta: KVLifeConnectorMetadata) -> None:
        if meta.stores:
            self.ready().store(meta.stores)

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

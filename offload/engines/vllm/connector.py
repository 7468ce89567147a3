"""``KVLifeConnector``: vLLM's connector interface, every call delegated to the scheduler
side ([`SchedulerSide`][kvlife.offload.engines.vllm.scheduler.SchedulerSide]) or the
worker side ([`WorkerSide`][kvlife.offload.engines.vllm.worker.WorkerSide])."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvlife.fsm import LifecycleRegistry
from kvlife.fsm import __version__ as KVLIFE_VERSION
from kvlife.offload.engines.vllm.layouts import block_layout_wish
from kvlife.offload.engines.vllm.metadata import KVLifeConnectorMetadata
from kvlife.offload.engines.vllm.scheduler import SchedulerSide
from kvlife.offload.engines.vllm.worker import WorkerSide, resolved_layout
from kvlife.offload.engines.vllm_common.config import (
    TESTED_VLLM,
    ConnectorConfig,
    audit_path,
    block_bytes,
)
from kvlife.offload.engines.vllm_common.stats import KVLifeConnectorStats, KVLifePromMetrics
from kvlife.offload.host_pool import HostPagePool
from kvlife.offload.layout import LayoutError
from kvlife.offload.planner import OffloadPlanner, PageAccount

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger: kvlife's lines appear in vLLM's own log, formatted as its own.
logger = logging.getLogger("vllm.kvlife")


def check_groups(kv_cache_config: KVCacheConfig, block_size: int) -> bool:
    """Check that kvlife can copy every KV cache group of the model; returns whether one
    is a sliding window. One group of any attention spec is taken; several (a hybrid
    model) must each be full attention or a sliding window, of ``block_size`` tokens.

    Raises:
        LayoutError: a group kvlife cannot copy (an SSM state, chunked local attention,
            another block size), naming it and its layers.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        return False
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    sliding = False
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        ok = isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)) and not isinstance(
            spec, ChunkedLocalAttentionSpec
        )
        if not ok or spec.block_size != block_size:
            why = f"a {kind}" if not ok else f"blocks of {spec.block_size} tokens"
            raise LayoutError(
                f"kvlife's vLLM connector copies full-attention and sliding-window KV cache "
                f"groups of {block_size}-token blocks; group {index} of this model is {why} "
                f"(layers {', '.join(group.layer_names[:3])}"
                f"{', ...' if len(group.layer_names) > 3 else ''}): not supported"
            )
        sliding |= isinstance(spec, SlidingWindowSpec)
    return sliding


class KVLifeConnector(KVConnectorBase_V1, SupportsHMA):
    """The vLLM KV connector; ``kv_connector_extra_config`` is a
    [`ConnectorConfig`][kvlife.offload.engines.vllm.ConnectorConfig].

    A ``SupportsHMA``: vLLM keeps its hybrid KV cache manager with it. A hybrid model's
    full-attention and sliding-window groups are stored and loaded block by block, every
    group's part of a block in one host page (see
    [`check_groups()`][kvlife.offload.engines.vllm.connector.check_groups] for what is
    refused).

    Raises (at construction, so the engine does not start): ``ValueError`` for an
    unknown extra-config key or a bad value, naming it; ``LayoutError`` for a KV cache
    group kvlife cannot copy, naming it.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        version = str(getattr(vllm, "__version__", "unknown"))
        if not version.startswith(TESTED_VLLM):
            logger.warning(
                "kvlife: vLLM %s is not a version kvlife's connector was tested on (%s)",
                version,
                ", ".join(f"{v}x" for v in TESTED_VLLM),
            )
        sliding = check_groups(kv_cache_config, vllm_config.cache_config.block_size)
        groups = kv_cache_config.kv_cache_groups
        pages = config.pages(block_bytes(kv_cache_config))
        self.config = config
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            audit = config.audit_log and audit_path(config.audit_log, vllm_config)
            events = getattr(vllm_config, "kv_events_config", None)
            self._scheduler = SchedulerSide(
                pages=pages,
                block_size=vllm_config.cache_config.block_size,
                workers=vllm_config.parallel_config.world_size,
                config=config,
                audit_log=audit,
                kv_events=bool(getattr(events, "enable_kv_cache_events", False)),
                bytes_per_block=block_bytes(kv_cache_config)
                * vllm_config.parallel_config.world_size,
                groups=len(groups),
                sliding=sliding,
            )
            logger.info(
                "kvlife %s connector active (vLLM %s): host cache %d blocks, audit log %s",
                KVLIFE_VERSION,
                version,
                pages,
                audit or "off",
            )
            self._scheduler.log.stop_hint(vllm_config)
        else:
            self._worker = WorkerSide(
                pages=pages,
                num_blocks=kv_cache_config.num_blocks,
                layout=resolved_layout(vllm_config),
                groups=[list(group.layer_names) for group in groups],
            )

    @property
    def registry(self) -> LifecycleRegistry:
        """The scheduler side's lifecycle registry (statistics, audit sinks, hooks)."""
        return self._scheduler_side().registry

    @property
    def planner(self) -> OffloadPlanner:
        """The scheduler side's offload planner (orders in flight, fences, host cache)."""
        return self._scheduler_side().planner

    @property
    def counters(self) -> dict[str, int]:
        """The scheduler side's counters since start (the keys of
        [`COUNTERS`][kvlife.offload.planner.COUNTERS]; vLLM's metrics get their growth
        per interval)."""
        return self._scheduler_side().planner.counters()

    def account(self) -> PageAccount:
        """Where every host page is now: free, cached, pinned by loads, written by stores
        in flight (they sum to the capacity); also in the stats vLLM logs."""
        return self._scheduler_side().planner.account()

    @property
    def free_host_pages(self) -> int:
        """Host pages no one holds now (cached pages are not counted: a store may evict
        them)."""
        return self.account().free

    @property
    def host_pages(self) -> HostPagePool:
        """The worker side's host page pool (after ``register_kv_caches``)."""
        return self._worker_side().host

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on a worker-side connector")
        return self._scheduler

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call on a scheduler-side connector")
        return self._worker

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """A block-outermost layout, where vLLM's attention backend may take one (see
        [`block_layout_wish()`][kvlife.offload.engines.vllm.layouts.block_layout_wish]);
        kvlife copies any layout vLLM resolves."""
        return block_layout_wish(vllm_config)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVLifePromMetrics:
        """kvlife's counters and gauges in vLLM's ``/metrics`` (see
        [`KVLifePromMetrics`][kvlife.offload.engines.vllm_common.stats.KVLifePromMetrics])."""
        return KVLifePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVLifeConnectorStats(data=dict(data)) if data else KVLifeConnectorStats()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is None:
            return None  # the scheduler side counts everything
        stats = self._scheduler.stats()
        self._scheduler.step_ended("output")  # vLLM's last connector call there
        return stats

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The host tier's KV events since the last call (none unless vLLM's
        ``kv_events_config`` enables KV cache events)."""
        if self._scheduler is None:
            return ()
        return self._scheduler.take_events()

    def reset_cache(self) -> bool | None:
        """Empty the host cache of every page no copy reads (vLLM's
        ``reset_prefix_cache(reset_connector=True)``); ``False`` while copies were in
        flight (their pages leave the cache when they are over, except those loads
        read). ``None`` on a worker-side connector (vLLM asks the scheduler's)."""
        if self._scheduler is None:
            return None
        ok = self._scheduler.planner.reset()
        self._scheduler.written()
        return ok

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    # ---------------------------------------------------------------- scheduler side
    def on_new_request(self, request: Request) -> None:
        side = self._scheduler_side()
        side.on_new_request(request)
        side.between_steps()  # vLLM adds requests between steps

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        blocks = self._scheduler_side().lookup(request, num_computed_tokens)
        return blocks * self._scheduler_side().block_size, False  # loaded before the forward

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side().load(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self._scheduler_side()
        meta = side.build_meta(scheduler_output)
        side.step_ended("schedule")
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        side = self._scheduler_side()
        side.update_connector_output(connector_output)
        side.written()  # vLLM reads the reports next, and may die on them

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        side = self._scheduler_side()
        delay = side.request_finished(request)
        side.between_steps()  # an abort between steps; a finish goes with its step's
        return delay, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call for a connector that is a ``SupportsHMA``: as ``request_finished``
        (the free is never delayed; stores in flight fence their blocks, every group's)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass (vLLM calls this first in each step): launch finished
        requests' last stores, then finish the copies of blocks vLLM reuses now."""
        if isinstance(kv_connector_metadata, KVLifeConnectorMetadata):
            side = self._worker_side()
            side.save(kv_connector_metadata.last_stores)
            side.wait_for(kv_connector_metadata.wait_jobs)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVLifeConnectorMetadata):
            self._worker_side().load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # stores are launched once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVLifeConnectorMetadata):
            self._worker_side().save(meta.stores)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # no free is delayed and loads are synchronous: nothing by id

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side().worker_meta()

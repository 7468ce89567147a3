"""kvlife as a vLLM KV connector (vLLM 0.32.x and 0.33.x, the ``vllm`` extra): stores
and loads.

Enable it with one config, no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "KVLifeConnector",
        "kv_connector_module_path": "kvlife.offload.engines.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_bytes": 4294967296, "audit_log": "kvlife.jsonl"}}'

The extra config's keys are checked at start-up (see
[`ConnectorConfig`][kvlife.offload.engines.vllm.ConnectorConfig]); an unknown key or a
bad value stops the engine with a one-line error naming it.

Scheduler side (the engine core): every vLLM ``Request`` *object* gets its own kvlife
lifecycle when vLLM first shows it (``on_new_request``); the request id is only used to
find the request object vLLM's scheduler holds under it now. Each step, newly full
blocks (``stride_blocks`` at a time) become one store job: a kvlife ticket whose copy
number is the job id the workers report back. ``request_finished`` finishes (or aborts)
the lifecycle and never delays vLLM's free: vLLM takes the blocks and the request id
back at once, so a client may reuse the id at once (vLLM's scheduler asserts on a live
duplicate id, which a delayed free would make). A finished request's blocks that a store
still reads are *fenced* instead: when vLLM hands one to another request, that step's
metadata names the stores that read it, and the workers finish them before the forward
pass writes it (``handle_preemptions``, as for preempted requests). A store completes
when every worker reported it (tensor parallelism); a failed store is a ``fail`` of its
ticket, audited, its host pages freed. A completion for a job whose lifecycle is gone is
refused and audited by the registry, never applied to whoever holds the id now. Counters
(stores, loads, hit blocks, evictions, refusals, ...) go to vLLM's own metrics log
through its connector-stats hook.

Worker side: a vLLM *block* is the unit. ``register_kv_caches`` takes vLLM's per-layer
caches in whatever layout the attention backend chose (vLLM 0.32+ hands each layer a
``[blocks, heads, tokens, content]`` view of one allocation, strided after one of its
six ``KVCacheLayout`` permutations; a ``[2, blocks, ...]`` K/V-split tensor is taken
too) and finds the block dimension from the shapes, strides and vLLM's resolved layout
(see [`block_views`][kvlife.offload.engines.vllm.block_views]). A host page holds one
block of every layer, each in the device's own byte order; a store is one gather per
layer over the block dimension (kvlife's ``CopyEngine``: side streams and events on
CUDA, synchronous on CPU), a load writes the pages back into the blocks vLLM allocated,
byte for byte.

Loads: when a lifecycle that *finished* is released, its whole stored blocks join a host
prefix cache keyed by vLLM's block hashes (an aborted one's pages are freed).
``get_num_new_matched_tokens`` reports the cached blocks that follow what vLLM computed
(never the block of the last prompt token: vLLM computes one token itself), and the load
into the blocks vLLM then allocates is a copy on the request's own lifecycle, with a
ticket like a store: a late load completion after an abort or an id reuse completes that
instance's copy and nothing else. Loads are synchronous as vLLM counts them (the request
is scheduled in the same step, and its forward pass is ordered after the load: at once
on the CPU, by a stream wait on CUDA), so no "finished receiving" report names a request
id. A page being loaded is pinned; new stores evict the least recently used cached pages
that no load reads, and a store that would need a pinned page is skipped. A load that
fails reports its blocks through ``get_block_ids_with_load_errors`` so that vLLM
recomputes them.

Audit log: every connector call's records are written to the file when the call returns
(fsynced within ``audit_flush_s`` seconds, default 1), so the log is current while the
server runs, and an engine core that is killed between calls -- as vLLM's server kills
it at every stop, before any shutdown call reaches the connector -- loses none; the next
start logs that the previous writer did not close the log. An ``LLM`` that ends closes it.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

from kvlife.fsm import (
    LIFECYCLE,
    JsonLinesSink,
    Lifecycle,
    LifecycleRegistry,
    State,
    Ticket,
    Trigger,
    UnknownRequestError,
)
from kvlife.fsm import __version__ as KVLIFE_VERSION
from kvlife.offload.copy_engine import CopyEngine, CopyJob
from kvlife.offload.host_pool import HostPagePool, PageAllocator
from kvlife.offload.layout import KVLayout, LayoutError
from kvlife.offload.prefix_cache import HostPrefixCache

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger: kvlife's lines appear in vLLM's own log, formatted as its own.
logger = logging.getLogger("vllm.kvlife")

DEFAULT_HOST_PAGES = 1024
"""Host pages (one vLLM block each) when the extra config says neither ``host_pages`` nor
``host_bytes``."""
TESTED_VLLM = ("0.32.", "0.33.")
"""vLLM release lines the connector is tested on."""
MAX_REMEMBERED_JOBS = 65536
"""Finished store jobs whose tickets are kept, so that a late or repeated report of one
is delivered (and refused, and audited) rather than dropped."""


_FSYNC = ("never", "batch", "record")


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, checked. Every key is optional.

    Attributes:
        host_pages: host cache size in vLLM blocks (one page holds one block of every
            layer); default 1024 when ``host_bytes`` is not given either.
        host_bytes: host cache size in bytes instead (per worker): as many whole blocks
            as fit, counted as vLLM's KV cache spec counts a block over all layers.
        stride_blocks: blocks per store job (default 1).
        audit_log: path of the scheduler side's JSON-lines audit log (default none).
        audit_flush_s: most seconds a record waits before it is written (default 1).
        audit_fsync: ``"never"``, ``"batch"`` (default) or ``"record"``.
        audit_max_bytes: rotate the log past this size (default: never).
        audit_backups: rotated files kept (default 5).
    """

    host_pages: int | None = None
    host_bytes: int | None = None
    stride_blocks: int = 1
    audit_log: str | None = None
    audit_flush_s: float = 1.0
    audit_fsync: str = "batch"
    audit_max_bytes: int | None = None
    audit_backups: int = 5

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Check the extra config and build it.

        Raises:
            ValueError: an unknown key (the message names it and the known ones), or a
                key whose value has the wrong type or range (named, with the value).
        """
        extra = dict(extra or {})
        known = [f.name for f in fields(cls)]
        for key in extra:
            if key not in known:
                raise ValueError(
                    f"kvlife: unknown kv_connector_extra_config key {key!r} "
                    f"(known: {', '.join(known)})"
                )

        def positive_int(key: str) -> None:
            value = extra.get(key)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"kvlife: {key} must be a positive integer, got {value!r}")

        for key in ("host_pages", "host_bytes", "stride_blocks", "audit_max_bytes"):
            positive_int(key)
        if extra.get("host_pages") is not None and extra.get("host_bytes") is not None:
            raise ValueError("kvlife: give host_pages or host_bytes, not both")
        backups = extra.get("audit_backups", 5)
        if not isinstance(backups, int) or isinstance(backups, bool) or backups < 0:
            raise ValueError(f"kvlife: audit_backups must be an integer >= 0, got {backups!r}")
        flush = extra.get("audit_flush_s", 1.0)
        if (
            not isinstance(flush, (int, float))
            or isinstance(flush, bool)
            or not 0 < flush < float("inf")
        ):
            raise ValueError(f"kvlife: audit_flush_s must be a positive number, got {flush!r}")
        if extra.get("audit_fsync", "batch") not in _FSYNC:
            raise ValueError(
                f"kvlife: audit_fsync must be one of {', '.join(_FSYNC)}, "
                f"got {extra['audit_fsync']!r}"
            )
        audit = extra.get("audit_log")
        if audit is not None and (not isinstance(audit, str) or not audit):
            raise ValueError(f"kvlife: audit_log must be a file path, got {audit!r}")
        return cls(
            **{
                **extra,
                "stride_blocks": extra.get("stride_blocks") or 1,
                "audit_flush_s": float(flush),
            }
        )

    def pages(self, block_bytes: int) -> int:
        """Host pages for blocks of ``block_bytes`` bytes.

        Raises:
            ValueError: ``host_bytes`` holds not even one block.
        """
        if self.host_bytes is None:
            return self.host_pages or DEFAULT_HOST_PAGES
        pages = self.host_bytes // block_bytes
        if pages <= 0:
            raise ValueError(
                f"kvlife: host_bytes={self.host_bytes} holds no block of {block_bytes} bytes"
            )
        return pages


def block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one vLLM block over every layer, as vLLM's KV cache spec counts them."""
    return sum(
        group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        for group in kv_cache_config.kv_cache_groups
    )


STAT_KEYS = (
    "stores",
    "stored_blocks",
    "store_failures",
    "skipped_stores",
    "loads",
    "loaded_blocks",
    "load_failures",
    "hit_blocks",
    "evictions",
    "refusals",
)
"""The counters the connector reports through vLLM's connector-stats hook."""


@dataclass
class KVLifeConnectorStats(KVConnectorStats):
    """kvlife's counters for one interval, as vLLM's metrics logger takes them
    (``KV Transfer metrics: stores=..., loads=..., ...``): stores and loads done (and
    their blocks), failed stores and loads, stores skipped for want of host pages, host
    cache hit blocks reported to vLLM, cached pages evicted, and calls the lifecycle
    registry refused (late or repeated reports, stale instances)."""

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data.get(key, 0) for key in STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(key, 0) for key in STAT_KEYS)


def block_views(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int, layout: str | None = None
) -> list[torch.Tensor]:
    """vLLM's per-layer KV caches as one ``[num_blocks, *block]`` view per component (a
    layer, or a layer's K and V when they are split), without copying.

    vLLM 0.32+ hands every layer a logical ``[B, H, N, C]`` view (blocks, heads, tokens,
    content: K and V side by side or interleaved in it) of one allocation, strided after
    the resolved ``KVCacheLayout`` (``layout``, its name, when known); older backends'
    ``[2, B, ...]`` tensors are K/V split. ``B`` is ``num_blocks`` or a multiple of it
    (kernel blocks that split a vLLM block: they become one more dimension). Each view's
    block interior is permuted into the device's memory order, so a contiguous block is
    copied as the bytes vLLM holds.

    Raises:
        LayoutError: no tensors; a tensor whose block dimension cannot be found; strides
            that are not the declared layout's; or layers that differ in block shape or
            dtype (several layer groups, as hybrid models have). The message names the
            layer, its shape and strides.
    """
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    order = _layer_view_order(layout)
    views: list[torch.Tensor] = []
    for name, tensor in kv_caches.items():
        where = f"layer {name!r}: shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}"
        if tensor.dim() == 4:
            if order is not None and not _strides_follow(tensor, order):
                raise LayoutError(
                    f"kvlife's vLLM connector: {where} do not follow vLLM's {layout} layout"
                )
            parts = [tensor]
        elif tensor.dim() == 5 and tensor.shape[0] == 2:
            parts = [tensor[0], tensor[1]]  # K/V split: [2, B, ...]
        else:
            raise LayoutError(
                "kvlife's vLLM connector takes per-layer caches [blocks, heads, tokens, "
                f"content] (any KVCacheLayout) or [2, blocks, ...] (K/V split); {where}"
            )
        for whole in parts:
            blocks = whole.shape[0]
            if blocks % num_blocks:
                raise LayoutError(
                    f"kvlife's vLLM connector: {where}: {blocks} blocks is not a multiple of "
                    f"vLLM's {num_blocks}"
                )
            part = whole  # kernel blocks: one vLLM block is `ratio` of them
            if blocks != num_blocks:
                part = whole.unflatten(0, (num_blocks, blocks // num_blocks))
            inner = sorted(range(1, part.dim()), key=lambda d: -part.stride()[d])
            views.append(part.permute(0, *inner))
    first = views[0]
    for name, view in zip(kv_caches, views, strict=False):
        if view.shape[1:] != first.shape[1:] or view.dtype != first.dtype:
            raise LayoutError(
                f"kvlife's vLLM connector needs one block shape and dtype for every layer; "
                f"layer {name!r} has {tuple(view.shape[1:])} {view.dtype}, the first "
                f"{tuple(first.shape[1:])} {first.dtype} (several KV cache groups, as "
                "hybrid models have, are not supported)"
            )
    devices = {view.device for view in views}
    if len(devices) != 1:
        raise LayoutError(f"KV caches are on several devices: {sorted(map(str, devices))}")
    return views


def _layer_view_order(layout: str | None) -> tuple[int, ...] | None:
    """The memory order of a per-layer ``[B, H, N, C]`` view in vLLM's ``layout``."""
    if layout is None:
        return None
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415 (0.32+)
    except ImportError:
        return None
    member = KVCacheLayout.__members__.get(layout)
    return None if member is None else tuple(member.layer_view_order)


def _strides_follow(tensor: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether ``tensor``'s strides put its dimensions in memory ``order`` (outermost
    first), ignoring dimensions of size 1, whose stride says nothing."""
    sized = [d for d in order if tensor.shape[d] > 1]
    strides = [tensor.stride(d) for d in sized]
    return all(a >= b for a, b in itertools.pairwise(strides))


def resolved_layout(vllm_config: VllmConfig) -> str | None:
    """The KV cache layout name vLLM resolved (0.32+), or ``None`` when it has none."""
    getter = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
    if getter is None:
        return None
    try:
        return str(getter().name)
    except ValueError:  # not resolved in this process (a bare scheduler in tests)
        return None


@dataclass
class StoreJob:
    """One store: device blocks into host pages, named by its ticket's copy number."""

    job_id: int
    block_ids: list[int]
    pages: list[int]


@dataclass
class LoadJob:
    """One load: host pages back into the device blocks vLLM allocated for a hit."""

    job_id: int
    req_id: str
    block_ids: list[int]
    pages: list[int]


@dataclass
class KVLifeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    stores: list[StoreJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    #: Stores that read blocks vLLM reuses in this step (of preempted requests, or of
    #: finished ones whose copies were in flight): workers finish them before the
    #: forward pass.
    wait_jobs: set[int] = field(default_factory=set)


@dataclass
class KVLifeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: stores this worker finished (``done``) or could not do
    (``failed``), as job id -> number of workers (summed by ``aggregate``)."""

    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVLifeWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} with kvlife's")
        done, failed = dict(self.done), dict(self.failed)
        for job_id, n in other.done.items():
            done[job_id] = done.get(job_id, 0) + n
        for job_id, n in other.failed.items():
            failed[job_id] = failed.get(job_id, 0) + n
        return KVLifeWorkerMetadata(done, failed)


@dataclass
class _Progress:
    """What the scheduler side knows of one lifecycle's request."""

    req_id: str
    block_ids: list[int] = field(default_factory=list)
    stored_blocks: int = 0
    pages: list[int] = field(default_factory=list)  # host pages of its stores
    hashes: dict[int, Any] = field(default_factory=dict)  # page -> block hash, once acked
    jobs: set[int] = field(default_factory=set)


@dataclass
class _Job:
    ticket: Ticket
    pages: list[int]
    block_ids: list[int] = field(default_factory=list)
    first_block: int = 0
    load: bool = False
    done: int = 0
    failed: int = 0


class _SchedulerSide:
    def __init__(
        self, *, pages: int, block_size: int, workers: int, config: ConnectorConfig
    ) -> None:
        self.sink: JsonLinesSink | None = None
        if config.audit_log:
            self.sink = JsonLinesSink(
                config.audit_log,
                fsync=config.audit_fsync,  # type: ignore[arg-type]  # checked by parse
                max_bytes=config.audit_max_bytes,
                backups=config.audit_backups,
                flush_interval_s=config.audit_flush_s,
                open_marker=True,
            )
        self.registry = LifecycleRegistry(sinks=[self.sink] if self.sink else [])

        self.registry.on_release(self._released)
        self.block_size = block_size
        self.workers = workers
        self.stride = config.stride_blocks
        self.counts = dict.fromkeys(STAT_KEYS, 0)  # since start
        self._reported = dict.fromkeys(STAT_KEYS, 0)  # what vLLM was given so far
        self.pages = PageAllocator(pages)  # the host pages the workers hold, by number
        self.requests: dict[str, Request] = {}  # the request vLLM holds under an id now
        self.progress: dict[int, _Progress] = {}  # by lifecycle serial
        self.jobs: dict[int, _Job] = {}  # by job id (the ticket's copy number)
        # tickets of finished jobs, newest last, so that a late report is refused by name
        self.over: OrderedDict[int, Ticket] = OrderedDict()
        # device blocks of finished requests that stores in flight still read: block ->
        # those jobs; vLLM may hand such a block to another request at once
        self.fenced: dict[int, set[int]] = {}
        # pages of finished requests' full blocks by vLLM's block hash; a page some load
        # reads is pinned, never evicted
        self.cache = HostPrefixCache()
        self.hits: dict[str, tuple[int, list[int]]] = {}  # req id -> (first block, pages)
        self.pending_loads: list[LoadJob] = []

    # vLLM shows a request
    def on_new_request(self, request: Request) -> None:
        lc = self.registry.register(request, rid=request.request_id)
        self.requests[request.request_id] = request
        self.progress[lc.serial] = _Progress(request.request_id)

    def _lifecycle(self, req_id: str) -> tuple[Lifecycle, _Progress] | None:
        request = self.requests.get(req_id)
        if request is None:
            return None
        lc = self.registry.lifecycle(request)
        return lc, self.progress[lc.serial]

    def build_meta(self, out: SchedulerOutput) -> KVLifeConnectorMetadata:
        meta = KVLifeConnectorMetadata(loads=self.pending_loads)
        self.pending_loads = []
        fenced = self.fenced
        for preempted in out.preempted_req_ids or ():
            found = self._lifecycle(preempted)
            if found is not None:
                _, prog = found
                meta.wait_jobs |= prog.jobs
                prog.block_ids = []  # freed by vLLM; new ones come when it resumes
        for new in out.scheduled_new_reqs:
            if fenced:
                self._unfence(new.block_ids[0], meta)
            found = self._lifecycle(new.req_id)
            if found is not None:
                found[1].block_ids = list(new.block_ids[0])
                computed = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
                self._store(found[0], found[1], computed, meta)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            found = self._lifecycle(req_id)
            if found is None:
                continue
            lc, prog = found
            new_ids = cached.new_block_ids[i]
            if fenced and new_ids:
                self._unfence(new_ids[0], meta)
            if req_id in cached.resumed_req_ids:
                prog.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                prog.block_ids += new_ids[0]
            computed = cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0)
            self._store(lc, prog, computed, meta)
        return meta

    def _unfence(self, block_ids: list[int], meta: KVLifeConnectorMetadata) -> None:
        """Blocks vLLM handed out in this step: the stores still reading any of them
        must be over before the forward pass writes them."""
        fenced = self.fenced
        for block in block_ids:
            jobs = fenced.pop(block, None)
            if jobs:
                meta.wait_jobs |= jobs

    def _store(
        self, lc: Lifecycle, prog: _Progress, computed: int, meta: KVLifeConnectorMetadata
    ) -> None:
        """Offload the blocks that are full once this step ran, ``stride`` at a time."""
        full = min(computed // self.block_size, len(prog.block_ids))
        count = full - prog.stored_blocks
        if count < self.stride or not LIFECYCLE.permits(lc.state, Trigger.START_OFFLOAD):
            return
        taken = self.cache.take(self.pages, count)  # evicts what no load reads, if need be
        if taken is None:
            self.counts["skipped_stores"] += 1
            return
        pages = list(taken)
        blocks = prog.block_ids[prog.stored_blocks : full]
        ticket = self.registry.start_offload(lc, blocks=count, first_block=prog.stored_blocks)
        self.jobs[ticket.op] = _Job(ticket, pages, blocks, first_block=prog.stored_blocks)
        prog.jobs.add(ticket.op)
        prog.pages += pages
        prog.stored_blocks = full
        meta.stores.append(StoreJob(ticket.op, blocks, pages))

    # the load path
    def lookup(self, request: Request, num_computed_tokens: int) -> int:
        """Blocks of ``request`` past ``num_computed_tokens`` that the host cache holds,
        from the first on and at most up to the block before its last token (vLLM must
        compute one token itself). Changes nothing but the lookup's own note."""
        if request not in self.registry:
            return 0  # not shown to the connector: no lifecycle to load on
        hashes = request.block_hashes
        first = num_computed_tokens // self.block_size
        last = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        pages = self.cache.lookup(hashes[first:last]) if last > first else []
        self.hits[request.request_id] = (first, pages)
        self.counts["hit_blocks"] += len(pages)
        return len(pages)

    def load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated blocks for a hit: load the host pages into them."""
        first, pages = self.hits.pop(request.request_id, (0, []))
        count = num_external_tokens // self.block_size
        if count == 0:
            return
        pages = pages[:count]
        block_ids = [block.block_id for block in blocks.blocks[0][first : first + count]]
        lc = self.registry.lifecycle(request, audit_as=Trigger.START_OFFLOAD)
        ticket = self.registry.start_offload(lc, kind="load", blocks=count, first_block=first)
        self.cache.pin(pages)
        self.jobs[ticket.op] = _Job(ticket, pages, first_block=first, load=True)
        self.progress[lc.serial].stored_blocks = first + count  # already on the host
        self.progress[lc.serial].jobs.add(ticket.op)
        self.pending_loads.append(LoadJob(ticket.op, request.request_id, block_ids, pages))

    # workers report
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVLifeWorkerMetadata):
            return
        for counts, failed in ((meta.done, False), (meta.failed, True)):
            for job_id, n in counts.items():
                job = self.jobs.get(job_id)
                if job is None:  # a report after the job was over: refused and audited
                    self._late(job_id, failed)
                    continue
                if failed:
                    job.failed += n
                else:
                    job.done += n
                if job.done + job.failed >= self.workers:  # every worker's copy is over
                    del self.jobs[job_id]
                    self._deliver(job_id, job)

    def _late(self, job_id: int, failed: bool) -> None:
        ticket = self.over.get(job_id)
        if ticket is None:
            logger.warning("kvlife: a report for store job %d, which kvlife never made", job_id)
            return
        self.registry.deliver(ticket, not failed, job=job_id)  # refused: counted, audited

    def _deliver(self, job_id: int, job: _Job) -> None:
        self.over[job_id] = job.ticket
        while len(self.over) > MAX_REMEMBERED_JOBS:
            self.over.popitem(last=False)
        lc = job.ticket.lifecycle
        prog = self.progress.get(lc.serial)
        if prog is not None:
            prog.jobs.discard(job_id)
        fenced = self.fenced
        if fenced:
            for block in job.block_ids:
                jobs = fenced.get(block)
                if jobs is not None:
                    jobs.discard(job_id)
                    if not jobs:
                        del fenced[block]
        counts = self.counts
        if job.load:  # the cached pages are no longer read
            self.cache.unpin(job.pages)
            if job.failed:
                counts["load_failures"] += 1
            else:
                counts["loads"] += 1
                counts["loaded_blocks"] += len(job.pages)
        elif job.failed:
            counts["store_failures"] += 1
            if prog is not None:  # the host copy is incomplete: pages back
                for page in job.pages:
                    prog.pages.remove(page)
                self.pages.free(job.pages)
        else:
            counts["stores"] += 1
            counts["stored_blocks"] += len(job.pages)
            if prog is not None and lc.req is not None:  # the copy is whole: name its blocks
                hashes = lc.req.block_hashes
                for i, page in enumerate(job.pages):
                    prog.hashes[page] = hashes[job.first_block + i]
        self.registry.deliver(job.ticket, job.failed == 0, job=job_id)

    def request_finished(self, request: Request) -> bool:
        try:
            lc = self.registry.lifecycle(request, audit_as=Trigger.FINISH)
        except UnknownRequestError:  # counted and audited; never raised into vLLM
            logger.warning("kvlife: vLLM finished %r, which it never showed", request)
            return False
        rid: str = request.request_id
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        self.hits.pop(rid, None)  # a lookup vLLM never allocated blocks for
        if self.requests.get(rid) is request:
            del self.requests[rid]
        if aborted:
            self.registry.abort(lc)
        else:
            self.registry.finish(lc)
        if lc.state is State.FINISHED_PENDING:  # stores still read its blocks: fence them
            for job_id in self.progress[lc.serial].jobs:
                job = self.jobs.get(job_id)
                if job is not None and not job.load:
                    for block in job.block_ids:
                        self.fenced.setdefault(block, set()).add(job_id)
        return False  # vLLM frees the blocks and the id now

    def _released(self, lc: Lifecycle, request: Any) -> None:
        prog = self.progress.pop(lc.serial)
        finished = lc.outcome == "finished"
        free = []
        for page in prog.pages:  # a finished request's whole copies join the host cache
            block_hash = prog.hashes.get(page)
            if not (finished and block_hash is not None and self.cache.insert(block_hash, page)):
                free.append(page)  # aborted, or the same content is cached already
        if free:
            self.pages.free(free)

    def written(self) -> None:
        """The end of a connector call: its records go to the file now (no fsync), so
        an engine core that is killed between calls loses none. vLLM kills its engine
        core at every stop of a server, before any shutdown call reaches the
        connector."""
        if self.sink is not None:
            self.sink.write_out()

    def stats(self) -> KVLifeConnectorStats | None:
        """The counters' growth since the last call, or ``None`` when none grew."""
        counts, reported = self.totals(), self._reported
        delta = {key: counts[key] - reported[key] for key in STAT_KEYS}
        if not any(delta.values()):
            return None
        self._reported = counts
        return KVLifeConnectorStats(data=delta)

    def totals(self) -> dict[str, int]:
        """Every counter since start."""
        counts = dict(self.counts)
        counts["evictions"] = self.cache.stats.evictions
        counts["refusals"] = sum(self.registry.refusals.values())
        return counts

    def shutdown(self) -> None:
        """Write every audit record and close the log (the engine is stopping)."""
        try:
            self.registry.flush()
        except Exception:  # another thread: the sink is flushed by its close below
            logger.debug("kvlife: registry flush at shutdown", exc_info=True)
        if self.sink is not None:
            self.sink.close()


class _WorkerSide:
    def __init__(self, *, pages: int, num_blocks: int, layout: str | None) -> None:
        self.pages = pages
        self.num_blocks = num_blocks
        self.layout_name = layout
        self.copier: CopyEngine | None = None
        self.host: HostPagePool | None = None
        self.inflight: dict[int, CopyJob] = {}
        self.failed: set[int] = set()
        self.loaded: set[int] = set()  # load jobs done since the last report
        self.loading: dict[int, CopyJob] = {}
        self.load_errors: set[int] = set()
        self.views: list[torch.Tensor] = []  # per component: [blocks, *block]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views = block_views(kv_caches, self.num_blocks, self.layout_name)
        first = views[0]
        layout = KVLayout.blocks(len(views), self.num_blocks, tuple(first.shape[1:]), first.dtype)
        self.views = views
        self.host = HostPagePool(layout, self.pages, pin_memory=first.is_cuda)
        self.copier = CopyEngine(layout, views, self.host)
        logger.info(
            "kvlife: %d KV cache components of %d blocks (%s layout, block %s %s), "
            "host cache %d blocks (%d bytes)",
            len(views),
            self.num_blocks,
            self.layout_name or "unnamed",
            tuple(first.shape[1:]),
            first.dtype,
            self.pages,
            self.pages * layout.bytes_per_page,
        )

    def _ready(self) -> tuple[CopyEngine, HostPagePool]:
        if self.copier is None or self.host is None:
            raise RuntimeError("register_kv_caches() was not called")
        return self.copier, self.host

    def save(self, meta: KVLifeConnectorMetadata) -> None:
        copier, host = self._ready()
        for store in meta.stores:
            try:
                self.inflight[store.job_id] = copier.launch(
                    store.block_ids, host.pages(store.pages)
                )
            except Exception:  # reported as failed; the scheduler side frees the pages
                logger.exception("kvlife: store job %d could not be launched", store.job_id)
                self.failed.add(store.job_id)

    def wait_for(self, job_ids: set[int]) -> None:
        """Finish the stores that read blocks vLLM is about to reuse (preemption)."""
        for job_id in job_ids:
            job = self.inflight.get(job_id)
            if job is not None and job.event is not None:
                job.event.synchronize()

    def worker_meta(self) -> KVLifeWorkerMetadata:
        self._poll_loads()
        meta = KVLifeWorkerMetadata(
            done=dict.fromkeys(self.loaded, 1), failed=dict.fromkeys(self.failed, 1)
        )
        self.failed, self.loaded = set(), set()
        for job_id, job in list(self.inflight.items()):
            if job.query():
                del self.inflight[job_id]
                job.release_resources()
                if job.error is None:
                    meta.done[job_id] = 1
                else:
                    meta.failed[job_id] = 1
        return meta

    def load(self, meta: KVLifeConnectorMetadata) -> None:
        """Copy each load's host pages into its device blocks before the forward pass
        that reads them (on the CPU at once; on CUDA on a copy stream that the current
        stream then waits for)."""
        if not meta.loads:
            return
        copier, host = self._ready()
        for load in meta.loads:
            try:
                job = copier.load(host.pages(load.pages), load.block_ids)
                error = job.error  # a copy that failed while running
            except Exception as exc:  # refused before copying
                error = exc
            if error is not None:  # reported as a failed load: vLLM recomputes the blocks
                logger.error("kvlife: load job %d failed: %s", load.job_id, error)
                self.failed.add(load.job_id)
                self.load_errors.update(load.block_ids)
                continue
            if job.event is not None:  # the forward pass reads the blocks after the copy
                torch.cuda.current_stream(job.event.device).wait_event(job.event)
            self.loading[load.job_id] = job

    def _poll_loads(self) -> None:
        for job_id, job in list(self.loading.items()):
            if job.query():
                del self.loading[job_id]
                job.release_resources()
                self.loaded.add(job_id)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Wait for the copies still in flight (they read vLLM's blocks)."""
        for job in [*self.inflight.values(), *self.loading.values()]:
            if job.event is not None:
                job.event.synchronize()


class KVLifeConnector(KVConnectorBase_V1):
    """The vLLM KV connector; ``kv_connector_extra_config`` is a
    [`ConnectorConfig`][kvlife.offload.engines.vllm.ConnectorConfig].

    Raises (at construction, so the engine does not start): ``ValueError`` for an
    unknown extra-config key or a bad value, naming it.
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
        if len(kv_cache_config.kv_cache_groups) > 1:
            raise LayoutError(
                f"kvlife's vLLM connector copies one KV cache group; this model has "
                f"{len(kv_cache_config.kv_cache_groups)} (a hybrid model): not supported"
            )
        pages = config.pages(block_bytes(kv_cache_config))
        self.config = config
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(
                pages=pages,
                block_size=vllm_config.cache_config.block_size,
                workers=vllm_config.parallel_config.world_size,
                config=config,
            )
            logger.info(
                "kvlife %s connector active (vLLM %s): host cache %d blocks, audit log %s",
                KVLIFE_VERSION,
                version,
                pages,
                config.audit_log or "off",
            )
        else:
            self._worker = _WorkerSide(
                pages=pages,
                num_blocks=kv_cache_config.num_blocks,
                layout=resolved_layout(vllm_config),
            )

    @property
    def registry(self) -> LifecycleRegistry:
        """The scheduler side's lifecycle registry (statistics, audit sinks, hooks)."""
        return self._scheduler_side().registry

    @property
    def counters(self) -> dict[str, int]:
        """The scheduler side's counters since start (the keys of ``STAT_KEYS``; vLLM's
        metrics get their growth per interval)."""
        return self._scheduler_side().totals()

    @property
    def free_host_pages(self) -> int:
        """Host pages the scheduler side can hand to new stores now."""
        return self._scheduler_side().pages.available

    @property
    def host_pages(self) -> HostPagePool:
        """The worker side's host page pool (after ``register_kv_caches``)."""
        return self._worker_side()._ready()[1]

    def _scheduler_side(self) -> _SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on a worker-side connector")
        return self._scheduler

    def _worker_side(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call on a scheduler-side connector")
        return self._worker

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # any layout the attention backend picks: the block views adapt

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVLifeConnectorStats(data=dict(data)) if data else KVLifeConnectorStats()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is None:
            return None  # the scheduler side counts everything
        return self._scheduler.stats()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    # ---------------------------------------------------------------- scheduler side
    def on_new_request(self, request: Request) -> None:
        side = self._scheduler_side()
        side.on_new_request(request)
        side.written()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        blocks = self._scheduler_side().lookup(request, num_computed_tokens)
        return blocks * self._scheduler_side().block_size, False  # loaded before the forward

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        side = self._scheduler_side()
        side.load(request, blocks, num_external_tokens)
        side.written()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self._scheduler_side()
        meta = side.build_meta(scheduler_output)
        side.written()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        side = self._scheduler_side()
        side.update_connector_output(connector_output)
        side.written()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        side = self._scheduler_side()
        delay = side.request_finished(request)
        side.written()
        return delay, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVLifeConnectorMetadata):
            self._worker_side().wait_for(kv_connector_metadata.wait_jobs)

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
            self._worker_side().save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # no free is delayed and loads are synchronous: nothing by id

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side().worker_meta()

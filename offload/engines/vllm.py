"""kvlife as a vLLM KV connector (vLLM 0.33.0, the ``vllm`` extra): stores and loads.

Enable it with one config, no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "KVLifeConnector",
        "kv_connector_module_path": "kvlife.offload.engines.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_pages": 4096, "audit_log": "kvlife.jsonl"}}'

Scheduler side (the engine core): every vLLM ``Request`` *object* gets its own kvlife
lifecycle when vLLM first shows it (``on_new_request``); the request id is only used to
find the request object vLLM's scheduler holds under it now. Each step, newly full blocks
(``stride_blocks`` at a time) become one store job: a kvlife ticket whose copy number is
the job id the workers report back. ``request_finished`` finishes (or aborts) the
lifecycle and returns ``True`` exactly when copies still read the blocks
(``finished_pending``): vLLM then keeps the blocks, and the request id is reported as
finished sending only once that lifecycle is released -- so the blocks are freed when no
copy reads them, and vLLM refuses a new request with the same id until then. A store
completes when every worker reported it (tensor parallelism); a failed store is a
``fail`` of its ticket, audited, its host pages freed. A completion for a job whose
lifecycle is gone is refused and audited by the registry, never applied to whoever holds
the id now.

Worker side: ``register_kv_caches`` takes vLLM's per-layer caches in the ``NHD`` layout
(``[2, blocks, block_size, heads, head_dim]``, asked for through
``get_required_kvcache_layout``) as a kvlife ``KVLayout``; stores run through kvlife's
``CopyEngine`` into a ``HostPagePool`` of ``host_pages`` blocks, and the worker reports
finished and failed job ids.

Loads: when a lifecycle that *finished* is released, its whole stored blocks join a host
prefix cache keyed by vLLM's block hashes (an aborted one's pages are freed).
``get_num_new_matched_tokens`` reports the cached blocks that follow what vLLM computed
(never the block of the last prompt token: vLLM computes one token itself), and the load
into the blocks vLLM then allocates is a copy on the request's own lifecycle, with a
ticket like a store: a late load completion after an abort or an id reuse completes that
instance's copy and nothing else. A page being loaded is pinned; new stores evict the
least recently used cached pages that no load reads, and a store that would need a pinned
page is skipped. A load that fails reports its blocks through
``get_block_ids_with_load_errors`` so that vLLM recomputes them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.request import RequestStatus

from kvlife.fsm import (
    JsonLinesSink,
    Lifecycle,
    LifecycleRegistry,
    State,
    Ticket,
    Trigger,
    UnknownRequestError,
)
from kvlife.offload.copy_engine import CopyEngine, CopyJob
from kvlife.offload.host_pool import HostPagePool, HostPages
from kvlife.offload.layout import KVLayout, LayoutError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

DEFAULT_HOST_PAGES = 1024
"""Host pages (one vLLM block each) when the extra config does not say."""
MAX_REMEMBERED_JOBS = 65536
"""Finished store jobs whose tickets are kept, so that a late or repeated report of one
is delivered (and refused, and audited) rather than dropped."""


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
    #: Request ids whose delayed free may happen now: workers report them as finished.
    released: set[str] = field(default_factory=set)
    #: Stores of preempted requests: workers finish them before the blocks are reused.
    preempted_jobs: set[int] = field(default_factory=set)


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
    delayed_free: bool = False


@dataclass
class _Job:
    ticket: Ticket
    pages: list[int]
    first_block: int = 0
    load: bool = False
    done: int = 0
    failed: int = 0


class _SchedulerSide:
    def __init__(
        self, *, pages: int, block_size: int, workers: int, stride: int, audit: str | None
    ) -> None:
        sinks = [JsonLinesSink(audit, fsync="batch")] if audit else []
        self.registry = LifecycleRegistry(sinks=sinks)
        self.registry.on_release(self._released)
        self.block_size = block_size
        self.workers = workers
        self.stride = stride
        self.free_pages = list(range(pages - 1, -1, -1))
        self.requests: dict[str, Request] = {}  # the request vLLM holds under an id now
        self.progress: dict[int, _Progress] = {}  # by lifecycle serial
        self.jobs: dict[int, _Job] = {}  # by job id (the ticket's copy number)
        # tickets of finished jobs, newest last, so that a late report is refused by name
        self.over: OrderedDict[int, Ticket] = OrderedDict()
        self.to_report: set[str] = set()
        self.skipped_stores = 0  # stores not made for want of host pages
        # The host prefix cache: pages of finished requests' full blocks by block hash,
        # least recently used first. A page some load reads is pinned, never evicted.
        self.cache: OrderedDict[Any, int] = OrderedDict()
        self.page_hash: dict[int, Any] = {}  # cached page -> its block hash
        self.pins: dict[int, int] = {}  # page -> loads in flight that read it
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
        meta = KVLifeConnectorMetadata(released=self.to_report, loads=self.pending_loads)
        self.to_report = set()
        self.pending_loads = []
        for preempted in out.preempted_req_ids or ():
            found = self._lifecycle(preempted)
            if found is not None:
                _, prog = found
                meta.preempted_jobs |= prog.jobs
                prog.block_ids = []  # freed by vLLM; new ones come when it resumes
        for new in out.scheduled_new_reqs:
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
            if req_id in cached.resumed_req_ids:
                prog.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                prog.block_ids += new_ids[0]
            computed = cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0)
            self._store(lc, prog, computed, meta)
        return meta

    def _store(
        self, lc: Lifecycle, prog: _Progress, computed: int, meta: KVLifeConnectorMetadata
    ) -> None:
        """Offload the blocks that are full once this step ran, ``stride`` at a time."""
        full = min(computed // self.block_size, len(prog.block_ids))
        count = full - prog.stored_blocks
        if count < self.stride or lc.state is State.FINISHED_PENDING:
            return
        pages = self._alloc_pages(count)
        if pages is None:
            self.skipped_stores += 1
            return
        blocks = prog.block_ids[prog.stored_blocks : full]
        ticket = self.registry.start_offload(lc, blocks=count, first_block=prog.stored_blocks)
        self.jobs[ticket.op] = _Job(ticket, pages, first_block=prog.stored_blocks)
        prog.jobs.add(ticket.op)
        prog.pages += pages
        prog.stored_blocks = full
        meta.stores.append(StoreJob(ticket.op, blocks, pages))

    def _alloc_pages(self, count: int) -> list[int] | None:
        """``count`` free pages, evicting the least recently used cached pages that no
        load reads when needed; ``None`` (nothing evicted) when there are not enough."""
        short = count - len(self.free_pages)
        if short > 0:
            victims = [h for h, page in self.cache.items() if not self.pins.get(page)][:short]
            if len(victims) < short:
                return None
            for block_hash in victims:
                page = self.cache.pop(block_hash)
                del self.page_hash[page]
                self.free_pages.append(page)
        return [self.free_pages.pop() for _ in range(count)]

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
        pages = []
        for block_hash in hashes[first:last]:
            page = self.cache.get(block_hash)
            if page is None:
                break
            pages.append(page)
        self.hits[request.request_id] = (first, pages)
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
        for page in pages:
            self.pins[page] = self.pins.get(page, 0) + 1
            self.cache.move_to_end(self.page_hash[page])
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
        if job.load:  # the cached pages are no longer read
            for page in job.pages:
                self.pins[page] -= 1
                if not self.pins[page]:
                    del self.pins[page]
        elif job.failed and prog is not None:  # the host copy is incomplete: pages back
            for page in job.pages:
                prog.pages.remove(page)
            self.free_pages += job.pages
        elif prog is not None and lc.req is not None:  # the copy is whole: name its blocks
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
        if lc.state is State.FINISHED_PENDING:
            self.progress[lc.serial].delayed_free = True
            return True  # vLLM keeps the blocks until the id is reported finished
        return False

    def _released(self, lc: Lifecycle, request: Any) -> None:
        prog = self.progress.pop(lc.serial)
        for page in prog.pages:  # a finished request's whole copies join the host cache
            block_hash = prog.hashes.get(page)
            if lc.outcome == "finished" and block_hash is not None and block_hash not in self.cache:
                self.cache[block_hash] = page
                self.page_hash[page] = block_hash
            else:  # aborted, or the same content is cached already
                self.free_pages.append(page)
        if prog.delayed_free:
            self.to_report.add(prog.req_id)


class _WorkerSide:
    def __init__(self, *, pages: int, block_size: int) -> None:
        self.pages = pages
        self.block_size = block_size
        self.copier: CopyEngine | None = None
        self.host: HostPagePool | None = None
        self.inflight: dict[int, CopyJob] = {}
        self.failed: set[int] = set()
        self.loaded: set[int] = set()  # load jobs done since the last report
        self.loading: dict[int, tuple[torch.cuda.Event | None, str]] = {}
        self.load_errors: set[int] = set()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.blocks: list[torch.Tensor] = []  # per component: [blocks, block_size, heads, dim]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        if not tensors:
            raise LayoutError("vLLM registered no KV cache tensors")
        first = tensors[0]
        if first.dim() != 5 or first.shape[0] != 2 or first.shape[2] != self.block_size:
            raise LayoutError(
                "kvlife's vLLM connector copies NHD caches shaped [2, blocks, block_size, "
                f"heads, head_dim] (block_size {self.block_size}); got {tuple(first.shape)}"
            )
        if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
            raise LayoutError("every layer's KV cache must have the same shape and dtype")
        _, blocks, block_size, heads, head_dim = first.shape
        layout = KVLayout(
            "per_layer",
            layers=len(tensors),
            slots=blocks * block_size,
            heads=heads,
            head_dim=head_dim,
            dtype=first.dtype,
            page_size=block_size,
        )
        kv = []
        for tensor in tensors:
            for component in (tensor[0], tensor[1]):
                view = component.view(blocks * block_size, heads, head_dim)  # no copy
                kv.append(view)
                self.blocks.append(component)
        self.host = HostPagePool(layout, self.pages, pin_memory=first.is_cuda)
        self.copier = CopyEngine(layout, kv, self.host)

    def save(self, meta: KVLifeConnectorMetadata) -> None:
        if self.copier is None or self.host is None:
            raise RuntimeError("register_kv_caches() was not called")
        offsets = torch.arange(self.block_size)
        for store in meta.stores:
            slots = (torch.tensor(store.block_ids)[:, None] * self.block_size + offsets).reshape(-1)
            try:
                self.inflight[store.job_id] = self.copier.launch(
                    slots, HostPages(self.host, tuple(store.pages))
                )
            except Exception:  # reported as failed; the scheduler side frees the pages
                logger.exception("kvlife: store job %d could not be launched", store.job_id)
                self.failed.add(store.job_id)
        self.finished_sending |= meta.released

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
                if job.error is None:
                    meta.done[job_id] = 1
                else:
                    meta.failed[job_id] = 1
        return meta

    def load(self, meta: KVLifeConnectorMetadata) -> None:
        """Copy each load's host pages into its device blocks (before the forward pass
        that reads them; synchronous on the CPU, ordered on the current stream on CUDA)."""
        host = self.host
        if host is None or not meta.loads:
            return
        for load in meta.loads:
            try:
                for page, block in zip(load.pages, load.block_ids, strict=True):
                    staged = host.page_view(page, 1)[0]  # [components, block_size, elems]
                    for c, device in enumerate(self.blocks):
                        device[block].copy_(staged[c].view_as(device[block]), non_blocking=True)
            except Exception:  # its blocks are recomputed by vLLM
                logger.exception("kvlife: load job %d failed", load.job_id)
                self.failed.add(load.job_id)
                self.load_errors.update(load.block_ids)
            else:
                event = None
                if self.blocks and self.blocks[0].is_cuda:  # done when the stream got there
                    event = torch.cuda.Event()
                    event.record()
                self.loading[load.job_id] = (event, load.req_id)
                continue
            self.finished_recving.add(load.req_id)

    def _poll_loads(self) -> None:
        for job_id, (event, req_id) in list(self.loading.items()):
            if event is None or event.query():
                del self.loading[job_id]
                self.loaded.add(job_id)
                self.finished_recving.add(req_id)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self._poll_loads()
        sending, self.finished_sending = self.finished_sending, set()
        recving, self.finished_recving = self.finished_recving, set()
        return sending or None, recving or None


class KVLifeConnector(KVConnectorBase_V1):
    """The vLLM KV connector. ``kv_connector_extra_config``: ``host_pages`` (host blocks
    per worker, default 1024), ``stride_blocks`` (blocks per store, default 1),
    ``audit_log`` (a JSON-lines audit log path for the scheduler side, default none)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        pages = int(extra.get("host_pages", DEFAULT_HOST_PAGES))
        stride = int(extra.get("stride_blocks", 1))
        if pages <= 0 or stride <= 0:
            raise ValueError(f"host_pages and stride_blocks must be positive, got {extra!r}")
        block_size = vllm_config.cache_config.block_size
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(
                pages=pages,
                block_size=block_size,
                workers=vllm_config.parallel_config.world_size,
                stride=stride,
                audit=extra.get("audit_log"),
            )
        else:
            self._worker = _WorkerSide(pages=pages, block_size=block_size)

    @property
    def registry(self) -> LifecycleRegistry:
        """The scheduler side's lifecycle registry (statistics, audit sinks, hooks)."""
        return self._scheduler_side().registry

    @property
    def free_host_pages(self) -> int:
        """Host pages the scheduler side can hand to new stores now."""
        return len(self._scheduler_side().free_pages)

    @property
    def host_pages(self) -> HostPagePool:
        """The worker side's host page pool (after ``register_kv_caches``)."""
        host = self._worker_side().host
        if host is None:
            raise RuntimeError("register_kv_caches() was not called")
        return host

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
        return "NHD"

    # ---------------------------------------------------------------- scheduler side
    def on_new_request(self, request: Request) -> None:
        self._scheduler_side().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        blocks = self._scheduler_side().lookup(request, num_computed_tokens)
        tokens = blocks * self._scheduler_side().block_size
        return tokens, tokens > 0  # loads are asynchronous

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side().load(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request), None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVLifeConnectorMetadata):
            self._worker_side().wait_for(kv_connector_metadata.preempted_jobs)

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
        return self._worker_side().get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side().worker_meta()

"""The connector's scheduler side (vLLM's engine core): vLLM's calls translated into
[`OffloadPlanner`][kvlife.offload.planner.OffloadPlanner] calls.

Every vLLM ``Request`` *object* gets its own lifecycle when vLLM first shows it
(``on_new_request``); the request id is only used to find the request object vLLM's
scheduler holds under it now, since vLLM's scheduler output names requests by id.
"""

from __future__ import annotations

import itertools
import logging
from itertools import compress, repeat
from operator import add, ge
from time import monotonic
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from kvlife.fsm import (
    Lifecycle,
    OverdueWatch,
    Trigger,
    UnknownRequestError,
)
from kvlife.offload.engines.vllm.metadata import KVLifeConnectorMetadata, KVLifeWorkerMetadata
from kvlife.offload.engines.vllm_common.config import ConnectorConfig
from kvlife.offload.engines.vllm_common.core_log import CoreLog, overdue_line
from kvlife.offload.engines.vllm_common.stats import (
    KVLifeConnectorStats,
    account_stats,
    audit_growth,
    lifecycle_stats,
    overdue_gauges,
    verdict_growth,
)
from kvlife.offload.planner import (
    COUNTERS,
    OffloadPlanner,
    Progress,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvlife")

_NEVER = repeat(float("inf"))  # due.get's default for an id kvlife holds no request under

MEDIUM = "CPU"
"""The ``medium`` of the host tier's KV events (vLLM's own CPU offload says the same)."""


class SchedulerSide:
    """The planner, its audit log, and the requests vLLM holds under each id now.

    Args:
        pages: host pages the workers hold.
        block_size: tokens per vLLM block.
        workers: workers that report each copy (the tensor-parallel world size).
        config: the checked extra config.
        audit_log: the file this engine core writes (see ``config.audit_path``), or none.
        kv_events: publish the host tier's changes as vLLM KV events (vLLM's
            ``kv_events_config.enable_kv_cache_events``).
        bytes_per_block: bytes one block copy moves over every worker (for the bytes
            counters).
        groups: vLLM's KV cache groups. With more than one (a hybrid model) each block of
            a request is a row of every group's device block (``None`` where a group holds
            none: a sliding window's blocks behind it); a block is stored only while every
            group holds it.
        sliding: a group is a sliding window: its blocks behind the window go back to
            vLLM while the request runs, so a store is planned in the step its blocks
            became full or never (``stride_blocks`` is 1 then).
    """

    def __init__(
        self,
        *,
        pages: int,
        block_size: int,
        workers: int,
        config: ConnectorConfig,
        audit_log: str | None,
        kv_events: bool = False,
        bytes_per_block: int = 0,
        groups: int = 1,
        sliding: bool = False,
    ) -> None:
        self.log = CoreLog(audit_log, config)
        self.sink = self.log.sink
        #: Write the records out now: see ``CoreLog.written``.
        self.written = self.log.written
        #: See ``CoreLog.step_ended`` and ``CoreLog.between_steps``.
        self.step_ended = self.log.step_ended
        self.between_steps = self.log.between_steps
        registry = self.log.registry
        #: Stores and loads open longer than ``audit_overdue_s``, told at each step.
        self.overdue = OverdueWatch(registry, config.audit_overdue_s)
        self.planner = OffloadPlanner(
            pages, registry=registry, reporters=workers, events=kv_events, overdue=self.overdue
        )
        self.kv_events = kv_events
        self.bytes_per_block = bytes_per_block
        self.registry = registry
        self.block_size = block_size
        self.groups = groups
        self.retry = not sliding
        self.stride = 1 if sliding else config.stride_blocks
        # the lifecycle (and its progress) of the request vLLM holds under an id now
        self.requests: dict[str, tuple[Lifecycle, Progress]] = {}
        # computed tokens at which the next store of the request held under an id is due
        # ((covered + stride) * block_size), kept where covered changes
        self._due: dict[str, int] = {}
        self._reported: dict[str, int] = dict.fromkeys(COUNTERS, 0)  # given to vLLM so far
        self._overdue_reported = 0
        self._verdicts_reported: dict[str, int] = {}  # refusals by reason given to vLLM
        self._audit_reported = [0, 0]  # audit records lost, sink errors given to vLLM
        self._gauges: dict[str, float] = {}  # the gauges vLLM was last given
        self._stats_at = -float("inf")  # when vLLM was last given them
        self.stats_interval_s = config.stats_interval_s
        # what the next step's metadata carries besides its own: loads vLLM allocated
        # blocks for since, finished requests' last stores
        self._pending: KVLifeConnectorMetadata = KVLifeConnectorMetadata()

    def on_new_request(self, request: Request) -> None:
        lc = self.planner.admit(request, rid=request.request_id)
        progress = self.planner.progress(lc)
        self.requests[request.request_id] = (lc, progress)
        self._due[request.request_id] = (progress.covered + self.stride) * self.block_size

    def _live(self, request: Request) -> Lifecycle | None:
        """``request``'s lifecycle, when it is the request vLLM holds under its id now."""
        entry = self.requests.get(request.request_id)
        if entry is not None and entry[0].req is request:
            return entry[0]
        return self.planner.find(request)  # shown, but no longer held under its id

    def build_meta(self, out: SchedulerOutput) -> KVLifeConnectorMetadata:
        """The step's connector metadata: the stores due, the loads vLLM allocated blocks
        for, and the copies the workers must finish first (blocks reused or taken back).

        Python work in proportion to what changed in the step: new requests, requests
        that got new blocks or resumed, preempted ones, and those whose computed tokens
        reach the next store (``due``, read for every scheduled request in one C-level
        pass of ``map``); a step where no request crosses a store boundary and none gets
        blocks does no Python work per request."""
        if self.overdue.check():
            logger.warning("kvlife: %s", overdue_line(self.overdue))
        meta, self._pending = self._pending, KVLifeConnectorMetadata()
        planner, live = self.planner, self.requests
        wait = meta.wait_jobs
        looked: list[tuple[str, Progress]] = []  # requests whose next store is due again
        items: list[tuple[Lifecycle, int, Any]] = []  # the stores due: one batch
        scheduled = out.num_scheduled_tokens
        for req_id in out.preempted_req_ids or ():
            entry = live.get(req_id)
            if entry is not None:
                wait |= planner.preempted(entry[0])
        slots_of = self._slots
        for new in out.scheduled_new_reqs:
            entry = live.get(new.req_id)
            if entry is None:
                wait |= planner.reused(slots_of(new.block_ids))
                continue
            lc, progress = entry
            wait |= planner.add_slots(lc, slots_of(new.block_ids), fresh=True)
            tokens = new.num_computed_tokens + scheduled[new.req_id]
            self._look(new.req_id, lc, progress, tokens, looked, items)
        cached = out.scheduled_cached_reqs
        ids = cached.req_ids
        if not ids:
            return self._stored(meta, looked, items)
        resumed = cached.resumed_req_ids
        computed = cached.num_computed_tokens
        # the requests whose blocks changed (new ones, or resumed) and those due a store:
        # one pass in C over every scheduled request, Python only for these
        totals = list(map(add, computed, map(scheduled.__getitem__, ids)))
        due = self._due
        picked = set(compress(range(len(ids)), cached.new_block_ids))
        picked.update(compress(range(len(ids)), map(ge, totals, map(due.get, ids, _NEVER))))
        if resumed:
            picked.update(i for i, req_id in enumerate(ids) if req_id in resumed)
        new_block_ids = cached.new_block_ids
        for i in sorted(picked):
            req_id, new_ids = ids[i], new_block_ids[i]
            entry = live.get(req_id)
            if entry is None:
                if new_ids:
                    wait |= planner.reused(slots_of(new_ids))
                continue
            lc, progress = entry
            if new_ids or req_id in resumed:
                fresh = req_id in resumed
                wait |= planner.add_slots(lc, slots_of(new_ids) if new_ids else (), fresh=fresh)
            self._look(req_id, lc, progress, totals[i], looked, items)
        return self._stored(meta, looked, items)

    def _look(
        self,
        req_id: str,
        lc: Lifecycle,
        progress: Progress,
        tokens: int,
        looked: list[tuple[str, Progress]],
        items: list[tuple[Lifecycle, int, Any]],
    ) -> None:
        """``lc`` has ``tokens`` computed once the step ran: add its store to ``items``
        when ``stride`` blocks past those covered are full (with several groups, only
        blocks every group holds: a row with ``None`` ends them), and note it in
        ``looked`` (its next store's due point is set after the batch)."""
        looked.append((req_id, progress))
        full = tokens // self.block_size
        if full - progress.covered < self.stride:
            return
        if self.groups > 1:
            full = self._whole_rows(progress, full)
        items.append((lc, full, lc.req.block_hashes))

    @staticmethod
    def _whole_rows(progress: Progress, full: int) -> int:
        """``full``, or the first block from those covered on that some group holds no
        longer (with several groups: a row with ``None``)."""
        rows = progress.slots
        for j in range(progress.covered, min(full, len(rows))):
            if None in rows[j]:  # type: ignore[operator]  # rows with several groups
                return j
        return full

    def _store_last(self, lc: Lifecycle, request: Request) -> None:
        """Plan the stores of ``request``'s full blocks that no step stored: those whose
        names (block hashes) came with its last output. Under vLLM's async scheduling a
        step's last block is named only once that step's output comes back, after the
        next step was planned, so the block a request's last step filled is named when it
        finishes, never in a step; with ``stride_blocks`` above 1, the blocks short of a
        stride are left at the end too. vLLM takes the blocks back now: the workers
        launch these before the next forward pass (``last_stores``), and the finish
        fences the blocks as for any store in flight."""
        progress = self.planner.progress(lc)
        full = request.num_computed_tokens // self.block_size  # KV computed (or enqueued)
        if full <= progress.covered:
            return
        if self.groups > 1:
            full = self._whole_rows(progress, full)
        orders = self.planner.store(lc, full, request.block_hashes, retry=self.retry)
        if orders:
            self._pending.last_stores += orders

    def _stored(
        self,
        meta: KVLifeConnectorMetadata,
        looked: list[tuple[str, Progress]],
        items: list[tuple[Lifecycle, int, Any]],
    ) -> KVLifeConnectorMetadata:
        """Plan the step's due stores in one batch, then when each looked-at request's
        next store is due."""
        if items:
            meta.stores += self.planner.store_many(items, stride=self.stride, retry=self.retry)
        due, step = self._due, self.stride
        size = self.block_size
        for req_id, progress in looked:
            due[req_id] = (progress.covered + step) * size
        return meta

    def _slots(self, block_ids: Any) -> Any:
        """A request's blocks as the planner's slots: group 0's block numbers, or, with
        several KV cache groups, a row per block of every group's (``None`` for vLLM's
        null block, number 0, which a sliding window holds behind it)."""
        if self.groups == 1:
            return block_ids[0]
        return [
            tuple(block or None for block in row)
            for row in itertools.zip_longest(*block_ids, fillvalue=0)
        ]

    def lookup(self, request: Request, num_computed_tokens: int) -> int:
        """Blocks of ``request`` past ``num_computed_tokens`` that the host cache holds,
        from the first on and at most up to the block before its last token (vLLM must
        compute one token itself)."""
        lc = self._live(request)
        if lc is None:
            return 0  # not shown to the connector: no lifecycle to load on
        first = num_computed_tokens // self.block_size
        last = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        return self.planner.lookup(lc, first, request.block_hashes[first:last])

    def load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated blocks for a hit: load the host pages into them. ``blocks`` are
        all of the request's blocks from its first, those vLLM's own prefix cache supplied
        included; the planner writes those from the lookup's first block on."""
        lc = self._live(request)
        if lc is None:
            return
        count = num_external_tokens // self.block_size
        device_blocks = self._slots(
            [[block.block_id for block in group] for group in blocks.blocks]
        )
        order = self.planner.load(lc, count, device_blocks)
        if order is not None:
            self._pending.loads.append(order)
            entry = self.requests.get(request.request_id)
            if entry is not None and entry[0] is lc:  # a load covers its blocks
                self._due[request.request_id] = (entry[1].covered + self.stride) * self.block_size

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVLifeWorkerMetadata):
            return
        # one registry batch for the step's reports; an unknown or malformed one (a copy
        # number never ordered, a count of workers that is not positive) is never raised
        for exc in self.planner.report_many(meta.done, meta.failed):
            logger.warning("kvlife: %s", exc)

    def request_finished(self, request: Request) -> bool:
        try:
            lc = self.registry.lifecycle(request, audit_as=Trigger.FINISH)
        except UnknownRequestError:  # counted and audited; never raised into vLLM
            logger.warning("kvlife: vLLM finished %r, which it never showed", request)
            return False
        rid: str = request.request_id
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        entry = self.requests.get(rid)
        if entry is not None and entry[0] is lc:
            del self.requests[rid]
            self._due.pop(rid, None)
        self._store_last(lc, request)
        self.planner.end(lc, aborted=aborted)
        return False  # vLLM frees the blocks and the id now; stores in flight fence them

    def take_events(self) -> list[Any]:
        """The host tier's changes since the last call as vLLM's KV events, ``medium``
        "CPU": ``BlockStored`` for blocks that joined the host cache (with the block
        hashes, parent hash, token ids and LoRA vLLM's device events give the same
        blocks), ``BlockRemoved`` for blocks evicted or dropped by a reset."""
        if not self.kv_events:
            return []
        size, out = self.block_size, []
        for event in self.planner.take_events():
            hashes = [maybe_convert_block_hash(key) for key in event.keys]
            if event.kind == "removed":
                out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=0))
                continue
            request, first = event.req, event.first
            lora = request.lora_request
            parent = request.block_hashes[first - 1] if first else None
            tokens = request.all_token_ids[first * size : (first + len(hashes)) * size]
            out.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                    token_ids=list(tokens),
                    block_size=size,
                    lora_id=lora.adapter_id if lora else None,
                    medium=MEDIUM,
                    lora_name=lora.name if lora else None,
                    group_idx=0,
                )
            )
        return out

    def stats(self) -> KVLifeConnectorStats | None:
        """The counters' growth since they were last handed over (the planner's, the
        overdue tickets, each verdict by reason, the audit sinks' losses and errors), and
        the gauges (page account, lifecycles per state) now; ``None`` within
        ``stats_interval_s`` of the last hand-over (the growth waits for the next one: vLLM
        calls this at every step, and logs and exports per interval of seconds), or when
        nothing changed."""
        now = monotonic()
        if now - self._stats_at < self.stats_interval_s:
            return None
        self._stats_at = now
        counts, reported = self.planner.counters(), self._reported
        delta: dict[str, Any] = {key: counts[key] - reported[key] for key in COUNTERS}
        watch = self.overdue
        delta["overdue_tickets"] = watch.overdue_total - self._overdue_reported
        delta |= verdict_growth(self.registry.refusals, self._verdicts_reported)
        delta |= audit_growth(self.registry, self._audit_reported)
        gauges = (
            account_stats(self.planner.account())
            | lifecycle_stats(self.registry.statistics().live)
            | overdue_gauges(watch)
        )
        if not any(delta.values()) and gauges == self._gauges:
            return None
        self._reported, self._gauges = counts, gauges
        self._overdue_reported = watch.overdue_total
        delta["stored_bytes"] = delta["stored_blocks"] * self.bytes_per_block
        delta["loaded_bytes"] = delta["loaded_blocks"] * self.bytes_per_block
        return KVLifeConnectorStats(data=delta | gauges)

    def shutdown(self) -> None:
        """Write every audit record and close the log (the engine is stopping)."""
        self.log.close()

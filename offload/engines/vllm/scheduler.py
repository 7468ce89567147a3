"""The connector's scheduler side (vLLM's engine core): vLLM's calls translated into
[`OffloadPlanner`][kvlife.offload.planner.OffloadPlanner] calls.

Every vLLM ``Request`` *object* gets its own lifecycle when vLLM first shows it
(``on_new_request``); the request id is only used to find the request object vLLM's
scheduler holds under it now, since vLLM's scheduler output names requests by id.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from kvlife.fsm import JsonLinesSink, Lifecycle, LifecycleRegistry, Trigger, UnknownRequestError
from kvlife.offload.engines.vllm.config import ConnectorConfig
from kvlife.offload.engines.vllm.metadata import KVLifeConnectorMetadata, KVLifeWorkerMetadata
from kvlife.offload.engines.vllm.stats import KVLifeConnectorStats, account_stats
from kvlife.offload.planner import COUNTERS, OffloadPlanner, UnknownOrderError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvlife")


class SchedulerSide:
    """The planner, its audit log, and the requests vLLM holds under each id now.

    Args:
        pages: host pages the workers hold.
        block_size: tokens per vLLM block.
        workers: workers that report each copy (the tensor-parallel world size).
        config: the checked extra config.
        audit_log: the file this engine core writes (see ``config.audit_path``), or none.
    """

    def __init__(
        self,
        *,
        pages: int,
        block_size: int,
        workers: int,
        config: ConnectorConfig,
        audit_log: str | None,
    ) -> None:
        self.sink: JsonLinesSink | None = None
        if audit_log:
            self.sink = JsonLinesSink(
                audit_log,
                fsync=config.audit_fsync,  # type: ignore[arg-type]  # checked by parse
                max_bytes=config.audit_max_bytes,
                backups=config.audit_backups,
                flush_interval_s=config.audit_flush_s,
                open_marker=True,
            )
        registry = LifecycleRegistry(sinks=[self.sink] if self.sink else [])
        self.planner = OffloadPlanner(pages, registry=registry, reporters=workers)
        self.registry = registry
        self.block_size = block_size
        self.stride = config.stride_blocks
        self.requests: dict[str, Request] = {}  # the request vLLM holds under an id now
        self._reported: dict[str, int] = dict.fromkeys(COUNTERS, 0)  # given to vLLM so far
        self._pending_loads: KVLifeConnectorMetadata = KVLifeConnectorMetadata()

    def on_new_request(self, request: Request) -> None:
        self.planner.admit(request, rid=request.request_id)
        self.requests[request.request_id] = request

    def _lifecycle(self, req_id: str) -> Lifecycle | None:
        request = self.requests.get(req_id)
        return None if request is None else self.planner.find(request)

    def build_meta(self, out: SchedulerOutput) -> KVLifeConnectorMetadata:
        meta, self._pending_loads = self._pending_loads, KVLifeConnectorMetadata()
        planner = self.planner
        wait = meta.wait_jobs
        for req_id in out.preempted_req_ids or ():
            lc = self._lifecycle(req_id)
            if lc is not None:
                wait |= planner.preempted(lc)
        for new in out.scheduled_new_reqs:
            lc = self._lifecycle(new.req_id)
            if lc is None:
                wait |= planner.reused(new.block_ids[0])
                continue
            wait |= planner.add_slots(lc, new.block_ids[0], fresh=True)
            computed = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
            self._store(lc, computed, meta)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            lc = self._lifecycle(req_id)
            if lc is None:
                if new_ids:
                    wait |= planner.reused(new_ids[0])
                continue
            resumed = req_id in cached.resumed_req_ids
            if new_ids or resumed:
                wait |= planner.add_slots(lc, new_ids[0] if new_ids else (), fresh=resumed)
            computed = cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0)
            self._store(lc, computed, meta)
        return meta

    def _store(self, lc: Lifecycle, computed: int, meta: KVLifeConnectorMetadata) -> None:
        """Offload the blocks that are full once this step ran, ``stride`` at a time."""
        request = lc.req
        meta.stores += self.planner.store(
            lc, computed // self.block_size, request.block_hashes, stride=self.stride
        )

    def lookup(self, request: Request, num_computed_tokens: int) -> int:
        """Blocks of ``request`` past ``num_computed_tokens`` that the host cache holds,
        from the first on and at most up to the block before its last token (vLLM must
        compute one token itself)."""
        lc = self.planner.find(request)
        if lc is None:
            return 0  # not shown to the connector: no lifecycle to load on
        first = num_computed_tokens // self.block_size
        last = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        return self.planner.lookup(lc, first, request.block_hashes[first:last])

    def load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated blocks for a hit: load the host pages into them. ``blocks`` are
        all of the request's blocks from its first, those vLLM's own prefix cache supplied
        included; the planner writes those from the lookup's first block on."""
        lc = self.planner.find(request)
        if lc is None:
            return
        count = num_external_tokens // self.block_size
        device_blocks = [block.block_id for block in blocks.blocks[0]]
        order = self.planner.load(lc, count, device_blocks)
        if order is not None:
            self._pending_loads.loads.append(order)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVLifeWorkerMetadata):
            return
        for counts, ok in ((meta.done, True), (meta.failed, False)):
            for op, n in counts.items():
                try:
                    self.planner.report(op, ok, n)
                except UnknownOrderError as exc:  # never raised into vLLM
                    logger.warning("kvlife: %s", exc)

    def request_finished(self, request: Request) -> bool:
        try:
            lc = self.registry.lifecycle(request, audit_as=Trigger.FINISH)
        except UnknownRequestError:  # counted and audited; never raised into vLLM
            logger.warning("kvlife: vLLM finished %r, which it never showed", request)
            return False
        rid: str = request.request_id
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        if self.requests.get(rid) is request:
            del self.requests[rid]
        self.planner.end(lc, aborted=aborted)
        return False  # vLLM frees the blocks and the id now; stores in flight fence them

    def written(self) -> None:
        """The end of a connector call: its records go to the file now (no fsync), so
        an engine core that is killed between calls loses none. vLLM kills its engine
        core at every stop of a server, before any shutdown call reaches the
        connector."""
        if self.sink is not None:
            self.sink.write_out()

    def stats(self) -> KVLifeConnectorStats | None:
        """The counters' growth since the last call and the page account now, or ``None``
        when no counter grew."""
        counts, reported = self.planner.counters(), self._reported
        delta: dict[str, Any] = {key: counts[key] - reported[key] for key in COUNTERS}
        if not any(delta.values()):
            return None
        self._reported = counts
        return KVLifeConnectorStats(data=delta | account_stats(self.planner.account()))

    def shutdown(self) -> None:
        """Write every audit record and close the log (the engine is stopping)."""
        try:
            self.registry.flush()
        except Exception:  # another thread: the sink is flushed by its close below
            logger.debug("kvlife: registry flush at shutdown", exc_info=True)
        if self.sink is not None:
            self.sink.close()

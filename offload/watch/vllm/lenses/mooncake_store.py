"""The lens of vLLM's ``MooncakeStoreConnector`` (KV cache offload to a Mooncake store),
vLLM 0.33 and 0.32.

Its scheduler side (``connector.connector_scheduler``, ``MooncakeStoreScheduler``) orders
each store as a ``ReqMeta`` in ``MooncakeStoreConnectorMetadata.requests`` with
``can_save`` and a ``store_job_id`` of its own, and pins the device blocks the store reads
(``_pinned_saves[job] = (blocks, workers yet to report)``) until every worker reported the
job in ``MooncakeStoreWorkerMetadata.completed_saves``; then it frees them. It never delays
a request's free (``request_finished`` answers ``False``): a store in flight holds its own
block references, and is credited to no request. A load is reported by request id
(``finished_recving``; its worker asserts ``load_async``), which the wrapper tickets
without a lens; the lens adds the stores.

Its per-request state is keyed by request id: ``_unfinished_requests[rid] = (Request,
block ids)``, set in ``update_state_after_alloc`` for every request vLLM allocates and
dropped for each id in the next step's ``finished_req_ids`` (and for preempted ids) inside
``build_connector_meta``, beside ``_request_trackers`` and ``load_specs``. The lens reads
it for the request object the state under an id belongs to; a running request whose state
is gone or another's is written down (``inherited_state``) when it is met.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vllm.v1.outputs import KVConnectorOutput

from kvlife.offload.watch.vllm.lenses import part_of


class MooncakeStoreLens:
    """See the module's text. Reads ``_unfinished_requests`` and ``_pinned_saves``."""

    name = "MooncakeStoreConnector"
    keeps_every_request = True  # a state for every request vLLM allocated, until finished

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        # the request object each store job in flight was issued for: its pinned blocks
        # are that request's (the connector credits the job to no request by id)
        self.issued_for: dict[int, Any] = {}

    def issued(self, meta: Any) -> Iterator[tuple[int, str, Any]]:
        unfinished = self.scheduler._unfinished_requests
        for req in meta.requests:
            job = req.store_job_id
            if not req.can_save or job is None:
                continue
            entry = unfinished.get(req.req_id)
            request = None if entry is None else entry[0]
            self.issued_for[job] = request
            yield job, "store", request

    def completions(self, output: KVConnectorOutput) -> Iterator[tuple[int, bool, Any]]:
        meta = output.kv_connector_worker_meta
        completed = getattr(meta, "completed_saves", None)
        if not completed:
            return
        pinned = self.scheduler._pinned_saves
        for job, count in completed.items():
            entry = pinned.get(job)
            if entry is not None and entry[1] - count > 0:
                continue  # not every worker reported it yet
            yield job, True, self.issued_for.pop(job, None)

    def owner(self, rid: str) -> Any:
        entry = self.scheduler._unfinished_requests.get(rid)
        return None if entry is None else entry[0]

    def finishing(self, request: Any) -> bool:
        return False  # its next step drops a finished request's state, no pass uses it

    def flushes(self, request: Any) -> bool:
        return False


def lens_for(connector: Any) -> MooncakeStoreLens | None:
    """A lens for a vLLM ``MooncakeStoreConnector`` scheduler side with the private state
    this module reads; ``None`` for any other connector (or another vLLM's shapes)."""
    scheduler = part_of(connector, "MooncakeStoreConnector", "connector_scheduler")
    if scheduler is None:
        return None
    state = [getattr(scheduler, name, None) for name in ("_unfinished_requests", "_pinned_saves")]
    if not all(isinstance(part, dict) for part in state):
        return None  # another vLLM's private shapes: relayed without a lens
    return MooncakeStoreLens(scheduler)


__all__ = ["MooncakeStoreLens", "lens_for"]

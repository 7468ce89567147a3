"""The lens of vLLM's ``OffloadingConnector`` (what ``--kv-offloading-size`` turns on),
vLLM 0.32 and 0.33.

Its scheduler side (``connector.connector_scheduler``) sends ``TransferJob(req_id, ...)``
per job id in ``OffloadingConnectorMetadata.load_jobs`` and ``store_jobs``; keeps a
``TransferJobStatus(req_id, pending_count, ...)`` per job in ``_jobs`` (``pending_count``
starts at the number of workers) and a ``RequestOffloadState(req=Request, ...)`` per
request id in ``_req_status`` (``on_new_request`` replaces the entry of an id that is
reused); and takes ``completed_jobs {job: workers}`` from ``OffloadingWorkerMetadata``,
crediting a job whose count reaches zero to ``_req_status[job.req_id]``. A finished
request keeps its entry until the next step's ``build_connector_meta`` has ordered its
final stores. It never delays a free and asserts on a failed copy (no failure report).
A load is also reported by request id (``finished_recving``), which the wrapper tickets
without a lens; the lens adds the stores.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvlife.offload.watch.vllm.lenses import part_of


class OffloadingLens:
    """See the module's text. Reads ``scheduler._jobs`` and ``scheduler._req_status``."""

    name = "OffloadingConnector"
    keeps_every_request = True  # on_new_request makes it; the step after the finish drops it

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def issued(self, meta: Any) -> Iterator[tuple[int, str, Any]]:
        # stores only: a load is reported by request id too (finished_recving), the
        # protocol's own load ticket
        states = self.scheduler._req_status
        for job, transfer in meta.store_jobs.items():
            state = states.get(transfer.req_id)
            yield job, "store", None if state is None else state.req

    def completions(self, output: KVConnectorOutput) -> Iterator[tuple[int, bool, Any]]:
        meta = output.kv_connector_worker_meta
        completed = getattr(meta, "completed_jobs", None)
        if not completed:
            return
        jobs, states = self.scheduler._jobs, self.scheduler._req_status
        for job, count in completed.items():
            status = jobs.get(job)
            if status is None or not status.is_store or status.pending_count - count > 0:
                continue  # a load, a job a cache reset flushed, or not over yet
            state = states.get(status.req_id)
            yield job, True, None if state is None else state.req

    def owner(self, rid: str) -> Any:
        state = self.scheduler._req_status.get(rid)
        return None if state is None else state.req

    def finishing(self, request: Any) -> bool:
        state = self.scheduler._req_status.get(request.request_id)
        return state is not None and state.req is request

    def flushes(self, request: Any) -> bool:
        # The next step's final pass (``_build_store_jobs`` over ``finished_req_ids``)
        # stores the chunks past those stored, up to the finished request's end as it
        # counts it: the same arithmetic, with the connector's own methods.
        scheduler = self.scheduler
        state = scheduler._req_status.get(request.request_id)
        if state is None or state.req is not request:
            return False
        if request.status is RequestStatus.FINISHED_ABORTED:
            end = request.num_computed_tokens
        else:
            end = max(request.num_prompt_tokens, request.num_tokens - 1)
        try:
            offloadable = scheduler._calc_num_offloadable_tokens(state, end)
            return any(
                state.storable_chunks(config, group, offloadable) > group.next_stored_chunk_idx
                for config, group in zip(
                    state.config.kv_group_configs, state.group_states, strict=True
                )
            )
        except (AttributeError, TypeError):  # another vLLM's shapes: count them all
            return True


def lens_for(connector: Any) -> OffloadingLens | None:
    """A lens for a vLLM ``OffloadingConnector`` (or a subclass) with the private state
    this module reads; ``None`` for any other connector."""
    scheduler = part_of(connector, "OffloadingConnector", "connector_scheduler")
    if scheduler is None:
        return None
    if not (hasattr(scheduler, "_jobs") and hasattr(scheduler, "_req_status")):
        return None  # another vLLM's private shapes: relayed without a lens
    return OffloadingLens(scheduler)


__all__ = ["OffloadingLens", "lens_for"]

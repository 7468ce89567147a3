"""The lens of vLLM's ``SimpleCPUOffloadConnector`` (``VLLM_USE_SIMPLE_KV_OFFLOAD=1``
makes ``--kv-offloading-size`` use it), vLLM 0.32 and 0.33, eager mode.

Its scheduler side (``connector.scheduler_manager``, a ``SimpleCPUOffloadScheduler``)
sends at most one store event per step in ``SimpleCPUOffloadMetadata.store_event`` (flat
block lists, no request in them) and keeps, in eager mode, which request ids each event
stores for (``_store_event_to_reqs``) and a ``StoreRequestState(request=Request, ...)`` per
request id (``_reqs_to_store``: made in ``update_state_after_alloc`` only when the id has
none, kept past the request's finish while its store events are in flight). Workers report
``completed_store_events {event: workers}``; an event is over when the count reaches the
world size (``_store_event_pending_counts``, ``_expected_worker_count``), and the connector
credits it to the state under each of its request ids then. A request's loads are
reported by request id (``finished_recving``): the wrapper tickets those without a lens.

Lazy mode stores blocks as vLLM evicts them, for no request: nothing to ticket, and the
per-request state the checks read does not exist. The final stores a finished request
queues (``_pending_finished_stores``) join the next event with no request id either.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vllm.v1.outputs import KVConnectorOutput

from kvlife.offload.watch.vllm.lenses import part_of


class SimpleCPUOffloadLens:
    """See the module's text. Reads the scheduler manager's ``_store_event_to_reqs``,
    ``_reqs_to_store``, ``_store_event_pending_counts`` and ``_expected_worker_count``."""

    name = "SimpleCPUOffloadConnector"
    keeps_every_request = True  # eager mode: a state for every request vLLM allocated

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        # event -> the request ids it stores for, as issued (the connector's own list
        # loses an id when that request's state is cleaned up)
        self._events: dict[int, tuple[str, ...]] = {}

    def issued(self, meta: Any) -> Iterator[tuple[Any, str, Any]]:
        event = meta.store_event
        if event < 0:
            return
        manager = self.manager
        rids = tuple(manager._store_event_to_reqs.get(event, ()))
        if not rids:
            return  # only blocks of finished requests, or none of a request
        self._events[event] = rids
        states = manager._reqs_to_store
        for rid in rids:
            state = states.get(rid)
            yield (event, rid), "store", None if state is None else state.request

    def completions(self, output: KVConnectorOutput) -> Iterator[tuple[Any, bool, Any]]:
        meta = output.kv_connector_worker_meta
        completed = getattr(meta, "completed_store_events", None)
        if not completed:
            return
        manager = self.manager
        pending, workers = manager._store_event_pending_counts, manager._expected_worker_count
        states = manager._reqs_to_store
        for event, count in completed.items():
            if pending.get(event, 0) + count < workers:
                continue  # not every worker reported it yet
            for rid in self._events.pop(event, ()):
                state = states.get(rid)
                yield (event, rid), True, None if state is None else state.request

    def owner(self, rid: str) -> Any:
        state = self.manager._reqs_to_store.get(rid)
        return None if state is None else state.request

    def finishing(self, request: Any) -> bool:
        return False  # no pass over finished requests at the next step

    def flushes(self, request: Any) -> bool:
        return False  # its final stores name no request


def lens_for(connector: Any) -> SimpleCPUOffloadLens | None:
    """A lens for a vLLM ``SimpleCPUOffloadConnector`` in eager mode with the private
    state this module reads; ``None`` for any other connector (or lazy mode)."""
    manager = part_of(connector, "SimpleCPUOffloadConnector", "scheduler_manager")
    if manager is None:
        return None
    wanted = (
        "_store_event_to_reqs",
        "_reqs_to_store",
        "_store_event_pending_counts",
        "_expected_worker_count",
    )
    if getattr(manager, "_lazy_mode", True) or not all(hasattr(manager, n) for n in wanted):
        return None  # lazy mode, or another vLLM's private shapes: relayed without a lens
    return SimpleCPUOffloadLens(manager)


__all__ = ["SimpleCPUOffloadLens", "lens_for"]

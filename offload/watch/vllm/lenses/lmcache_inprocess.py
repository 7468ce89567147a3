"""The lens of LMCache's in-process connector, ``LMCacheConnectorV1`` (vLLM's
``lmcache_connector.py`` delegating to LMCache 0.5's ``LMCacheConnectorV1Impl``).

Its protocol tells the wrapper little: ``request_finished`` never delays a free, its
worker reports nothing by request id (``get_finished`` answers ``(None, None)``) and
vLLM's wrapper makes every load synchronous (``load_async=False``: the load runs inside
``start_load_kv`` of the step that carries it, and its stores inside ``wait_for_save``).
So there is no copy to ticket: a copy is over before the step's output comes back.

What can go wrong per request is its scheduler-side state, kept in dictionaries keyed by
request id: ``_unfinished_requests[rid]`` holds the vLLM ``Request`` object (set in
``update_state_after_alloc`` for every request vLLM allocates, dropped for each id in the
next step's ``finished_req_ids`` inside ``build_connector_meta``), beside
``_request_trackers``, ``load_specs`` and the lookup client's results. A request that
reuses the id of one that finished in the step before is allocated first and dropped
second: its state is gone while it runs, and LMCache raises ``ValueError`` at its next step.
The lens reads ``_unfinished_requests``: the request object the state under an id
belongs to, and the wrapper writes down a running request whose state is gone or
another's (``inherited_state``) when it is met, a step before LMCache raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vllm.v1.outputs import KVConnectorOutput

from kvlife.offload.watch.vllm.lenses import part_of


class LMCacheInProcessLens:
    """See the module's text. Reads ``LMCacheConnectorV1Impl._unfinished_requests``."""

    name = "LMCacheConnectorV1"
    keeps_every_request = True  # a state for every request vLLM allocated, until finished

    def __init__(self, impl: Any) -> None:
        self.impl = impl

    def issued(self, meta: Any) -> Iterator[tuple[Any, str, Any]]:
        return iter(())  # its copies finish inside the step's worker calls

    def completions(self, output: KVConnectorOutput) -> Iterator[tuple[Any, bool, Any]]:
        return iter(())

    def owner(self, rid: str) -> Any:
        return self.impl._unfinished_requests.get(rid)

    def finishing(self, request: Any) -> bool:
        return False  # its next step drops a finished request's state, no pass uses it

    def flushes(self, request: Any) -> bool:
        return False


def lens_for(connector: Any) -> LMCacheInProcessLens | None:
    """A lens for LMCache's ``LMCacheConnectorV1`` scheduler side with the private state
    this module reads; ``None`` for any other connector (or another LMCache's shapes)."""
    impl = part_of(connector, "LMCacheConnectorV1", "_lmcache_engine")
    if impl is None:
        return None
    if not isinstance(getattr(impl, "_unfinished_requests", None), dict):
        return None  # a worker role, or another LMCache's private shapes: no lens
    return LMCacheInProcessLens(impl)


__all__ = ["LMCacheInProcessLens", "lens_for"]

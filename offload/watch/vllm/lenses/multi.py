"""The lens of vLLM's ``MultiConnector`` (vLLM 0.33): its children's lenses, each over its
own part of what MultiConnector passes between its halves.

MultiConnector keeps its children in ``_connectors`` (the scheduler side's children on the
scheduler side), sends ``MultiKVConnectorMetadata(metadata=(one per child, ...))`` and
takes back ``MultiKVConnectorWorkerMetadata(metadata=(one per child, ...))``; child ``i``
reads part ``i``. A child with a lens of its own is seen through it; the others (kvlife's
own connector, which audits itself, or a connector without a lens) are relayed. Job keys
carry the child's index last, so that two children's job numbers never meet.

The state under a request id is the children's: a child that keeps every request and
holds none for a running one lost it; children that hold different request objects under
one id, the earliest of them (by arrival) is the one that should not be there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator
from typing import Any

from vllm.v1.outputs import KVConnectorOutput

from kvlife.offload.watch.vllm.lenses import Lens, part_of


def _key(job: Hashable, child: int) -> tuple[Any, ...]:
    """A child's job key with the child's index last (the job number stays first)."""
    return (*job, child) if isinstance(job, tuple) else (job, child)


class MultiLens:
    """See the module's text. Reads ``MultiConnector._connectors`` once, when made."""

    def __init__(self, children: list[tuple[int, Lens]]) -> None:
        self.children = children
        self.name = "MultiConnector(" + ", ".join(lens.name for _, lens in children) + ")"
        self.keeps_every_request = any(lens.keeps_every_request for _, lens in children)

    def issued(self, meta: Any) -> Iterator[tuple[Hashable, str, Any]]:
        parts = getattr(meta, "metadata", None)
        if parts is None:
            return
        for index, lens in self.children:
            for job, kind, request in lens.issued(parts[index]):
                yield _key(job, index), kind, request

    def completions(self, output: KVConnectorOutput) -> Iterator[tuple[Hashable, bool, Any]]:
        parts = getattr(output.kv_connector_worker_meta, "metadata", None)
        if parts is None:
            return
        for index, lens in self.children:
            if parts[index] is None:
                continue
            own = dataclasses.replace(output, kv_connector_worker_meta=parts[index])
            for job, ok, credited in lens.completions(own):
                yield _key(job, index), ok, credited

    def owner(self, rid: str) -> Any:
        held: list[Any] = []
        for _, lens in self.children:
            owner = lens.owner(rid)
            if owner is None:
                if lens.keeps_every_request:
                    return None  # a child that keeps every request holds none
                continue
            if all(owner is not other for other in held):
                held.append(owner)
        if not held:
            return None
        return min(held, key=lambda request: getattr(request, "arrival_time", 0.0))

    def finishing(self, request: Any) -> bool:
        return any(lens.finishing(request) for _, lens in self.children)

    def flushes(self, request: Any) -> bool:
        return any(lens.flushes(request) for _, lens in self.children)


def lens_for(connector: Any, child_lens: Any) -> MultiLens | None:
    """A lens for a vLLM ``MultiConnector`` with at least one child ``child_lens`` sees
    (``child_lens(child)``: a child's lens or ``None``); ``None`` for any other connector."""
    connectors = part_of(connector, "MultiConnector", "_connectors")
    if not isinstance(connectors, list):
        return None
    children = [(i, lens) for i, c in enumerate(connectors) if (lens := child_lens(c))]
    return MultiLens(children) if children else None


__all__ = ["MultiLens", "lens_for"]

"""What crosses vLLM's process line each step: the scheduler side's orders to the workers,
and each worker's reports back (summed over workers by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvlife.offload.planner import LoadOrder, StoreOrder


@dataclass
class KVLifeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    stores: list[StoreOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    #: Copies that read or write blocks vLLM reuses in this step (of preempted requests,
    #: or of finished ones whose stores were in flight): workers finish them before the
    #: forward pass.
    wait_jobs: set[int] = field(default_factory=set)
    #: Stores of finished requests' last full blocks (planned when the request finished,
    #: once its last output named them): vLLM took those blocks back, so workers launch
    #: these before the forward pass (``handle_preemptions``), which may write the blocks
    #: for another request (that request's step waits for them, in ``wait_jobs``).
    last_stores: list[StoreOrder] = field(default_factory=list)


@dataclass
class KVLifeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: copies this worker finished (``done``) or could not do
    (``failed``), as copy number -> number of workers (summed by ``aggregate``)."""

    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVLifeWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} with kvlife's")
        done, failed = dict(self.done), dict(self.failed)
        for op, n in other.done.items():
            done[op] = done.get(op, 0) + n
        for op, n in other.failed.items():
            failed[op] = failed.get(op, 0) + n
        return KVLifeWorkerMetadata(done, failed)

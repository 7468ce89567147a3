"""How ``kvlife vllm exercise`` runs a connector's worker side (see
[`kvlife.offload.watch.vllm.exercise`][kvlife.offload.watch.vllm.exercise]): the
connector's own worker role on CPU KV caches (``real``), workers played from the jobs a
connector's metadata orders (``played``: vLLM's OffloadingConnector and
SimpleCPUOffloadConnector, which need a GPU worker, and NIXL's P/D, Mooncake's P/D,
Mooncake's store and the hidden-states example, each in its own module), none
(``none``), and LMCache's in their own modules; ``workers_class`` picks one by the
connector's name, ``transfer_params_of`` what the workload's requests carry for it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kvlife.offload.watch.vllm.exercise_hidden_states import HiddenStatesPlay
from kvlife.offload.watch.vllm.exercise_mooncake import MooncakePlay
from kvlife.offload.watch.vllm.exercise_mooncake_store import MooncakeStorePlay
from kvlife.offload.watch.vllm.exercise_nixl import NixlPlay, NixlPushPlay

BLOCK = 16
LAYERS = ("layer.0", "layer.1")
HEADS, HEAD_DIM = 2, 8


class Workers(Protocol):
    """The connector's worker side, as the exercise runs it."""

    #: ``real``, ``played`` or ``none`` (see the module's text)
    kind: str

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        """Run step ``n`` of scheduler output ``out`` on every worker; each worker's
        ``KVConnectorOutput`` (or ``None``) due at this step, after ``delay()`` steps."""
        ...

    def busy(self) -> bool:
        """Whether a worker still owes vLLM a report."""
        ...


class _Held:
    """Each worker's outputs, held until due; those due together merged in order."""

    def __init__(self, workers: int) -> None:
        self.queues: list[list[tuple[int, Any]]] = [[] for _ in range(workers)]

    def put(self, rank: int, due: int, output: Any) -> None:
        self.queues[rank].append((due, output))

    def each(self, n: int, delay: Callable[[], int], **report: Any) -> None:
        """Every worker reports ``report`` (``KVConnectorOutput`` fields), each after a
        ``delay()`` of its own from step ``n``, in rank order."""
        from vllm.v1.outputs import KVConnectorOutput  # noqa: PLC0415

        for rank in range(len(self.queues)):
            self.put(rank, n + delay(), KVConnectorOutput(**report))

    def due(self, n: int) -> list[Any]:
        released = []
        for rank, queue in enumerate(self.queues):
            now = [o for when, o in queue if when <= n]
            self.queues[rank] = [(when, o) for when, o in queue if when > n]
            released.append(_merged(now))
        return released

    def busy(self) -> bool:
        """Whether an output still held tells vLLM anything (a real worker's output of a
        step with nothing to report is held too)."""
        return any(_carries(output) for queue in self.queues for _, output in queue)


def _carries(output: Any) -> bool:
    """Whether ``output`` (a ``KVConnectorOutput`` or ``None``) reports anything: an id
    sent or received, a block that failed, or worker metadata with a field not empty
    (metadata the exercise cannot look into counts as something)."""
    if output is None:
        return False
    if (
        output.finished_sending
        or output.finished_recving
        or output.invalid_block_ids
        or getattr(output, "failed_recving", None)
    ):
        return True
    meta = output.kv_connector_worker_meta
    if meta is None:
        return False
    if dataclasses.is_dataclass(meta):
        return any(getattr(meta, f.name) for f in dataclasses.fields(meta))
    return not hasattr(meta, "__dict__") or any(vars(meta).values())


def _merged(outputs: list[Any]) -> Any:
    """One worker's outputs of several steps as one ``KVConnectorOutput`` (``None``: none)."""
    if not outputs:
        return None
    first = dataclasses.replace(outputs[0])
    for later in outputs[1:]:
        first.finished_sending = (first.finished_sending or set()) | (
            later.finished_sending or set()
        )
        first.finished_recving = (first.finished_recving or set()) | (
            later.finished_recving or set()
        )
        first.invalid_block_ids = set(first.invalid_block_ids or ()) | set(
            later.invalid_block_ids or ()
        )
        if hasattr(first, "failed_recving"):
            first.failed_recving = set(first.failed_recving or ()) | set(later.failed_recving or ())
        meta, other = first.kv_connector_worker_meta, later.kv_connector_worker_meta
        if meta is None:
            first.kv_connector_worker_meta = other
        elif other is not None:
            first.kv_connector_worker_meta = meta.aggregate(other)
    first.finished_sending = first.finished_sending or None
    first.finished_recving = first.finished_recving or None
    return first


def output_of(worker: Any, results: Any) -> Any:
    """A worker connector's ``KVConnectorOutput`` for a step: its transfer ``results``
    (``get_transfer_results``), then its load errors and its worker metadata, asked in
    that order as vLLM's model runner asks."""
    from vllm.v1.outputs import KVConnectorOutput  # noqa: PLC0415

    output = KVConnectorOutput(
        finished_sending=set(results.finished_sending or ()) or None,
        finished_recving=set(results.finished_recving or ()) or None,
        invalid_block_ids=set(worker.get_block_ids_with_load_errors() or ()),
        kv_connector_worker_meta=worker.build_connector_worker_meta(),
    )
    failed = getattr(results, "failed_recving", None)
    if failed:
        output.failed_recving = set(failed)
    return output


class RealWorkers:
    """The connector's own worker role, one instance per worker, on CPU KV caches."""

    kind = "real"
    #: the KV cache layout vLLM must resolve before the connector is built (``None``:
    #: vLLM's default)
    kv_cache_layout: str | None = None

    def __init__(self, scheduler: Any, workers: int) -> None:
        import torch  # noqa: PLC0415
        from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: PLC0415
            KVConnectorFactory,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
            KVConnectorRole,
        )

        from kvlife.offload.watch.vllm.audit import wrapped_config  # noqa: PLC0415

        vllm_config = wrapped_config(scheduler.vllm_config)[1]
        cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
        blocks = scheduler.kv_cache_config.num_blocks
        self.ranks = []
        for rank in range(workers):
            worker = self.build(
                lambda config: cls(config, KVConnectorRole.WORKER, scheduler.kv_cache_config),
                vllm_config,
                rank,
            )
            shape = (2, blocks, BLOCK, HEADS, HEAD_DIM)
            worker.register_kv_caches(
                {name: torch.zeros(shape, dtype=torch.float16) for name in LAYERS}
            )
            self.ranks.append(worker)
        self.held = _Held(workers)

    def build(self, make: Callable[[Any], Any], vllm_config: Any, rank: int) -> Any:
        """Worker ``rank``'s connector, ``make(vllm_config)``: every worker of one config
        here; a connector that needs each worker to know its rank says so here."""
        return make(vllm_config)

    def forward_context(self) -> Any:
        """What ``start_load_kv`` is given: no forward pass runs (``None``)."""
        return None

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        meta = out.kv_connector_metadata
        context = self.forward_context()
        for rank, worker in enumerate(self.ranks):
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(context)
            worker.wait_for_save()
            self.saved(worker)
            output = output_of(worker, worker.get_transfer_results(out.finished_req_ids))
            worker.clear_connector_metadata()
            self.held.put(rank, n + delay(), output)
        return self.held.due(n)

    def saved(self, worker: Any) -> None:
        """After ``wait_for_save``: where a connector's copies run on, wait for them."""

    def close(self) -> None:
        """Shut every worker down (its threads, its connections), as vLLM does at exit."""
        for worker in self.ranks:
            with contextlib.suppress(Exception):
                worker.shutdown()

    def busy(self) -> bool:
        return self.held.busy()


class NoWorkers:
    """A connector whose worker reports nothing by request id and loads synchronously."""

    kind = "none"
    kv_cache_layout: str | None = None

    def __init__(self, scheduler: Any, workers: int) -> None:
        self.workers = workers

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        return [None] * self.workers

    def busy(self) -> bool:
        return False


class _JobPlay:
    """Workers played from the jobs a connector's metadata orders: each worker reports
    each job after ``delay()`` steps (a job vLLM waits for in its own step); a load job
    is also reported by its request ids once that worker finished it."""

    kind = "played"
    kv_cache_layout: str | None = None

    def __init__(self, scheduler: Any, workers: int) -> None:
        self.workers = workers
        self.pending: list[tuple[int, int, int, list[str]]] = []  # due, rank, job, rids

    def orders(self, meta: Any) -> Iterable[tuple[int, list[str], bool]]:
        """The jobs ``meta`` orders: (job, the request ids a load reports, now)."""
        raise NotImplementedError

    def worker_meta(self, completed: dict[int, int]) -> Any:
        raise NotImplementedError

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        from vllm.v1.outputs import KVConnectorOutput  # noqa: PLC0415

        for job, rids, now in self.orders(out.kv_connector_metadata):
            for rank in range(self.workers):
                self.pending.append((n if now else n + delay(), rank, job, rids))
        due = [p for p in self.pending if p[0] <= n]
        self.pending = [p for p in self.pending if p[0] > n]
        outputs: list[Any] = []
        for rank in range(self.workers):
            mine = [p for p in due if p[1] == rank]
            if not mine:
                outputs.append(None)
                continue
            completed: dict[int, int] = {}
            recving: set[str] = set()
            for _, _, job, rids in mine:
                completed[job] = completed.get(job, 0) + 1
                recving.update(rids)
            outputs.append(
                KVConnectorOutput(
                    finished_recving=recving or None,
                    kv_connector_worker_meta=self.worker_meta(completed),
                )
            )
        return outputs

    def busy(self) -> bool:
        return bool(self.pending)


class OffloadingPlay(_JobPlay):
    """vLLM's ``OffloadingConnector``: store and load jobs in its metadata, completed
    through ``completed_jobs``; flushed jobs and synchronous loads in their own step."""

    def orders(self, meta: Any) -> Iterable[tuple[int, list[str], bool]]:
        now = set(meta.jobs_to_flush or ())
        for job, transfer in meta.load_jobs.items():
            sync = bool(getattr(transfer, "sync", False))
            yield job, [] if sync else [transfer.req_id], sync or job in now
        for job in meta.store_jobs:
            yield job, [], job in now

    def worker_meta(self, completed: dict[int, int]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: PLC0415
            OffloadingWorkerMetadata,
        )

        return OffloadingWorkerMetadata(completed_jobs=completed)


class SimpleCPUPlay(_JobPlay):
    """vLLM's ``SimpleCPUOffloadConnector``: one store event and one load event a step at
    most, completed through ``completed_store_events`` (stores) and by request id (loads);
    when vLLM preempted (``need_flush``) every worker finishes everything in that step."""

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        if out.kv_connector_metadata.need_flush:
            self.pending = [(n, rank, job, rids) for _, rank, job, rids in self.pending]
        return super().step(out, n, delay)

    def orders(self, meta: Any) -> Iterable[tuple[int, list[str], bool]]:
        if meta.store_event >= 0:
            yield meta.store_event, [], bool(meta.need_flush)
        if meta.load_event >= 0:
            rids = list(meta.load_event_to_reqs[meta.load_event])
            yield -1 - meta.load_event, rids, bool(meta.need_flush)

    def worker_meta(self, completed: dict[int, int]) -> Any:
        from vllm.v1.simple_kv_offload.metadata import (  # noqa: PLC0415
            SimpleCPUOffloadWorkerMetadata,
        )

        stores = {job: count for job, count in completed.items() if job >= 0}
        return SimpleCPUOffloadWorkerMetadata(completed_store_events=stores) if stores else None


PLAYED: dict[str, type[Any]] = {
    "OffloadingConnector": OffloadingPlay,
    "SimpleCPUOffloadConnector": SimpleCPUPlay,
    "ExampleConnector": NoWorkers,
    "NixlConnector": NixlPlay,
    "NixlPullConnector": NixlPlay,
    "NixlPushConnector": NixlPushPlay,
    "MooncakeConnector": MooncakePlay,
    "MooncakeStoreConnector": MooncakeStorePlay,
    "ExampleHiddenStatesConnector": HiddenStatesPlay,
}


def transfer_params_of(transfer: dict[str, Any]) -> Callable[..., Any] | None:
    """What gives each request of the workload its ``kv_transfer_params``, for the
    connector of ``transfer`` (a MultiConnector's: its first child's that has one):
    ``transfer_params(rng, rid, prompt_tokens, workers) -> (params, max_tokens)`` of the
    played workers (``None``: requests carry none)."""
    if transfer.get("kv_connector") == "MultiConnector":
        children = transfer.get("kv_connector_extra_config", {}).get("connectors") or []
        hooks = [transfer_params_of(c) for c in children if isinstance(c, dict)]
        return next((hook for hook in hooks if hook is not None), None)
    return getattr(PLAYED.get(str(transfer.get("kv_connector"))), "transfer_params", None)


def workers_class(connector: str) -> type[Any]:
    """How the worker side of the connector named ``connector`` (its ``kv_connector``)
    runs: played for the connectors in ``PLAYED``, LMCache's with its pacing
    (``kvlife.offload.watch.vllm.exercise_lmcache``), MultiConnector's with each child's
    as alone (``kvlife.offload.watch.vllm.exercise_multi``), else its own worker role."""
    if connector == "LMCacheMPConnector":
        from kvlife.offload.watch.vllm.exercise_lmcache import LMCacheWorkers  # noqa: PLC0415

        return LMCacheWorkers
    if connector == "LMCacheConnectorV1":
        from kvlife.offload.watch.vllm import exercise_lmcache_inprocess as inprocess  # noqa: PLC0415

        inprocess.settings()  # before LMCache reads its config, once per process
        return inprocess.LMCacheInProcessWorkers
    if connector == "MultiConnector":
        from kvlife.offload.watch.vllm.exercise_multi import MultiWorkers  # noqa: PLC0415

        return MultiWorkers
    return PLAYED.get(connector, RealWorkers)

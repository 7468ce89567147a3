"""vLLM's ``MultiConnector`` in ``kvlife vllm exercise``: its own worker role (vLLM's class,
which splits the scheduler's metadata between its children, joins their reports and
counts a request's stores over every child), each child's worker as the exercise runs that
child alone: played for the connectors the exercise plays (vLLM's ``OffloadingConnector``
and ``SimpleCPUOffloadConnector`` need a GPU worker), else the child's own worker role on
CPU KV caches.

What ``MultiConnector`` needs that other connectors do not, all of it here:

* a played child stands where MultiConnector keeps the child it built
  (``MultiConnector._connectors``, private in vLLM 0.33): a small object with a
  connector's worker calls, answering from the jobs the child's metadata orders;
* each child's reports are held back for the family's delay on their own (a played
  child's job that vLLM waits for in its own step, a flush or a synchronous load, is never
  held), so that one child's report can come before the other's, as two real workers'
  would; MultiConnector's joined output is then passed on in the step it was made.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from kvlife.offload.watch.vllm.exercise_workers import PLAYED, RealWorkers, _JobPlay

#: children ``MultiWorkers`` cannot run: their workers need pacing of their own
UNSUPPORTED_CHILDREN = ("LMCacheMPConnector", "LMCacheConnectorV1")


class _Clock:
    """The step the exercise is at and its delay, shared by one worker's children."""

    def __init__(self) -> None:
        self.n = 0
        self.delay: Callable[[], int] = lambda: 0


class _PlayedChild:
    """One worker's side of a played child: the connector calls MultiConnector's worker
    makes, answered from the jobs the child's metadata orders (each job done after the
    family's delay; a job vLLM waits for in its own step, done in that step)."""

    def __init__(self, play: _JobPlay, clock: _Clock) -> None:
        self.play = play
        self.clock = clock
        self.pending: list[tuple[int, int, list[str]]] = []  # due, job, rids
        self.done: dict[int, int] = {}  # jobs reported in this step

    # the calls MultiConnector's worker makes of a child
    def register_kv_caches(self, kv_caches: Any) -> None:
        return None

    def handle_preemptions(self, meta: Any) -> None:
        return None

    def bind_connector_metadata(self, meta: Any) -> None:
        clock = self.clock
        if getattr(meta, "need_flush", False):  # SimpleCPUOffload: vLLM preempted, all now
            self.pending = [(clock.n, job, rids) for _, job, rids in self.pending]
        for job, rids, now in self.play.orders(meta):
            self.pending.append((clock.n if now else clock.n + clock.delay(), job, rids))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
            KVConnectorTransferResults,
        )

        n = self.clock.n
        due = [p for p in self.pending if p[0] <= n]
        self.pending = [p for p in self.pending if p[0] > n]
        results = KVConnectorTransferResults()
        self.done = {}
        for _, job, rids in due:
            self.done[job] = self.done.get(job, 0) + 1
            results.finished_recving.update(rids)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def build_connector_worker_meta(self) -> Any:
        return self.play.worker_meta(self.done) if self.done else None

    def clear_connector_metadata(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def busy(self) -> bool:
        return bool(self.pending)


class _HeldChild:
    """A child's own worker, its reports held back for the family's delay: each step's
    transfer results, load errors and worker metadata come out together, when due."""

    def __init__(self, inner: Any, clock: _Clock) -> None:
        self.inner = inner
        self.clock = clock
        self.held: list[tuple[int, Any, set[int], Any]] = []  # due, results, errors, meta
        self.out: tuple[set[int], Any] = (set(), None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
            KVConnectorTransferResults,
        )

        inner, n = self.inner, self.clock.n
        results = inner.get_transfer_results(finished_req_ids)
        errors = set(inner.get_block_ids_with_load_errors() or ())
        meta = inner.build_connector_worker_meta()
        self.held.append((n + self.clock.delay(), results, errors, meta))
        due = [h for h in self.held if h[0] <= n]
        self.held = [h for h in self.held if h[0] > n]
        joined = KVConnectorTransferResults()
        all_errors: set[int] = set()
        joined_meta: Any = None
        for _, got, got_errors, got_meta in due:
            joined.finished_sending.update(got.finished_sending)
            joined.finished_recving.update(got.finished_recving)
            joined.failed_recving.update(got.failed_recving)
            all_errors |= got_errors
            if got_meta is not None:
                joined_meta = got_meta if joined_meta is None else joined_meta.aggregate(got_meta)
        self.out = (all_errors, joined_meta)
        return joined

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.out[0]

    def build_connector_worker_meta(self) -> Any:
        return self.out[1]

    def busy(self) -> bool:
        return bool(self.held)


class MultiWorkers(RealWorkers):
    """``MultiConnector``'s own worker role, one per worker, each child's worker played or
    its own (see the module's text)."""

    kind = "multi"

    @staticmethod
    def refused(transfer: dict[str, Any]) -> str | None:
        """Why the exercise cannot run the MultiConnector of ``transfer`` (``None``: it
        can): a child whose workers need pacing of their own, or no children."""
        children = transfer.get("kv_connector_extra_config", {}).get("connectors")
        if not isinstance(children, list) or not children:
            return "a MultiConnector's config needs kv_connector_extra_config.connectors"
        names = [c.get("kv_connector") if isinstance(c, dict) else None for c in children]
        paced = [str(name) for name in names if name in UNSUPPORTED_CHILDREN]
        if paced:
            return (
                f"kvlife vllm exercise runs {', '.join(paced)} alone only, not as a "
                "MultiConnector's child (its workers need pacing of their own)"
            )
        return None

    def __init__(self, scheduler: Any, workers: int) -> None:
        from kvlife.offload.watch.vllm.audit import wrapped_config  # noqa: PLC0415

        children = wrapped_config(scheduler.vllm_config)[1].kv_transfer_config
        self.names = [c["kv_connector"] for c in children.kv_connector_extra_config["connectors"]]
        self.clocks: list[_Clock] = []
        self.children: list[list[Any]] = []
        super().__init__(scheduler, workers)

    def build(self, make: Callable[[Any], Any], vllm_config: Any, rank: int) -> Any:
        multi = make(vllm_config)
        clock = _Clock()
        children = []
        for i, name in enumerate(self.names):
            play = PLAYED.get(name)
            if play is not None:
                child: Any = _PlayedChild(play(None, 1), clock)
            else:
                child = _HeldChild(multi._connectors[i], clock)
            multi._connectors[i] = child
            children.append(child)
        self.clocks.append(clock)
        self.children.append(children)
        return multi

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        for clock in self.clocks:
            clock.n, clock.delay = n, delay
        return super().step(out, n, lambda: 0)  # each child held its own reports

    def busy(self) -> bool:
        return super().busy() or any(c.busy() for cs in self.children for c in cs)


def multi_config(*children: dict[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_config`` of a ``MultiConnector`` of ``children`` (each a child's
    own config), in that order (the first that has a hit loads it)."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [copy.deepcopy(c) for c in children]},
    }


__all__ = ["UNSUPPORTED_CHILDREN", "MultiWorkers", "multi_config"]

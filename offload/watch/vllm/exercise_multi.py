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

import contextlib
import copy
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from kvlife.offload.watch.vllm.exercise_workers import (
    PLAYED,
    RealWorkers,
    Workers,
    _Held,
    output_of,
)

#: children ``MultiWorkers`` cannot run: their workers need pacing of their own
UNSUPPORTED_CHILDREN = ("LMCacheMPConnector", "LMCacheConnectorV1")


class _Clock:
    """The step the exercise is at and its delay, shared by one worker's children."""

    def __init__(self) -> None:
        self.n = 0
        self.delay: Callable[[], int] = lambda: 0


class _ChildReports:
    """A child's reports of the step, answered from one ``KVConnectorOutput`` (``None``:
    nothing to report) as MultiConnector's worker asks for them."""

    output: Any = None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
            KVConnectorTransferResults,
        )

        results = KVConnectorTransferResults()
        output = self.output
        if output is not None:
            results.finished_sending.update(output.finished_sending or ())
            results.finished_recving.update(output.finished_recving or ())
            results.failed_recving.update(getattr(output, "failed_recving", None) or ())
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.output.invalid_block_ids or ()) if self.output is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self.output.kv_connector_worker_meta if self.output is not None else None


class _PlayedChild(_ChildReports):
    """One worker's side of a played child: the play (``exercise_workers``) of one worker
    takes the child's metadata at each step and reports its jobs when due (a job vLLM waits
    for in its own step, in that step); the other worker calls do nothing."""

    def __init__(self, play: Workers, clock: _Clock) -> None:
        self.play = play
        self.clock = clock

    def bind_connector_metadata(self, meta: Any) -> None:
        step = SimpleNamespace(kv_connector_metadata=meta)  # what the play reads of a step
        self.output = self.play.step(step, self.clock.n, self.clock.delay)[0]

    def register_kv_caches(self, kv_caches: Any) -> None:
        return None

    def handle_preemptions(self, meta: Any) -> None:
        return None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def clear_connector_metadata(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def busy(self) -> bool:
        return bool(self.play.busy())


class _HeldChild(_ChildReports):
    """A child's own worker, its reports held back for the family's delay: each step's
    transfer results, load errors and worker metadata come out together, when due."""

    def __init__(self, inner: Any, clock: _Clock) -> None:
        self.inner = inner
        self.clock = clock
        self.held = _Held(1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        inner, n = self.inner, self.clock.n
        self.held.put(
            0,
            n + self.clock.delay(),
            output_of(inner, inner.get_transfer_results(finished_req_ids)),
        )
        self.output = self.held.due(n)[0]
        return super().get_transfer_results(finished_req_ids)

    def busy(self) -> bool:
        return self.held.busy()


class _Unbuilt:
    """Where MultiConnector's worker would build a played child's own worker (NIXL's
    needs the NIXL library, the offloading ones a GPU): nothing, replaced at once."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        return None


@contextlib.contextmanager
def _played_children_unbuilt() -> Iterator[None]:
    """While MultiConnector's worker is built, its played children are ``_Unbuilt``
    (vLLM's ``MultiConnector._get_connector_classes_and_configs``, patched on the class for
    the duration and put back)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: PLC0415
        MultiConnector,
    )

    original = MultiConnector.__dict__["_get_connector_classes_and_configs"]
    found = original.__func__

    def classes(cls: Any, vllm_config: Any) -> list[tuple[Any, Any]]:
        made = found(cls, vllm_config)
        return [
            (_Unbuilt if config.kv_transfer_config.kv_connector in PLAYED else klass, config)
            for klass, config in made
        ]

    MultiConnector._get_connector_classes_and_configs = classmethod(classes)
    try:
        yield
    finally:
        MultiConnector._get_connector_classes_and_configs = original


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
        with _played_children_unbuilt():
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

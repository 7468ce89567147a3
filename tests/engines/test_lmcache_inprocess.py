"""LMCache 0.5.6's in-process connector, ``LMCacheConnectorV1``, in ``kvlife vllm exercise``
(``kvlife.offload.watch.vllm.exercise_lmcache_inprocess``) and alone in vLLM 0.33.0's
bare ``Scheduler`` (CPU, ``make test-lmcache``).

What runs is LMCache's: its scheduler role inside vLLM's scheduler, its worker role with its
engine, its lookup server (the scheduler's lookups go there, over LMCache's ZMQ transport)
and its local CPU backend, which stores and retrieves chunks for real. Only the copy
between vLLM's KV tensors and LMCache's memory objects is LMCache's ``MockGPUConnector``
(LMCache has no CPU connector), so no test here compares bytes.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="runs in the LMCache environment: make test-lmcache")

from lmcache.v1.cache_engine import LMCacheEngine

from kvlife.offload.watch.vllm.exercise import (
    FamilyReport,
    RunResult,
    exercise,
    workers_class,
)
from kvlife.offload.watch.vllm.exercise_lmcache_inprocess import LMCacheInProcessWorkers
from tests.engines.vllm_harness import finished_then_again, make_scheduler, model_output

CONFIG: dict[str, Any] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
CLEAN = ("basic", "abort", "preempt", "hold", "prefix", "tp2")


class Seen:
    """What LMCache's engines did, counted where LMCache does it."""

    def __init__(self) -> None:
        #: lookups each worker rank's engine answered, and on which thread
        self.lookups: Counter[tuple[int, str]] = Counter()
        self.retrieved = 0  # tokens a retrieve brought back from the CPU backend
        self.stores = 0


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Seen:
    counts = Seen()
    lookup, retrieve, store = LMCacheEngine.lookup, LMCacheEngine.retrieve, LMCacheEngine.store

    def counted_lookup(self: LMCacheEngine, *args: Any, **kwargs: Any) -> Any:
        counts.lookups[(self.metadata.worker_id, threading.current_thread().name)] += 1
        return lookup(self, *args, **kwargs)

    def counted_retrieve(self: LMCacheEngine, *args: Any, **kwargs: Any) -> Any:
        mask = retrieve(self, *args, **kwargs)
        counts.retrieved += int(mask.sum().item())
        return mask

    def counted_store(self: LMCacheEngine, *args: Any, **kwargs: Any) -> Any:
        counts.stores += 1
        return store(self, *args, **kwargs)

    monkeypatch.setattr(LMCacheEngine, "lookup", counted_lookup)
    monkeypatch.setattr(LMCacheEngine, "retrieve", counted_retrieve)
    monkeypatch.setattr(LMCacheEngine, "store", counted_store)
    return counts


def _by_family(reports: list[FamilyReport]) -> dict[str, FamilyReport]:
    return {r.family: r for r in reports}


def test_the_exercise_picks_the_in_process_module_for_lmcaches_connector() -> None:
    assert workers_class("LMCacheConnectorV1") is LMCacheInProcessWorkers
    assert LMCacheInProcessWorkers.kv_cache_layout == "LBNHC"  # LMCache's NHD


def test_every_family_runs_lmcaches_real_worker_and_only_reused_ids_fail(
    seen: Seen, tmp_path: Path
) -> None:
    """Each family on LMCache's real scheduler and worker roles: the lookups are answered
    by the workers' lookup servers (each tp2 worker its own rank, its own server), chunks
    are stored to and retrieved from the CPU backend, and every family but ``reuse`` runs
    clean (no exception, every request drained, every block back, the log clean)."""
    reports, _ = exercise(CONFIG, [*CLEAN, "reuse"], range(3), 80, tmp_path, runners=["v1"])
    did = _by_family(reports)
    for family in CLEAN:
        assert did[family].failed == 0, did[family].lines()
    assert did["preempt"].preemptions > 0 and did["abort"].aborts > 0
    served = {rank for rank, thread in seen.lookups if thread == "lookup-server-thread"}
    assert served == {0, 1}  # rank 1 only in the tp2 family
    assert sum(seen.lookups.values()) == sum(
        n for (_, thread), n in seen.lookups.items() if thread == "lookup-server-thread"
    )  # never looked up on the scheduler's own thread (LMCache's bypass mode is off)
    assert seen.retrieved > 0 and seen.stores > 0
    reuse = did["reuse"]
    assert reuse.failed == reuse.runs
    for report in reports:
        print("\n".join(report.lines()))  # pytest -s: the figures the docs quote
    print(f"lookups by (rank, thread): {dict(seen.lookups)}; tokens retrieved {seen.retrieved}")


def test_a_reused_id_loses_its_state_and_lmcache_raises_named_on_that_id(tmp_path: Path) -> None:
    """The ``reuse`` family: a request that reuses the id of a request finished in the step
    before is allocated (LMCache keeps it under its id), then that id's clean-up drops it;
    at its next step LMCache raises ``ValueError`` naming it. The log names the same rid
    twice, ``inherited_state`` (its state gone while it runs) before ``connector_raised``."""
    (reuse,), runs = exercise(CONFIG, ["reuse"], range(3), 80, tmp_path, runners=["v1"])
    for run in runs:
        assert run.raised is not None and run.raised.startswith("ValueError: Request ")
        assert run.raised_at is not None and run.raised_at.endswith(" in build_connector_meta")
        named = run.raised.split()[2]  # "ValueError: Request reuse0-p1 is not in ..."
        assert run.verdicts["connector_raised"] == [named], run.describe()
        assert named in run.verdicts["inherited_state"], run.describe()
    (where,) = reuse.raises
    assert where.startswith("ValueError at lmcache/integration/vllm/vllm_v1_adapter.py:")


def test_a_run_leaves_none_of_lmcaches_socket_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every ``ipc://`` socket LMCache's servers bind makes a file (under vLLM's
    ``VLLM_RPC_BASE_PATH``) that libzmq leaves when the socket closes: the exercise removes
    those its run made (two a worker: the lookup and the offload server), and no other."""
    import zmq  # noqa: PLC0415

    bound: list[str] = []
    bind = zmq.Socket.bind

    def recorded(self: zmq.Socket[Any], addr: str) -> Any:
        result = bind(self, addr)
        endpoint = self.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint.startswith("ipc://"):
            bound.append(endpoint.removeprefix("ipc://"))
        return result

    monkeypatch.setattr(zmq.Socket, "bind", recorded)
    bystander = tmp_path / "engine_other_service_lookup_lmcache_rpc_port_0"
    bystander.touch()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    exercise(CONFIG, ["basic", "tp2"], range(1), 20, tmp_path / "log", runners=["v1"])
    assert len(bound) == 2 * 3  # basic: one worker; tp2: two
    assert all(Path(path).parent == tmp_path for path in bound)
    assert [path for path in bound if Path(path).exists()] == []
    assert bystander.exists()


def _outcome(run: RunResult) -> tuple[Any, ...]:
    return (run.raised, run.raised_at, run.undrained, run.leaked_blocks, run.verdicts, run.steps)


def test_a_seed_replays_the_same_run(tmp_path: Path) -> None:
    """Same seeds, same results: LMCache's lookups are synchronous and its loads run in
    the step that carries them, so nothing depends on how fast its threads answered."""
    families = ["reuse", "prefix", "tp2"]
    first = exercise(CONFIG, families, range(2), 60, tmp_path / "a", runners=["v1"])
    second = exercise(CONFIG, families, range(2), 60, tmp_path / "a", runners=["v1"])
    assert [r.lines() for r in first[0]] == [r.lines() for r in second[0]]
    assert [_outcome(r) for r in first[1]] == [_outcome(r) for r in second[1]]
    assert [(r.lifecycles, r.aborts, r.preemptions) for r in first[1]] == [
        (r.lifecycles, r.aborts, r.preemptions) for r in second[1]
    ]


def test_lmcache_alone_raises_when_an_id_comes_again_right_after_its_request_finished() -> None:
    """The reproduction in ``docs/exercise-report.md``, without kvlife: vLLM 0.33.0's bare
    ``Scheduler`` with ``LMCacheConnectorV1``'s scheduler role. Request ``x`` finishes; the
    next step admits a new ``x`` (``update_state_after_alloc`` keeps it in
    ``_unfinished_requests``), then ``build_connector_meta`` drops ``x`` for the finished
    one; the step after raises. (No worker runs: each lookup waits out LMCache's timeout
    and answers 0 tokens, which changes nothing here.)"""
    scheduler = make_scheduler("LMCacheConnectorV1", None, {}, layout="LBNHC")
    impl = scheduler.connector._lmcache_engine
    try:
        finished_then_again(scheduler, "x")
        out = scheduler.schedule()  # the new x is allocated, then dropped with the old x
        assert "x" not in impl._unfinished_requests
        scheduler.update_from_output(out, model_output(out))
        with pytest.raises(ValueError, match="Request x is not in _unfinished_requests"):
            scheduler.schedule()
    finally:
        for sent in impl._manager.lookup_client.transport.sockets:
            sent.close(linger=0)

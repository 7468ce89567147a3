"""vLLM's ``MooncakeStoreConnector`` in ``kvlife vllm exercise``
(``kvlife.offload.watch.vllm.exercise_mooncake_store``) and its lens
(``kvlife.offload.watch.vllm.lenses.mooncake_store``), in vLLM's environments (``make
test-vllm``, ``make test-vllm-cpu``): its real scheduler side asking the played rank 0's
lookup server over ZMQ, stores and loads played; and the failure the exercise finds,
reproduced on vLLM's bare ``Scheduler`` without kvlife."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="runs in the vLLM environment: make test-vllm")

from kvlife.offload.watch.vllm.exercise import FAMILIES, exercise, run_one
from kvlife.offload.watch.vllm.exercise_mooncake_store import MooncakeStorePlay
from tests.engines.vllm_harness import (
    copies_started,
    exercised_clean,
    finished_then_again,
    make_scheduler,
    run_with_step,
)

STORE = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
STEPS = 80


def test_stores_and_loads_pass_every_family_with_fresh_ids(tmp_path: Path) -> None:
    """Stores through the lens (store jobs, their pinned blocks freed when every worker
    reported them), loads of what the played store holds, found by lookups over ZMQ;
    clean in every family with fresh ids, under both runners."""
    families = [f for f in FAMILIES if f != "reuse"]
    _, run = exercised_clean(STORE, families, tmp_path, kept="tp2", steps=STEPS)
    kinds = copies_started(run.log)
    assert kinds["store"] > 0 and kinds["load"] > 0, kinds


def test_reuse_fails_with_vllms_assertion_and_names_the_request(tmp_path: Path) -> None:
    reports, _ = exercise(STORE, ["reuse"], range(2), STEPS, tmp_path)
    for report in reports:
        assert report.failed == report.runs, report.lines()
        assert any(
            where.startswith("AssertionError at vllm/")
            and "mooncake/store/scheduler.py" in where
            and where.endswith("in build_connector_meta")
            for where in report.raises
        ), report.raises
        assert "connector_raised" in report.verdicts


def test_the_lookup_server_and_client_are_released_at_the_runs_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The played lookup server answered (loads came of it); after the run its thread is
    gone, its IPC path's file removed, and the scheduler role's lookup client closed."""
    made: list[MooncakeStorePlay] = []
    build = MooncakeStorePlay.__init__

    def keep(self: MooncakeStorePlay, scheduler: Any, workers: int) -> None:
        build(self, scheduler, workers)
        made.append(self)

    monkeypatch.setattr(MooncakeStorePlay, "__init__", keep)
    run = run_one(STORE, FAMILIES["basic"], 0, STEPS, tmp_path)
    assert not run.failed, run.describe()
    (play,) = made
    assert play.lookups > 0 and copies_started(run.log)["load"] > 0
    assert not play.server.is_alive() and play.socket.closed
    assert not os.path.exists(play.path)
    assert "kvlife-mooncake-lookup" not in {t.name for t in threading.enumerate()}


def test_a_worker_that_never_reports_its_stores_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lens sees the store jobs: when no worker reports them, the connector keeps
    their blocks pinned for ever (vLLM runs out of blocks: its requests never drain, or
    the blocks leak) and the stores stay open (unreported)."""

    def forgets_stores(play: MooncakeStorePlay) -> None:
        play.stores.clear()

    run = run_with_step(monkeypatch, MooncakeStorePlay, STORE, tmp_path, after=forgets_stores)
    assert run.undrained or run.leaked_blocks, run.describe()
    assert "unreported" in run.verdicts, run.describe()


def test_mooncake_store_alone_fails_when_an_id_comes_again_right_after_its_request_finished() -> (
    None
):
    """The reproduction in ``docs/exercise.md``, without kvlife: vLLM's bare ``Scheduler``
    with ``MooncakeStoreConnector``'s scheduler role (lookups off: no lookup server is
    needed). Request ``x`` finishes; the next step allocates a new ``x``
    (``update_state_after_alloc`` keeps it in ``_unfinished_requests``), then
    ``build_connector_meta`` drops ``x`` for the finished one and asserts that the new
    one is there."""
    scheduler = make_scheduler("MooncakeStoreConnector", None, {"enable_lookup": False})
    inner = scheduler.connector.connector_scheduler
    try:
        finished_then_again(scheduler, "x")
        with pytest.raises(AssertionError):
            scheduler.schedule()
        assert "x" not in inner._unfinished_requests  # the new x's state, dropped
    finally:
        inner.client.close()
        inner.client.ctx.term()

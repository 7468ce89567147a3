"""vLLM's ``ExampleHiddenStatesConnector`` in ``kvlife vllm exercise``
(``kvlife.offload.watch.vllm.exercise_hidden_states``), in vLLM's environments (``make
test-vllm``, ``make test-vllm-cpu``): its real scheduler side in a scheduler built with
the ``extract_hidden_states`` speculative config it requires, rank 0's copies played."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="runs in the vLLM environment: make test-vllm")

from kvlife.offload.watch.vllm.exercise import (
    FAMILIES,
    ExerciseConfigError,
    build_scheduler,
    shut_down,
)
from kvlife.offload.watch.vllm.exercise_hidden_states import SPECULATIVE, HiddenStatesPlay
from kvlife.offload.watch.vllm.exercise_workers import workers_class
from tests.engines.vllm_harness import copies_started, exercised_clean, run_with_step

STEPS = 80


def _hidden(tmp_path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "hidden")},
    }


def test_the_connector_builds_only_with_its_speculative_config(tmp_path: Path) -> None:
    hidden = _hidden(tmp_path)
    assert workers_class("ExampleHiddenStatesConnector") is HiddenStatesPlay
    with pytest.raises(ExerciseConfigError, match="extract_hidden_states"):
        build_scheduler(hidden, tmp_path / "bare.jsonl")
    scheduler = build_scheduler(hidden, tmp_path / "built.jsonl", speculative=SPECULATIVE)
    try:
        assert scheduler.vllm_config.speculative_config.method == "extract_hidden_states"
        assert scheduler.connector.wrapped.get_finished_count() == 1  # rank 0 copies
    finally:
        assert shut_down(scheduler) is None


def test_delayed_frees_pass_every_family(tmp_path: Path) -> None:
    """Every scheduled request's free waits for rank 0's copy; a request aborted before
    it was scheduled has nothing to copy (vLLM #56841: its ``request_finished`` once
    raised ``KeyError``), under both runners, two workers included."""
    reports, run = exercised_clean(_hidden(tmp_path), FAMILIES, tmp_path, kept="tp2", steps=STEPS)
    abort = next(r for r in reports if r.family == "abort")
    assert abort.aborts > 0 and abort.copies < abort.lifecycles
    assert set(copies_started(run.log)) == {"delayed_free"}


def test_a_rank_0_that_never_copies_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    def never_copies(play: HiddenStatesPlay, out: Any) -> None:
        out.kv_connector_metadata.pending_saves = []

    run = run_with_step(
        monkeypatch, HiddenStatesPlay, _hidden(tmp_path), tmp_path, before=never_copies
    )
    assert run.undrained and "unreported" in run.verdicts, run.describe()

"""``kvlife sglang exercise`` on SGLang 0.5.23's real hierarchical cache (CPU build, both
tree cores): every family clean and reproducible, and each check failing a run when the
cache is made to lose an ack, ack twice or keep host pages.

Runs in ``.venv-sglang`` (``make sglang-venv``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs SGLang 0.5.23 (make sglang-venv)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from tests.engines import hicache_harness as H  # noqa: F401  (the torchvision stand-in)

from kvlife.offload.watch.sglang.cpu import CpuCache
from kvlife.offload.watch.sglang.exercise import (
    FAMILIES,
    ExerciseError,
    RunResult,
    exercise,
    main,
    run_one,
)

ROOT = Path(__file__).resolve().parents[2]


def same(run: RunResult) -> dict[str, Any]:
    """A run's results without where its log went."""
    return {k: v for k, v in dataclasses.asdict(run).items() if k != "log"}


def test_every_family_runs_clean_on_sglang_0_5_23_and_reproducibly(tmp_path: Path) -> None:
    reports, runs = exercise(list(FAMILIES), ["python", "rust"], range(2), 80, tmp_path / "a")
    bad = [line for r in reports if r.failed for line in r.lines()]
    assert not bad, "\n".join(bad)
    assert len(reports) == len(FAMILIES) * 2 and all(r.runs == 2 for r in reports)
    by = {(r.family, r.core): r for r in reports}
    # each family did what it is for
    assert sum(r.aborts for r in reports if r.family == "abort") > 10
    assert sum(r.splits for r in reports if r.family == "prefix") > 0
    assert by["write_back", "rust"].copies.get("write_back", 0) > 0
    assert by["basic", "python"].copies.get("load_back", 0) > 0
    storage = by["storage", "rust"]  # backups to L3, prefetches back, aborts mid-prefetch
    assert storage.copies.get("storage_backup", 0) > 0 and storage.prefetched > 0
    assert storage.prefetches > 0 and storage.aborts > 0
    assert not list((tmp_path / "a").glob("*.jsonl"))  # a clean run's log is removed
    _, again = exercise(list(FAMILIES), ["python", "rust"], range(2), 80, tmp_path / "b")
    assert [same(r) for r in again] == [same(r) for r in runs]


def _lose_load_acks(hc: CpuCache) -> None:
    """Every load ack from the third on never arrives (taken off as the poll starts)."""
    cc = hc.cache.cache_controller
    original = hc.cache.check_hicache_events
    seen = [0]

    def poll() -> None:
        kept = []
        for ack in cc.ack_load_queue:
            seen[0] += 1
            if seen[0] <= 2:
                kept.append(ack)
        cc.ack_load_queue[:] = kept
        original()

    hc.cache.check_hicache_events = poll


def test_a_lost_ack_fails_the_run_with_its_node_seed_and_why_command(tmp_path: Path) -> None:
    run = run_one(FAMILIES["basic"], "python", 3, 80, tmp_path, tamper=_lose_load_acks)
    assert run.failed and run.undrained and run.locked > 0
    assert "unreported" in run.verdicts
    node = run.verdicts["unreported"][0]
    assert node in {f"node{n}" for n in run.undrained}
    reports, _ = exercise(["basic"], ["python"], [3], 80, tmp_path, tamper=_lose_load_acks)
    text = "\n".join(reports[0].lines())
    assert "never acked in 1 run(s), first seed 3: nodes" in text
    assert f"verdict unreported in 1 run(s), first seed 3: {node}: kvlife audit why " in text
    log = tmp_path / "basic-python-3.jsonl"
    assert f"--rid {node}" in text and log.exists()  # a failing run's log stays


def _ack_writes_twice(hc: CpuCache) -> None:
    """The fifth write ack is delivered twice."""
    cc = hc.cache.cache_controller
    original = cc.start_writing
    calls = [0]

    def start_writing() -> None:
        before = len(cc.ack_write_queue)
        original()
        if len(cc.ack_write_queue) > before:
            calls[0] += 1
            if calls[0] == 5:
                cc.ack_write_queue.append(cc.ack_write_queue[-1])

    cc.start_writing = start_writing


def test_a_duplicate_ack_fails_the_run_with_the_exception_and_its_frame(tmp_path: Path) -> None:
    run = run_one(FAMILIES["basic"], "rust", 0, 80, tmp_path, tamper=_ack_writes_twice)
    assert run.raised.startswith("KeyError: ") and "in " in run.raised_at
    assert {"stray_report", "connector_raised"} <= set(run.verdicts)


def _keep_host_pages(hc: CpuCache) -> None:
    """The host pool's first free returns nothing to the pool (the lens saw it freed)."""
    pool = hc.host_pool()
    original = pool.free
    calls = [0]

    def free(indices: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return len(indices)
        return original(indices, *args, **kwargs)

    pool.free = free


def test_host_pages_never_given_back_are_a_leak(tmp_path: Path) -> None:
    run = run_one(FAMILIES["pressure"], "python", 1, 80, tmp_path, tamper=_keep_host_pages)
    assert run.failed and run.leaked_host > 0 and run.leaked_device == 0, run


def test_unknown_families_and_cores_are_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ExerciseError, match="families are basic"):
        exercise(["nope"], ["python"], [0], 10, tmp_path / "x")
    with pytest.raises(ExerciseError, match="cores python, rust"):
        exercise(["basic"], ["cpp"], [0], 10, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert main(["--seeds", "0"]) == 2


def _kvlife(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests/engines/standins")]))
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "kvlife.diagrams.cli", *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_command_prints_a_table_per_family_and_writes_no_redraws_into_a_file(
    tmp_path: Path,
) -> None:
    done = _kvlife(
        "sglang", "exercise", "--families", "basic,hold", "--cores", "rust", "--seeds", "2",
        "--steps", "30", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "basic (rust core): 2 runs, 0 failed" in done.stdout
    assert "hold (rust core): 2 runs, 0 failed" in done.stdout
    assert "\r" not in done.stderr and "basic (rust): 2 runs" in done.stderr
    as_json = _kvlife(
        "sglang", "exercise", "--families", "abort", "--cores", "python", "--seeds", "1",
        "--steps", "20", "--out", str(tmp_path), "--json",
    )  # fmt: skip
    body = json.loads(as_json.stdout)
    assert body["families"][0]["family"] == "abort" and body["runs"][0]["failed"] is False
    bad = _kvlife("sglang", "exercise", "--families", "nope")
    assert bad.returncode == 2 and "unknown ['nope']" in bad.stderr

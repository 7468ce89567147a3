"""The core benchmark runs end to end and prints every row (figures are not asserted:
timing belongs in the benchmark's output, not in tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlife.fsm import LifecycleRegistry, MemorySink
from kvlife.fsm.bench import (
    RECORDS,
    RidKeyedBookkeeping,
    Row,
    _limits_lines,
    _requests,
    main,
    measure_limits,
    measure_memory,
    run_kvlife_batched,
    run_rid_keyed,
)


def test_bench_prints_every_setup(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rounds", "1", "--batch", "20", "--memory-live", "500"]) == 0
    out = capsys.readouterr().out
    for name in (
        "rid-keyed dicts (baseline)",
        "kvlife, no audit",
        "kvlife + memory ring",
        "kvlife + disabled LoggingSink",
        "a disabled LoggingSink costs",
        "kvlife + JSON lines (fsync never)",
        "kvlife + Prometheus metrics",
        "Prometheus metrics cost",
        "transitions static machine",
        "transitions Machine per request",
        "bytes per live lifecycle",
        "owner-thread check",
        "one audit record costs at least",
        "kvlife + memory ring: the target leaves",
        "costs that must not grow",
        "<= 0.50",
        "noise: how much a ratio moved",
        "batched, no audit",
        "batched + memory ring",
        "batched + JSON lines (fsync never)",
        "batched + memory ring: the target leaves",
        "an audit record's floor on its way to a JSON-lines file",
        "encode, 256 a call",
        "write, 256 a write",
    ):
        assert name in out


def test_bench_runs_another_tree_beside_this_one(capsys: pytest.CaptureFixture[str]) -> None:
    """--against: this source tree loaded a second time as the "before" tree."""
    root = Path(__file__).resolve().parents[1]
    argv = ["--rounds", "1", "--batch", "20", "--memory-live", "500", "--against", str(root)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "before: kvlife + memory ring" in out
    assert re.search(r"kvlife, no audit: before [\d.]+ us .* now / before [\d.]+", out), out


def test_bench_refuses_a_directory_that_is_no_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--rounds", "1", "--against", str(tmp_path)])
    assert info.value.code == 2
    assert "not a kvlife source tree" in capsys.readouterr().err


def test_the_batched_run_leaves_nothing_live() -> None:
    registry = LifecycleRegistry(sinks=[MemorySink()])
    run_kvlife_batched(registry, _requests(100))
    stats = registry.statistics()
    assert len(registry) == 0 and stats.released == 100
    assert stats.records == 100 * RECORDS


def test_a_missed_target_fails_the_run_only_with_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvlife.fsm import bench  # noqa: PLC0415

    argv = ["--rounds", "4", "--batch", "20", "--memory-live", "500"]
    monkeypatch.setattr(bench, "RATIO_TARGETS", {"kvlife, no audit": 0.0})  # always missed
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "MISSED" in out and "Missed targets fail only with --check" in out
    assert re.search(r"kvlife, no audit .* ±\d+%", out), out
    assert main([*argv, "--check"]) == 1


def test_rid_keyed_baseline_does_the_same_bookkeeping() -> None:
    book = RidKeyedBookkeeping()
    run_rid_keyed(book, _requests(10))
    assert len(book.state) == 0 and book.ongoing == {} and book.next_ack == 40


def test_memory_is_measured_per_live_lifecycle() -> None:
    figures = measure_memory(live=500)
    assert all(50 < value < 5000 for value in figures.values()), figures


def test_bad_arguments_exit_2() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--rounds", "0"])
    assert info.value.code == 2


def test_limits_are_measured_net_of_the_loop() -> None:
    limits = measure_limits(rounds=3, n=20_000)
    assert set(limits) == {
        "owner check",
        "ticket object",
        "lifecycle object",
        "birth clock",
        "**detail",
        "emit call",
        "clock read",
        "record build",
        "ring append",
    }
    assert all(0 <= value < 10_000 for value in limits.values()), limits
    assert limits["clock read"] > 0 and limits["record build"] > 0, limits
    assert limits["ticket object"] > 0 and limits["lifecycle object"] > 0, limits


def test_limits_lines_do_the_arithmetic() -> None:
    rows = [
        Row("rid-keyed dicts (baseline)", 10.0, 1.0),
        Row("kvlife, no audit", 6.0, 0.6),
        Row("kvlife + memory ring", 9.0, 0.9),
    ]
    limits = {
        "owner check": 50.0,
        "ticket object": 100.0,
        "lifecycle object": 200.0,
        "birth clock": 40.0,
        "**detail": 20.0,
        "emit call": 50.0,
        "clock read": 60.0,
        "record build": 80.0,
        "ring append": 10.0,
    }
    text = "\n".join(_limits_lines(rows, rows[1], limits))
    assert "owner check 50 ns x 10 = 0.50 us" in text
    assert "ticket object 100 ns x 4 = 0.40 us" in text
    # 0.50 + 0.40 + 0.20 + 0.04 + 0.18 = 1.32 us, 22% of 6.0; (6.0 - 1.32) / 10 = 0.47
    assert "together 1.32 us (22% of kvlife, no audit)" in text and ": 0.47 x rid-keyed" in text
    # 50 x 10 + 20 x 9 = 680 ns = 0.68 us, 11% of 6.0; (6.0 - 0.68) / 10 = 0.53
    assert "are 0.68 us (11% of kvlife, no audit; without both: 0.53" in text
    assert "= 200 ns" in text  # 50 + 60 + 80 + 10
    # 0.80 x 10 us - 6 us = 2 us over RECORDS records; spent (9 - 6) us over RECORDS
    budget, spent = 2000 / RECORDS, 3000 / RECORDS
    assert f"leaves {budget:.0f} ns per record over kvlife, no audit; spent {spent:.0f} ns" in text

"""The core benchmark runs end to end and prints every row (figures are not asserted:
timing belongs in the benchmark's output, not in tests)."""

from __future__ import annotations

import pytest

from kvlife.fsm.bench import SeedBookkeeping, _requests, main, measure_memory, run_seed


def test_bench_prints_every_setup(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rounds", "1", "--batch", "20", "--memory-live", "500"]) == 0
    out = capsys.readouterr().out
    for name in (
        "seed-style dicts (baseline)",
        "kvlife, no audit",
        "kvlife + memory ring",
        "kvlife + disabled LoggingSink",
        "a disabled LoggingSink costs",
        "kvlife + JSON lines (fsync never)",
        "transitions static machine",
        "transitions Machine per request",
        "bytes per live lifecycle",
        "owner-thread check",
        "costs that must not grow",
        "<= 0.50",
    ):
        assert name in out


def test_seed_baseline_does_the_same_bookkeeping() -> None:
    book = SeedBookkeeping()
    run_seed(book, _requests(10))
    assert len(book.state) == 0 and book.ongoing == {} and book.next_ack == 40


def test_memory_is_measured_per_live_lifecycle() -> None:
    figures = measure_memory(live=500)
    assert all(50 < value < 5000 for value in figures.values()), figures


def test_bad_arguments_exit_2() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--rounds", "0"])
    assert info.value.code == 2

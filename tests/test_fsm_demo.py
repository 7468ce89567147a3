"""The race demo (``make demo`` until the full workload lands) runs for real and checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.fsm import LifecycleRegistry, MemorySink, check_audit, read_audit
from kvlife.fsm.demo import format_trail, main, play_race


def test_race_releases_only_the_old_lifecycle() -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    said = play_race(registry)
    assert "stale_instance" in said[4]
    assert len(registry) == 0
    records = sink.records()
    assert [(r.serial, r.trigger, r.ok) for r in records if r.trigger == "ack"] == [
        (0, "ack", True),
        (0, "ack", False),
        (1, "ack", True),
    ]
    assert check_audit(records, expect_released=True).ok
    assert "(refused)" in format_trail(records)


def test_main_writes_a_clean_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 violations" in out and "stale_instance" in out
    log = read_audit(tmp_path / "race-audit.jsonl")
    assert len(log.records) == 9 and not log.problems

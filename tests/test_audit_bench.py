"""The audit-check benchmark runs end to end on small logs (figures are printed by the
benchmark, not asserted here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.diagrams.audit_bench import main, run_measured, write_workload
from kvlife.fsm import check_audit, read_audit


def test_the_generated_workload_is_a_clean_log_with_rid_reuse(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    written = write_workload(path, 3000)
    log = read_audit(path)
    assert len(log.records) == written >= 3000
    report = check_audit(log, expect_released=True)
    assert (
        report.ok
        and report.reused_while_unreleased > 0
        and report.refusals.get("stale_instance", 0) > 0
    )


def test_bench_prints_a_row_per_setup_and_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--records", "500,1500", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("json.loads floor") == 2 and out.count("kvlife audit check") == 2
    assert (tmp_path / "audit-500.jsonl").exists()  # kept for the next run


def test_a_measured_run_reports_its_own_peak_memory(tmp_path: Path) -> None:
    log = tmp_path / "w.jsonl"
    write_workload(log, 100)
    seconds, small, status = run_measured("import sys", log)
    _, big, _ = run_measured(
        "import sys\nx = bytearray(200 << 20)\nx[::4096] = b'1' * len(x[::4096])", log
    )
    assert status == 0 and seconds > 0 and big - small > 150


def test_bad_sizes_are_usage_errors() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--records", "a,b"])
    assert info.value.code == 2


def test_the_help_reads_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "kvlife found in DIR" not in out
    assert "--old-tree DIR" in out and "another kvlife unpacked in DIR" in " ".join(out.split())

"""The demo workload: real tensors, rid reuse, aborts, held-back completions; deterministic."""

from __future__ import annotations

import sys

import pytest

from kvlife.fsm import AuditRecord, MemorySink, check_audit
from kvlife.offload.demo import DemoConfig, DemoSummary, run_workload, text_progress


def _run(seed: int, **overrides: int) -> tuple[DemoSummary, list[AuditRecord]]:
    sink = MemorySink(capacity=1 << 20)
    summary = run_workload(DemoConfig(requests=60, seed=seed, **overrides), sinks=[sink])
    return summary, sink.records()


def test_workload_releases_everything_and_its_log_checks() -> None:
    summary, records = _run(1)
    assert summary.lifecycles == 60 and summary.released == 60 and summary.live_at_end == 0
    assert summary.finished + summary.aborted == 60
    assert summary.bytes_offloaded > 0 and summary.audit_records == len(records)
    assert check_audit(records, expect_released=True).ok


def test_same_seed_same_run() -> None:
    (a, ra), (b, rb) = _run(5), _run(5)
    strip = lambda rs: [r.replace(t_ns=0) for r in rs]  # noqa: E731
    assert strip(ra) == strip(rb)
    assert a.table().splitlines()[:10] == b.table().splitlines()[:10]


def test_host_memory_pressure_is_reported_not_fatal() -> None:
    summary, records = _run(2, host_pages=12)
    assert summary.skipped_no_host_memory > 0
    assert check_audit(records, expect_released=True).ok


def test_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    show = text_progress(sys.stdout)
    for done in range(0, 101, 5):
        show(done, 100)
    out = capsys.readouterr().out
    assert "100% 100/100" in out and out.count("\n") == 5


def test_the_summary_explains_its_refusals_and_names_reused_rids() -> None:
    sink = MemorySink(capacity=1 << 20)
    summary = run_workload(DemoConfig(requests=120, seed=0), sinks=[sink])
    records = sink.records()
    report = check_audit(records, expect_released=True)
    refused = sum(summary.refusals.values())
    assert refused == summary.redelivered == sum(report.refusals.values()) > 0
    assert 0 < len(summary.reused_rids) <= 5
    text = summary.explanation("out/audit.jsonl", "out")
    assert f"All {refused} refusals come from completions the demo delivers again" in text
    assert f"kvlife audit why out/audit.jsonl --rid {summary.reused_rids[0]}" in text
    # each rid named was registered while a lifecycle of it still had a copy in flight
    for rid in summary.reused_rids:
        assert any(u.rid == rid for u in report.reuses)

"""The streaming checker: released instances forgotten but still guarded, partial logs,
lost ranges versus gaps, segments, table digests, bounded violation lists."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args

import pytest

from kvlife.fsm import LIFECYCLE, JsonLinesSink, LifecycleRegistry, MemorySink, Trigger
from kvlife.fsm.audit import (
    MAX_VIOLATIONS,
    AuditChecker,
    AuditRecord,
    AuditReport,
    AuditTableMismatchError,
    LostRecords,
    Segment,
    Verdict,
    ViolationKind,
    check_audit,
    ending_lines,
    make_header,
    read_audit,
)
from kvlife.fsm.audit.checker import pid_alive
from kvlife.fsm.audit.records import make_closing
from tests.strategies import Req
from tests.violations import EDITS, UNRECORDED, clean_log, edited_log


def _records(n: int = 3) -> list[AuditRecord]:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    for i in range(n):
        req = Req(f"r{i}")
        ticket = registry.start_offload(registry.register(req))
        registry.finish(req)
        registry.complete(ticket)
    return sink.records()


def _renumber(records: list[AuditRecord]) -> list[AuditRecord]:
    return [r.replace(seq=i) for i, r in enumerate(records)]


def test_a_transition_accepted_after_release_is_a_violation() -> None:
    records = _records(1)
    ack = records[-1]
    records.append(ack.replace(seq=ack.seq + 1, op=99, src="released", dst="released"))
    kinds = [v.kind for v in check_audit(records).violations]
    assert kinds == ["after_release"]


def test_a_refusal_on_a_released_instance_must_say_released() -> None:
    records = _records(1)
    last = records[-1]
    stale = AuditRecord(
        last.seq + 1, 0, "r0", 0, "ack", "offloading", None, False, "stale_instance", 0, 0, {}
    )
    assert [v.kind for v in check_audit([*records, stale]).violations] == ["state_mismatch"]
    fine = stale.replace(src="released")
    assert check_audit([*records, fine]).ok


def test_an_instance_never_registered_in_a_complete_log_is_a_violation() -> None:
    records = _records(1)
    forged = records[1].replace(seq=len(records), serial=7, op=7)
    assert [v.kind for v in check_audit([*records, forged]).violations] == ["unknown_instance"]


def test_a_log_that_starts_mid_way_takes_instances_as_it_finds_them() -> None:
    ring = MemorySink(capacity=5)
    registry = LifecycleRegistry(sinks=[ring])
    reqs = [Req(f"r{i}") for i in range(3)]
    tickets = [registry.start_offload(registry.register(r)) for r in reqs]
    for req, ticket in zip(reqs, tickets, strict=True):
        registry.finish(req)
        registry.complete(ticket)
    report = check_audit(ring.records(), expect_released=True)
    assert report.ok, report.violations
    assert report.records == 5 and report.released == 3


def test_lost_records_are_not_a_gap_and_excuse_what_they_may_hold() -> None:
    records = _records(3)  # 12 records: r0 0-3, r1 4-7, r2 8-11
    lost = LostRecords(3, 5, 7, "OSError: full")  # r1's start, finish and ack are gone
    kept = [*records[:5], lost, *records[8:]]
    report = check_audit(kept, expect_released=True)
    assert report.ok, report.violations
    assert report.lost_records == 3 and report.lost == [lost]
    assert [(i.rid, i.uncertain) for i in report.live] == [("r1", True)]


def test_each_segment_is_its_own_serial_space() -> None:
    first, second = _records(2), _records(1)
    header = make_header()
    events = [Segment(0, header, ""), *first, Segment(1, header, ""), *second]
    report = check_audit(events, expect_released=True, keep_instances=True)
    assert report.ok and report.segments == 2 and report.lifecycles == 3
    assert sorted(report.instances) == [(0, 0), (0, 1), (1, 0)]
    # the same records as one segment: serial 0 registered twice
    assert "serial_reused" in {v.kind for v in check_audit([*first, *second]).violations}


def test_another_table_is_refused_unless_accepted() -> None:
    header = make_header().__class__(**{**_fields(make_header()), "table": "feedfacefeedface"})
    events = [Segment(0, header, "x.jsonl"), *_records(1)]
    with pytest.raises(AuditTableMismatchError, match="--accept-table feedfacefeedface") as info:
        check_audit(events)
    assert info.value.digest == "feedfacefeedface" and LIFECYCLE.digest in str(info.value)
    assert check_audit(events, accept_tables=["feedfacefeedface"]).ok


def _fields(header: object) -> dict[str, object]:
    return {name: getattr(header, name) for name in header.__struct_fields__}  # type: ignore[attr-defined]


def test_violations_are_counted_all_but_kept_up_to_a_bound() -> None:
    records = _records(1)
    flood = [records[0].replace(seq=i * 2) for i in range(MAX_VIOLATIONS + 50)]
    report = check_audit(flood)
    assert report.violation_count > MAX_VIOLATIONS == len(report.violations)


def test_feeding_something_else_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not an audit event"):
        AuditChecker().feed("register")  # type: ignore[arg-type]


def test_stats_fields_count_rid_reuse_and_the_busiest_moment() -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    old, new = Req("a"), Req("a")
    ticket = registry.start_offload(registry.register(old))
    registry.finish(old)
    registry.register(new)  # rid reused while the old copy is in flight
    registry.complete(ticket)
    report = check_audit(sink.records())
    assert report.reused_while_unreleased == 1 and report.max_live == 2 and len(report.live) == 1


def _watched(witness: str) -> tuple[LifecycleRegistry, MemorySink, list[object]]:
    """A registry of a watcher: one delayed free reported, one still open."""
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    reported, still_open = Req("done"), Req("open")
    for req in (reported, still_open):
        registry.register(req)
    ticket = registry.start_offload(reported, kind="delayed_free")
    registry.finish(reported)
    registry.complete(ticket)
    registry.start_offload(still_open, kind="delayed_free")
    registry.finish(still_open)
    return registry, sink, [Segment(0, make_header(witness=witness), "")]


def test_a_protocol_verdict_in_the_log_is_a_violation_naming_the_rid() -> None:
    registry, sink, events = _watched("OffloadingConnector")
    released = registry.lifecycles()[0]  # "open"; "done" was released
    registry.record_violation(
        "stray_report", Trigger.ACK, "again", rid="done", report="finished_sending"
    )
    registry.record_violation(
        "connector_raised", Trigger.FINISH, "boom", lifecycle=released, error="KeyError: 'x'"
    )
    report = check_audit([*events, *sink.records()])
    found = [(v.kind, v.rid) for v in report.violations]
    assert found == [("stray_report", "done"), ("connector_raised", "open"), ("unreported", "open")]
    assert "report=finished_sending" in report.violations[0].message
    assert report.refusals == {"stray_report": 1, "connector_raised": 1}


def test_an_open_ticket_at_the_end_is_unreported_only_in_a_watchers_log() -> None:
    _, sink, events = _watched("ExampleConnector")
    report = check_audit([*events, *sink.records()])
    assert [(v.kind, v.rid) for v in report.violations] == [("unreported", "open")]
    assert "ExampleConnector" in report.violations[0].message
    _, sink, events = _watched("")  # kvlife's own log: a copy in flight at the end is no verdict
    assert check_audit([*events, *sink.records()]).ok


#: Where each edit of ``tests/violations.py`` puts its violation: the record's ``seq``
#: (``None``: about no record, a lifecycle left open at the end).
AT = {
    "after_release": 8,
    "connector_raised": 8,
    "credited_elsewhere": 8,
    "inherited_state": 8,
    "duplicate_completion": 7,
    "event_mismatch": 8,
    "illegal_transition": 2,
    "inflight_mismatch": 4,
    "rid_mismatch": 6,
    "leaked": None,
    "overdue": 6,
    "seq_gap": 5,
    "serial_reused": 7,
    "state_mismatch": 6,
    "stray_report": 8,
    "unknown_instance": 8,
    "unknown_op": 6,
    "unreported": None,
    "wrong_instance": 5,
    "freed_before_read": 5,
    "handover_mismatch": 4,
    "host_freed_in_flight": 8,
    "failed_write_backed": 8,
    "unbalanced_lock": 8,
    "pending_overwritten": 8,
}


@pytest.mark.parametrize("kind", sorted(EDITS))
def test_each_violation_kind_is_found_directly_by_the_checker(kind: str, tmp_path: Path) -> None:
    """Every kind the checker knows, from the one edit of a clean log that makes it: the
    checker names that kind at the edited record, on its rid (an edit may also break what
    follows it, which the checker reports too)."""
    assert set(EDITS) == set(AT) == set(get_args(ViolationKind))  # one edit per kind
    log = edited_log(clean_log(tmp_path / "clean.jsonl"), kind, tmp_path / "edited.jsonl")
    report = check_audit(read_audit(log), expect_released=kind in UNRECORDED)
    found = [(v.seq, v.rid) for v in report.violations if v.kind == kind]
    assert found[:1] == [(AT[kind], "r")], [(v.kind, v.seq) for v in report.violations]
    assert not report.ok
    assert check_audit(read_audit(clean_log(tmp_path / "again.jsonl")), expect_released=True).ok


# --- how a log ended: closed, cut short, still open, unknown -----------------------------


def _ended(witness: str, *, closes: bool, closing: str | None) -> list[object]:
    """``_watched``'s log, its header saying whether its writer closes segments, ended by
    a closing record ``closing`` (``None``: none)."""
    _, sink, _ = _watched(witness)
    events: list[object] = [Segment(0, make_header(witness=witness, closes=closes), "")]
    events += sink.records()
    if closing is not None:
        events.append(make_closing(closing, len(sink.records()), (1, 1)))  # type: ignore[arg-type]
    return events


def _check(events: list[object], *, alive: bool = False) -> AuditReport:
    checker = AuditChecker(alive=lambda pid: alive)
    for event in events:
        checker.feed(event)  # type: ignore[arg-type]
    return checker.finish()


def test_a_ticket_open_at_the_end_of_a_closed_log_is_unreported() -> None:
    report = _check(_ended("LMCacheMPConnector", closes=True, closing="close"))
    assert [e.status for e in report.endings] == ["closed"] and report.endings[0].how == "close"
    assert [(v.kind, v.rid) for v in report.violations] == [("unreported", "open")]
    assert report.open_at_end == [] and Verdict.of(report).exit_status == 1
    assert ending_lines(report) == []  # a clean close is not news


def test_a_ticket_open_at_the_end_of_a_cut_log_is_no_verdict_but_listed() -> None:
    report = _check(_ended("LMCacheMPConnector", closes=True, closing=None))
    [ending] = report.endings
    assert ending.status == "cut" and ending.open_tickets == 1 and ending.live == 1
    assert report.ok and report.violations == []
    [at_cut] = report.open_at_end
    assert (at_cut.rid, at_cut.kind, at_cut.state, at_cut.status) == (
        "open",
        "delayed_free",
        "finished_pending",
        "cut",
    )
    assert at_cut.age_s is not None and at_cut.age_s >= 0
    verdict = Verdict.of(report)
    assert verdict.ok and verdict.exit_status == 3 and verdict.open_at_cut == 1
    assert str(verdict).startswith("CUT SHORT: 1 writer stopped without closing the log (1 copy")
    lines = ending_lines(report)
    assert "CUT SHORT" in lines[0] and "1 copy in flight at the cut" in lines[0]
    assert "rid 'open'" in lines[1] and "(delayed_free)" in lines[1]


def test_a_log_whose_writer_still_runs_is_open_not_cut() -> None:
    report = _check(_ended("LMCacheMPConnector", closes=True, closing=None), alive=True)
    assert [e.status for e in report.endings] == ["open"] and report.ok
    assert Verdict.of(report).exit_status == 0 and report.open_at_end[0].status == "open"
    assert "OPEN" in ending_lines(report)[0]


def test_a_log_of_a_writer_without_closing_records_keeps_todays_verdicts() -> None:
    report = _check(_ended("LMCacheMPConnector", closes=False, closing=None))
    assert [e.status for e in report.endings] == ["unknown"]
    assert [v.kind for v in report.violations] == ["unreported"]
    assert (
        "closing unknown" in " ".join(ending_lines(report)) or "unknown" in ending_lines(report)[0]
    )


def test_a_log_closed_on_a_signal_lists_what_was_in_flight_without_a_verdict() -> None:
    report = _check(_ended("LMCacheMPConnector", closes=True, closing="signal"))
    [ending] = report.endings
    assert ending.status == "closed" and ending.how == "signal" and ending.stopping == "signal"
    assert report.ok and Verdict.of(report).exit_status == 0
    assert [o.status for o in report.open_at_end] == ["signal"]
    assert "closed on a signal" in ending_lines(report)[0]


def test_records_after_a_closing_record_open_the_segment_again() -> None:
    events = _ended("", closes=True, closing="signal")
    closing = events.pop()
    events.insert(-1, closing)  # the last record came after the closing record
    report = _check(events)
    assert [e.status for e in report.endings] == ["cut"]


def test_overdue_written_before_a_cut_keeps_its_meaning() -> None:
    _, sink, _ = _watched("C")
    registry_records = sink.records()
    last = registry_records[-1]
    overdue = last.replace(
        seq=last.seq + 1,
        trigger="ack",
        src="finished_pending",
        dst=None,
        ok=False,
        reason="overdue",
        op=2,
        inflight=1,
        detail={"kind": "delayed_free", "age_s": 200.0, "limit_s": 120.0},
    )
    events = [Segment(0, make_header(witness="C", closes=True), ""), *registry_records, overdue]
    report = _check(events)
    assert [v.kind for v in report.violations] == ["overdue"]
    assert report.endings[0].status == "cut" and len(report.open_at_end) == 1


def test_expect_released_does_not_call_a_cut_log_a_leak() -> None:
    events = _ended("", closes=True, closing=None)
    checker = AuditChecker(expect_released=True, alive=lambda pid: False)
    for event in events:
        checker.feed(event)  # type: ignore[arg-type]
    assert checker.finish().ok
    checker = AuditChecker(expect_released=True, alive=lambda pid: False)
    for event in _ended("", closes=True, closing="close"):
        checker.feed(event)  # type: ignore[arg-type]
    assert [v.kind for v in checker.finish().violations] == ["leaked"]


def _closed_file(path: Path, *, max_bytes: int | None = None) -> Path:
    """Three lifecycles offloaded and released, logged by a ``JsonLinesSink`` that closed
    its segment (rotating files past ``max_bytes``)."""
    with JsonLinesSink(path, max_bytes=max_bytes, backups=50, batch_records=1) as sink:
        registry = LifecycleRegistry(sinks=[sink])
        for i in range(3):
            req = Req(f"r{i}")
            ticket = registry.start_offload(registry.register(req))
            registry.finish(req)
            registry.complete(ticket)
    return path


def test_lines_missing_before_a_closing_record_are_a_gap_not_a_leak(tmp_path: Path) -> None:
    log = _closed_file(tmp_path / "audit.jsonl")
    assert check_audit(read_audit(log), expect_released=True).ok
    lines = log.read_text().splitlines()  # header, 12 records, closing record
    log.write_text("\n".join([*lines[:-3], lines[-1]]) + "\n")  # r2's finish and ack gone
    report = check_audit(read_audit(log), expect_released=True)
    [gap] = report.violations  # before: "leaked" for r2, in a log that read as complete
    assert (gap.kind, gap.seq, gap.serial) == ("seq_gap", 10, None)
    assert "closed segment 0 after 12 line(s), 10 were read: the last 2" in gap.message
    assert [e.status for e in report.endings] == ["closed"]
    assert [(i.rid, i.state, i.uncertain) for i in report.live] == [("r2", "offloading", True)]


def test_a_lost_records_marker_is_one_of_the_lines_its_writer_counted() -> None:
    records = _records(3)
    kept = [r for r in records if r.seq not in (4, 5)]
    marker = LostRecords(2, 4, 5, "disk full")
    events: list[object] = [Segment(0, make_header(closes=True), ""), *kept[:4], marker]
    events += kept[4:]
    report = _check([*events, make_closing("close", len(kept) + 1, (0, 0))])
    assert report.violations == [] and report.endings[0].status == "closed"
    report = _check([*events, make_closing("close", len(kept) + 2, (0, 0))])
    assert [v.kind for v in report.violations] == ["seq_gap"]


def test_a_closed_segment_whose_first_files_were_rotated_out_is_not_a_gap(
    tmp_path: Path,
) -> None:
    log = _closed_file(tmp_path / "audit.jsonl", max_bytes=700)
    backups = sorted(tmp_path.glob("audit.jsonl.*"), key=lambda p: int(p.suffix[1:]))
    assert len(backups) >= 2
    assert check_audit(read_audit(log), expect_released=True).ok
    backups[-1].unlink()  # the oldest file of the segment, with its first records
    report = check_audit(read_audit(log))
    assert report.endings[0].status == "closed" and report.endings[0].begins_mid_way
    assert "seq_gap" not in report.violation_kinds
    header, *_, closing = log.read_text().splitlines()
    log.write_text(f"{header}\n{closing}\n")  # a last file with no record of its own
    report = check_audit(read_audit(log, rotated=False))
    assert report.endings[0].begins_mid_way and report.ok, report.violations


def test_several_writers_are_counted_by_how_they_ended() -> None:
    first = _ended("", closes=True, closing="close")
    second = _ended("", closes=True, closing=None)
    second[0] = Segment(1, make_header(closes=True), "")
    report = _check([*first, *second])
    assert [e.status for e in report.endings] == ["closed", "cut"]
    lines = ending_lines(report)
    assert lines[0].startswith("2 writers: 1 closed their log, 1 stopped without closing it")
    assert "segment 1" in lines[1]


def test_a_zombie_writer_is_not_alive_and_a_running_one_is() -> None:
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while _state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child.pid)  # exited, not reaped yet: a zombie
    child.wait()
    assert not pid_alive(child.pid) and not pid_alive(0)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]

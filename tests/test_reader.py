"""The streaming reader: typed decoding, rotated sets in order, segments, progress,
and memory that does not grow with the log."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from kvlife.fsm import LifecycleRegistry
from kvlife.fsm.audit import (
    AuditFormatError,
    AuditReader,
    AuditRecord,
    JsonLinesSink,
    Segment,
    audit_files,
    check_audit,
    segment_records,
)
from tests.strategies import Req


def _write(path: Path, lifecycles: int, **sink_args: object) -> JsonLinesSink:
    sink = JsonLinesSink(path, fsync="never", **sink_args)  # type: ignore[arg-type]
    registry = LifecycleRegistry(sinks=[sink])
    for i in range(lifecycles):
        req = Req(f"r{i % 50}")
        registry.register(req)
        tickets = [registry.start_offload(req, tokens=16) for _ in range(2)]
        registry.finish(req)
        for ticket in tickets:
            registry.complete(ticket)
    sink.close()
    return sink


def test_events_are_segments_then_records_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    _write(path, 3)
    _write(path, 2)  # a second writer appends: a second segment, seq from 0 again
    events = list(AuditReader(path))
    assert [type(e).__name__ for e in events[:2]] == ["Segment", "AuditRecord"]
    segments = [e for e in events if isinstance(e, Segment)]
    assert [s.index for s in segments] == [0, 1]
    records = [e for e in events if isinstance(e, AuditRecord)]
    assert len(records) == 5 * 6 and records[18].seq == 0


def test_segment_records_tags_each_record_with_its_segment(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    _write(path, 3)
    _write(path, 2)
    tagged = list(segment_records(AuditReader(path)))
    assert [segment for segment, _ in tagged] == [0] * 18 + [1] * 12
    assert all(type(record) is AuditRecord for _, record in tagged)
    assert tagged[18][1].seq == 0  # the second writer's first record


def test_a_rotated_set_is_read_oldest_first(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    sink = _write(path, 200, batch_records=16, max_bytes=20_000, backups=100)
    files = audit_files(path)
    assert len(files) == sink.rotations + 1 > 3
    assert files[-1] == path and files[0].name == f"a.jsonl.{sink.rotations}"
    reader = AuditReader(path)
    seqs = [e.seq for e in reader if isinstance(e, AuditRecord)]
    assert seqs == list(range(200 * 6)) and reader.segments == 1
    only = AuditReader(path, rotated=False)
    assert sum(isinstance(e, AuditRecord) for e in only) < len(seqs)


def test_a_crash_while_rotating_leaves_a_readable_set(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    _write(path, 50, batch_records=8, max_bytes=5_000, backups=100)
    for older in audit_files(path):  # oldest first: rotate as the sink does ...
        number = int(older.suffix[1:]) if older != path else 0
        older.rename(path.with_name(f"a.jsonl.{number + 1}"))
    path.write_bytes(b'{"kvlife_audit":1,"libr')  # ... and get killed writing the header
    reader = AuditReader(path)
    assert sum(isinstance(e, AuditRecord) for e in reader) == 50 * 6
    assert reader.torn_tail == 23 and not reader.problems


def test_missing_base_file_after_a_crash_reads_the_backups(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    _write(path, 50, batch_records=8, max_bytes=5_000, backups=100)
    path.unlink()  # killed between the rename and the new file
    assert audit_files(path)[-1].name == "a.jsonl.1"
    assert check_audit(AuditReader(path)).ok


def test_progress_is_reported_up_to_the_whole_size(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    _write(path, 7000)
    calls: list[tuple[int, int]] = []
    reader = AuditReader(path, progress=lambda done, total: calls.append((done, total)))
    for _ in reader:
        pass
    size = path.stat().st_size
    assert len(calls) >= 2 and calls[-1] == (size, size)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_a_reader_is_iterated_once(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    _write(path, 1)
    reader = AuditReader(path)
    list(reader)
    with pytest.raises(RuntimeError, match="once"):
        list(reader)
    with pytest.raises(ValueError, match="no audit log files"):
        AuditReader([])


def test_a_header_of_another_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"kvlife_audit": 2, "anything": true}\n')
    with pytest.raises(AuditFormatError, match="schema version 2"):
        list(AuditReader(path))


def _peak_check_bytes(path: Path) -> int:
    tracemalloc.start()
    try:
        report = check_audit(AuditReader(path), expect_released=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok and report.lifecycles > 0
    return peak


def test_checking_memory_does_not_grow_with_the_log(tmp_path: Path) -> None:
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    _write(small, 2_000)  # 12k records
    _write(big, 16_000)  # 96k records, 8x
    peak_small, peak_big = _peak_check_bytes(small), _peak_check_bytes(big)
    # one byte per serial and per copy number is all that grows: 48 kB for 8x the log
    assert peak_big < peak_small + 200_000, (peak_small, peak_big)
    assert peak_big < 3_000_000

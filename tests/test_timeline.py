"""The timeline: one row per lifecycle instance, spans per state."""

from __future__ import annotations

import re
import time
from pathlib import Path

from kvlife.diagrams import build_timeline, plot_timeline, timeline_rows
from kvlife.diagrams.timeline import MAX_ROWS
from kvlife.fsm import AuditRecord, JsonLinesSink, LifecycleRegistry, MemorySink, read_audit
from tests.strategies import Req
from tests.violations import clean_log, edited_log, reuse_log


def _records() -> list[AuditRecord]:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    old, new = Req("a"), Req("a")
    t = registry.start_offload(registry.register(old))
    registry.finish(old)
    registry.register(new)
    registry.complete(t)
    registry.deliver(t)
    return sink.records()


def test_rows_follow_the_states_of_each_instance() -> None:
    rows, end = timeline_rows(_records())
    assert [(r.serial, r.rid) for r in rows] == [(0, "a"), (1, "a")]
    old, new = rows
    assert [s for _, _, s in old.spans] == ["allocated", "offloading", "finished_pending"]
    assert old.released and len(old.refusals) == 1
    assert [s for _, _, s in new.spans] == ["allocated"] and not new.released
    assert new.spans[0][1] == end  # still live: runs to the end
    assert all(a <= b for a, b, _ in old.spans)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    assert plot_timeline(_records(), path) == 2
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_empty_log() -> None:
    assert timeline_rows([]) == ([], 0.0)


def test_a_restarted_writer_gets_rows_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    for rid in ("a", "a"):  # two runs of a writer: serial 0 twice, one rid
        sink = JsonLinesSink(path, fsync="never")
        registry = LifecycleRegistry(sinks=[sink])
        req = Req(rid)
        registry.register(req)
        registry.finish(req)
        sink.close()
    rows, _ = timeline_rows(read_audit(path))
    assert [(r.segment, r.serial, r.released) for r in rows] == [(0, 0, True), (1, 0, True)]


def test_rows_sort_rids_naturally_and_stop_at_max_rows() -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    for i in (10, 2, 1, 33, 3):
        registry.register(Req(f"req-{i}"))
    for _ in range(3):  # one rid, many lifecycles: it cannot push the other rids out
        req = Req("req-0")
        registry.register(req)
        registry.finish(req)
    timeline = build_timeline(sink.records(), max_rows=5)
    assert [(r.rid, r.serial) for r in timeline.rows] == [
        ("req-0", 5), ("req-1", 2), ("req-2", 1), ("req-3", 4), ("req-10", 0)
    ]  # fmt: skip
    assert (timeline.lifecycles, timeline.rids) == (8, 6)
    seven = build_timeline(sink.records(), max_rows=7)
    assert [(r.rid, r.serial) for r in seven.rows] == [
        ("req-0", 5), ("req-0", 6), ("req-1", 2), ("req-2", 1), ("req-3", 4), ("req-10", 0),
        ("req-33", 3),
    ]  # fmt: skip


def test_600_lifecycles_of_one_rid_leave_room_for_every_other_rid() -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    for _ in range(600):
        req = Req("hot")
        registry.finish(registry.register(req))
    for i in range(23):
        registry.register(Req(f"req-{i}"))
    timeline = build_timeline(sink.records(), max_rows=80)
    rids = [row.rid for row in timeline.rows]
    assert len(rids) == 80 and set(rids) == {"hot", *(f"req-{i}" for i in range(23))}
    assert rids.count("hot") == 80 - 23
    only = build_timeline(sink.records(), max_rows=80, rids=["req-7", "req-11"])
    assert [row.rid for row in only.rows] == ["req-7", "req-11"] and only.lifecycles == 2


def test_the_plot_caps_rows_cuts_long_rids_and_says_what_it_left_out(tmp_path: Path) -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    for _ in range(600):
        registry.finish(registry.register(Req("hot")))
    registry.register(Req("x" * 10_000))
    out = tmp_path / "t.svg"
    assert plot_timeline(sink.records(), out, max_rows=10_000) == MAX_ROWS
    svg = out.read_text()
    assert "x" * 23 + "…" in svg and "x" * 25 not in svg
    assert "200 of 601 lifecycles and 2 of 2 rids shown" in svg


def test_a_microsecond_of_finished_pending_is_drawn_a_few_pixels_wide(tmp_path: Path) -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    old = Req("a")
    ticket = registry.start_offload(registry.register(old))
    registry.finish(old)
    registry.complete(ticket)  # finished_pending for a few microseconds
    later = Req("b")
    registry.register(later)
    time.sleep(0.2)  # a log 200 ms long: a microsecond is far below one pixel
    registry.finish(later)
    out = tmp_path / "t.svg"
    plot_timeline(sink.records(), out)
    svg = out.read_text()
    # the finished_pending span: outlined, and at least 4 px wide
    (path,) = re.findall(r'<path id="[^"]+" d="([^"]+)"\s+style="stroke: #a63603', svg)
    xs = [float(x) for x in re.findall(r"[ML] ([\d.]+) ", path)]
    assert max(xs) - min(xs) >= 4, path


def test_every_rid_reuse_while_unreleased_is_one_mark_and_counted(tmp_path: Path) -> None:
    log, reused = reuse_log(tmp_path / "reuse.jsonl")
    timeline = build_timeline(read_audit(log))
    assert {reuse.new[1] for reuse in timeline.reuses} == reused
    assert all(reuse.old[1] == reuse.new[1] - 1 for reuse in timeline.reuses)  # the one before
    svg = tmp_path / "t.svg"
    plot_timeline(read_audit(log), svg)
    text = svg.read_text()
    assert len(re.findall(r'id="reuse-\d+"', text)) == len(reused) == 9
    assert "0 violations; 9 reuses of a rid while its earlier lifecycle was unreleased" in text
    assert 'id="violation-' not in text


def test_violating_records_are_marked_on_their_rows(tmp_path: Path) -> None:
    log = edited_log(clean_log(tmp_path / "clean.jsonl"), "unknown_op", tmp_path / "e.jsonl")
    timeline = build_timeline(read_audit(log))
    assert [(m.row, m.kinds) for m in timeline.violations] == [((0, 1), ("unknown_op",))]
    svg = tmp_path / "t.svg"
    plot_timeline(read_audit(log), svg, rids=["r"])
    text = svg.read_text()
    assert len(re.findall(r'id="violation-\d+"', text)) == 1
    assert "1 violation; 1 reuse of a rid while its earlier lifecycle was unreleased" in text


def test_each_refusal_reason_has_its_mark_and_legend_and_rows_are_explained(
    tmp_path: Path,
) -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    req = Req("a")
    ticket = registry.start_offload(registry.register(req))
    registry.complete(ticket)
    registry.deliver(ticket)  # duplicate_ack: live
    registry.finish(req)
    registry.deliver(ticket)  # stale_instance: released
    out = tmp_path / "t.svg"
    plot_timeline(sink.records(), out)
    svg = out.read_text()
    assert "late delivery after release (stale_instance)" in svg
    assert "repeated delivery (duplicate_ack)" in svg
    assert "rid #serial: one row per lifecycle" in svg
    assert "0 violations; 0 reuses of a rid" in svg

"""The story of one rid as a picture (``kvlife audit why LOG --rid RID -o story.svg``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlife.diagrams.story import Copy, build_story, plot_story
from kvlife.diagrams.story import _levels as levels
from kvlife.fsm import (
    AuditChecker,
    JsonLinesSink,
    LifecycleRegistry,
    MemorySink,
    Trigger,
    read_audit,
)
from kvlife.fsm.audit import make_header
from kvlife.fsm.audit.reader import Segment
from tests.strategies import Req
from tests.violations import EDITS, UNRECORDED, clean_log, edited_log


def _ids(svg: str) -> set[str]:
    return set(re.findall(r'<g id="([^"]+)"', svg))


def test_the_story_of_a_late_completion(tmp_path: Path) -> None:
    """The clean log: #0's copy 0 is in flight when #1 takes rid r; its ack completes #0."""
    story = build_story(read_audit(clean_log(tmp_path / "a.jsonl")), "r")
    assert [lane.serial for lane in story.lanes] == [0, 1]
    old, new = story.lanes
    assert [(c.op, c.ok, c.end is not None) for c in old.copies] == [(0, True, True)]
    assert [c.op for c in new.copies] == [1]
    assert [s for _, _, s in old.spans] == ["allocated", "offloading", "finished_pending"]
    assert old.released is not None and new.released is not None
    ((t, segment, before, after),) = story.reuses
    assert (segment, before, after) == (0, 0, 1) and t == new.registered
    ((late,),) = [story.late]
    assert (late.op, late.ticket, late.holder) == (0, 0, 1)
    assert old.copies[0].start < t < late.t == old.copies[0].end


def test_the_svg_draws_lanes_copies_the_reuse_and_the_arrow_to_the_ticket(
    tmp_path: Path,
) -> None:
    story = build_story(read_audit(clean_log(tmp_path / "a.jsonl")), "r")
    plot_story(story, tmp_path / "story.svg")
    svg = (tmp_path / "story.svg").read_text()
    ids = _ids(svg)
    assert {"lane-0", "lane-1", "copy-0", "copy-1", "copy-label-0", "reuse-0"} <= ids
    assert "late-0" in ids and not any(i.startswith("violation-") for i in ids)
    arrow = svg[svg.index('<g id="late-0">') :]
    arrow = arrow[: arrow.index("</g>\n   </g>") if "</g>\n   </g>" in arrow else 2000]
    assert "copy 0 completes #0 (its ticket), not #1" in arrow
    assert "rid &#39;r&#39;: 2 lifecycles" in svg or "rid 'r': 2 lifecycles" in svg


def test_refusals_are_marked_one_mark_per_reason(tmp_path: Path) -> None:
    path = tmp_path / "late.jsonl"
    sink = JsonLinesSink(path, fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    req = Req("x")
    ticket = registry.start_offload(registry.register(req))
    registry.complete(ticket)
    registry.deliver(ticket)  # duplicate_ack: the lifecycle is live
    registry.finish(req)
    registry.deliver(ticket)  # stale_instance: released
    sink.close()
    story = build_story(read_audit(path), "x")
    assert [reason for _, reason, _ in story.lanes[0].refusals] == [
        "duplicate_ack",
        "stale_instance",
    ]
    plot_story(story, tmp_path / "x.svg")
    svg = (tmp_path / "x.svg").read_text()
    assert {"refused-0", "refused-1"} <= _ids(svg)
    assert "repeated delivery (duplicate_ack)" in svg
    assert "late delivery after release (stale_instance)" in svg


@pytest.mark.parametrize("kind", sorted(set(EDITS) - UNRECORDED - {"unknown_instance"}))
def test_a_violation_on_the_rid_is_a_mark(kind: str, tmp_path: Path) -> None:
    log = edited_log(clean_log(tmp_path / "clean.jsonl"), kind, tmp_path / f"{kind}.jsonl")
    story = build_story(read_audit(log), "r", checker=AuditChecker())
    assert story.violations, kind
    assert any(kind in kinds for _, _, _, kinds in story.violations), story.violations
    plot_story(story, tmp_path / "v.svg")
    assert "violation-0" in _ids((tmp_path / "v.svg").read_text())


def test_copies_and_labels_never_share_a_row_where_they_would_overlap() -> None:
    copies = [
        Copy(1, 0, 0.0, 10.0),
        Copy(2, 0, 5.0, 6.0),  # inside 1: a row above
        Copy(3, 0, 10.5, 11.0),  # after 1 ends, but 1's label is wider than 1? no: 1 is wide
        Copy(40, 0, 6.5, 7.0),  # after 2's span but inside 2's label ("2" + a space, 2 ms)
        Copy(5, 0, 20.0, None),  # in flight to the end
    ]
    level = levels(copies, end=30.0, char=1.0)
    assert level[1] == 0 and level[2] == 1 and level[3] == 0
    assert level[40] == 2  # row 1 is busy until 5 + 2 = 7
    assert level[5] == 0


def test_a_rid_the_log_does_not_hold_is_a_lookup_error(tmp_path: Path) -> None:
    with pytest.raises(LookupError, match="no lifecycle of rid 'nope'"):
        build_story(read_audit(clean_log(tmp_path / "a.jsonl")), "nope")


def _hot_rid(path: Path, lifecycles: int) -> Path:
    """``lifecycles`` lifecycles of rid "hot", one after the other."""
    sink = JsonLinesSink(path, fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    for _ in range(lifecycles):
        req = Req("hot")
        registry.complete(registry.start_offload(registry.register(req)))
        registry.finish(req)
    sink.close()
    return path


def test_a_hot_rid_draws_at_most_max_lanes_and_says_how_many_it_has(tmp_path: Path) -> None:
    from kvlife.diagrams.story import MAX_LANES  # noqa: PLC0415

    log = _hot_rid(tmp_path / "hot.jsonl", 30)
    story = build_story(read_audit(log), "hot")
    assert [lane.serial for lane in story.lanes] == list(range(MAX_LANES)) and story.total == 30
    around = build_story(read_audit(log), "hot", around=(0, 25))
    assert [lane.serial for lane in around.lanes] == list(range(10, 30))  # clipped at the end
    middle = build_story(read_audit(log), "hot", around=(0, 15))
    assert [lane.serial for lane in middle.lanes] == list(range(5, 25))
    plot_story(story, tmp_path / "hot.svg")
    assert "rid &#39;hot&#39;: 20 of its 30 lifecycles drawn" in (
        tmp_path / "hot.svg"
    ).read_text().replace("'", "&#39;")


def test_each_segment_has_lanes_of_its_own(tmp_path: Path) -> None:
    """Two writers of one log each hold rid "a" as serial 0: two lanes, two ids."""
    path = tmp_path / "two.jsonl"
    for _ in range(2):
        sink = JsonLinesSink(path, fsync="never")
        registry = LifecycleRegistry(sinks=[sink])
        req = Req("a")
        registry.complete(registry.start_offload(registry.register(req)))
        registry.finish(req)
        sink.close()
    story = build_story(read_audit(path), "a")
    assert [(lane.segment, lane.serial) for lane in story.lanes] == [(0, 0), (1, 0)]
    assert story.reuses == [] and story.late == []  # one writer's serial 0 is not the other's
    plot_story(story, tmp_path / "a.svg")
    ids = _ids((tmp_path / "a.svg").read_text())
    assert {"lane-0", "lane-1-0", "copy-0", "copy-1-0"} <= ids


def test_a_wrapped_connectors_tickets_and_verdicts_are_drawn_in_its_words(
    tmp_path: Path,
) -> None:
    """An on-call engineer reads the picture without the log: each ticket by what it is
    and the report or cut that ended it, each verdict by its kind and reason."""
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    req = Req("victim-1")
    lc = registry.register(req)
    load = registry.start_offload(req, kind="load", tokens=16)
    free = registry.start_offload(req, kind="delayed_free")
    registry.abort(req)
    registry.complete(load, report="finished_recving")
    registry.complete(free, False, cut_by="finished_recving")
    registry.record_violation(
        "stray_report",
        Trigger.ACK,
        "reported finished_sending",
        lifecycle=lc,
        report="finished_sending",
        why="already_freed",
    )
    story = build_story(
        [Segment(0, make_header(witness="LMCacheMPConnector"), ""), *sink.records()],
        "victim-1",
        checker=AuditChecker(),
    )
    assert [c.label for c in story.lanes[0].copies] == [
        "load 0 (finished_recving)",
        "delayed free 1 (cut by finished_recving)",
    ]
    assert story.verdicts == ["stray_report: already_freed"]
    plot_story(story, tmp_path / "s.svg")
    svg = (tmp_path / "s.svg").read_text()
    assert "delayed free 1 (cut by finished_recving)" in svg
    assert "stray_report: already_freed" in svg and "violation-label-0" in svg
    assert "report no open ticket explains (stray_report)" in svg  # its mark's legend

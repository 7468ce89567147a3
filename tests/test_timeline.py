"""The timeline: one row per lifecycle instance, spans per state."""

from __future__ import annotations

from pathlib import Path

from kvlife.diagrams import plot_timeline, timeline_rows
from kvlife.fsm import AuditRecord, LifecycleRegistry, MemorySink
from tests.strategies import Req


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

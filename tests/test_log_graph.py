"""The lifecycle diagram of a real log: edge counts and refusals."""

from __future__ import annotations

import re

import pytest

from kvlife.diagrams import log_graph
from kvlife.fsm import AuditRecord, InvalidTransitionError, LifecycleRegistry, MemorySink
from tests.strategies import Req


def _log() -> list[AuditRecord]:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    for i in range(3):
        req = Req(f"r{i}")
        t1 = registry.start_offload(registry.register(req))
        t2 = registry.start_offload(req)
        registry.complete(t1)
        registry.finish(req)
        registry.complete(t2, ok=i != 0)
        registry.deliver(t2)  # stale
    registry.register(Req("live"))
    return sink.records()


def test_edges_are_labelled_with_their_counts() -> None:
    dot = str(log_graph(_log()).source)
    assert "register ×4" in dot
    assert "start_offload ×3" in dot  # allocated -> offloading
    assert "ack [more_in_flight] ×3" in dot
    assert "ack [last_in_flight] ×2" in dot  # finished_pending -> released, ok
    assert "fail [last_in_flight] ×1" in dot
    assert "abort ×0" in dot  # drawn, in grey
    assert re.search(r"allocated -> released \[label=\"abort ×0\" color=gray70", dot)


def test_refusals_are_red_dashed_edges_with_reason_and_count() -> None:
    dot = str(log_graph(_log()).source)
    assert re.search(
        r'released -> released \[label="ack refused ×3: stale_instance\\l" color=red '
        r"fontcolor=red style=dashed\]",
        dot,
    )


def test_live_lifecycles_are_listed() -> None:
    dot = str(log_graph(_log()).source)
    assert "live at end of log: 1" in dot and "live #3 allocated inflight=0" in dot


def test_refusals_of_one_state_share_one_loop_so_labels_cannot_overlap() -> None:
    registry = LifecycleRegistry(sinks=[sink := MemorySink()])
    req = Req("a")
    registry.start_offload(registry.register(req))
    registry.finish(req)  # finished_pending: a second finish and a new copy are refused
    with pytest.raises(InvalidTransitionError):
        registry.start_offload(req)
    with pytest.raises(InvalidTransitionError):
        registry.finish(req)
    dot = str(log_graph(sink.records()).source)
    loops = re.findall(r"(\w+) -> \1 \[label=\"([^\"]*refused[^\"]*)\"", dot)
    assert loops == [
        (
            "finished_pending",
            "finish refused ×1: invalid_transition\\lstart_offload refused ×1: "
            "invalid_transition\\l",
        )
    ]


def test_a_10_kb_rid_is_cut_short_in_the_live_note() -> None:
    registry = LifecycleRegistry(sinks=[sink := MemorySink()])
    registry.register(Req("r" * 10_000))
    dot = str(log_graph(sink.records(), title="t" * 5000).source)
    assert "r" * 39 + "…" in dot and "r" * 41 not in dot
    assert max(len(line) for line in dot.splitlines()) < 400

"""The lifecycle diagram of a real log: edge counts and refusals."""

from __future__ import annotations

import re

from kvlife.diagrams import log_graph
from kvlife.fsm import AuditRecord, LifecycleRegistry, MemorySink
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
        r'released -> released \[label="ack refused ×3\\nstale_instance" color=red '
        r"fontcolor=red style=dashed\]",
        dot,
    )


def test_live_lifecycles_are_listed() -> None:
    dot = str(log_graph(_log()).source)
    assert "live at end of log: 1" in dot and "live #3 allocated inflight=0" in dot

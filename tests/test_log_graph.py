"""The lifecycle diagram of a real log: edge counts and refusals."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvlife.diagrams import log_graph
from kvlife.diagrams.dot import render
from kvlife.fsm import (
    AuditRecord,
    InvalidTransitionError,
    LifecycleRegistry,
    MemorySink,
    read_audit,
)
from kvlife.offload.demo import DemoConfig, run_workload
from tests.strategies import Req
from tests.violations import EDITS, clean_log, edited_log, reuse_log

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot")


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
    assert "abort ×0" not in dot  # never taken: not drawn unless asked
    everything = str(log_graph(_log(), all_edges=True).source)
    assert re.search(r"allocated -> released \[label=\"abort ×0\" color=gray70", everything)


def test_refusals_are_red_lines_in_the_state_they_were_refused_in() -> None:
    dot = str(log_graph(_log()).source)
    assert re.search(
        r'released \[label=<<table.*<td>released</td>.*<font point-size="9" color="red">'
        r"ack refused ×3: stale_instance</font>",
        dot,
    )
    assert not re.search(r"(\w+) -> \1 \[label=\"[^\"]*refused", dot)  # no refusal loops
    assert "legend" in dot and "bold red: records the checker found wrong" in dot


def test_live_lifecycles_are_listed() -> None:
    dot = str(log_graph(_log()).source)
    assert "live at end of log: 1" in dot and "live #3 allocated inflight=0" in dot


def test_refusals_of_one_state_are_listed_in_its_node() -> None:
    registry = LifecycleRegistry(sinks=[sink := MemorySink()])
    req = Req("a")
    registry.start_offload(registry.register(req))
    registry.finish(req)  # finished_pending: a second finish and a new copy are refused
    with pytest.raises(InvalidTransitionError):
        registry.start_offload(req)
    with pytest.raises(InvalidTransitionError):
        registry.finish(req)
    dot = str(log_graph(sink.records()).source)
    (node,) = re.findall(r"finished_pending \[label=(<<.*>>)", dot)
    assert node.index("finish refused ×1: invalid_transition") < node.index(
        "start_offload refused ×1: invalid_transition"
    )


def test_a_10_kb_rid_is_cut_short_in_the_live_note() -> None:
    registry = LifecycleRegistry(sinks=[sink := MemorySink()])
    registry.register(Req("r" * 10_000))
    dot = str(log_graph(sink.records(), title="t" * 5000).source)
    assert "r" * 39 + "…" in dot and "r" * 41 not in dot
    assert max(len(line) for line in dot.splitlines() if "__legend" not in line) < 400


# --- no label drawn over another label or another edge ---------------------------------------


def _boxes(layout: dict[str, Any]) -> list[tuple[str, tuple[float, float, float, float]]]:
    """Every text Graphviz placed (edge labels and node labels), as (owner, box)."""
    boxes = []
    for kind in ("objects", "edges"):
        for item in layout.get(kind, []):
            owner = f"{kind}:{item.get('_gvid')}"
            for key in ("_ldraw_", "_hldraw_", "_tldraw_"):
                size = 14.0
                for op in item.get(key, []):
                    if op["op"] == "F":
                        size = op["size"]
                    elif op["op"] == "T":
                        (x, y), width = op["pt"], op["width"]
                        left = {"l": x, "c": x - width / 2, "r": x - width}[op["align"]]
                        boxes.append((owner, (left, y - size * 0.25, left + width, y + size * 0.8)))
    return boxes


def _bezier(points: list[list[float]], steps: int = 12) -> list[tuple[float, float]]:
    out = []
    for i in range(0, len(points) - 3, 3):
        p0, p1, p2, p3 = points[i : i + 4]
        for k in range(steps + 1):
            t = k / steps
            a, b, c, d = (1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t * t * (1 - t), t**3
            out.append(
                (
                    a * p0[0] + b * p1[0] + c * p2[0] + d * p3[0],
                    a * p0[1] + b * p1[1] + c * p2[1] + d * p3[1],
                )
            )
    return out


def _overlaps(dot_source: str) -> list[str]:
    """Labels that cover another label, or an edge other than their own, in Graphviz's own
    layout (``dot -Tjson``: each text's anchor, alignment and width, each edge's spline)."""
    layout = json.loads(render(dot_source, "json"))  # type: ignore[arg-type]
    boxes = _boxes(layout)
    found = []
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        across = box_a[0] < box_b[2] and box_b[0] < box_a[2]
        if a != b and across and box_a[1] < box_b[3] and box_b[1] < box_a[3]:
            found.append(f"{a} and {b}")
    for edge in layout.get("edges", []):
        owner = f"edges:{edge.get('_gvid')}"
        curve = [
            point
            for op in edge.get("_draw_", [])
            if op["op"] == "b"
            for point in _bezier(op["points"])
        ]
        for label, (x0, y0, x1, y1) in boxes:
            if label == owner:
                continue
            if any(x0 + 1 < x < x1 - 1 and y0 + 1 < y < y1 - 1 for x, y in curve):
                found.append(f"{label} over {owner}")
    return found


def _logs(tmp_path: Path) -> dict[str, Any]:
    clean = clean_log(tmp_path / "clean.jsonl")
    demo = MemorySink(capacity=1 << 16)
    run_workload(DemoConfig(requests=120, seed=0), sinks=[demo])
    logs: dict[str, Any] = {
        "demo": demo.records(),
        "busy": _log(),
        "reuse": read_audit(reuse_log(tmp_path / "r.jsonl")[0]),
    }
    for kind in EDITS:
        logs[kind] = read_audit(edited_log(clean, kind, tmp_path / f"{kind}.jsonl"))
    return logs


@needs_dot
def test_no_label_is_drawn_over_another_label_or_edge(tmp_path: Path) -> None:
    for name, log in _logs(tmp_path).items():
        events = log.events() if hasattr(log, "events") else log
        assert _overlaps(str(log_graph(events).source)) == [], name


@needs_dot
def test_the_overlap_check_finds_the_old_stacked_loops() -> None:
    """Three loops on one state, their labels on one side (as refusals were drawn before):
    the check sees the labels drawn through the loops."""
    source = (
        "digraph { rankdir=LR; a -> b; "
        'b -> b [label="start_offload ×7"]; b -> b [label="ack [more_in_flight] ×0"]; '
        'b -> b [label="ack refused ×1: duplicate_ack"]; }'
    )
    assert _overlaps(source)

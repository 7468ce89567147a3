"""Escaping user-controlled text for DOT, and running dot."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET

import graphviz
import pytest

from kvlife.diagrams import log_graph, render
from kvlife.diagrams.dot import DotNotFoundError, dot_text, visible
from kvlife.fsm import LifecycleRegistry, MemorySink
from tests.strategies import Req

HOSTILE = [
    'say "hi"',
    "back\\slash",
    "\\N",
    "\\G\\E\\T",
    "<b>bold</b>",
    "new\nline",
    "tab\there",
    "a\\lb",
    "{}[];=,",
    "ünï ☃",
    "trailing\\",
]
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is missing")


def test_visible_shows_control_characters_as_escapes() -> None:
    assert visible("new\nline") == "new\\nline"
    assert visible("nul\x00") == "nul\\x00"
    assert visible("plain ☃") == "plain ☃"


def _svg_texts(svg: bytes) -> tuple[list[str], int]:
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    texts = ["".join(t.itertext()) for t in root.iter(f"{ns}text")]
    nodes = [g for g in root.iter(f"{ns}g") if g.get("class") == "node"]
    return texts, len(nodes)


@needs_dot
def test_hostile_rids_are_rendered_literally_with_no_extra_nodes() -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    for rid in HOSTILE:
        registry.start_offload(registry.register(Req(rid)))  # live at the end: listed by rid
    graph = log_graph(sink.records(), title='log "x" \\N <y>')
    texts, nodes = _svg_texts(render(str(graph.source), "svg"))
    for serial, rid in enumerate(HOSTILE):
        line = f"{visible(rid)} #{serial} offloading inflight=1"
        assert line in texts, (rid, line, texts)
    assert any(t.startswith('log "x" \\N <y>') for t in texts)
    # __start, the four states, the live note and the legend: nothing injected by a rid
    assert nodes == 7


@needs_dot
def test_a_hostile_rid_in_a_refusal_keeps_the_graph_intact() -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    with pytest.raises(LookupError):
        registry.finish(Req('"] evil [label="'))  # unknown request: refused and audited
    texts, nodes = _svg_texts(render(str(log_graph(sink.records()).source), "svg"))
    assert nodes == 7  # __start, four states, the "no lifecycle" node, the legend
    assert any("unknown_request" in t for t in texts)


def test_dot_text_marks_text_as_not_html() -> None:
    g = graphviz.Digraph()
    g.node("n", label=dot_text("<b>x</b>"))
    assert 'label="<b>x</b>"' in g.source  # quoted: a plain string, not an HTML label


def test_render_without_dot_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvlife.diagrams.dot.shutil.which", lambda name: None)
    with pytest.raises(DotNotFoundError, match="apt-get install graphviz"):
        render("digraph {}", "svg")

"""The lifecycle diagram of a real audit log: how often each edge was taken, and what was
refused.

Every edge of the table that a transition took is drawn and labelled with its count
(with ``all_edges``, the others too, in grey, with a count of 0). The refusals are
summarised inside the node of the state they were refused in, in red, one line per
(trigger, reason) with its count, rather than as self-loops whose labels would stack on
the table's own loops; refusals that found no lifecycle (``unknown_request``) are listed
in a separate "no lifecycle" node; the lifecycles still live at the end of the log are
listed in a note; a legend says what black, grey, red and bold red mean. A state's own
loops (``start_offload`` while ``offloading``, ``ack [more_in_flight]``) leave and enter
its node on the top and the bottom side alternately, so that two loops and their labels
are not drawn over each other. The log is checked in
the same pass, as ``kvlife audit check`` checks it: an edge that a violating record took is
drawn red with the count of violations on it (a transition the table does not have gets a
red edge of its own), and the title says "N violations" or "check OK". All user-controlled
text goes through [`kvlife.diagrams.dot.dot_text()`][kvlife.diagrams.dot.dot_text].

The log is read in one streaming pass (counters and the checker's open lifecycles only),
so a log of any size can be drawn; each segment is its own serial space.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Iterable
from typing import Final

import graphviz

from kvlife.diagrams.dot import dot_text, shortened
from kvlife.fsm.audit import REGISTER, AuditChecker, AuditLog, AuditReader, AuditRecord, Event
from kvlife.fsm.table import LIFECYCLE, State, sorted_edges

NO_LIFECYCLE: Final = "__no_lifecycle"
_STATE_NAMES: Final = frozenset(s.value for s in State)
MAX_LIVE_LISTED: Final = 12


def log_graph(
    source: AuditReader | AuditLog | Iterable[Event],
    title: str = "audit log",
    *,
    accept_tables: Iterable[str] = (),
    checker: AuditChecker | None = None,
    all_edges: bool = False,
) -> graphviz.Digraph:
    """The lifecycle diagram annotated with the transitions, refusals and violations of a
    log. ``checker``: the one to check the log with (its report is the verdict's; it is
    finished when this returns); by default one with ``accept_tables``. ``all_edges``:
    also draw the table's edges no transition took (grey, with a count of 0).

    Raises:
        AuditTableMismatchError: the log was written with another table (not accepted).
    """
    taken: Counter[tuple[str | None, str, str | None]] = Counter()
    refused: Counter[tuple[str | None, str, str | None]] = Counter()
    violating: Counter[tuple[str | None, str, str | None]] = Counter()
    if checker is None:
        checker = AuditChecker(accept_tables=accept_tables)
    feed = checker.feed
    found = checker.report
    records = 0
    for event in source.events() if isinstance(source, AuditLog) else source:
        before = found.violation_count
        feed(event)
        if type(event) is AuditRecord:
            records += 1
            if event.ok:
                taken[(event.src, event.trigger, event.dst)] += 1
                if found.violation_count != before:
                    violating[(event.src, event.trigger, event.dst)] += 1
            else:
                refused[(event.src, event.trigger, event.reason)] += 1
    report = checker.finish()
    n = report.violation_count
    verdict = f"{n} violation{'' if n == 1 else 's'}" if n else "check OK"
    graph = graphviz.Digraph(
        name="kvlife_audit",
        graph_attr={
            "rankdir": "LR",
            "label": dot_text(f"{shortened(title, 80)}: {records} records, {verdict}"),
            "fontcolor": "red" if n else "black",
            "labelloc": "t",
            "fontname": "Helvetica",
        },
    )
    graph.attr(
        "node", shape="rectangle", style="rounded,filled", fillcolor="white", fontname="Helvetica"
    )
    graph.attr("edge", fontname="Helvetica", fontsize="10")
    graph.node("__start", label="", shape="point", width="0.15")
    refusals: dict[str, list[str]] = {}
    for (src, trigger, reason), count in sorted(
        refused.items(), key=lambda kv: tuple(map(str, kv[0]))
    ):
        node = src if src is not None else NO_LIFECYCLE
        refusals.setdefault(node, []).append(f"{trigger} refused ×{count}: {reason}")
    for state in State:
        extra = {"peripheries": "2"} if state is LIFECYCLE.terminal else {}
        graph.node(state.value, label=_node_label(state.value, refusals.get(state.value)), **extra)
    registered = taken[(None, REGISTER, State.ALLOCATED.value)]
    graph.edge("__start", LIFECYCLE.initial.value, label=f"register ×{registered}")
    drawn: set[tuple[str | None, str, str | None]] = {(None, REGISTER, State.ALLOCATED.value)}
    loops: Counter[str] = Counter()  # a state's loops drawn so far: the next one's side
    for edge in sorted_edges(LIFECYCLE.edges):
        key = (edge.src.value, edge.trigger.value, edge.dst.value)
        drawn.add(key)
        count = taken[key]
        if not count and not all_edges:
            continue
        guard = f" [{edge.guard.value}]" if edge.guard else ""
        label = f"{edge.trigger.value}{guard} ×{count}"
        if violating[key]:
            label += f"\\n{violating[key]} violating"
            style = {"color": "red", "fontcolor": "red", "penwidth": "2.4"}
        elif count:
            style = {"color": "black", "penwidth": "1.6"}
        else:
            style = {"color": "gray70", "fontcolor": "gray50"}
        if edge.src is edge.dst:
            side = "ns"[loops[edge.src.value] % 2]
            loops[edge.src.value] += 1
            style |= {"tailport": side, "headport": side}
        graph.edge(edge.src.value, edge.dst.value, label=label, **style)
    for (src, trigger, dst), count in sorted(violating.items(), key=lambda kv: str(kv[0])):
        if (src, trigger, dst) in drawn or src is None or dst is None:
            continue  # a registration's violations show on its own edge's title count
        for name in (src, dst):
            if name not in _STATE_NAMES:
                graph.node(name, label=dot_text(shortened(name)), color="red", fontcolor="red")
        graph.edge(
            src,
            dst,
            label=dot_text(f"{trigger} ×{count}: not in the table"),
            color="red",
            fontcolor="red",
            penwidth="2.4",
        )
    if NO_LIFECYCLE in refusals:
        graph.node(
            NO_LIFECYCLE,
            label=_node_label("no lifecycle (unknown request)", refusals[NO_LIFECYCLE]),
            style="dashed",
            color="red",
            fontcolor="red",
        )
    graph.node("__legend", label=_LEGEND, shape="plaintext", fillcolor="none")
    live = report.live
    if live:
        lines = [f"live at end of log: {len(live)}"]
        where = " (segment {})" if report.segments > 1 else ""
        lines += [
            f"{dot_text(shortened(str(i.rid)))} #{i.serial}{where.format(i.segment)}"
            f" {i.state} inflight={i.inflight}"
            for i in live[:MAX_LIVE_LISTED]
        ]
        if len(live) > MAX_LIVE_LISTED:
            lines.append(f"... {len(live) - MAX_LIVE_LISTED} more")
        graph.node("__live", label="\\l".join(lines) + "\\l", shape="note", fillcolor="lightyellow")
    return graph


_LEGEND: Final = (
    '<<table border="0" cellspacing="0" cellpadding="2">'
    '<tr><td align="left"><font point-size="9">legend</font></td></tr>'
    '<tr><td align="left"><font point-size="9">━ black: transitions the log took (×count)'
    "</font></td></tr>"
    '<tr><td align="left"><font point-size="9" color="gray50">━ grey: in the table, never '
    "taken (shown with --all-edges)</font></td></tr>"
    '<tr><td align="left"><font point-size="9" color="red">red lines in a state: calls '
    "refused in it (×count: reason)</font></td></tr>"
    '<tr><td align="left"><font point-size="9" color="red">━ bold red: records the checker '
    "found wrong</font></td></tr>"
    "</table>>"
)


def _node_label(name: str, refused: list[str] | None) -> str:
    """A state's label: its name, and under it in red the calls refused in it."""
    if not refused:
        return name
    cell = '<tr><td align="left"><font point-size="9" color="red">{}</font></td></tr>'
    lines = "".join(cell.format(html.escape(line)) for line in refused)
    return (
        f'<<table border="0" cellspacing="0" cellpadding="1"><tr><td>{html.escape(name)}</td></tr>'
        f"{lines}</table>>"
    )

"""``kvlife audit report``: one self-contained HTML page about an audit log.

The page holds the log-annotated lifecycle diagram, the timeline, and a table of the
log's lifecycles (rid, serial, outcome, copies, time in each state, refusals) that sorts by
any column and filters by rid, outcome and refusals; selecting a row shows that
lifecycle's whole history. Everything is inline (styles, script, pictures, data): the
page loads no file and makes no request, so it can be mailed or attached to an incident.

User text (rids) only ever reaches the page as JSON data that the script puts in with
``textContent``, and the JSON is escaped so that it cannot end its ``<script>`` element: a
rid like ``</script><img onerror=...>`` shows as text.
"""

from __future__ import annotations

import html
import json
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from kvlife.diagrams.dot import DotNotFoundError, render
from kvlife.diagrams.log_graph import log_graph
from kvlife.diagrams.timeline import plot_timeline
from kvlife.fsm.audit import Event
from kvlife.fsm.reader import segment_records
from kvlife.fsm.table import State

MAX_LIFECYCLES: Final = 5000
"""Lifecycles listed in the table (the first met); the page says how many were left out."""
MAX_HISTORY: Final = 300
"""Records kept per lifecycle for its history; the rest are counted."""

_STATES: Final = (State.ALLOCATED.value, State.OFFLOADING.value, State.FINISHED_PENDING.value)
_OUTCOMES: Final = {"finish": "finished", "abort": "aborted"}


@dataclass
class _Entry:
    rid: str
    serial: int
    segment: int
    start: float
    state: str = ""
    since: float = 0.0
    outcome: str = "live"
    copies: int = 0
    acks: int = 0
    fails: int = 0
    refusals: int = 0
    end: float | None = None
    time: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_STATES, 0.0))
    history: list[list[object]] = field(default_factory=list)
    more: int = 0


@dataclass
class ReportData:
    """What the page shows, gathered in one pass over the log. ``total`` counts the
    lifecycles registered in the log plus those listed that began before it."""

    lifecycles: list[_Entry]
    total: int
    records: int
    end_ms: float

    def to_json(self) -> str:
        """The page's data as JSON that cannot close a ``<script>`` element."""
        rows = [
            {
                "rid": e.rid,
                "serial": e.serial,
                "segment": e.segment,
                "outcome": e.outcome,
                "state": e.state or "released",
                "copies": e.copies,
                "acks": e.acks,
                "fails": e.fails,
                "refusals": e.refusals,
                "start": round(e.start, 3),
                "end": None if e.end is None else round(e.end, 3),
                "time": {k: round(v, 3) for k, v in e.time.items()},
                "history": e.history,
                "more": e.more,
            }
            for e in self.lifecycles
        ]
        text = json.dumps(
            {"lifecycles": rows, "total": self.total, "records": self.records}, sort_keys=True
        )
        return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def gather(source: Iterable[Event], *, max_lifecycles: int = MAX_LIFECYCLES) -> ReportData:
    """Read the log once into the table's rows (times in ms from the first record)."""
    entries: dict[tuple[int, int], _Entry] = {}
    total = records = 0
    t0: int | None = None
    t = 0.0
    for segment, r in segment_records(source):
        records += 1
        if t0 is None:
            t0 = r.t_ns
        t = (r.t_ns - t0) / 1e6
        if r.serial is None:
            continue
        key = (segment, r.serial)
        entry = entries.get(key)
        if entry is None:
            registered = r.trigger == "register" and r.ok
            total += registered
            if (not r.ok and not registered) or len(entries) >= max_lifecycles:
                continue  # a refusal for an instance not listed, or past the cap
            total += not registered  # listed, though it began before the log did
            entry = entries[key] = _Entry(r.rid or "", r.serial, segment, t)
            entry.state = r.src or ""
        if len(entry.history) < MAX_HISTORY:
            entry.history.append(
                [
                    round(t, 3),
                    r.trigger,
                    r.src,
                    r.dst,
                    r.ok,
                    r.reason,
                    r.op,
                    r.inflight,
                    " ".join(f"{k}={v}" for k, v in r.detail.items()),
                ]
            )
        else:
            entry.more += 1
        if not r.ok:
            entry.refusals += 1
            continue
        if r.trigger == "start_offload":
            entry.copies += 1
        elif r.trigger == "ack":
            entry.acks += 1
        elif r.trigger == "fail":
            entry.fails += 1
        elif r.trigger in _OUTCOMES:
            entry.outcome = _OUTCOMES[r.trigger]
        if r.dst != entry.state:
            if entry.state in entry.time:
                entry.time[entry.state] += t - entry.since
            entry.state, entry.since = r.dst or "", t
            if r.dst == State.RELEASED.value:
                entry.end, entry.state = t, ""
    for entry in entries.values():
        if entry.state in entry.time:
            entry.time[entry.state] += t - entry.since
    return ReportData(list(entries.values()), total, records, t)


def _svg(data: bytes) -> str:
    """An SVG document as an inline element (its XML prolog and doctype dropped)."""
    text = data.decode("utf-8")
    return text[text.index("<svg") :]


def build_report(
    events: Callable[[], Iterable[Event]],
    *,
    title: str = "kvlife audit log",
    accept_tables: Iterable[str] = (),
) -> tuple[str, ReportData]:
    """The page, and what its table holds. ``events`` is called once per pass (three
    passes: the diagram, the timeline, the table), each time returning the log's events
    afresh (an ``AuditReader`` is read once).

    Raises:
        AuditTableMismatchError: the log was written with another table (not accepted).
    """
    notes: list[str] = []
    dot = str(log_graph(events(), title=title, accept_tables=accept_tables).source)
    try:
        diagram = _svg(render(dot, "svg"))
    except DotNotFoundError as exc:
        diagram = ""
        notes.append(f"The diagram is left out: {exc}")
    with tempfile.TemporaryDirectory(prefix="kvlife-report-") as tmp:
        picture = Path(tmp) / "timeline.svg"
        try:
            plot_timeline(events(), picture, title=title)
            timeline = _svg(picture.read_bytes())
        except ModuleNotFoundError as exc:
            timeline = ""
            notes.append(f"The timeline is left out: {exc}")
    data = gather(events())
    page = _PAGE.format(
        title=html.escape(title),
        summary=html.escape(
            f"{data.records} records, {data.total} lifecycles over {data.end_ms:.1f} ms"
        ),
        notes="".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes),
        diagram=diagram,
        timeline=timeline,
        data=data.to_json(),
    )
    return page, data


_PAGE: Final = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.4em; margin: 0 0 .2em; }} h2 {{ font-size: 1.15em; margin: 1.4em 0 .5em; }}
.note {{ color: #a63603; }} .pictures svg {{ max-width: 100%; height: auto; }}
#filters {{ display: flex; gap: 1em; align-items: center; margin-bottom: .5em; }}
table {{ border-collapse: collapse; font-variant-numeric: tabular-nums; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: right; }}
th {{ cursor: pointer; background: #f4f4f4; position: sticky; top: 0; user-select: none; }}
td.text, th.text {{ text-align: left; max-width: 28em; overflow-wrap: anywhere; }}
tbody tr {{ cursor: pointer; }} tbody tr:hover {{ background: #eef5fb; }}
tr.selected {{ background: #d6e8f7 !important; }}
.refused {{ color: #c00; }} #wrap {{ max-height: 32em; overflow: auto; }}
#history table {{ margin-top: .5em; }}
</style></head>
<body>
<h1>{title}</h1>
<p id="summary">{summary}</p>
{notes}
<div class="pictures">
<h2>Lifecycle diagram, with the log's counts and refusals</h2>
{diagram}
<h2>Timeline</h2>
{timeline}
</div>
<h2>Lifecycles</h2>
<div id="filters">
<label>rid contains <input id="rid-filter" type="search" placeholder="req-7"></label>
<label>outcome <select id="outcome-filter">
<option value="">any</option><option>finished</option><option>aborted</option>
<option>live</option></select></label>
<label><input id="refused-filter" type="checkbox"> with refusals</label>
<span id="count"></span>
</div>
<div id="wrap"><table id="lifecycles"><thead><tr>
<th class="text" data-key="rid">rid</th><th data-key="serial">serial</th>
<th data-key="segment">segment</th><th class="text" data-key="outcome">outcome</th>
<th data-key="copies">copies</th><th data-key="acks">acks</th><th data-key="fails">fails</th>
<th data-key="allocated">allocated ms</th><th data-key="offloading">offloading ms</th>
<th data-key="finished_pending">finished_pending ms</th>
<th data-key="refusals">refusals</th>
</tr></thead><tbody></tbody></table></div>
<div id="history"><p>Select a lifecycle to see its whole history.</p></div>
<script id="data" type="application/json">{data}</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const rows = DATA.lifecycles;
const body = document.querySelector("#lifecycles tbody");
const TIMES = ["allocated", "offloading", "finished_pending"];
let sortKey = "serial", sortUp = true, selected = null;

function value(row, key) {{
  return TIMES.includes(key) ? row.time[key] : row[key];
}}
function naturalCompare(a, b) {{
  return String(a).localeCompare(String(b), undefined, {{numeric: true}});
}}
function cell(tr, text, cls) {{
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
}}
function render() {{
  const ridText = document.getElementById("rid-filter").value.toLowerCase();
  const outcome = document.getElementById("outcome-filter").value;
  const refusedOnly = document.getElementById("refused-filter").checked;
  const shown = rows.filter(r =>
    r.rid.toLowerCase().includes(ridText) &&
    (!outcome || r.outcome === outcome) && (!refusedOnly || r.refusals > 0));
  shown.sort((a, b) => {{
    const x = value(a, sortKey), y = value(b, sortKey);
    const c = typeof x === "number" && typeof y === "number" ? x - y : naturalCompare(x, y);
    return (sortUp ? c : -c) || a.segment - b.segment || a.serial - b.serial;
  }});
  body.replaceChildren();
  for (const r of shown) {{
    const tr = document.createElement("tr");
    tr.dataset.index = rows.indexOf(r);
    if (r === selected) tr.className = "selected";
    cell(tr, r.rid, "text");
    cell(tr, r.serial); cell(tr, r.segment); cell(tr, r.outcome, "text");
    cell(tr, r.copies); cell(tr, r.acks); cell(tr, r.fails);
    for (const k of TIMES) cell(tr, r.time[k].toFixed(3));
    cell(tr, r.refusals, r.refusals ? "refused" : "");
    body.appendChild(tr);
  }}
  const left = DATA.total - rows.length;
  document.getElementById("count").textContent =
    `showing ${{shown.length}} of ${{rows.length}} lifecycles` +
    (left > 0 ? ` (${{left}} more in the log are not listed)` : "");
}}
function showHistory(r) {{
  selected = r;
  const box = document.getElementById("history");
  box.replaceChildren();
  const h = document.createElement("h2");
  h.textContent = `History of ${{r.rid}} #${{r.serial}}` +
    (r.segment ? ` (segment ${{r.segment}})` : "") + `: ${{r.outcome}}, ${{r.state}} at the end`;
  box.appendChild(h);
  const table = document.createElement("table");
  const head = document.createElement("tr");
  for (const name of ["ms", "trigger", "copy", "from", "to", "in flight", "refused", "detail"]) {{
    const th = document.createElement("th");
    th.textContent = name;
    if (!["ms", "copy", "in flight"].includes(name)) th.className = "text";
    head.appendChild(th);
  }}
  table.appendChild(head);
  for (const [t, trigger, src, dst, ok, reason, op, inflight, detail] of r.history) {{
    const tr = document.createElement("tr");
    if (!ok) tr.className = "refused";
    cell(tr, t.toFixed(3)); cell(tr, trigger, "text"); cell(tr, op === null ? "" : op);
    cell(tr, src || "", "text"); cell(tr, dst || "", "text"); cell(tr, inflight);
    cell(tr, ok ? "" : reason, "text"); cell(tr, detail, "text");
    table.appendChild(tr);
  }}
  box.appendChild(table);
  if (r.more) {{
    const p = document.createElement("p");
    p.textContent = `... ${{r.more}} more records`;
    box.appendChild(p);
  }}
  render();
}}
document.querySelectorAll("#lifecycles th").forEach(th => th.addEventListener("click", () => {{
  const key = th.dataset.key;
  sortUp = key === sortKey ? !sortUp : true;
  sortKey = key;
  render();
}}));
for (const id of ["rid-filter", "outcome-filter", "refused-filter"]) {{
  document.getElementById(id).addEventListener("input", render);
}}
body.addEventListener("click", event => {{
  const tr = event.target.closest("tr");
  if (tr) showHistory(rows[Number(tr.dataset.index)]);
}});
render();
</script>
</body></html>
"""

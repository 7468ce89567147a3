"""``kvlife audit report``: one self-contained HTML page about an audit log.

The page leads with what an on-call engineer needs first: the verdict of ``kvlife audit
check`` on the log, the unreadable lines by file and line number, a table of its
violations (rid, serial, seq, kind, what it means), and the table of the log's lifecycles
(rid, serial, outcome, copies, time in each state, refusals, violations, which unreleased
lifecycles held the rid when it was registered), which sorts by any column and filters by
rid, outcome, refusals, violations and reuse, every column explained. Selecting a
lifecycle shows its story, drawn as ``kvlife audit why -o`` draws it (a lane per lifecycle
of its rid, copies, refusals, reuses, late completions), and its whole history, with the
sentences ``kvlife audit why`` prints for a rid reuse and a late completion and the
violations on the records they are about. Every ``#serial`` on the page is a link to that
lifecycle (``#lc-SEGMENT-SERIAL`` in the address). The pictures of the whole log (the
log-annotated diagram, the timeline) come after the table. Everything is inline (styles,
script, pictures, data): the page loads no file and makes no request, so it can be mailed
or attached to an incident.

User text (rids) only ever reaches the page as JSON data that the script puts in with
``textContent``, and the JSON is escaped so that it cannot end its ``<script>`` element: a
rid like ``</script><img onerror=...>`` shows as text.

Why one module: it writes one self-contained page (its styles, script and data inline);
the pictures it embeds are drawn by ``story``, ``log_graph`` and ``timeline``.
"""

from __future__ import annotations

import html
import json
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from kvlife.diagrams.dot import DotNotFoundError, render
from kvlife.diagrams.log_graph import log_graph
from kvlife.diagrams.timeline import plot_timeline
from kvlife.fsm.audit import AuditChecker, AuditReport, Event, Verdict, ending_lines, fed
from kvlife.fsm.audit.explain import late_sentence, reused_in_flight
from kvlife.fsm.audit.handover import Handover
from kvlife.fsm.audit.reader import segment_records
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
    reused: str = ""  # "#3, #5": the unreleased lifecycles that held the rid at registration
    held: list[int] = field(default_factory=list)  # their serials, for the story
    late: list[list[int]] = field(default_factory=list)  # [copy, newest holder] per late one
    violations: int = 0
    started: dict[int, int] = field(default_factory=dict)  # copy -> t_ns of its start


@dataclass
class ReportData:
    """What the page shows, gathered in one pass over the log. ``total`` counts the
    lifecycles registered in the log plus those listed that began before it; ``report``
    is the check of the log made in the same pass, ``verdict`` its verdict."""

    lifecycles: list[_Entry]
    total: int
    records: int
    end_ms: float
    report: AuditReport = field(default_factory=AuditReport)
    verdict: Verdict = field(default_factory=lambda: Verdict.of(AuditReport()))
    #: The first unreadable lines, as "file:line: what was wrong".
    unreadable: list[str] = field(default_factory=list)

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
                "reused": e.reused,
                "held": e.held,
                "late": e.late,
                "violations": e.violations,
            }
            for e in self.lifecycles
        ]
        violations = [
            {
                "rid": v.rid,
                "serial": v.serial,
                "segment": v.segment,
                "seq": v.seq,
                "kind": v.kind,
                "meaning": v.meaning,
                "message": v.message,
            }
            for v in self.report.violations
        ]
        text = json.dumps(
            {
                "lifecycles": rows,
                "total": self.total,
                "records": self.records,
                "violations": violations,
                "violation_count": self.report.violation_count,
                "verdict": str(self.verdict),
                "ok": self.verdict.ok,
                "unreadable": self.unreadable,
                "unreadable_count": self.verdict.unreadable_lines,
            },
            sort_keys=True,
        )
        return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def gather(
    source: Iterable[Event],
    *,
    max_lifecycles: int = MAX_LIFECYCLES,
    checker: AuditChecker | None = None,
    allow_lost: bool = False,
) -> ReportData:
    """Read the log once into the table's rows (times in ms from the first record),
    checking it with ``checker`` (by default a plain ``AuditChecker()``) in the same pass.
    The verdict counts the source's ``problem_count`` (unreadable lines) when it has one;
    ``allow_lost`` as for [`Verdict`][kvlife.fsm.audit.checker.Verdict].

    Raises:
        AuditTableMismatchError: the log was written with another table (not accepted).
    """
    if checker is None:
        checker = AuditChecker()
    found = checker.report
    entries: dict[tuple[int, int], _Entry] = {}
    births: dict[tuple[int, str], list[tuple[int, int]]] = {}  # (segment, rid) -> registrations
    total = records = 0
    t0: int | None = None
    t = 0.0
    reuses_seen = kept = 0
    for segment, r in segment_records(fed(source, checker)):
        fresh = found.violations[kept:]  # what the checker found on this record
        kept = len(found.violations)
        reuse = found.reused_while_unreleased != reuses_seen  # this record reused its rid
        reuses_seen = found.reused_while_unreleased
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
        notes = [f"VIOLATION {v.kind}: {v.message}" for v in fresh]
        entry.violations += len(notes)
        if r.ok and r.trigger == "register":
            births.setdefault((segment, entry.rid), []).append((r.t_ns, r.serial))
            if reuse:
                complete = len(found.reuses) == found.reused_while_unreleased
                previous = found.reuses[-1].previous if complete else ()
                entry.held = list(previous)
                entry.reused = ", ".join(f"#{n}" for n in previous) or "yes"
                notes.insert(
                    0,
                    f"registered while {entry.reused} still held the rid: the rid was reused; "
                    f"{entry.reused}'s copies stay theirs",
                )
        elif r.ok and r.op is not None and r.trigger in ("ack", "fail"):
            newer = reused_in_flight(
                births.get((segment, entry.rid), []),
                r.serial,
                entry.started.pop(r.op, r.t_ns),
                r.t_ns,
            )
            if newer:
                entry.late.append([r.op, max(newer)])
                notes.insert(0, late_sentence(newer, r.serial, r.op))
        elif r.ok and r.op is not None and r.trigger == "start_offload":
            entry.started[r.op] = r.t_ns
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
                    " ".join(notes),
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
    report = checker.finish()
    problems = int(getattr(source, "problem_count", 0))
    verdict = Verdict.of(report, problems, allow_lost=allow_lost)
    unreadable = [
        f"{Path(p.file).name or 'log'}:{p.line}: {p.message}"
        for p in getattr(source, "problems", [])
    ]
    return ReportData(list(entries.values()), total, records, t, report, verdict, unreadable)


def _svg(data: bytes) -> str:
    """An SVG document as an inline element (its XML prolog and doctype dropped)."""
    text = data.decode("utf-8")
    return text[text.index("<svg") :]


def build_report(
    events: Callable[[], Iterable[Event]],
    *,
    title: str = "kvlife audit log",
    accept_tables: Iterable[str] = (),
    checker: Callable[[], AuditChecker] | None = None,
    allow_lost: bool = False,
) -> tuple[str, ReportData]:
    """The page, and what its table holds. ``events`` is called once per pass (three
    passes: the diagram, the timeline, the table), each time returning the log's events
    afresh (an ``AuditReader`` is read once). ``checker`` makes a fresh checker per pass
    (``audit check``'s options: expect_released, accepted tables); by default one with
    ``accept_tables``. The verdict is the table pass's.

    Raises:
        AuditTableMismatchError: the log was written with another table (not accepted).
    """
    tables = tuple(accept_tables)

    def new_checker() -> AuditChecker:
        return checker() if checker is not None else AuditChecker(accept_tables=tables)

    notes: list[str] = []
    dot = str(log_graph(events(), title=title, checker=new_checker()).source)
    try:
        diagram = _svg(render(dot, "svg"))
    except DotNotFoundError as exc:
        diagram = ""
        notes.append(f"The diagram is left out: {exc}")
    with tempfile.TemporaryDirectory(prefix="kvlife-report-") as tmp:
        picture = Path(tmp) / "timeline.svg"
        try:
            plot_timeline(events(), picture, title=title, checker=new_checker())
            timeline = _svg(picture.read_bytes())
        except ModuleNotFoundError as exc:
            timeline = ""
            notes.append(f"The timeline is left out: {exc}")
    table_checker = new_checker()
    data = gather(events(), checker=table_checker, allow_lost=allow_lost)
    verdict = data.verdict
    fields = {
        "title": html.escape(title),
        "verdict": html.escape(f"Verdict (kvlife audit check): {verdict}"),
        "verdict_class": "failed" if not verdict.ok else "cut" if verdict.cut_short else "ok",
        "endings": "".join(
            f"<p class='ending'>{html.escape(line)}</p>"
            for line in ending_lines(table_checker.report)
        ),
        "summary": html.escape(
            f"{data.records} records, {data.total} lifecycles over {data.end_ms:.1f} ms"
        ),
        "notes": "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes),
        "diagram": diagram,
        "timeline": timeline,
        "handovers": handover_table(table_checker.report.handovers),
        "data": data.to_json(),
    }
    # One pass over the template: text put in one field is never read as another's name.
    page = _FIELD.sub(lambda m: fields[m.group(1)], _PAGE)
    return page, data


_FIELD: Final = re.compile(
    r"@(title|verdict_class|verdict|endings|summary|notes|diagram|timeline|handovers|data)@"
)

MAX_HANDOVER_ROWS: Final = 500
"""Hand-overs listed on the page (those with verdicts first); the rest are counted."""


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def handover_table(handovers: Sequence[Handover]) -> str:
    """The page's prefill/decode section: one row per request handed over between the
    logs read (prefill side, decode side, how long the prefill side held the blocks, how
    long the decode side's load took, the verdicts); empty when there is none."""
    if not handovers:
        return ""
    ordered = sorted(handovers, key=lambda h: not h.verdicts)[:MAX_HANDOVER_ROWS]
    rows = []
    for h in ordered:
        p = h.prefill
        d = h.decode[0] if h.decode else None
        load = None
        if d is not None and d.opened is not None and d.closed is not None:
            load = d.closed - d.opened
        cells = [
            html.escape(h.rid),
            html.escape(f"{Path(p.file).name} #{p.serial}" if p is not None else "not in the logs"),
            html.escape(f"{Path(d.file).name} #{d.serial} {d.rid!r}" if d else "none read it"),
            _seconds(h.held_s),
            html.escape(p.closed_by if p is not None else ""),
            _seconds(load),
            html.escape("; ".join(f"{kind}: {message}" for kind, _, message in h.verdicts)),
        ]
        css = " class='violation'" if h.verdicts else ""
        rows.append(f"<tr{css}>" + "".join(f"<td class='text'>{c}</td>" for c in cells) + "</tr>")
    more = len(handovers) - len(ordered)
    tail = f"<p>{more} more hand-overs: kvlife audit why tells each.</p>" if more > 0 else ""
    return (
        "<h2>Prefill/decode hand-overs</h2>\n<p>Requests one server's log handed over to "
        "another's (joined by the prefill engine and request id the wrapper recorded on "
        "each side); <code>kvlife audit why --rid RID</code> tells one whole.</p>\n"
        "<table id='handovers'><thead><tr><th class='text'>request (prefill id)</th>"
        "<th class='text'>prefill side</th><th class='text'>decode side</th>"
        "<th>prefill held s</th><th class='text'>freed by</th><th>decode load s</th>"
        "<th class='text'>verdicts</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
        + tail
    )


_PAGE: Final = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>@title@</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .2em; } h2 { font-size: 1.15em; margin: 1.4em 0 .5em; }
.note { color: #a63603; } .pictures svg { max-width: 100%; height: auto; }
#filters { display: flex; flex-wrap: wrap; gap: 1em; align-items: center; margin-bottom: .5em; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { cursor: pointer; background: #f4f4f4; position: sticky; top: 0; user-select: none; }
td.text, th.text { text-align: left; max-width: 28em; overflow-wrap: anywhere; }
tbody tr { cursor: pointer; } tbody tr:hover { background: #eef5fb; }
tr.selected { background: #d6e8f7 !important; }
.refused { color: #c00; } #wrap { max-height: 32em; overflow: auto; }
#verdict { font-size: 1.2em; font-weight: bold; padding: .3em .6em; display: inline-block; }
#verdict.ok { background: #e5f5e0; color: #006d2c; }
#verdict.failed { background: #fee0d2; color: #a50f15; }
#verdict.cut { background: #fff3cd; color: #7a4b00; }
p.ending { margin: .2em 0; font-family: monospace; white-space: pre-wrap; color: #7a4b00; }
tr.violation td { background: #fee0d2; } .why { color: #6a3d9a; }
#history table { margin-top: .5em; } #columns dt { font-weight: bold; display: inline; }
#columns dd { display: inline; margin: 0 1em 0 .3em; } #columns { font-size: .9em; color: #444; }
#story svg { max-width: 100%; height: auto; border: 1px solid #eee; }
a.serial { color: #08519c; }
</style></head>
<body>
<h1>@title@</h1>
<p id="verdict" class="@verdict_class@">@verdict@</p>
<div id="endings">@endings@</div>
<p id="summary">@summary@</p>
@notes@
<div id="unreadable"></div>
<div id="violations"></div>
@handovers@
<h2>Lifecycles</h2>
<div id="filters">
<label>rid contains <input id="rid-filter" type="search" placeholder="req-7"></label>
<label>outcome <select id="outcome-filter">
<option value="">any</option><option>finished</option><option>aborted</option>
<option>live</option></select></label>
<label><input id="refused-filter" type="checkbox"> with refusals</label>
<label><input id="violation-filter" type="checkbox"> with violations</label>
<label><input id="reused-filter" type="checkbox"> reused a rid while unreleased</label>
<span id="count"></span>
</div>
<div id="wrap"><table id="lifecycles"><thead><tr>
<th class="text" data-key="rid">rid</th><th data-key="serial">serial</th>
<th data-key="segment">segment</th><th class="text" data-key="outcome">outcome</th>
<th data-key="copies">copies</th><th data-key="acks">acks</th><th data-key="fails">fails</th>
<th data-key="allocated">allocated ms</th><th data-key="offloading">offloading ms</th>
<th data-key="finished_pending">finished_pending ms</th>
<th data-key="refusals">refusals</th><th data-key="violations">violations</th>
<th class="text" data-key="reused">reused rid held by</th>
</tr></thead><tbody></tbody></table></div>
<dl id="columns"></dl>
<div id="story"></div>
<div id="history"><p>Select a lifecycle to see its story and its whole history.</p></div>
<div class="pictures">
<h2>Lifecycle diagram of the whole log, with its counts and refusals</h2>
<p>Of the whole log: the filters above do not change it.</p>
@diagram@
<h2>Timeline of the whole log</h2>
<p>Of the whole log (the rows its title names): the filters above do not change it; the
story above draws the selected lifecycle's rid.</p>
@timeline@
</div>
<script id="data" type="application/json">@data@</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const rows = DATA.lifecycles;
const body = document.querySelector("#lifecycles tbody");
const TIMES = ["allocated", "offloading", "finished_pending"];
const COLUMNS = {
  rid: "the request id the lifecycle was registered under (a label: one rid can have " +
    "many lifecycles)",
  serial: "the lifecycle's number, never reused within its segment; #N links to it",
  segment: "which writer wrote it: each time a log is opened is a segment, with its own " +
    "serials (0 for a log written once)",
  outcome: "finished (host copies kept), aborted (discarded) or live (neither at the end " +
    "of the log)",
  copies: "copies started (start_offload)", acks: "copies that completed",
  fails: "copies that failed",
  allocated: "ms in allocated (no copy in flight)",
  offloading: "ms in offloading (copies in flight)",
  finished_pending: "ms finished or aborted with copies still in flight",
  refusals: "calls refused on it (late or repeated deliveries, calls its state does not allow)",
  violations: "records the checker found wrong on it",
  reused: "the lifecycles that still held its rid, unreleased, when it was registered",
};
let sortKey = "serial", sortUp = true, selected = null;

function value(row, key) {
  return TIMES.includes(key) ? row.time[key] : row[key];
}
function naturalCompare(a, b) {
  return String(a).localeCompare(String(b), undefined, {numeric: true});
}
function find(segment, serial) {
  return rows.find(r => r.serial === serial && r.segment === segment);
}
function link(serial, segment, text) {
  const a = document.createElement("a");
  a.className = "serial";
  a.href = `#lc-${segment}-${serial}`;
  a.textContent = text === undefined ? `#${serial}` : text;
  return a;
}
// Text with every "#N" made a link to lifecycle N of the same segment (when listed).
function linked(parent, text, segment) {
  const parts = String(text).split(/(#\d+)/);
  for (const part of parts) {
    const m = /^#(\d+)$/.exec(part);
    if (m && find(segment, Number(m[1]))) parent.appendChild(link(Number(m[1]), segment));
    else if (part) parent.appendChild(document.createTextNode(part));
  }
}
function cell(tr, text, cls, segment) {
  const td = document.createElement("td");
  if (segment === undefined) td.textContent = text; else linked(td, text, segment);
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}
function render() {
  const ridText = document.getElementById("rid-filter").value.toLowerCase();
  const outcome = document.getElementById("outcome-filter").value;
  const refusedOnly = document.getElementById("refused-filter").checked;
  const violatingOnly = document.getElementById("violation-filter").checked;
  const reusedOnly = document.getElementById("reused-filter").checked;
  const shown = rows.filter(r =>
    r.rid.toLowerCase().includes(ridText) &&
    (!outcome || r.outcome === outcome) && (!refusedOnly || r.refusals > 0) &&
    (!violatingOnly || r.violations > 0) && (!reusedOnly || r.reused !== ""));
  shown.sort((a, b) => {
    const x = value(a, sortKey), y = value(b, sortKey);
    const c = typeof x === "number" && typeof y === "number" ? x - y : naturalCompare(x, y);
    return (sortUp ? c : -c) || a.segment - b.segment || a.serial - b.serial;
  });
  body.replaceChildren();
  for (const r of shown) {
    const tr = document.createElement("tr");
    tr.dataset.index = rows.indexOf(r);
    if (r === selected) tr.className = "selected";
    cell(tr, r.rid, "text");
    const serial = cell(tr, "");
    serial.appendChild(link(r.serial, r.segment, String(r.serial)));
    cell(tr, r.segment); cell(tr, r.outcome, "text");
    cell(tr, r.copies); cell(tr, r.acks); cell(tr, r.fails);
    for (const k of TIMES) cell(tr, r.time[k].toFixed(3));
    cell(tr, r.refusals, r.refusals ? "refused" : "");
    cell(tr, r.violations, r.violations ? "refused" : "");
    cell(tr, r.reused, "text", r.segment);
    body.appendChild(tr);
  }
  const left = DATA.total - rows.length;
  document.getElementById("count").textContent =
    `showing ${shown.length} of ${rows.length} lifecycles` +
    (left > 0 ? ` (${left} more in the log are not listed)` : "");
}

// --- the story of the selected lifecycle's rid, drawn as `kvlife audit why -o` draws it
const SVG = "http://www.w3.org/2000/svg";
const COLOURS = {allocated: "#9ecae1", offloading: "#3182bd", finished_pending: "#fd8d3c"};
const MARKS = {stale_instance: "\u00d7", duplicate_ack: "+"};
function el(name, attrs, parent, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}
const MAX_LANES = 20;  // as `kvlife audit why -o` draws at most
// The rid's lifecycles of r's segment, at most MAX_LANES of them around r.
function nearby(r) {
  const all = rows.filter(x => x.rid === r.rid && x.segment === r.segment)
    .sort((a, b) => a.serial - b.serial);
  const at = all.indexOf(r);
  const first = Math.max(0, Math.min(at - MAX_LANES / 2, all.length - MAX_LANES));
  return [all.slice(first, first + MAX_LANES), all.length];
}
function lanesOf(shown) {
  return shown.map(x => {
      const lane = {row: x, spans: [], copies: [], refusals: [], registered: null};
      let state = "", since = 0;
      const started = {};
      for (const [t, trigger, src, dst, ok, reason, op] of x.history) {
        if (!ok) { lane.refusals.push([t, reason, op]); continue; }
        if (trigger === "register") lane.registered = t;
        if (trigger === "start_offload" && op !== null) started[op] = t;
        if ((trigger === "ack" || trigger === "fail") && op !== null && op in started) {
          lane.copies.push({op: op, start: started[op], end: t, ok: trigger === "ack"});
          delete started[op];
        }
        if (dst !== state) {
          if (state) lane.spans.push([since, t, state]);
          state = dst === "released" ? "" : dst; since = t;
        }
      }
      for (const op in started) {
        lane.copies.push({op: Number(op), start: started[op], end: null, ok: true});
      }
      if (state) lane.spans.push([since, null, state]);
      return lane;
    });
}
function drawStory(r) {
  const box = document.getElementById("story");
  box.replaceChildren();
  const [shown, total] = nearby(r);
  const lanes = lanesOf(shown);
  const h = document.createElement("h2");
  const plural = lanes.length === 1 ? "" : "s";
  h.textContent = `Story of rid ${r.rid}: ${lanes.length} lifecycle${plural}` +
    (total > lanes.length ? ` of its ${total}, around #${r.serial}` : "");
  box.appendChild(h);
  let t0 = Infinity, t1 = -Infinity;
  for (const lane of lanes) {
    for (const [t] of lane.row.history) { t0 = Math.min(t0, t); t1 = Math.max(t1, t); }
  }
  if (!(t1 > t0)) t1 = t0 + 1;
  const width = 1200, left = 60, right = 20, laneH = 28, copyH = 13;
  const x = t => left + (t - t0) / (t1 - t0) * (width - left - right);
  let y = 10;
  const base = {};
  const svg = el("svg", {width: width, xmlns: SVG, "font-family": "sans-serif", "font-size": 13});
  const levelsOf = lane => {
    const busy = [], level = {};
    for (const c of [...lane.copies].sort((a, b) => a.start - b.start)) {
      const label = x(c.start) + 7 * (String(c.op).length + 1);
      const stop = Math.max(x(c.end === null ? t1 : c.end), label);
      let i = busy.findIndex(b => b < x(c.start));
      if (i < 0) { i = busy.length; busy.push(0); }
      busy[i] = stop; level[c.op] = i;
    }
    return [level, busy.length];
  };
  for (const lane of lanes) {
    const [level, n] = levelsOf(lane);
    const top = y + n * copyH + (n ? 12 : 0);
    base[lane.row.serial] = top + laneH / 2;
    const g = el("g", {id: `lane-${lane.row.serial}`}, svg);
    el("text", {x: 4, y: top + laneH / 2 + 4}, g, `#${lane.row.serial}`);
    for (const [a, b, state] of lane.spans) {
      el("rect", {x: x(a), y: top, width: Math.max(x(b === null ? t1 : b) - x(a), 3), height: laneH,
                  fill: COLOURS[state] || "gray"}, g);
    }
    for (const c of lane.copies) {
      const cy = top - 6 - level[c.op] * copyH;
      const cg = el("g", {id: `copy-${c.op}`}, svg);
      const x2 = Math.max(x(c.end === null ? t1 : c.end), x(c.start) + 3);
      el("line", {x1: x(c.start), x2: x2, y1: cy, y2: cy,
                  stroke: c.ok ? "#31a354" : "#d62728", "stroke-width": 3,
                  "stroke-dasharray": c.end === null ? "2 2" : "none"}, cg);
      el("text", {x: x(c.start), y: cy - 3, "font-size": 11}, cg, String(c.op));
    }
    for (const [t, reason] of lane.refusals) {
      el("text", {x: x(t) - 4, y: top + laneH / 2 + 4, fill: "#d62728", "font-weight": "bold",
                  "font-size": 14}, g, MARKS[reason] || "*")
        .appendChild(el("title", {}, null, reason));
    }
    y = top + laneH + 16;
  }
  // The reuses and late completions are the page's data (the checker's and `why`'s
  // rules, applied when the page was written): drawn, not worked out again here.
  let reuses = 0;
  for (const lane of lanes) {
    for (const older of lane.row.held) {
      if (lane.registered === null || !(older in base)) continue;
      const g = el("g", {id: `reuse-${reuses++}`}, svg);
      el("line", {x1: x(lane.registered), x2: x(lane.registered), y1: base[older],
                  y2: base[lane.row.serial], stroke: "#6a3d9a", "stroke-width": 2}, g);
    }
  }
  for (const lane of lanes) for (const [op, holder] of lane.row.late) {
    const c = lane.copies.find(copy => copy.op === op);
    if (!c || !(holder in base)) continue;
    const g = el("g", {id: `late-${c.op}`}, svg);
    el("line", {x1: x(c.end) + 8, y1: base[holder], x2: x(c.end), y2: base[lane.row.serial] + 6,
                stroke: "#e6550d", "stroke-width": 2}, g);
    el("text", {x: x(c.end) + 10, y: base[holder] + 22, fill: "#e6550d"}, g,
       `copy ${c.op} completes #${lane.row.serial} (its ticket), not #${holder}`);
  }
  svg.setAttribute("height", y + 10);
  svg.setAttribute("viewBox", `0 0 ${width} ${y + 10}`);
  box.appendChild(svg);
  const p = document.createElement("p");
  p.textContent = "Lanes: the rid's lifecycles, coloured by state (allocated light blue, " +
    "offloading blue, finished_pending orange); above each, its copies from start to completion " +
    "(green; red failed; dotted still in flight); \u00d7 a late delivery after release, + a " +
    "repeated delivery; purple: the rid taken while an older lifecycle held it; orange: a late " +
    "completion, applied to its ticket's lifecycle.";
  box.appendChild(p);
}
function showHistory(r) {
  selected = r;
  drawStory(r);
  const box = document.getElementById("history");
  box.replaceChildren();
  const h = document.createElement("h2");
  h.textContent = `History of ${r.rid} #${r.serial}` +
    (r.segment ? ` (segment ${r.segment})` : "") + `: ${r.outcome}, ${r.state} at the end`;
  box.appendChild(h);
  const table = document.createElement("table");
  const head = document.createElement("tr");
  for (const name of ["ms", "trigger", "copy", "from", "to", "in flight", "refused", "detail",
                      "why"]) {
    const th = document.createElement("th");
    th.textContent = name;
    if (!["ms", "copy", "in flight"].includes(name)) th.className = "text";
    head.appendChild(th);
  }
  table.appendChild(head);
  for (const [t, trigger, src, dst, ok, reason, op, inflight, detail, why] of r.history) {
    const tr = document.createElement("tr");
    if (!ok) tr.className = "refused";
    if (why.includes("VIOLATION")) tr.className = "violation";
    cell(tr, t.toFixed(3)); cell(tr, trigger, "text"); cell(tr, op === null ? "" : op);
    cell(tr, src || "", "text"); cell(tr, dst || "", "text"); cell(tr, inflight);
    cell(tr, ok ? "" : reason, "text"); cell(tr, detail, "text");
    cell(tr, why, "text why", r.segment);
    table.appendChild(tr);
  }
  box.appendChild(table);
  if (r.more) {
    const p = document.createElement("p");
    p.textContent = `... ${r.more} more records`;
    box.appendChild(p);
  }
  render();
}
document.querySelectorAll("#lifecycles th").forEach(th => {
  th.title = COLUMNS[th.dataset.key] || "";
  th.addEventListener("click", () => {
    const key = th.dataset.key;
    sortUp = key === sortKey ? !sortUp : true;
    sortKey = key;
    render();
  });
});
function showColumns() {
  const box = document.getElementById("columns");
  for (const th of document.querySelectorAll("#lifecycles th")) {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = th.textContent; dd.textContent = COLUMNS[th.dataset.key];
    box.append(dt, dd);
  }
}
// "... N more" under a list that holds only the first ones
function more(box, left) {
  if (left <= 0) return;
  const p = document.createElement("p");
  p.textContent = `... ${left} more`;
  box.appendChild(p);
}
function showUnreadable() {
  if (!DATA.unreadable_count) return;
  const box = document.getElementById("unreadable");
  const h = document.createElement("h2");
  h.textContent =
    `Unreadable lines (${DATA.unreadable_count}): skipped, never joined with a neighbour`;
  box.appendChild(h);
  const list = document.createElement("ul");
  for (const line of DATA.unreadable) {
    const li = document.createElement("li");
    li.textContent = line;
    list.appendChild(li);
  }
  box.appendChild(list);
  more(box, DATA.unreadable_count - DATA.unreadable.length);
}
function showViolations() {
  const box = document.getElementById("violations");
  if (!DATA.violations.length) return;
  const h = document.createElement("h2");
  h.textContent = `Violations (${DATA.violation_count})`;
  box.appendChild(h);
  const table = document.createElement("table");
  table.id = "violation-table";
  const head = document.createElement("tr");
  for (const name of ["rid", "serial", "seq", "kind", "what it means", "detail"]) {
    const th = document.createElement("th");
    th.textContent = name;
    th.className = "text";
    head.appendChild(th);
  }
  table.appendChild(head);
  for (const v of DATA.violations) {
    const tr = document.createElement("tr");
    const row = find(v.segment, v.serial);
    cell(tr, v.rid === null ? "" : v.rid, "text");
    cell(tr, v.serial === null ? "" : `#${v.serial}`, "text", v.segment);
    cell(tr, v.seq === null ? "" : v.seq, "text");
    cell(tr, v.kind, "text refused"); cell(tr, v.meaning, "text"); cell(tr, v.message, "text");
    if (row) tr.addEventListener("click", () => {
      showHistory(row);
      document.getElementById("story").scrollIntoView();
    });
    table.appendChild(tr);
  }
  box.appendChild(table);
  more(box, DATA.violation_count - DATA.violations.length);
}
for (const id of ["rid-filter", "outcome-filter", "refused-filter", "violation-filter",
                  "reused-filter"]) {
  document.getElementById(id).addEventListener("input", render);
}
body.addEventListener("click", event => {
  if (event.target.closest("a")) return;  // a link: the address says which
  const tr = event.target.closest("tr");
  if (tr) showHistory(rows[Number(tr.dataset.index)]);
});
function followAddress() {
  const m = /^#lc-(\d+)-(\d+)$/.exec(location.hash);
  const row = m && find(Number(m[1]), Number(m[2]));
  if (row) {
    showHistory(row);
    document.getElementById("story").scrollIntoView();
  }
}
window.addEventListener("hashchange", followAddress);
showUnreadable();
showViolations();
showColumns();
render();
followAddress();
</script>
</body></html>
"""

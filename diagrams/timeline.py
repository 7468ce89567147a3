"""A timeline of an audit log: one row per lifecycle instance (rid + serial), coloured by
state over time. The log is checked in the same pass, as ``kvlife audit check`` checks it:
every registration of a rid that another lifecycle still held (not released) is drawn as
a purple connector from the old row to the new one at that moment, every record the
checker finds wrong as a red diamond on its row, and the title counts both.

Needs matplotlib (the ``plot`` extra: ``pip install 'kvlife[plot]'``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from kvlife.diagrams.dot import shortened
from kvlife.fsm.audit import (
    REGISTER,
    AuditChecker,
    AuditLog,
    AuditReader,
    AuditRecord,
    AuditReport,
    Event,
    Segment,
)
from kvlife.fsm.table import State

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes

COLOURS: Final = {
    State.ALLOCATED.value: "#9ecae1",
    State.OFFLOADING.value: "#3182bd",
    State.FINISHED_PENDING.value: "#fd8d3c",
}
"""Colour per state (released is not drawn: the row ends there)."""
REUSE_COLOUR: Final = "#6a3d9a"
"""The connector from an old row to the new one that reused its rid."""
REFUSAL_MARKS: Final = {
    "stale_instance": ("x", "#d62728", "late delivery after release (stale_instance)"),
    "duplicate_ack": ("+", "#d62728", "repeated delivery (duplicate_ack)"),
    "rid_conflict": ("s", "#8c564b", "rid taken while held (rid_conflict)"),
    "invalid_transition": ("v", "#7f7f7f", "not allowed in its state (invalid_transition)"),
    "stray_report": ("*", "#e377c2", "report no open ticket explains (stray_report)"),
    "connector_raised": ("P", "#e377c2", "the connector raised (connector_raised)"),
    "event_mismatch": ("h", "#e377c2", "KV event against the engine's hashes (event_mismatch)"),
    "overdue": ("^", "#fd8d3c", "ticket open past its limit (overdue)"),
    "credited_elsewhere": (">", "#e377c2", "completion credited to another request"),
    "inherited_state": ("<", "#e377c2", "state of another request of its id (inherited_state)"),
}
"""Marker, colour and legend text per refusal reason, a watched connector's verdicts
included; other reasons (lookups that found nothing, a registration refused) share
``OTHER_REFUSAL``."""
OTHER_REFUSAL: Final = ("*", "#e377c2", "other refusal")
MAX_REFUSALS_PER_ROW: Final = 200
"""Refusal marks kept per row (a flood of stale deliveries draws as one smear anyway)."""


@dataclass
class Row:
    """One lifecycle instance's history: (start, end, state) spans, refusal times and each
    refusal's reason (``reasons[i]`` for ``refusals[i]``)."""

    serial: int
    rid: str
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    refusals: list[float] = field(default_factory=list)
    released: bool = False
    segment: int = 0
    reasons: list[str] = field(default_factory=list)


_DIGITS: Final = re.compile(r"(\d+)")


def natural_key(rid: str) -> tuple[str | int, ...]:
    """Sort key that puts ``req-2`` before ``req-10``."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(_DIGITS.split(rid)))


MAX_ROWS: Final = 200
"""The most rows a timeline draws, whatever is asked: a taller picture is unreadable."""


@dataclass(frozen=True)
class Reuse:
    """A rid registered again while ``old`` (a (segment, serial)) still held it: ``new``
    took it at ``t`` ms."""

    t: float
    old: tuple[int, int]
    new: tuple[int, int]


@dataclass(frozen=True)
class ViolationMark:
    """A record of ``row`` (a (segment, serial)) at ``t`` ms that the checker found wrong."""

    t: float
    row: tuple[int, int]
    kinds: tuple[str, ...]


@dataclass
class Timeline:
    """The rows kept, in natural (rid, segment, serial) order; ``lifecycles`` and
    ``rids`` count the instances and distinct rids of the log (of the rids asked for).
    ``report`` is the check of the whole log; ``reuses`` (the first
    [`MAX_REUSES`][kvlife.fsm.audit.checker.MAX_REUSES]) and ``violations`` are its marks, also
    those on rows not kept."""

    rows: list[Row]
    end: float
    lifecycles: int
    rids: int = 0
    report: AuditReport = field(default_factory=AuditReport)
    reuses: list[Reuse] = field(default_factory=list)
    violations: list[ViolationMark] = field(default_factory=list)


def build_timeline(
    source: AuditReader | AuditLog | Iterable[Event],
    *,
    max_rows: int | None = None,
    rids: Collection[str] | None = None,
    checker: AuditChecker | None = None,
    accept_tables: Collection[str] = (),
) -> Timeline:
    """Replay a log into rows (times in ms from the first record), in one pass, checking
    it with ``checker`` (finished when this returns; by default one with
    ``accept_tables``).

    With ``max_rows``, only that many rows are kept while reading, shared out fairly: every
    rid's first instance comes before any rid's second one (then rid order), so one rid
    with 600 lifecycles cannot push the others out. Memory stays bounded by the rows kept
    plus one counter per rid. ``rids`` keeps only the instances of those rids. Each
    segment is its own serial space: a row is one (segment, serial).

    Raises:
        AuditTableMismatchError: the log was written with another table (not accepted).
    """
    events = source.events() if isinstance(source, AuditLog) else source
    if checker is None:
        checker = AuditChecker(accept_tables=accept_tables)
    feed, found = checker.feed, checker.report
    marks: list[ViolationMark] = []
    wanted = None if rids is None else set(rids)
    kept: dict[tuple[int, int], Row] = {}
    keys: dict[tuple[int, int], tuple[object, ...]] = {}  # kept rows only: their priority
    per_rid: dict[str, int] = {}  # instances met per rid
    cutoff: tuple[object, ...] | None = None  # instances at or past it are not drawn
    current: dict[tuple[int, int], tuple[float, str]] = {}  # kept and unreleased
    lifecycles = 0
    segment = 0
    first_registered: int | None = None  # serials below it began before the log did
    t0: int | None = None
    t = 0.0
    for event in events:
        before = found.violation_count
        feed(event)
        if type(event) is Segment:
            segment, first_registered = event.index, None
            continue
        if type(event) is not AuditRecord:
            continue
        r = event
        if t0 is None:
            t0 = r.t_ns
        t = (r.t_ns - t0) / 1e6
        serial = r.serial
        if found.violation_count != before and serial is not None:
            kinds = tuple(v.kind for v in found.violations[before:])
            marks.append(ViolationMark(t, (segment, serial), kinds))
        if serial is None:
            continue
        ident = (segment, serial)
        row = kept.get(ident)
        if row is None:
            rid = r.rid or ""
            if wanted is not None and rid not in wanted:
                continue
            if r.trigger == REGISTER:
                lifecycles += 1
                if first_registered is None:
                    first_registered = serial
            elif not r.ok or (first_registered is not None and serial >= first_registered):
                continue  # an instance that is not drawn
            elif r.src is None:
                continue
            else:
                lifecycles += 1  # met mid-history: the log began after its registration
            nth = per_rid.get(rid, 0)
            per_rid[rid] = nth + 1
            key = (nth, natural_key(rid), segment, serial)
            if cutoff is not None and key >= cutoff:
                continue
            row = kept[ident] = Row(serial, rid, segment=segment)
            keys[ident] = key
            if r.trigger != REGISTER:
                current[ident] = (t, r.src or "")
            if max_rows is not None and len(kept) > max_rows:
                drop = max(kept, key=keys.__getitem__)
                cutoff = keys.pop(drop)
                del kept[drop]
                current.pop(drop, None)
                if drop == ident:
                    continue
        if not r.ok:
            if len(row.refusals) < MAX_REFUSALS_PER_ROW:
                row.refusals.append(t)
                row.reasons.append(r.reason or "")
            continue
        since, state = current.get(ident, (t, ""))
        if r.dst == state:
            continue  # offloading -> offloading: one span
        if state:
            row.spans.append((since, t, state))
        if r.dst == State.RELEASED.value:
            row.released = True
            current.pop(ident, None)
        elif r.dst is not None:
            current[ident] = (t, r.dst)
    for ident, (since, state) in current.items():
        kept[ident].spans.append((since, t, state))
    rows = sorted(kept.values(), key=lambda row: (natural_key(row.rid), row.segment, row.serial))
    report = checker.finish()
    start = t0 or 0
    reuses = [
        Reuse((u.t_ns - start) / 1e6, (u.segment, u.previous[-1]), (u.segment, u.serial))
        for u in report.reuses
    ]
    return Timeline(rows, t, lifecycles, len(per_rid), report, reuses, marks)


def timeline_rows(source: AuditReader | AuditLog | Iterable[Event]) -> tuple[list[Row], float]:
    """Every row of a (small) log and the end time; see
    [`build_timeline()`][kvlife.diagrams.timeline.build_timeline]."""
    timeline = build_timeline(source)
    return sorted(timeline.rows, key=lambda row: (row.segment, row.serial)), timeline.end


def plot_timeline(
    source: AuditReader | AuditLog | Iterable[Event],
    path: Path,
    *,
    title: str = "kvlife lifecycles",
    max_rows: int = 80,
    rids: Collection[str] | None = None,
    checker: AuditChecker | None = None,
    accept_tables: Collection[str] = (),
) -> int:
    """Draw the timeline to ``path`` (PNG or SVG by suffix); return the rows drawn.
    ``checker`` and ``accept_tables``: as for
    [`build_timeline()`][kvlife.diagrams.timeline.build_timeline].

    Rows are grouped by rid in natural order (``req-2`` before ``req-10``), then segment and
    serial, so the instances that reused a rid sit one under the other and overlaps show. At
    most ``max_rows`` rows are drawn (never more than
    [`MAX_ROWS`][kvlife.diagrams.timeline.MAX_ROWS]), picked as
    [`build_timeline()`][kvlife.diagrams.timeline.build_timeline] says; the title says what
    was left out, and ``rids`` draws just the rids you name. Every span and refusal is drawn
    at least a few pixels wide, so a short ``finished_pending`` after a rid reuse shows at
    any zoom. Rids are cut to 24 characters. Rid reuses and violations are marked (SVG
    element ids ``reuse-N`` and ``violation-N``) where both rows are drawn; the title counts
    all of them. Raises ``ModuleNotFoundError`` with an install hint without matplotlib,
    ``AuditTableMismatchError`` as ``build_timeline()``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ModuleNotFoundError as exc:  # pragma: no cover - the plot extra is installed in CI
        raise ModuleNotFoundError(
            "the timeline needs matplotlib: pip install 'kvlife[plot]'"
        ) from exc
    timeline = build_timeline(
        source,
        max_rows=min(max_rows, MAX_ROWS),
        rids=rids,
        checker=checker,
        accept_tables=accept_tables,
    )
    shown, end = timeline.rows, timeline.end
    y_of = {(row.segment, row.serial): y for y, row in enumerate(shown)}
    height = 1.6 + 0.2 * max(len(shown), 1)
    fig, ax = plt.subplots(figsize=(11, min(height, 42)), dpi=110)
    least = max(end, 1e-6) * 0.006  # about 6 px of the plot's width
    reasons_seen: dict[str, tuple[str, str]] = {}  # legend text -> (marker, colour)
    for y, row in enumerate(shown):
        for start, stop, state in row.spans:
            pending = state == State.FINISHED_PENDING.value
            ax.broken_barh(
                [(start, max(stop - start, least))],
                (y - 0.4, 0.8),
                facecolors=COLOURS.get(state, "gray"),
                edgecolor="#a63603" if pending else "none",
                linewidth=0.8,
                zorder=3 if pending else 2,
            )
        by_reason: dict[str, list[float]] = {}
        for t, reason in zip(row.refusals, row.reasons, strict=True):
            by_reason.setdefault(reason if reason in REFUSAL_MARKS else "", []).append(t)
        for reason, times in by_reason.items():
            marker, colour, text = REFUSAL_MARKS.get(reason, OTHER_REFUSAL)
            reasons_seen[text] = (marker, colour)
            ax.plot(
                times,
                [y] * len(times),
                marker,
                color=colour,
                markersize=6,
                markeredgewidth=1.5,
                zorder=4,
                clip_on=False,
            )
    reuses_drawn = 0
    for reuse in timeline.reuses:
        old, new = y_of.get(reuse.old), y_of.get(reuse.new)
        if old is None or new is None:
            continue
        (line,) = ax.plot(
            [reuse.t, reuse.t],
            [old, new],
            color=REUSE_COLOUR,
            linewidth=2,
            marker="o",
            markersize=5,
            zorder=7,  # above refusal marks
        )
        line.set_gid(f"reuse-{reuses_drawn}")
        reuses_drawn += 1
    violations_drawn = 0
    for mark in timeline.violations:
        row_y = y_of.get(mark.row)
        if row_y is None:
            continue
        (point,) = ax.plot(
            [mark.t], [row_y], "D", color="red", markersize=8, markeredgecolor="black", zorder=8
        )
        point.set_gid(f"violation-{violations_drawn}")
        violations_drawn += 1
    for y in range(1, len(shown)):
        if shown[y].rid != shown[y - 1].rid:
            ax.axhline(y - 0.5, color="gray", linewidth=0.5)
    ax.set_yticks(range(len(shown)))
    segments = len({row.segment for row in shown}) > 1
    ax.set_yticklabels(
        [
            f"{shortened(row.rid, 24)} #{row.serial}" + (f" s{row.segment}" if segments else "")
            for row in shown
        ],
        fontsize=7,
    )
    ax.set_ylim(max(len(shown), 1) - 0.5, -0.5)  # top to bottom, no empty band
    ax.set_xlim(0, max(end, 1e-6) * 1.01)
    ax.set_xlabel("time since the first record (ms)")
    ax.set_ylabel("rid #serial: one row per lifecycle" + (", s: segment" if segments else ""))
    shown_rids = len({row.rid for row in shown})
    report = timeline.report
    reuses = report.reused_while_unreleased
    counts = (
        f"{_plural(report.violation_count, 'violation')}; {_plural(reuses, 'reuse')} of a rid "
        "while its earlier lifecycle was unreleased"
    )
    if violations_drawn < report.violation_count or reuses_drawn < len(timeline.reuses):
        counts += (
            f" ({reuses_drawn} of the reuses and {violations_drawn} of the violations "
            "on the rows shown)"
        )
    note = ""
    if timeline.lifecycles > len(shown):
        note = (
            f"\n{len(shown)} of {timeline.lifecycles} lifecycles and {shown_rids} of "
            f"{timeline.rids} rids shown: each rid's first lifecycle, then each one's second, "
            "and so on, in rid order"
        )
    ax.set_title(f"{shortened(title, 80)}: {counts}{note}", fontsize=9)
    if report.violation_count:
        ax.title.set_color("red")
    handles: list[Artist] = [Patch(color=colour, label=state) for state, colour in COLOURS.items()]
    handles += mark_handles(
        [(marker, colour, text) for text, (marker, colour) in reasons_seen.items()],
        reuse="rid reused: old row to new row",
        violation=True,
    )
    # under the plot, never over a row
    legend_below(ax, handles, drop=0.5 / max(height, 1.0) + 0.02, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return len(shown)


def mark_handles(
    reasons: Iterable[tuple[str, str, str]], *, reuse: str | None, violation: bool
) -> list[Artist]:
    """Legend entries for the marks the timeline and the story share: one per refusal
    reason drawn ((marker, colour, text), as in ``REFUSAL_MARKS``), the rid reuse (labelled
    ``reuse``; none when ``None``) and the violation diamond (when ``violation``)."""
    from matplotlib.lines import Line2D

    handles: list[Artist] = [
        Line2D([], [], marker=marker, color=colour, linestyle="none", label=text)
        for marker, colour, text in reasons
    ]
    if reuse is not None:
        handles.append(Line2D([], [], color=REUSE_COLOUR, marker="o", label=reuse))
    if violation:
        handles.append(
            Line2D(
                [],
                [],
                marker="D",
                color="red",
                markeredgecolor="black",
                linestyle="none",
                label="violation",
            )
        )
    return handles


def legend_below(ax: Axes, handles: list[Artist], *, drop: float, fontsize: float) -> None:
    """The legend under the plot (``drop``: how far below the axes, as a fraction of their
    height), never over a row or a lane, and the time grid: how the timeline and the story
    finish their axes."""
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0, -drop),
        ncol=3,
        fontsize=fontsize,
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"

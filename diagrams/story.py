"""The story of one rid as a picture: what ``kvlife audit why`` tells, drawn.

One lane per lifecycle that held the rid (``#serial``), coloured by state over time as in
the timeline; above each lane its copies, each a span from its start to its completion
labelled with its copy number, in the writer's words where its record says what it is
(``delayed free 4 (finished_sending)``, ``load 2 (cut by finished_recving)``, ``store 7``;
red when it failed); refused deliveries marked on the lane,
one mark per reason; the moment a newer lifecycle took the rid while an older one was
unreleased (a reuse), a purple line from the old lane to the new one; and for a late
completion (the rid was reused while the copy was in flight), an arrow from the newest
lane that held the rid when the copy completed (where a rid-keyed bookkeeping would have
applied it) to the lifecycle its ticket named, which is the one it completed. Records the
checker finds wrong are red diamonds, each labelled with its verdict and the record's
reason (``stray_report: repeated``).

[`build_story()`][kvlife.diagrams.story.build_story] reads the log once and keeps only the
rid's records; [`plot_story()`][kvlife.diagrams.story.plot_story] draws it (PNG or SVG by
suffix). The SVG's elements carry ids a test or a script can find: ``lane-SERIAL``,
``copy-OP`` (the span) and ``copy-label-OP``, ``refused-N``, ``reuse-N``, ``late-OP`` (the
arrow; its label names the target ``#serial``), ``violation-N`` and
``violation-label-N``.

Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from kvlife.diagrams.dot import shortened
from kvlife.diagrams.timeline import (
    COLOURS,
    OTHER_REFUSAL,
    REFUSAL_MARKS,
    REUSE_COLOUR,
    legend_below,
    mark_handles,
)
from kvlife.fsm.audit import AuditChecker, AuditLog, AuditReader, Event
from kvlife.fsm.audit.checker import Violation
from kvlife.fsm.audit.explain import (
    RidHistory,
    ended_by,
    held_at_registration,
    read_story,
    registrations,
    reused_in_flight,
)
from kvlife.fsm.audit.records import REGISTER
from kvlife.fsm.table import State

LATE_COLOUR: Final = "#e6550d"
"""The late-completion arrow."""
HANDOVER_COLOUR: Final = "#3182bd"
"""The prefill/decode hand-over arrow."""


@dataclass(frozen=True)
class Copy:
    """One copy (ticket) of a lifecycle: started at ``start`` ms, completed at ``end``
    (``None``: still in flight at the end of the log), ``ok`` unless it failed. ``kind``:
    what the writer said it is (``store``, ``load``, ``delayed_free``, ``flush``; empty
    when it said nothing); ``ended_by``: the report or cut that ended it, as its
    completion record says (``finished_sending``, ``cut by finished_recving``, ...)."""

    op: int
    serial: int
    start: float
    end: float | None
    ok: bool = True
    kind: str = ""
    ended_by: str = ""

    @property
    def label(self) -> str:
        """``7``, or in the writer's words: ``delayed free 7 (finished_sending)``."""
        name = f"{self.kind.replace('_', ' ')} {self.op}" if self.kind else str(self.op)
        return f"{name} ({self.ended_by})" if self.ended_by else name


def verdict_label(kinds: Sequence[str], detail: Mapping[str, object]) -> str:
    """A violation mark's words: its kinds and the record's reason for each
    (``stray_report: repeated``, ``connector_raised: update_connector_output``)."""
    why = detail.get("why") or detail.get("call") or detail.get("kind") or ""
    said = ", ".join(kinds)
    return f"{said}: {why}" if why else said


@dataclass(frozen=True)
class LateCompletion:
    """Copy ``op`` of lifecycle ``ticket`` completed at ``t`` ms, after the rid was taken
    by ``holder`` (the newest lifecycle holding the rid then): it completed ``ticket``.
    Both lifecycles are of ``segment``."""

    op: int
    t: float
    ticket: int
    holder: int
    segment: int = 0


MAX_LANES: Final = 20
"""Lifecycles drawn per story (as ``kvlife audit why`` tells at most 20); the title says
how many the rid has."""


@dataclass
class Lane:
    """One lifecycle of the rid: its state spans, copies and refusals (times in ms)."""

    serial: int
    segment: int
    registered: float | None
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    refusals: list[tuple[float, str, int | None]] = field(default_factory=list)
    released: float | None = None
    #: The request id, drawn when the story has lanes of other rids (the other side of a
    #: prefill/decode hand-over, ``other``).
    rid: str = ""
    other: bool = False


@dataclass
class Story:
    """What the picture draws: the lanes in (segment, serial) order, the reuses (time,
    segment, old serial, new serial), the late completions and the checker's marks (time,
    segment, serial, kinds), with the log's end time. ``total``: the rid's lifecycles in
    the log (more than ``lanes`` when some were left out)."""

    rid: str
    lanes: list[Lane]
    reuses: list[tuple[float, int, int, int]]
    late: list[LateCompletion]
    violations: list[tuple[float, int, int, tuple[str, ...]]]
    end: float
    total: int = 0
    #: The words of each violation mark, in ``violations``' order.
    verdicts: list[str] = field(default_factory=list)
    #: Prefill/decode hand-overs: (prefill side's finish in ms, its lane's key, decode
    #: side's load start in ms, its lane's key).
    handovers: list[tuple[float, tuple[int, int], float, tuple[int, int]]] = field(
        default_factory=list
    )


def story_of(
    history: RidHistory,
    marks: Mapping[tuple[int, int], Sequence[Violation]],
    *,
    around: tuple[int, int] | None = None,
    max_lanes: int = MAX_LANES,
) -> Story:
    """The picture's content from ``collect``'s history of a rid and the checker's
    violations by (segment, seq) (``violations_by_record``). At most ``max_lanes``
    lifecycles are kept: the first ones, or those nearest lifecycle ``around`` (a
    (segment, serial)) in serial order."""
    t0 = history.t0 or 0
    lanes: list[Lane] = []
    violations: list[tuple[float, int, int, tuple[str, ...]]] = []
    verdicts: list[str] = []
    reuses: list[tuple[float, int, int, int]] = []
    late: list[LateCompletion] = []
    births = registrations(history)  # the rules are explain's: the words and the picture agree

    def ms(t_ns: int) -> float:
        return (t_ns - t0) / 1e6

    ordered = sorted(history.lifecycles.values(), key=lambda h: (h.segment, h.serial))
    total = len(ordered)
    end = max((ms(h.records[-1].t_ns) for h in ordered if h.records), default=0.0)
    if total > max_lanes:  # the lanes drawn are chosen first: nothing is worked out for others
        keys = [(h.segment, h.serial) for h in ordered]
        at = keys.index(around) if around in keys else 0
        first = max(0, min(at - max_lanes // 2, total - max_lanes)) if around in keys else 0
        ordered = ordered[first : first + max_lanes]
    kept = {(h.segment, h.serial) for h in ordered}
    partners = sorted(history.partners.values(), key=lambda h: (h.segment, h.serial))
    partners = partners[:max_lanes]
    if partners:  # two servers' logs: time from the first record drawn, on either side
        t0 = min(h.records[0].t_ns for h in [*ordered, *partners] if h.records)
        end = max(ms(h.records[-1].t_ns) for h in [*ordered, *partners] if h.records)
    # where the joined hand-overs begin and end: a lifecycle's end, a ticket's start
    ends: dict[tuple[int, int], float] = {}
    starts: dict[tuple[int, int, int], float] = {}
    for lc in [*ordered, *partners]:
        registered = lc.registered_ns
        lane = Lane(lc.serial, lc.segment, None if registered is None else ms(registered))
        if partners:
            lane.rid, lane.other = lc.rid, lc.rid != history.rid
        if registered is not None:
            reuses += [
                (ms(registered), lc.segment, held.serial, lc.serial)
                for held in held_at_registration(history, lc)
                if (held.segment, held.serial) in kept
            ]
        state, since = "", 0.0
        started: dict[int, tuple[int, str]] = {}  # op -> (t_ns, kind)
        for record in lc.records:
            t = ms(record.t_ns)
            found = marks.get((lc.segment, record.seq))
            if found:
                kinds = tuple(dict.fromkeys(v.kind for v in found))
                violations.append((t, lc.segment, lc.serial, kinds))
                verdicts.append(verdict_label(kinds, record.detail))
            if not record.ok:
                lane.refusals.append((t, record.reason or "", record.op))
                continue
            if record.trigger == "start_offload" and record.op is not None:
                started[record.op] = (record.t_ns, str(record.detail.get("kind", "")))
                starts[lc.segment, lc.serial, record.op] = t
            elif record.trigger in ("finish", "abort"):
                ends[lc.segment, lc.serial] = t
            elif record.trigger in ("ack", "fail") and record.op is not None:
                begun, kind = started.pop(record.op, (record.t_ns, ""))
                ok = record.trigger == "ack"
                lane.copies.append(
                    Copy(
                        record.op,
                        lc.serial,
                        ms(begun),
                        t,
                        ok=ok,
                        kind=kind,
                        ended_by=ended_by(record.detail),
                    )
                )
                newer = reused_in_flight(births.get(lc.segment, []), lc.serial, begun, record.t_ns)
                if newer and (lc.segment, max(newer)) in kept:  # late: completed lc, its ticket's
                    late.append(LateCompletion(record.op, t, lc.serial, max(newer), lc.segment))
            if record.trigger == REGISTER or record.dst != state:
                if state:
                    lane.spans.append((since, t, state))
                state, since = record.dst or "", t
            if record.dst == State.RELEASED.value:
                lane.released = t
                state = ""
        lane.copies += [
            Copy(op, lc.serial, ms(t_ns), None, kind=kind) for op, (t_ns, kind) in started.items()
        ]
        if state:
            lane.spans.append((since, -1.0, state))  # open: to the end of the log
        lanes.append(lane)
    for lane in lanes:
        lane.spans = [(a, end if b < 0 else b, s) for a, b, s in lane.spans]
    story = Story(history.rid, lanes, reuses, late, violations, end, total, verdicts)
    for handover in history.handovers:  # as the checker joined them: words and picture agree
        p = handover.prefill
        if p is None or (p.segment, p.serial) not in ends:
            continue
        given = (p.segment, p.serial)
        for d in handover.decode:
            if d.op is not None and (d.segment, d.serial, d.op) in starts:
                began = starts[d.segment, d.serial, d.op]
                story.handovers.append((ends[given], given, began, (d.segment, d.serial)))
    return story


def build_story(
    source: AuditReader | AuditLog | Iterable[Event],
    rid: str,
    *,
    checker: AuditChecker | None = None,
    around: tuple[int, int] | None = None,
    max_lanes: int = MAX_LANES,
) -> Story:
    """Read ``source`` once and return the story of ``rid``; with ``checker``, the whole
    log is checked in the same pass (``checker.finish()`` has been called on return) and
    its violations on this rid's records are marked. ``around`` and ``max_lanes``: as for
    [`story_of()`][kvlife.diagrams.story.story_of].

    Raises:
        LookupError: the log holds no lifecycle of ``rid``.
    """
    events = source.events() if isinstance(source, AuditLog) else source
    history, marks = read_story(events, rid, checker=checker)
    if not history.lifecycles:
        raise LookupError(f"the log has no lifecycle of rid {rid!r}")
    return story_of(history, marks, around=around, max_lanes=max_lanes)


def _levels(copies: list[Copy], end: float, char: float) -> dict[int, int]:
    """A row above the lane for each copy, so that neither copies nor their labels cover
    each other: the lowest row whose last copy and label ended before this one starts
    (``char``: the width of one label character, in ms)."""
    rows: list[float] = []
    level: dict[int, int] = {}
    for copy in sorted(copies, key=lambda c: c.start):
        label_end = copy.start + char * (len(copy.label) + 1)
        stop = max(end if copy.end is None else copy.end, label_end)
        for index, busy_until in enumerate(rows):
            if busy_until < copy.start:
                rows[index] = stop
                level[copy.op] = index
                break
        else:
            level[copy.op] = len(rows)
            rows.append(stop)
    return level


def plot_story(story: Story, path: Path) -> None:
    """Draw ``story`` to ``path`` (PNG or SVG by suffix).

    Raises:
        ModuleNotFoundError: matplotlib is not installed (with the install hint).
        OSError: ``path`` cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.artist import Artist
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ModuleNotFoundError as exc:  # pragma: no cover - the plot extra is installed in CI
        raise ModuleNotFoundError("the story needs matplotlib: pip install 'kvlife[plot]'") from exc
    end = max(story.end, 1e-6)
    least = end * 0.006  # about 6 px of the plot's width
    # Each lane: its state bar, then a row per level of overlapping copies above it.
    char = end * 0.0065  # one label character: about 6 px of the plot's width
    levels = {_key(lane): _levels(lane.copies, end, char) for lane in story.lanes}
    heights = [
        1.0 + 0.35 * (max(levels[_key(lane)].values(), default=-1) + 1) for lane in story.lanes
    ]
    base: dict[tuple[int, int], float] = {}
    y = 0.0
    for lane, height in zip(story.lanes, heights, strict=True):
        base[_key(lane)] = y + height - 0.5  # the state bar's centre, copies above it
        y += height + 0.3
    fig, ax = plt.subplots(figsize=(11, min(2.2 + 0.55 * y, 40)), dpi=110)
    for lane in story.lanes:
        centre = base[_key(lane)]
        for start, stop, state in lane.spans:
            bars = ax.broken_barh(
                [(start, max(stop - start, least))],
                (centre - 0.3, 0.6),
                facecolors=COLOURS.get(state, "gray"),
                edgecolor="#a63603" if state == State.FINISHED_PENDING.value else "none",
                zorder=2,
            )
            bars.set_gid(f"lane-{_name(lane.segment, lane.serial)}")
        for copy in lane.copies:
            cy = centre - 0.55 - 0.35 * levels[_key(lane)][copy.op]
            stop = end if copy.end is None else copy.end
            colour = "#31a354" if copy.ok else "#d62728"
            (span,) = ax.plot(
                [copy.start, max(stop, copy.start + least)],
                [cy, cy],
                color=colour,
                linewidth=3,
                solid_capstyle="butt",
                linestyle="-" if copy.end is not None else ":",
                zorder=3,
            )
            span.set_gid(f"copy-{_name(lane.segment, copy.op)}")
            label = ax.text(copy.start, cy - 0.06, copy.label, fontsize=7, va="bottom")
            label.set_gid(f"copy-label-{_name(lane.segment, copy.op)}")
    refused = 0
    reasons_seen: dict[str, tuple[str, str, str]] = {}
    for lane in story.lanes:
        for t, reason, _ in lane.refusals:
            marker, colour, text = REFUSAL_MARKS.get(reason, OTHER_REFUSAL)
            reasons_seen[reason if reason in REFUSAL_MARKS else "other"] = (marker, colour, text)
            (point,) = ax.plot(
                [t],
                [base[_key(lane)]],
                marker,
                color=colour,
                markersize=9,
                markeredgewidth=2,
                zorder=6,
                clip_on=False,
            )
            point.set_gid(f"refused-{refused}")
            refused += 1
    for n, (t, segment, old, new) in enumerate(story.reuses):
        (line,) = ax.plot(
            [t, t],
            [base[segment, old], base[segment, new]],
            color=REUSE_COLOUR,
            linewidth=2,
            marker="o",
            markersize=4,
            zorder=5,
        )
        line.set_gid(f"reuse-{n}")
        ax.text(
            t - char,
            base[segment, new] + 0.45,
            f"#{new} takes the rid",
            color=REUSE_COLOUR,
            fontsize=7,
            ha="right",
            va="top",
        )
    for late in story.late:
        arrow = ax.annotate(
            f"copy {late.op} completes #{late.ticket} (its ticket), not #{late.holder}",
            xy=(late.t, base[late.segment, late.ticket]),
            xytext=(late.t + 2 * char, base[late.segment, late.holder] + 0.45),
            arrowprops={"arrowstyle": "-|>", "color": LATE_COLOUR, "linewidth": 1.8},
            color=LATE_COLOUR,
            fontsize=7,
            ha="left",
            va="top",
            zorder=7,
        )
        arrow.set_gid(f"late-{_name(late.segment, late.op)}")
    for n, (t_given, given, t_taken, taken) in enumerate(story.handovers):
        arrow = ax.annotate(
            "",
            xy=(t_taken, base[taken]),
            xytext=(t_given, base[given]),
            arrowprops={
                "arrowstyle": "-|>",
                "color": HANDOVER_COLOUR,
                "linewidth": 1.6,
                "linestyle": "--",
            },
            zorder=7,
        )
        if arrow.arrow_patch is not None:  # the arrow alone: its text is empty
            arrow.arrow_patch.set_gid(f"handover-{n}")
        words = ax.text(
            (t_given + t_taken) / 2 + char,
            (base[given] + base[taken]) / 2,
            "handed over (prefill -> decode)",
            color=HANDOVER_COLOUR,
            fontsize=7,
            va="center",
            zorder=7,
        )
        words.set_gid(f"handover-label-{n}")
    for n, (t, segment, serial, _) in enumerate(story.violations):
        (point,) = ax.plot(
            [t],
            [base[segment, serial]],
            "D",
            color="red",
            markersize=9,
            markeredgecolor="black",
            zorder=8,
        )
        point.set_gid(f"violation-{n}")
        if n < len(story.verdicts):
            words = ax.text(
                t + char,
                base[segment, serial] + 0.42,
                story.verdicts[n],
                color="red",
                fontsize=7,
                va="top",
                zorder=8,
            )
            words.set_gid(f"violation-label-{n}")
    ax.set_yticks([base[_key(lane)] for lane in story.lanes])
    segments = len({lane.segment for lane in story.lanes}) > 1
    ax.set_yticklabels(
        [
            f"#{lane.serial}"
            + (f" {shortened(lane.rid, 24)!r}" if lane.rid else "")
            + (f" (segment {lane.segment})" if segments else "")
            for lane in story.lanes
        ],
        fontsize=8,
    )
    ax.set_ylim(y - 0.1, -0.4)
    ax.set_xlim(0, end * 1.02)
    ax.set_xlabel(
        "time since the first record drawn (ms)"
        if story.handovers
        else "time since the log's first record (ms)"
    )
    ax.set_ylabel(
        "lifecycles on both sides (#serial 'rid')"
        if story.handovers
        else "lifecycles of the rid (#serial)"
    )
    ax.set_title(_title(story), fontsize=10, color="red" if story.violations else "black")
    handles: list[Artist] = [Patch(color=colour, label=state) for state, colour in COLOURS.items()]
    handles.append(
        Line2D(
            [],
            [],
            color="#31a354",
            linewidth=3,
            label="copy N (or its kind: store, load, delayed free), start to completion",
        )
    )
    if any(not c.ok for lane in story.lanes for c in lane.copies):
        handles.append(Line2D([], [], color="#d62728", linewidth=3, label="failed copy"))
    if story.late:
        handles.append(Line2D([], [], color=LATE_COLOUR, label="late completion -> its ticket"))
    if story.handovers:
        handles.append(
            Line2D(
                [],
                [],
                color=HANDOVER_COLOUR,
                linestyle="--",
                label="hand-over: prefill finished -> decode began to read",
            )
        )
    handles += mark_handles(
        reasons_seen.values(),
        reuse="rid reused" if story.reuses else None,
        violation=bool(story.violations),
    )
    legend_below(ax, handles, drop=0.6 / max(y, 1.0) + 0.04, fontsize=7)
    fig.tight_layout()
    try:
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text
            fig.savefig(path)
    finally:
        plt.close(fig)


def _key(lane: Lane) -> tuple[int, int]:
    return (lane.segment, lane.serial)


def _name(segment: int, serial: int) -> str:
    """An element id's lifecycle part: ``SERIAL``, or ``SEGMENT-SERIAL`` past segment 0."""
    return f"{segment}-{serial}" if segment else str(serial)


def _title(story: Story) -> str:
    lanes = len([lane for lane in story.lanes if not lane.other])  # the rid's own
    rid = shortened(story.rid, 30 if story.handovers else 40)
    parts = [f"rid {rid!r}: {lanes} lifecycle{'' if lanes == 1 else 's'}"]
    if story.total > lanes:
        parts[0] = f"rid {rid!r}: {lanes} of its {story.total} lifecycles drawn"
    if story.reuses:
        n = len(story.reuses)
        parts.append(f"{n} reuse{'' if n == 1 else 's'} of the rid while a lifecycle held it")
    if story.late:
        n = len(story.late)
        parts.append(
            f"{n} late completion{'' if n == 1 else 's'}, applied to its ticket's lifecycle only"
        )
    if story.handovers:
        others = sorted({lane.rid for lane in story.lanes if lane.other})
        names = ", ".join(repr(shortened(r, 24)) for r in others[:2])
        parts.append(f"handed over with {names} (another log)")
    if story.violations:
        n = len(story.violations)
        parts.append(f"{n} violation{'' if n == 1 else 's'}")
    return "; ".join(parts)


__all__ = [
    "Copy",
    "Lane",
    "LateCompletion",
    "Story",
    "build_story",
    "plot_story",
    "story_of",
]

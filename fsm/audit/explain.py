"""A lifecycle's history told as a person would: ``kvlife audit why``.

[`explain()`][kvlife.fsm.audit.explain.explain] reads a log once and keeps only the records of
one rid (every lifecycle that held it, and the calls that found no lifecycle for it). It
tells each lifecycle's story: every transition and refusal with its time, state and
copy, what each refusal means, which other lifecycles held the same rid meanwhile, and,
for a completion that arrived after the rid was reused, which lifecycle's copy it was.

Given an [`AuditChecker`][kvlife.fsm.audit.checker.AuditChecker], it checks the whole log in the
same pass, as ``kvlife audit check`` does: each record of the story that the checker finds
wrong is marked where it is told, and the story ends with the log's verdict.
"""

from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvlife.fsm.audit.checker import (
    VIOLATION_MEANINGS,
    AuditChecker,
    Verdict,
    Violation,
    ending_lines,
    fed,
    violations_by_record,
)
from kvlife.fsm.audit.handover import (
    Clock,
    Handover,
    HandoverSide,
    anchor,
    moved,
    tell_handover,
)
from kvlife.fsm.audit.reader import Event, Segment, segment_records
from kvlife.fsm.audit.records import REGISTER, AuditRecord
from kvlife.fsm.errors import PROTOCOL_REASONS

MAX_STORIES = 20
"""Lifecycles told per call; a rid held by more says how many were left out."""
MAX_STEPS = 400
"""Records told per lifecycle; the rest are counted."""


@dataclass
class LifecycleHistory:
    """What the log says of one lifecycle: its records, in order."""

    segment: int
    serial: int
    rid: str
    records: list[AuditRecord] = field(default_factory=list)
    dropped: int = 0

    @property
    def registered_ns(self) -> int | None:
        first = self.records[0] if self.records else None
        return first.t_ns if first is not None and first.trigger == REGISTER else None

    @property
    def released_ns(self) -> int | None:
        for record in reversed(self.records):
            if record.ok and record.dst == "released":
                return record.t_ns
        return None


@dataclass
class RidHistory:
    """Every lifecycle of one rid in a log, and the calls for it that found none;
    ``partners``: the lifecycles of other servers' logs that the rid was handed over to
    or from (prefill/decode), their times on this log's clock (see
    [`collect_partners()`][kvlife.fsm.audit.explain.collect_partners])."""

    rid: str
    lifecycles: dict[tuple[int, int], LifecycleHistory] = field(default_factory=dict)
    unknown: list[tuple[int, AuditRecord]] = field(default_factory=list)  # (segment, record)
    t0: int | None = None  # the log's first record, for times in ms
    partners: dict[tuple[int, int], LifecycleHistory] = field(default_factory=dict)
    #: Each segment's clock anchor, to put records of two logs on one clock.
    clocks: dict[int, Clock] = field(default_factory=dict)
    #: The hand-overs ``partners`` come from (joined by the checker).
    handovers: list[Handover] = field(default_factory=list)


def collect(source: Iterable[Event], rid: str) -> RidHistory:
    """Read ``source`` once, keeping the records of ``rid`` only: those that name it, and
    those of a lifecycle registered under it that name another (a ``rid_mismatch``)."""
    history = RidHistory(rid)
    lifecycles = history.lifecycles
    for segment, event in segment_records(_clocked(source, history.clocks)):
        if history.t0 is None:
            history.t0 = event.t_ns
        if event.rid != rid and (
            event.serial is None or not lifecycles or (segment, event.serial) not in lifecycles
        ):
            continue
        if event.serial is None:
            history.unknown.append((segment, event))
            continue
        key = (segment, event.serial)
        lc = history.lifecycles.get(key)
        if lc is None:
            lc = history.lifecycles[key] = LifecycleHistory(segment, event.serial, rid)
        if len(lc.records) < MAX_STEPS:
            lc.records.append(event)
        else:
            lc.dropped += 1
    return history


def _clocked(source: Iterable[Event], clocks: dict[int, Clock]) -> Iterator[Event]:
    """``source``, noting each segment's clock anchor on the way."""
    for event in source:
        if type(event) is Segment:
            clocks[event.index] = anchor(event.header)
        yield event


def handovers_of(checker: AuditChecker | None, rid: str) -> list[Handover]:
    """The prefill/decode hand-overs (joined by a finished ``checker``) that ``rid`` took
    part in, on either side."""
    if checker is None:
        return []
    return [h for h in checker.report.handovers if h.involves(rid)]


def collect_partners(
    source: Iterable[Event], history: RidHistory, handovers: Iterable[Handover]
) -> None:
    """Read ``source`` once more and put the other side of each hand-over of
    ``history``'s rid into ``history.partners``: their records moved onto the clock of
    the rid's first segment by the wall-clock anchors of the two segments' headers (exact
    on one host, as good as the hosts' clocks agree otherwise); ``history.handovers`` keeps
    ``handovers``, which the story's picture draws."""
    history.handovers = list(handovers)
    own = set(history.lifecycles)
    wanted = {(side.segment, side.serial) for h in history.handovers for side in _sides(h)} - own
    if not wanted:
        return
    clocks: dict[int, Clock] = {}
    found: dict[tuple[int, int], LifecycleHistory] = {}
    for segment, record in segment_records(_clocked(source, clocks)):
        key = (segment, record.serial or 0)
        if record.serial is None or key not in wanted:
            continue
        lc = found.get(key)
        if lc is None:
            lc = found[key] = LifecycleHistory(segment, record.serial, record.rid or "")
        if len(lc.records) < MAX_STEPS:
            lc.records.append(record)
        else:
            lc.dropped += 1
    home = min((k[0] for k in own), default=None)
    here = history.clocks.get(home) if home is not None else None
    for key, lc in found.items():
        there = clocks.get(key[0])
        if here is not None and there is not None:
            lc.records = [r.replace(t_ns=moved(r.t_ns, there, here)) for r in lc.records]
        history.partners[key] = lc


def _sides(h: Handover) -> list[HandoverSide]:
    return ([h.prefill] if h.prefill is not None else []) + h.decode


def find_rid(source: Iterable[Event], serial: int, segment: int = 0) -> str | None:
    """The rid of lifecycle ``serial`` in ``segment``, or ``None`` if the log has none."""
    for current, record in segment_records(source):
        if record.serial == serial and current == segment and record.rid is not None:
            return record.rid
    return None


def _ms(t_ns: int, t0: int | None) -> str:
    return f"{(t_ns - (t0 or t_ns)) / 1e6:10.3f} ms"


def _detail(record: AuditRecord, told: tuple[str, ...] = ()) -> str:
    """The record's detail in brackets, less the keys ``told`` (said in the line's words)."""
    shown = [f"{k}={v}" for k, v in record.detail.items() if k not in told]
    return " [" + " ".join(shown) + "]" if shown else ""


#: Detail keys a line says in words instead of brackets.
_IN_WORDS: tuple[str, ...] = ("kind", "cut_by", "report", "by")


def copy_name(op: int, kind: str = "") -> str:
    """A copy as the writer called it: ``store 7``, ``delayed free 2``, ``write back 3``
    (the ticket's ``kind``, underscores read as spaces), or ``copy 7`` when it said none."""
    return f"{kind.replace('_', ' ')} {op}" if kind else f"copy {op}"


def ended_by(detail: Mapping[str, object]) -> str:
    """What ended a ticket, from its completion record's detail: the report that
    completed it, the report that cut it short, or the lensed job (empty: not said)."""
    if "cut_by" in detail:
        return f"cut by {detail['cut_by']}"
    if "report" in detail:
        return str(detail["report"])
    if detail.get("jobs") == 0:
        return "nothing to store"
    return ""


def _others(history: RidHistory, lc: LifecycleHistory, t_ns: int) -> list[LifecycleHistory]:
    """The other lifecycles of the rid (same segment) alive at ``t_ns``."""
    alive = []
    for other in history.lifecycles.values():
        if other is lc or other.segment != lc.segment or not other.records:
            continue
        born = other.registered_ns if other.registered_ns is not None else other.records[0].t_ns
        gone = other.released_ns
        if born <= t_ns and (gone is None or gone >= t_ns):
            alive.append(other)
    return alive


def _refusal(record: AuditRecord, lc: LifecycleHistory) -> str:
    op = f" copy {record.op}" if record.op is not None else ""
    reason = record.reason
    if reason == "stale_instance":
        return (
            f"a delivery of{op}, which belonged to this lifecycle (#{lc.serial}), came after "
            "it was released: refused, nothing changed (a late or repeated completion)"
        )
    if reason == "duplicate_ack":
        return f"{op.strip() or 'the copy'} was already delivered: refused, nothing changed"
    if reason == "rid_conflict":
        return (
            f"another request tried to register rid {lc.rid!r} while this lifecycle held it "
            "and had not finished: refused"
        )
    if reason == "duplicate_registration":
        return "the same request object was registered again before this lifecycle finished"
    if reason in PROTOCOL_REASONS:
        return _verdict(record)
    return f"{record.trigger} is not allowed in state {record.src}: refused, nothing changed"


def _meaning(record: AuditRecord) -> str:
    """What an accepted transition means for the request, when the states alone do not
    say it: what happens to its host copies, and when it will be released."""
    kept = {"finish": "host copies kept", "abort": "host copies discarded"}.get(record.trigger)
    if kept is not None:
        if record.dst == "released":
            return f"  ({kept}; no copy in flight: released at once)"
        copies = "copy in flight ends" if record.inflight == 1 else "copies in flight end"
        return f"  ({kept}; released when its {record.inflight} {copies})"
    if record.trigger in ("ack", "fail") and record.dst == "released":
        return "  (its last copy ended: released)"
    return ""


def _verdict(record: AuditRecord) -> str:
    """A verdict on a watched connector, in the checker's words, with what was reported."""
    said = _detail(record).strip(" []")
    return VIOLATION_MEANINGS[record.reason or ""] + (f" ({said})" if said else "")


def held_at_registration(history: RidHistory, lc: LifecycleHistory) -> list[LifecycleHistory]:
    """The older lifecycles of ``lc``'s rid (same segment) that still held it, unreleased,
    when ``lc`` was registered (none when the log begins after its registration): the rid
    reuses ``kvlife audit why`` tells and its picture draws."""
    born = lc.registered_ns
    if born is None:
        return []
    return [o for o in _others(history, lc, born) if o.serial < lc.serial]


def registrations(history: RidHistory) -> dict[int, list[tuple[int, int]]]:
    """Per segment, (registration time, serial) of the rid's lifecycles, in time order: a
    late completion's "reused by" is a range of it, found by bisection."""
    births: dict[int, list[tuple[int, int]]] = {}
    for lc in history.lifecycles.values():
        if lc.registered_ns is not None:
            births.setdefault(lc.segment, []).append((lc.registered_ns, lc.serial))
    for entries in births.values():
        entries.sort()
    return births


def reused_in_flight(
    births: list[tuple[int, int]], serial: int, started_ns: int, done_ns: int
) -> list[int]:
    """The newer lifecycles (serials) that took the rid of lifecycle ``serial`` while one of
    its copies was in flight, from ``started_ns`` to ``done_ns`` (``births``: the rid's
    (registration time, serial), in time order, from
    [`registrations()`][kvlife.fsm.audit.explain.registrations]). Not empty: the copy's
    completion was late."""
    since = bisect_left(births, (started_ns, -1))
    until = bisect_right(births, (done_ns, sys.maxsize))
    return [n for _, n in births[since:until] if n > serial]


def late_completion(
    births: list[tuple[int, int]], serial: int, op: int, started_ns: int, done_ns: int
) -> str | None:
    """The sentence for a completion of copy ``op`` of lifecycle ``serial`` that arrived
    after its rid was reused (see
    [`reused_in_flight()`][kvlife.fsm.audit.explain.reused_in_flight]), or ``None`` when no
    newer lifecycle took the rid while the copy was in flight."""
    newer = reused_in_flight(births, serial, started_ns, done_ns)
    return late_sentence(newer, serial, op) if newer else None


def late_sentence(newer: Sequence[int], serial: int, op: int) -> str:
    """What ``kvlife audit why`` says of copy ``op`` of lifecycle ``serial``, completed
    after the lifecycles ``newer`` took its rid."""
    names = ", ".join(f"#{n}" for n in newer)
    return (
        f"late: the rid was reused by {names} while copy {op} was in flight; its ticket "
        f"named #{serial}, so it completed #{serial} only"
    )


def _marked(lines: list[str], marks: list[Violation]) -> None:
    for v in marks:
        lines.append(f"      !! VIOLATION {v.kind}: {v.message} ({v.meaning})")


def _story(
    history: RidHistory,
    lc: LifecycleHistory,
    births: dict[int, list[tuple[int, int]]],
    marks: dict[tuple[int, int], list[Violation]],
) -> list[str]:
    t0 = history.t0
    where = f" (segment {lc.segment})" if lc.segment else ""
    lines = [f"rid {lc.rid!r} lifecycle #{lc.serial}{where}"]
    born = lc.registered_ns
    if born is None:
        lines.append("  the log begins after its registration: told from its first record")
    else:
        for other in held_at_registration(history, lc):
            state = _state_at(other, born)
            lines.append(
                f"  registered while #{other.serial} still held the rid ({state}): the rid "
                f"was reused; #{other.serial}'s copies stay #{other.serial}'s"
            )
    started: dict[int, int] = {}  # op -> t_ns
    kinds = {  # op -> the kind its start said: each line names the copy in the writer's words
        r.op: str(r.detail["kind"])
        for r in lc.records
        if r.trigger == "start_offload" and r.op is not None and "kind" in r.detail
    }
    for record in lc.records:
        when = _ms(record.t_ns, t0)
        op = "" if record.op is None else " " + copy_name(record.op, kinds.get(record.op, ""))
        if record.reason == "overdue":
            lines.append(f"  {when}  OVERDUE{op}: {overdue_sentence(record, lc, t0)}")
            _marked(lines, marks.get((lc.segment, record.seq), []))
            continue
        if not record.ok:
            lines.append(
                f"  {when}  REFUSED {record.trigger}{op}: {record.reason}: {_refusal(record, lc)}"
            )
            _marked(lines, marks.get((lc.segment, record.seq), []))
            continue
        move = f"{record.src} -> {record.dst}" if record.src else f"-> {record.dst}"
        inflight = f", {record.inflight} in flight" if record.inflight else ""
        line = f"  {when}  {record.trigger}{op}{_how(record)}: {move}{inflight}"
        line += _detail(record, _IN_WORDS) + _meaning(record)
        if record.trigger == "start_offload" and record.op is not None:
            started[record.op] = record.t_ns
        elif record.trigger in ("ack", "fail") and record.op is not None:
            late = late_completion(
                births.get(lc.segment, []),
                lc.serial,
                record.op,
                started.get(record.op, record.t_ns),
                record.t_ns,
            )
            if late is not None:
                line += f"  <- {late}"
        lines.append(line)
        _marked(lines, marks.get((lc.segment, record.seq), []))
    if lc.dropped:
        lines.append(f"  ... {lc.dropped} more records")
    if lc.released_ns is None:
        lines.append("  not released at the end of the log")
    return lines


def _how(record: AuditRecord) -> str:
    """What the writer said ended a copy or a lifecycle, in words: `` (cut by
    finished_recving)``, `` (host eviction)``; empty when it said nothing."""
    said = ended_by(record.detail) or str(record.detail.get("by", "")).replace("_", " ")
    return f" ({said})" if said else ""


def overdue_sentence(record: AuditRecord, lc: LifecycleHistory, t0: int | None) -> str:
    """What an ``overdue`` record says: the ticket's kind, age and limit, and whether (and
    when) it completed later in ``lc``'s records."""
    detail = record.detail
    kind = detail.get("kind", "ticket")
    said = (
        f"the {kind} ticket had been open {detail.get('age_s', '?')} s, longer than the "
        f"{detail.get('limit_s', '?')} s limit (told while the engine ran)"
    )
    for later in lc.records:
        if later.ok and later.op == record.op and later.trigger in ("ack", "fail"):
            how = "completed" if later.trigger == "ack" else "failed"
            return f"{said}; it {how} later, at {_ms(later.t_ns, t0).strip()}"
    return f"{said}; it never completed in the log"


def _state_at(lc: LifecycleHistory, t_ns: int) -> str:
    state, inflight = "allocated", 0
    for record in lc.records:
        if record.t_ns > t_ns:
            break
        if record.ok and record.dst is not None:
            state, inflight = record.dst, record.inflight
    return f"{state}, {inflight} in flight" if inflight else state


def read_story(
    source: Iterable[Event], rid: str, *, checker: AuditChecker | None = None
) -> tuple[RidHistory, dict[tuple[int, int], list[Violation]]]:
    """Read ``source`` once: the records of ``rid`` and, with ``checker`` (fed the whole
    log in the same pass and finished on return), its violations by (segment, seq). What
    [`tell()`][kvlife.fsm.audit.explain.tell] tells, and what ``kvlife audit why -o``
    draws, from one pass."""
    history = collect(source if checker is None else fed(source, checker), rid)
    marks: dict[tuple[int, int], list[Violation]] = {}
    if checker is not None:
        marks = violations_by_record(checker.finish())
    return history, marks


def tell(
    history: RidHistory,
    marks: dict[tuple[int, int], list[Violation]],
    *,
    serial: int | None = None,
    segment: int = 0,
    checker: AuditChecker | None = None,
    unreadable_lines: int = 0,
    allow_lost: bool = False,
) -> str:
    """The story of every lifecycle in ``history`` (or of lifecycle ``serial`` of
    ``segment`` only, with the others of its rid as context), as text; with ``checker``
    (finished), ending with the log's verdict. See
    [`explain()`][kvlife.fsm.audit.explain.explain].

    Raises:
        LookupError: the history holds no record of that rid (or serial).
    """
    rid = history.rid
    stories = sorted(history.lifecycles.values(), key=lambda lc: (lc.segment, lc.serial))
    if serial is not None:
        stories = [lc for lc in stories if (lc.segment, lc.serial) == (segment, serial)]
    if not stories and (serial is not None or not history.unknown):
        what = f"lifecycle #{serial} of rid {rid!r}" if serial is not None else f"rid {rid!r}"
        raise LookupError(f"the log has no record of {what}")
    lines: list[str] = []
    if checker is not None and (stopped := ending_lines(checker.report, rid=rid)):
        lines += [*stopped, ""]  # how the writers stopped comes first
    if serial is None:
        lines.append(
            f"rid {rid!r}: {len(history.lifecycles)} lifecycle(s) in the log"
            + (f", {len(history.unknown)} call(s) that found none" if history.unknown else "")
        )
    births = registrations(history)
    for lc in stories[:MAX_STORIES]:
        lines += ["", *_story(history, lc, births, marks)]
    if len(stories) > MAX_STORIES:
        lines += ["", f"... {len(stories) - MAX_STORIES} more lifecycles of this rid"]
    if history.unknown and serial is None:
        lines += ["", "calls and reports for this rid that found no lifecycle:"]
        for seg, record in history.unknown[:MAX_STEPS]:
            if record.reason in PROTOCOL_REASONS:
                why = f"{record.reason}: {_verdict(record)}"
            else:
                why = (
                    "the request object was not registered (or already released, or another object)"
                )
            lines.append(f"  {_ms(record.t_ns, history.t0)}  REFUSED {record.trigger}: {why}")
            _marked(lines, marks.get((seg, record.seq), []))
    partners = sorted(history.partners.values(), key=lambda lc: (lc.segment, lc.serial))
    for lc in partners[:MAX_STORIES]:
        lines += ["", "the other side of the hand-over:", *_story(history, lc, births, marks)]
    for handover in handovers_of(checker, rid)[:MAX_STORIES]:
        lines += ["", *tell_handover(handover)]
    if checker is not None:
        partner_rids = {lc.rid for lc in partners}
        lines += [
            "",
            *verdict_lines(
                checker, unreadable_lines, allow_lost=allow_lost, rid=rid, also=partner_rids
            ),
        ]
    return "\n".join(lines)


def explain(
    source: Iterable[Event],
    rid: str,
    *,
    serial: int | None = None,
    segment: int = 0,
    checker: AuditChecker | None = None,
    allow_lost: bool = False,
) -> str:
    """The story of every lifecycle of ``rid`` in the log (or of lifecycle ``serial`` of
    ``segment`` only, with the others of its rid as context), as text.

    With ``checker``, the whole log is fed to it in the same pass: records it finds wrong
    are marked (``!! VIOLATION``) in the story, and the text ends with the verdict on the
    log, [`Verdict`][kvlife.fsm.audit.checker.Verdict] (``allow_lost`` as for it; unreadable
    lines are the source's ``problem_count`` when it has one), listing this rid's
    violations. ``checker.finish()`` has been called when this returns.

    Raises:
        LookupError: the log holds no record of that rid (or serial).
    """
    history, marks = read_story(source, rid, checker=checker)
    return tell(
        history,
        marks,
        serial=serial,
        segment=segment,
        checker=checker,
        unreadable_lines=int(getattr(source, "problem_count", 0)),
        allow_lost=allow_lost,
    )


MAX_LISTED = 20
"""Violations listed under a verdict; the rest are counted."""


def verdict_lines(
    checker: AuditChecker,
    unreadable_lines: int = 0,
    *,
    allow_lost: bool = False,
    rid: str | None = None,
    also: Iterable[str] = (),
) -> list[str]:
    """The verdict on a finished check, as ``kvlife audit check`` would give it, and the
    violations it kept (those of ``rid`` and of the rids ``also``, when ``rid`` is given;
    the others counted)."""
    report = checker.report
    verdict = Verdict.of(report, unreadable_lines, allow_lost=allow_lost)
    lines = [f"verdict on the whole log (kvlife audit check): {verdict}"]
    rids = {rid, *also}
    listed = [v for v in report.violations if rid is None or v.rid in rids]
    lines += [f"  {v.line()}" for v in listed[:MAX_LISTED]]
    if len(listed) > MAX_LISTED:
        lines.append(f"  ... {len(listed) - MAX_LISTED} more")
    others = report.violation_count - len(listed)
    if rid is not None and others > 0:
        lines.append(f"  {others} violation(s) of other rids: kvlife audit check shows them")
    return lines


__all__ = [
    "MAX_LISTED",
    "MAX_STEPS",
    "MAX_STORIES",
    "LifecycleHistory",
    "RidHistory",
    "collect",
    "collect_partners",
    "explain",
    "find_rid",
    "handovers_of",
    "held_at_registration",
    "late_completion",
    "late_sentence",
    "overdue_sentence",
    "read_story",
    "registrations",
    "reused_in_flight",
    "tell",
    "verdict_lines",
]

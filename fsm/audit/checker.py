"""Replaying an audit log against the transition table, in one streaming pass.

[`AuditChecker`][kvlife.fsm.audit.checker.AuditChecker] takes the reader's events one at a time
([`AuditChecker.feed()`][kvlife.fsm.audit.checker.AuditChecker.feed]) and keeps only what is open
at that point of the log: the unreleased lifecycles, the copies in flight, and one byte per
serial and per copy number seen (to tell "released" and "completed" from "never seen"). A
log of any length is checked in memory bounded by its busiest moment.

Verdicts on a watched component (a log written by a wrapper around a vLLM connector):
a refused record whose reason is one of
[`PROTOCOL_REASONS`][kvlife.fsm.errors.PROTOCOL_REASONS] is a violation of that name, and in a
segment whose header names a ``witness`` every ticket still open at the segment's end is
one (``unreported``). An ``overdue`` record (a ticket open longer than its limit, written
while the engine ran) is a violation only when the ticket never completed in its segment
afterwards, unless the checker is asked to count every one (``overdue_fails``); the others
are counted in ``report.overdue_completed``.

Rules, per segment (each segment is its own serial and ``seq`` space): ``seq`` is
gap-free, except where a [`LostRecords`][kvlife.fsm.audit.records.LostRecords] marker says a failing
sink lost records (reported as lost, not as tampering), and a closed segment holds as
many lines as its closing record counts (fewer: its last lines are missing, a
``seq_gap``, and the lifecycles live at its end get no verdict); every accepted transition is
legal from the instance's previous state with its in-flight count; a refusal leaves its
instance as it was; every ``ack``/``fail`` completes a copy that the same instance
started and that was not completed before; serials are never reused; nothing happens to
a released instance. A log that starts mid-way (a ring, rotated-out backups) or lost
records takes each instance it first meets mid-history as it finds it.

How each segment ended ([`SegmentEnding`][kvlife.fsm.audit.checker.SegmentEnding]): closed
(its last line is a closing record), cut short (its writer closes segments and this one
ended without a closing record: a crash, a kill, a full disk), open (no closing record
yet, and its writer is running on this machine: the log is still being written), or
unknown (written before closing records existed). Tickets still open at the end of a
closed segment (or one whose ending is unknown) are ``unreported`` when a wrapper wrote
it; at the end of a segment cut short or still open they are listed in
``report.open_at_end`` ([`OpenAtEnd`][kvlife.fsm.audit.checker.OpenAtEnd]): copies in flight
when the writer stopped (or now), not the watched component's fault.

Why one module: the checker is one linear replay of a log against the transition table
(segments, records, tickets, the ending), and every verdict reads the same per-segment
state; split, each rule would reach into the others' state. Reading a log is
``reader``'s, telling a rid's story ``explain``'s.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from kvlife.fsm.audit.handover import Handover, HandoverJoin
from kvlife.fsm.audit.reader import (
    AuditFormatError,
    AuditLog,
    AuditReader,
    Event,
    Segment,
    open_marker,
)
from kvlife.fsm.audit.records import (
    REGISTER,
    AuditHeader,
    AuditRecord,
    ClosingHow,
    ClosingRecord,
    LostRecords,
)
from kvlife.fsm.errors import PROTOCOL_REASONS
from kvlife.fsm.table import LIFECYCLE, State, Trigger

MAX_VIOLATIONS: Final = 1000
"""Violations kept in detail (all are counted in ``violation_count``)."""
MAX_REUSES: Final = 1000
"""Rid reuses kept in detail (all are counted in ``reused_while_unreleased``)."""

ViolationKind = Literal[
    "seq_gap",
    "illegal_transition",
    "state_mismatch",
    "inflight_mismatch",
    "rid_mismatch",
    "wrong_instance",
    "unknown_op",
    "duplicate_completion",
    "serial_reused",
    "unknown_instance",
    "after_release",
    "leaked",
    "stray_report",
    "connector_raised",
    "event_mismatch",
    "unreported",
    "overdue",
    "credited_elsewhere",
    "inherited_state",
    "freed_before_read",
    "handover_mismatch",
    "host_freed_in_flight",
    "failed_write_backed",
    "unbalanced_lock",
    "pending_overwritten",
]


SegmentStatus = Literal["closed", "cut", "open", "unknown"]
"""How a segment ended: see [`SegmentEnding`][kvlife.fsm.audit.checker.SegmentEnding]."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine: ``kill(pid, 0)`` finds it and,
    where ``/proc`` tells, it is not a zombie (a killed process whose parent has not
    reaped it yet, as an engine core killed with its server often is for a while)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc here (or it is gone now): kill() found it
    state = stat.rpartition(")")[2].split()[:1]  # the name in parentheses may hold spaces
    return state not in (["Z"], ["X"])


StopKind = Literal["cut", "open", "signal"]
"""How a writer was stopping when copies in flight at its segment's end are no verdict:
see [`SegmentEnding.stopping`][kvlife.fsm.audit.checker.SegmentEnding.stopping]."""


@dataclass(frozen=True)
class SegmentEnding:
    """How one writer's segment of a log ended.

    ``status``: ``closed`` (its last line is a closing record: ``how`` says how it was
    closed, see [`ClosingHow`][kvlife.fsm.audit.records.ClosingHow]); ``cut`` (its writer
    ends segments with a closing record and this one has none: the writer stopped
    without closing it, a crash, a kill or a full disk); ``open`` (no closing record,
    and the writer's pid runs on this machine: the log is still being written, or the
    pid was reused); ``unknown`` (written by a kvlife that wrote no closing records).

    ``last_t_ns`` and ``last_wall`` are the last record's times (``None`` for a segment
    without records); ``open_tickets`` and ``live`` the copies in flight and lifecycles
    live at the segment's end, as replayed; ``marker`` what the ``PATH.open`` marker
    beside the log says, for the last segment of a log whose marker is there;
    ``begins_mid_way`` the segment's first records are not in the log (rotated out, or
    a ring).
    """

    segment: int
    status: SegmentStatus
    pid: int
    file: str
    witness: str
    how: ClosingHow | None
    last_t_ns: int | None
    last_wall: float | None
    records: int
    open_tickets: int
    live: int
    marker: str | None = None
    closing: ClosingRecord | None = None
    begins_mid_way: bool = False

    @property
    def stopping(self) -> StopKind | None:
        """How the writer was stopping at the segment's end, when copies then in flight
        are no verdict on anyone: ``cut`` (stopped without closing), ``open`` (still
        running), ``signal`` (closed on SIGTERM or SIGINT, a kill following); ``None``
        when it closed otherwise, or its ending is unknown."""
        if self.status == "cut" or self.status == "open":  # noqa: PLR1714 - narrows for mypy
            return self.status
        return "signal" if self.how == "signal" else None

    def line(self) -> str:
        """One line for the first screen of every view: who wrote the segment, how it
        ended, and what was in flight then."""
        who = (
            f"segment {self.segment} (pid {self.pid}{f', {self.witness}' if self.witness else ''})"
        )
        when = ""
        if self.last_wall is not None:
            when = f", last record {_clock(self.last_wall)}"
        if self.begins_mid_way:  # its first files were rotated out (or a ring's)
            who += " (its beginning is not in the log: rotated out)"
        flight = f"{copies(self.open_tickets)} in flight"
        if self.status == "closed" and self.how == "signal":
            return (
                f"{who}: closed on a signal (SIGTERM or SIGINT: the process was being "
                f"stopped){when}, {flight} then"
            )
        if self.status == "closed":
            return f"{who}: closed ({self.how}){when}"
        if self.status == "unknown":
            return f"{who}: closing unknown (written before closing records){when}"
        marker = f"; its .open marker says: {self.marker}" if self.marker else ""
        if self.status == "open":
            return (
                f"{who}: OPEN, its writer is running on this machine (still being "
                f"written?){when}, {flight} so far{marker}"
            )
        return (
            f"{who}: CUT SHORT: its writer stopped without closing the log{when}, "
            f"{flight} at the cut{marker}"
        )


def copies(n: int) -> str:
    """``no copy``, ``1 copy``, ``2 copies``."""
    return "no copy" if not n else f"{n} cop{'y' if n == 1 else 'ies'}"


def _clock(wall: float) -> str:
    return (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"
    )


@dataclass(frozen=True)
class OpenAtEnd:
    """A copy in flight at the end of a segment that was cut short or is still open:
    its lifecycle (``serial``, ``rid``, state at the end), its copy number, the ``kind``
    its start gave (``store``, ``load``, ``delayed_free``; ``None`` when none), and how
    long it had been in flight at the segment's last record (``age_s``; ``None`` when its
    start is not in the log)."""

    segment: int
    serial: int
    rid: str | None
    state: str
    op: int
    kind: str | None
    age_s: float | None
    status: StopKind


class AuditTableMismatchError(AuditFormatError):
    """A segment was written with another transition table than this kvlife's.

    Replaying it against this table would report false violations (or hide real ones).
    Pass the segment's digest in ``accept_tables`` (``--accept-table``) to replay anyway.
    """

    def __init__(self, message: str, *, digest: str) -> None:
        super().__init__(message)
        self.digest = digest


@dataclass(frozen=True)
class Violation:
    """One thing in a log that the table or the contract does not allow: its kind, the
    record (``seq``; ``None`` for a leak found at the end), the lifecycle (``serial``,
    ``rid``) and what was wrong."""

    kind: ViolationKind
    seq: int | None
    serial: int | None
    message: str
    segment: int = 0
    rid: str | None = None

    @property
    def meaning(self) -> str:
        """What this kind of violation means, in a sentence."""
        return VIOLATION_MEANINGS[self.kind]

    def line(self) -> str:
        """``VIOLATION kind seq=N rid='...' serial=N: message`` (the segment when not 0)."""
        where = f" segment={self.segment}" if self.segment else ""
        return (
            f"VIOLATION {self.kind}{where} seq={self.seq} rid={self.rid!r} "
            f"serial={self.serial}: {self.message}"
        )


#: One sentence per violation kind: what the log shows happened.
VIOLATION_MEANINGS: Final[dict[str, str]] = {
    "seq_gap": "records are missing from the log and no sink reported them lost",
    "illegal_transition": "a transition the lifecycle table does not allow was accepted",
    "state_mismatch": "a record's state before differs from the lifecycle's replayed state",
    "inflight_mismatch": "a record's copies in flight differ from the replayed count",
    "rid_mismatch": "a record names another rid than its lifecycle was registered under",
    "wrong_instance": "a copy's completion was applied to a lifecycle that did not start it",
    "unknown_op": "a completion names a copy that was never started",
    "duplicate_completion": "a copy was completed twice",
    "serial_reused": "one serial was registered twice",
    "unknown_instance": "a transition was accepted on a lifecycle never registered",
    "after_release": "a transition was accepted on a lifecycle after its release",
    "leaked": "a lifecycle was not released by the end of the log",
    "stray_report": "the watched component reported a completion that no open ticket explains",
    "connector_raised": "the watched component raised while handling this lifecycle",
    "event_mismatch": "an event the watched component published contradicts what the engine holds",
    "unreported": "a ticket of the watched component was still open when its writer closed "
    "the log (a log cut short lists such tickets instead, as in flight at the cut)",
    "overdue": "a ticket stayed open longer than its limit (and never completed afterwards)",
    "credited_elsewhere": "the watched component credited a copy's completion to another "
    "request object than the one it issued the copy for",
    "inherited_state": "the watched component's state under this request's id belongs to "
    "another request object with that id (or was dropped with it)",
    "freed_before_read": "the prefill side freed a handed-over request's blocks before the "
    "decode side began to read them",
    "handover_mismatch": "the decode side read other blocks than the prefill side handed over "
    "under that request's identity",
    "host_freed_in_flight": "host memory was freed while a copy still read or wrote it (a "
    "load-back reading freed pages loads whatever is written there next)",
    "failed_write_backed": "a node was committed as backed on host by a write that failed",
    "unbalanced_lock": "a lock was released on a node that no increment had locked",
    "pending_overwritten": "a pending copy's entry was replaced while the copy was still in "
    "flight (its completion will be credited to the new one, or lost)",
}


@dataclass(frozen=True)
class RidReuse:
    """A registration whose rid was held by other lifecycles that were not released yet
    (``previous``: their serials, oldest first): the moment a rid-keyed bookkeeping would
    confuse the two requests."""

    segment: int
    seq: int
    t_ns: int
    rid: str | None
    serial: int
    previous: tuple[int, ...]


@dataclass(frozen=True)
class InstanceSummary:
    """A lifecycle instance as replayed from the log.

    ``uncertain``: records of this instance may be missing (lost by a failing sink, or
    written before the log starts), so its replayed state is the best the log can say.
    """

    serial: int
    rid: str | None
    state: str
    inflight: int
    transitions: int
    refusals: int
    segment: int = 0
    uncertain: bool = False


@dataclass
class AuditReport:
    """The result of a check.

    ``live`` lists the instances not released at the end of the log. ``instances`` holds
    every instance's final state, keyed by (segment, serial), only when the check was
    asked to keep them (``keep_instances``): a big log has millions.
    """

    records: int = 0
    segments: int = 0
    lifecycles: int = 0
    released: int = 0
    violations: list[Violation] = field(default_factory=list)
    violation_count: int = 0
    #: Every violation by kind (not only those kept in ``violations``).
    violation_kinds: dict[str, int] = field(default_factory=dict)
    lost: list[LostRecords] = field(default_factory=list)
    lost_records: int = 0
    live: list[InstanceSummary] = field(default_factory=list)
    instances: dict[tuple[int, int], InstanceSummary] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    transitions: dict[str, int] = field(default_factory=dict)
    #: Most lifecycles unreleased at once.
    max_live: int = 0
    #: Registrations whose rid was held by another lifecycle not released yet.
    reused_while_unreleased: int = 0
    #: The first [`MAX_REUSES`][kvlife.fsm.audit.checker.MAX_REUSES] of them, in log order.
    reuses: list[RidReuse] = field(default_factory=list)
    #: Tickets written down as overdue while the log was written.
    overdue: int = 0
    #: Of those, the ones that completed later in their segment (not violations unless
    #: the check counts every overdue ticket).
    overdue_completed: int = 0
    #: Prefill/decode hand-overs, joined across the logs read (see
    #: [`kvlife.fsm.audit.handover`][kvlife.fsm.audit.handover]).
    handovers: list[Handover] = field(default_factory=list)
    #: How each segment ended, in log order.
    endings: list[SegmentEnding] = field(default_factory=list)
    #: Copies in flight at the end of segments cut short or still open (not violations).
    open_at_end: list[OpenAtEnd] = field(default_factory=list)

    @property
    def cut_short(self) -> list[SegmentEnding]:
        """The segments whose writer stopped without closing them."""
        return [e for e in self.endings if e.status == "cut"]

    @property
    def ok(self) -> bool:
        """No violations (lost records are reported in ``lost``, not as violations)."""
        return self.violation_count == 0


@dataclass(frozen=True)
class Verdict:
    """What ``kvlife audit check`` concludes from a report and the reader's unreadable
    lines: every tool that shows a log shows this and exits as ``check`` does.

    Not ok when the log has violations, unreadable lines, or records a failing sink lost
    (unless ``allow_lost``). ``cut_short`` counts the segments whose writer stopped
    without closing them and ``open_at_cut`` the copies in flight then: a log cut short
    with nothing else wrong is ok, but says so, and exits 3."""

    ok: bool
    violations: int
    lost_records: int
    unreadable_lines: int
    cut_short: int = 0
    open_at_cut: int = 0

    @classmethod
    def of(
        cls, report: AuditReport, unreadable_lines: int = 0, *, allow_lost: bool = False
    ) -> Verdict:
        """The verdict on ``report``."""
        lost_ok = allow_lost or not report.lost_records
        ok = report.ok and not unreadable_lines and lost_ok
        cut = report.cut_short
        at_cut = sum(e.open_tickets for e in cut)
        return cls(
            ok, report.violation_count, report.lost_records, unreadable_lines, len(cut), at_cut
        )

    @property
    def exit_status(self) -> int:
        """1 when not ``ok``; else 3 when a segment was cut short; else 0."""
        if not self.ok:
            return 1
        return 3 if self.cut_short else 0

    def __str__(self) -> str:
        """``OK``; ``CUT SHORT: 1 writer stopped without closing its log (2 copies in
        flight then); nothing else wrong``; or ``FAILED: 1 violation, 3 lost records, 2
        unreadable lines`` (the parts that are not zero, and the cut when there is one)."""
        cut = ""
        if self.cut_short:
            writers = "writer" if self.cut_short == 1 else "writers"
            cut = (
                f"{self.cut_short} {writers} stopped without closing the log "
                f"({copies(self.open_at_cut)} in flight then)"
            )
        if self.ok:
            return f"CUT SHORT: {cut}; nothing else wrong" if cut else "OK"
        parts = [
            _count(self.violations, "violation"),
            _count(self.lost_records, "lost record"),
            _count(self.unreadable_lines, "unreadable line"),
            cut,
        ]
        return "FAILED: " + ", ".join(p for p in parts if p)


def _count(n: int, noun: str) -> str:
    return "" if not n else f"{n} {noun}{'' if n == 1 else 's'}"


class _Replay:
    __slots__ = ("inflight", "refusals", "resync", "rid", "state", "transitions", "uncertain")

    def __init__(self, rid: str | None, state: str, inflight: int = 0) -> None:
        self.rid = rid
        self.state = state
        self.inflight = inflight
        self.transitions = 0
        self.refusals = 0
        self.resync = False  # records may be missing: take the next record's src as truth
        self.uncertain = False


class _Marks:
    """One byte per non-negative integer seen (serials, copy numbers), growing as they
    do; huge outliers go to a dict so a hostile number cannot allocate gigabytes."""

    __slots__ = ("_bytes", "_far")
    _DENSE: Final = 1 << 26

    def __init__(self) -> None:
        self._bytes = bytearray()
        self._far: dict[int, int] = {}

    def get(self, n: int) -> int:
        b = self._bytes
        if n < len(b):
            return b[n]
        return self._far.get(n, 0) if n >= self._DENSE else 0

    def set(self, n: int, value: int) -> None:
        b = self._bytes
        if n >= len(b):
            if n >= self._DENSE:
                self._far[n] = value
                return
            b.extend(bytes(max(n + 1 - len(b), len(b) // 2, 1024)))
        b[n] = value


_SEEN: Final = 1
_DONE: Final = 2  # a released serial, a completed copy


class _SegmentState:
    __slots__ = (
        "began_mid_way",
        "closed_at",
        "closing",
        "file",
        "header",
        "index",
        "last_t_ns",
        "live",
        "lost",
        "op_owner",
        "op_start",
        "ops",
        "overdue",
        "partial",
        "previous_seq",
        "records",
        "serials",
        "witness",
    )

    def __init__(self, index: int, header: AuditHeader | None = None, file: str = "") -> None:
        self.index = index
        self.header = header
        self.file = file
        # the watched component, when a wrapper wrote the segment
        self.witness = header.witness if header is not None else ""
        self.closing: ClosingRecord | None = None
        self.closed_at: tuple[int | None, int, int] = (None, 0, 0)  # (seq, lost, records)
        self.last_t_ns: int | None = None
        self.records = 0
        self.began_mid_way = False
        self.op_start: dict[int, tuple[int, object]] = {}  # copies in flight: op -> (t_ns, kind)
        self.live: dict[int, _Replay] = {}
        self.serials = _Marks()
        self.ops = _Marks()
        self.op_owner: dict[int, int] = {}  # copies in flight: op -> serial
        # overdue copies not completed yet: op -> (seq, serial, rid, message)
        self.overdue: dict[int, tuple[int, int | None, str | None, str]] = {}
        self.lost: list[tuple[int, int]] = []
        self.previous_seq: int | None = None
        self.partial = False  # the segment's history before some record is unknown


_BEFORE: Final[dict[str, int]] = {"start_offload": -1, "ack": 1, "fail": 1, "finish": 0, "abort": 0}
_STATES: Final = frozenset(s.value for s in State)
_RELEASED: Final = State.RELEASED.value
_ALLOCATED: Final = State.ALLOCATED.value


def _legal_next(src: str | None, trigger: str, inflight_before: int) -> str | None:
    if src is None or src not in _STATES:
        return None
    try:
        dst = LIFECYCLE.next_state(State(src), Trigger(trigger), inflight_before)
    except ValueError:
        return None
    return None if dst is None else dst.value


class AuditChecker:
    """Check a log event by event: ``feed`` each event, then ``finish()``.

    Args:
        expect_released: instances not released at the end are violations (``leaked``),
            except uncertain ones (their release may be among lost records).
        accept_tables: table digests to replay as if they were this kvlife's table.
        keep_instances: keep every instance's final state in ``report.instances``.
        overdue_fails: every ``overdue`` record is a violation, even when its ticket
            completed later.
        alive: whether a writer's pid runs (tells a segment still being written from
            one cut short); ``kill(pid, 0)`` on this machine by default.
        join: the hand-over join to feed (one shared by the checkers of several logs
            followed at once); a join of its own by default.

    ``report.violation_kinds`` counts every violation found so far by kind (the list
    keeps the first [`MAX_VIOLATIONS`][kvlife.fsm.audit.checker.MAX_VIOLATIONS]): what a
    tool that checks a log while it is written reads between events.
    """

    def __init__(
        self,
        *,
        expect_released: bool = False,
        accept_tables: Iterable[str] = (),
        keep_instances: bool = False,
        overdue_fails: bool = False,
        alive: Callable[[int], bool] = pid_alive,
        join: HandoverJoin | None = None,
    ) -> None:
        self._alive = alive
        self.expect_released = expect_released
        self.overdue_fails = overdue_fails
        self.accept_tables = frozenset(accept_tables) | {LIFECYCLE.digest}
        self.keep_instances = keep_instances
        self.report = AuditReport()
        self._segment: _SegmentState | None = None
        self._rid_live: dict[str | None, list[int]] = {}  # rid -> its unreleased serials
        self._live_total = 0
        self._join = join if join is not None else HandoverJoin()
        self._joined = False

    # ------------------------------------------------------------------ events

    def feed(self, event: Event) -> None:
        """Take one event of the reader's stream (or a bare record)."""
        if type(event) is AuditRecord:
            self._record(event)
        elif type(event) is Segment:
            self._new_segment(event)
        elif type(event) is LostRecords:
            self._lost(event)
        elif type(event) is ClosingRecord:
            seg = self._seg()
            seg.closing = event
            seg.closed_at = (seg.previous_seq, len(seg.lost), seg.records)
        else:
            raise TypeError(f"not an audit event: {type(event).__name__}")

    def _new_segment(self, event: Segment) -> None:
        digest = event.header.table
        if digest not in self.accept_tables:
            raise AuditTableMismatchError(
                f"segment {event.index}{f' of {event.file}' if event.file else ''} was "
                f"written with transition table {digest}, but this kvlife's table is "
                f"{LIFECYCLE.digest}; replaying it would be wrong. Accept it explicitly "
                f"to replay anyway (--accept-table {digest})",
                digest=digest,
            )
        self._close_segment()
        self._segment = _SegmentState(self.report.segments, event.header, event.file)
        if event.header.part:  # its earlier files are not read (rotated out, removed)
            self._segment.partial = self._segment.began_mid_way = True
        self._join.segment(event.header, event.file, self.report.segments)
        self.report.segments += 1

    def _seg(self) -> _SegmentState:
        if self._segment is None:  # bare records: one segment without a header
            self._segment = _SegmentState(self.report.segments)
            self.report.segments += 1
        return self._segment

    def _lost(self, marker: LostRecords) -> None:
        seg = self._seg()
        seg.lost.append((marker.first_seq, marker.last_seq))
        self.report.lost.append(marker)
        self.report.lost_records += marker.kvlife_lost

    def _bad(
        self,
        kind: ViolationKind,
        seq: int | None,
        serial: int | None,
        message: str,
        rid: str | None = None,
        segment: int | None = None,
    ) -> None:
        report = self.report
        report.violation_count += 1
        report.violation_kinds[kind] = report.violation_kinds.get(kind, 0) + 1
        if len(report.violations) < MAX_VIOLATIONS:
            index = segment
            if index is None:
                index = self._segment.index if self._segment is not None else 0
            report.violations.append(Violation(kind, seq, serial, message, index, rid))

    def _covered(self, seg: _SegmentState, first: int, last: int) -> bool:
        """Whether lost-record markers of this segment cover ``first..last``."""
        for lo, hi in sorted(seg.lost):
            if lo <= first <= hi:
                first = hi + 1
                if first > last:
                    return True
        return False

    def _gap(self, seg: _SegmentState, previous: int, r: AuditRecord) -> None:
        if r.seq > previous + 1 and self._covered(seg, previous + 1, r.seq - 1):
            # lost by a failing sink, and marked as such: not tampering, but from here on
            # every open instance may have missed records
            seg.partial = True
            for inst in seg.live.values():
                inst.resync = inst.uncertain = True
            return
        self._bad("seq_gap", r.seq, r.serial, f"seq {previous} is followed by {r.seq}", rid=r.rid)

    def _record(self, r: AuditRecord) -> None:
        report = self.report
        report.records += 1
        seg = self._segment if self._segment is not None else self._seg()
        previous = seg.previous_seq
        if previous is None:
            if r.seq != 0:
                seg.partial = seg.began_mid_way = True  # a ring, rotated-out files
        elif r.seq != previous + 1:
            self._gap(seg, previous, r)
        seg.previous_seq = r.seq
        seg.last_t_ns = r.t_ns
        seg.records += 1
        serial = r.serial
        live = seg.live
        if not r.ok:
            reason = r.reason or "?"
            report.refusals[reason] = report.refusals.get(reason, 0) + 1
            if reason == "overdue":
                self._overdue(seg, r)
            elif reason in PROTOCOL_REASONS:
                said = " ".join(f"{k}={v}" for k, v in r.detail.items())
                self._bad(
                    reason,  # type: ignore[arg-type]  # the protocol reasons are kinds too
                    r.seq,
                    serial,
                    f"{r.trigger} refused: {said}" if said else f"{r.trigger} refused",
                    rid=r.rid,
                )
            if serial is None:
                return
            inst = live.get(serial)
            if inst is not None:
                inst.refusals += 1
                state = None if inst.resync else inst.state
            else:
                state = _RELEASED if seg.serials.get(serial) == _DONE else None
            if r.src is not None and state is not None and r.src != state:
                self._bad(
                    "state_mismatch",
                    r.seq,
                    serial,
                    f"refusal reports state {r.src} but the instance is {state}",
                    rid=r.rid,
                )
            return
        trigger = r.trigger
        report.transitions[trigger] = report.transitions.get(trigger, 0) + 1
        if serial is None:
            self._bad(
                "unknown_instance", r.seq, None, "accepted record without a serial", rid=r.rid
            )
            return
        if trigger == REGISTER:
            self._register(seg, r, serial)
            return
        inst = live.get(serial)
        if inst is None:
            inst = self._first_seen(seg, r, serial)
            if inst is None:
                return
        elif inst.resync:
            inst.state = r.src or inst.state
            inst.inflight = r.inflight + _BEFORE[trigger]
            inst.resync = False
        if r.src != inst.state:
            self._bad(
                "state_mismatch",
                r.seq,
                serial,
                f"{trigger} from {r.src} but the instance was {inst.state}",
                rid=r.rid,
            )
        if r.rid != inst.rid:  # `why --rid` would tell this record under the other rid
            self._bad(
                "rid_mismatch",
                r.seq,
                serial,
                f"{trigger} names rid {r.rid!r}, but lifecycle {serial} was registered "
                f"as {inst.rid!r}",
                rid=inst.rid,
            )
        before = r.inflight + _BEFORE[trigger]
        if before != inst.inflight:
            self._bad(
                "inflight_mismatch",
                r.seq,
                serial,
                f"{trigger} implies {before} in flight before, replay has {inst.inflight}",
                rid=r.rid,
            )
        expected = _legal_next(r.src, trigger, before)
        if expected is None or expected != r.dst:
            self._bad(
                "illegal_transition",
                r.seq,
                serial,
                f"{r.src} --{trigger} (inflight {before})--> {r.dst} is not in the "
                f"table (table says {expected})",
                rid=r.rid,
            )
        op = r.op
        if trigger == "start_offload":
            if op is not None:
                seg.op_owner[op] = serial
                seg.op_start[op] = (r.t_ns, r.detail.get("kind"))
                seg.ops.set(op, _SEEN)
        elif trigger == "ack" or trigger == "fail":  # noqa: PLR1714 - two literals, hot loop
            self._completion(seg, inst, r, serial)
        if r.detail or self._join.open:  # a transfer identity, or a completion of one
            join = self._join
            if join.at != (seg.file, seg.index):  # another checker fed it last
                join.segment(seg.header, seg.file, seg.index)
            join.record(r)
        inst.state = r.dst or inst.state
        inst.inflight = r.inflight
        inst.transitions += 1
        if inst.state == _RELEASED:
            self._release(seg, inst, serial)

    def _overdue(self, seg: _SegmentState, r: AuditRecord) -> None:
        self.report.overdue += 1
        join = self._join
        if join.at != (seg.file, seg.index):
            join.segment(seg.header, seg.file, seg.index)
        join.overdue(r)
        detail = r.detail
        message = (
            f"{detail.get('kind', 'ticket')} (copy {r.op}) open {detail.get('age_s', '?')} s, "
            f"longer than {detail.get('limit_s', '?')} s"
        )
        if self.overdue_fails or r.op is None or seg.ops.get(r.op) == _DONE:
            self._bad("overdue", r.seq, r.serial, message, rid=r.rid)
        else:
            seg.overdue[r.op] = (r.seq, r.serial, r.rid, message)

    def _register(self, seg: _SegmentState, r: AuditRecord, serial: int) -> None:
        report = self.report
        if serial in seg.live or seg.serials.get(serial):
            self._bad(
                "serial_reused", r.seq, serial, f"serial {serial} registered twice", rid=r.rid
            )
        seg.live[serial] = _Replay(r.rid, r.dst or "?")
        seg.serials.set(serial, _SEEN)
        report.lifecycles += 1
        held = self._rid_live.get(r.rid)
        if held is None:
            self._rid_live[r.rid] = [serial]
        else:
            report.reused_while_unreleased += 1
            if len(report.reuses) < MAX_REUSES:
                report.reuses.append(RidReuse(seg.index, r.seq, r.t_ns, r.rid, serial, tuple(held)))
            held.append(serial)
        self._live_total += 1
        report.max_live = max(report.max_live, self._live_total)
        if r.dst != _ALLOCATED or r.inflight != 0:
            self._bad(
                "illegal_transition",
                r.seq,
                serial,
                f"registration to {r.dst} with {r.inflight} in flight",
                rid=r.rid,
            )

    def _first_seen(self, seg: _SegmentState, r: AuditRecord, serial: int) -> _Replay | None:
        """An accepted transition of an instance that is not live in the replay."""
        if seg.serials.get(serial) == _DONE:
            self._bad(
                "after_release",
                r.seq,
                serial,
                f"{r.trigger} accepted on lifecycle {serial} after it was released",
                rid=r.rid,
            )
            return None
        if not seg.partial:
            self._bad(
                "unknown_instance",
                r.seq,
                serial,
                f"{r.trigger} accepted on lifecycle {serial}, which was never registered",
                rid=r.rid,
            )
            return None
        # The log does not hold this instance's beginning: take the record's source state.
        inst = seg.live[serial] = _Replay(r.rid, r.src or "?", r.inflight + _BEFORE[r.trigger])
        inst.uncertain = True
        seg.serials.set(serial, _SEEN)
        self.report.lifecycles += 1
        self._rid_live.setdefault(r.rid, []).append(serial)
        self._live_total += 1
        return inst

    def _completion(self, seg: _SegmentState, inst: _Replay, r: AuditRecord, serial: int) -> None:
        op = r.op
        if op is None:
            self._bad("unknown_op", r.seq, serial, f"{r.trigger} without a copy number", rid=r.rid)
            return
        owner = seg.op_owner.pop(op, None)
        seg.op_start.pop(op, None)
        if seg.overdue and seg.overdue.pop(op, None) is not None:
            self.report.overdue_completed += 1
        if owner is None:
            if seg.ops.get(op) == _DONE:
                self._bad(
                    "duplicate_completion", r.seq, serial, f"copy {op} completed twice", rid=r.rid
                )
            elif not inst.uncertain:
                self._bad(
                    "unknown_op",
                    r.seq,
                    serial,
                    f"{r.trigger} of copy {op} never started",
                    rid=r.rid,
                )
        elif owner != serial:
            self._bad(
                "wrong_instance",
                r.seq,
                serial,
                f"copy {op} was started by lifecycle {owner}, completed on lifecycle {serial}",
                rid=r.rid,
            )
        seg.ops.set(op, _DONE)

    def _summary(self, seg: _SegmentState, serial: int, inst: _Replay) -> InstanceSummary:
        return InstanceSummary(
            serial,
            inst.rid,
            inst.state,
            inst.inflight,
            inst.transitions,
            inst.refusals,
            seg.index,
            inst.uncertain,
        )

    def _release(self, seg: _SegmentState, inst: _Replay, serial: int) -> None:
        del seg.live[serial]
        seg.serials.set(serial, _DONE)
        self.report.released += 1
        self._left(inst.rid, serial)
        if self.keep_instances:
            self.report.instances[(seg.index, serial)] = self._summary(seg, serial, inst)

    def _close_segment(self) -> None:
        seg = self._segment
        if seg is None:
            return
        for seq, serial, rid, message in seg.overdue.values():
            self._bad("overdue", seq, serial, f"{message}; never completed", rid=rid)
        ending = self._ending(seg)
        self.report.endings.append(ending)
        if ending.closing is not None:
            self._missing_tail(seg, ending.closing)
        if ending.stopping is not None:  # in flight when the writer stopped: no verdict
            self._open_at_end(seg, ending.stopping)
        elif seg.witness:
            open_ops: dict[int, list[int]] = {}
            for op, owner in seg.op_owner.items():
                open_ops.setdefault(owner, []).append(op)
            for serial, inst in seg.live.items():
                if inst.inflight > 0 and not inst.uncertain:
                    ops = ", ".join(map(str, sorted(open_ops.get(serial, ()))))
                    self._bad(
                        "unreported",
                        None,
                        serial,
                        f"lifecycle {serial} ({inst.rid!r}) ended the log {inst.state} with "
                        f"{inst.inflight} ticket(s) of {seg.witness} open (copy {ops or '?'})",
                        rid=inst.rid,
                    )
        for serial, inst in seg.live.items():
            summary = self._summary(seg, serial, inst)
            self.report.live.append(summary)
            if self.keep_instances:
                self.report.instances[(seg.index, serial)] = summary
            self._left(inst.rid, serial)
        self._segment = None

    def _missing_tail(self, seg: _SegmentState, closing: ClosingRecord) -> None:
        """A closed segment whose writer wrote more lines than were read: the last ones
        before its closing record are missing, which no gap in ``seq`` can show. The
        lifecycles live at the end may have lost their last records: no verdict on them."""
        if seg.began_mid_way:  # its first files were rotated out: the count cannot tell
            return
        read = seg.records + len(seg.lost)  # a sink counts its lost-records markers too
        missing = closing.records - read
        if missing <= 0:
            return
        first = 0 if seg.previous_seq is None else seg.previous_seq + 1
        self._bad(
            "seq_gap",
            first,
            None,
            f"its writer closed segment {seg.index} after {closing.records} line(s), "
            f"{read} were read: the last {missing} before the closing record are missing",
            segment=seg.index,
        )
        for inst in seg.live.values():
            inst.resync = inst.uncertain = True

    def _ending(self, seg: _SegmentState) -> SegmentEnding:
        header = seg.header
        closing = seg.closing
        closed = closing is not None and seg.closed_at == (
            seg.previous_seq,
            len(seg.lost),
            seg.records,
        )
        status: SegmentStatus
        if closed:
            status = "closed"
        elif header is None or not header.closes:
            status = "unknown"
        else:
            status = "open" if self._alive(header.pid) else "cut"
        last_wall = None
        if header is not None and seg.last_t_ns is not None:
            last_wall = header.wall_start + (seg.last_t_ns - header.t_ns_start) / 1e9
        open_tickets = sum(inst.inflight for inst in seg.live.values())
        return SegmentEnding(
            seg.index,
            status,
            header.pid if header is not None else 0,
            seg.file,
            seg.witness,
            closing.kvlife_closed if closed and closing is not None else None,
            seg.last_t_ns,
            last_wall,
            seg.records,
            open_tickets,
            len(seg.live),
            closing=closing if closed else None,
            begins_mid_way=seg.began_mid_way,
        )

    def _open_at_end(self, seg: _SegmentState, status: StopKind) -> None:
        """List the copies in flight at the end of a segment cut short or still open."""
        kept = self.report.open_at_end
        end = seg.last_t_ns
        for op, serial in sorted(seg.op_owner.items()):
            if len(kept) >= MAX_VIOLATIONS:
                return
            inst = seg.live.get(serial)
            started = seg.op_start.get(op)
            age = None
            kind = None
            if started is not None:
                t_ns, said = started
                kind = said if isinstance(said, str) else None
                age = (end - t_ns) / 1e9 if end is not None else None
            kept.append(
                OpenAtEnd(
                    seg.index,
                    serial,
                    inst.rid if inst is not None else None,
                    inst.state if inst is not None else "?",
                    op,
                    kind,
                    age,
                    status,
                )
            )

    def _left(self, rid: str | None, serial: int) -> None:
        """An instance stopped being live (released, or its segment ended)."""
        self._live_total -= 1
        held = self._rid_live.get(rid)
        if held is None:
            return
        if len(held) == 1:
            del self._rid_live[rid]
        elif serial in held:
            held.remove(serial)

    def finish(self) -> AuditReport:
        """Close the last segment, join the prefill/decode hand-overs of every segment
        read (their verdicts are violations) and return the report. Calling it again
        returns the same report."""
        self._close_segment()
        if self._joined:  # finished before
            return self.report
        self._joined = True
        self.report.handovers = self._join.finish()
        self._mark_open_logs()
        ended = {e.segment: e.status for e in self.report.endings}
        for handover in self.report.handovers:
            for side in [handover.prefill, *handover.decode]:
                if side is not None:
                    side.log_ending = ended.get(side.segment, "")
        for handover in self.report.handovers:
            for kind, side, message in handover.verdicts:
                self._bad(kind, side.seq, side.serial, message, side.rid, side.segment)
        if self.expect_released:
            stopped = {e.segment for e in self.report.endings if e.stopping is not None}
            for inst in self.report.live:
                if not inst.uncertain and inst.segment not in stopped:
                    self._bad(
                        "leaked",
                        None,
                        inst.serial,
                        f"lifecycle {inst.serial} ({inst.rid!r}) of segment {inst.segment} "
                        f"ended {inst.state} with {inst.inflight} in flight",
                        rid=inst.rid,
                    )
        return self.report

    def _mark_open_logs(self) -> None:
        """Give the last segment of each log read from a file the ``PATH.open`` marker
        beside it, when the writer left one."""
        endings = self.report.endings
        last: dict[str, int] = {}
        for index, ending in enumerate(endings):
            if ending.file:
                last[re.sub(r"\.[1-9][0-9]*$", "", ending.file)] = index
        for base, index in last.items():
            text = open_marker(base)
            if text is not None and endings[index].status != "closed":
                endings[index] = dataclasses.replace(endings[index], marker=text)


MAX_AT_CUT_LISTED: Final = 10
"""Copies in flight at a cut listed per segment on a first screen; the rest are counted."""


def ending_lines(report: AuditReport, *, rid: str | None = None) -> list[str]:
    """What every view says first about how the log's writers stopped: nothing when
    every segment was closed cleanly; else one line per segment cut short or still open
    (writer pid, last record's time, copies in flight, the ``.open`` marker) with the
    copies in flight then (``rid``'s first), a line for segments whose ending is unknown,
    and, for several writers, how many closed."""
    endings = report.endings
    if all(e.status == "closed" and not (e.how == "signal" and e.open_tickets) for e in endings):
        return []
    lines: list[str] = []
    if len(endings) > 1:
        counts = {
            status: sum(e.status == status for e in endings)
            for status in ("closed", "cut", "open", "unknown")
        }
        lines.append(
            f"{len(endings)} writers: {counts['closed']} closed their log, "
            f"{counts['cut']} stopped without closing it (cut short), {counts['open']} "
            f"still open, {counts['unknown']} of unknown ending"
        )
    at_end = sorted(report.open_at_end, key=lambda o: (o.rid != rid, o.segment, o.op))
    for ending in endings:
        stopping = ending.stopping
        if stopping is not None and (stopping != "signal" or ending.open_tickets):
            lines.append(ending.line())
            mine = [o for o in at_end if o.segment == ending.segment]
            when = {"cut": "at the cut", "open": "now", "signal": "at the signal"}[stopping]
            for item in mine[:MAX_AT_CUT_LISTED]:
                age = "" if item.age_s is None else f", {item.age_s:.1f} s in flight"
                lines.append(
                    f"  in flight {when}: rid {item.rid!r} lifecycle {item.serial} copy "
                    f"{item.op}{f' ({item.kind})' if item.kind else ''}, {item.state}{age}"
                )
            if len(mine) > MAX_AT_CUT_LISTED:
                lines.append(f"  ... {len(mine) - MAX_AT_CUT_LISTED} more in flight {when}")
    unknown = [e.segment for e in endings if e.status == "unknown"]
    if unknown:
        lines.append(
            f"{len(unknown)} segment(s) written by a kvlife without closing records "
            f"({', '.join(map(str, unknown[:10]))}): whether their writer closed them is "
            "unknown"
        )
    return lines


def fed(events: Iterable[Event], checker: AuditChecker) -> Iterator[Event]:
    """``events``, each fed to ``checker`` before it is passed on: a tool that reads a log
    for its own purpose checks it in the same pass (call ``checker.finish()`` after)."""
    feed = checker.feed
    for event in events:
        feed(event)
        yield event


def violations_by_record(report: AuditReport) -> dict[tuple[int, int], list[Violation]]:
    """The violations kept in ``report`` by (segment, seq) of the record they are about
    (leaks, which have no record, are left out)."""
    marks: dict[tuple[int, int], list[Violation]] = {}
    for v in report.violations:
        if v.seq is not None:
            marks.setdefault((v.segment, v.seq), []).append(v)
    return marks


def check_audit(
    source: AuditReader | AuditLog | Iterable[Event],
    *,
    expect_released: bool = False,
    accept_tables: Iterable[str] = (),
    keep_instances: bool = False,
    overdue_fails: bool = False,
) -> AuditReport:
    """Replay an audit log (a reader, a log read into memory, or records) against the
    transition table. See [`AuditChecker`][kvlife.fsm.audit.checker.AuditChecker] for the arguments.

    Raises:
        AuditTableMismatchError: a segment was written with another table, not accepted.
        AuditFormatError: the reader found the input is not an audit log.
    """
    checker = AuditChecker(
        expect_released=expect_released,
        accept_tables=accept_tables,
        keep_instances=keep_instances,
        overdue_fails=overdue_fails,
    )
    events = source.events() if isinstance(source, AuditLog) else source
    feed = checker.feed
    for event in events:
        feed(event)
    return checker.finish()


__all__ = [
    "MAX_VIOLATIONS",
    "AuditChecker",
    "AuditReport",
    "AuditTableMismatchError",
    "InstanceSummary",
    "OpenAtEnd",
    "SegmentEnding",
    "SegmentStatus",
    "StopKind",
    "Verdict",
    "Violation",
    "ViolationKind",
    "check_audit",
    "copies",
    "ending_lines",
    "pid_alive",
]

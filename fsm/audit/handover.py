"""Prefill/decode hand-overs: one request's story across two servers' logs.

When prefill and decode run on two servers, the prefill server computes a request's KV
and holds its blocks (a delayed free) until the decode server has read them; each server
writes its own log, and the request has a different id on each. A writer that watches such
a hand-over (vLLM's audit wrapper around ``NixlConnector``) writes the request's *transfer
identity* into the records that matter, as detail:

- on the prefill side, the ``delayed_free`` ticket and the ``finish`` record carry
  ``handoff_engine`` (the prefill engine's id), ``handoff_rid`` (the id the decode side
  will name it by), ``handoff_blocks`` (how many blocks it handed over) and
  ``handoff_digest`` (a digest of their ids);
- on the decode side, the ``load`` ticket and the ``finish``/``abort`` record carry
  ``peer_engine``, ``peer_rid``, ``peer_blocks`` and ``peer_digest``: what the request
  said it would read.

[`HandoverJoin`][kvlife.fsm.audit.handover.HandoverJoin] reads both logs (any order, in one
pass, fed by the checker) and joins the two sides of each request by (engine, id): when the
prefill side finished, when its blocks were freed and by which report, when the decode side
began and ended its load. Verdicts where the two sides disagree:

- ``freed_before_read``: the prefill side freed the blocks (a lease or timeout ended the
  delayed free) before the decode side began to read them: the decode side read blocks
  that may hold another request's KV by then;
- ``handover_mismatch``: the decode side read other blocks than those the prefill side
  handed over under that identity (a proxy that mixed up two requests' parameters).

Times on the two sides are compared on the wall clock each log's header anchors: exact on
one host, as good as the hosts' clocks agree across hosts. A prefill side that finished
before the decode side's load began by less than ``CLOCK_SLACK_S`` is not judged.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import PurePath
from typing import Final, Literal

from kvlife.fsm.audit.records import AuditHeader, AuditRecord, DetailValue

HANDOFF_ENGINE: Final = "handoff_engine"
HANDOFF_RID: Final = "handoff_rid"
HANDOFF_BLOCKS: Final = "handoff_blocks"
HANDOFF_DIGEST: Final = "handoff_digest"
PEER_ENGINE: Final = "peer_engine"
PEER_RID: Final = "peer_rid"
PEER_BLOCKS: Final = "peer_blocks"
PEER_DIGEST: Final = "peer_digest"

HandoverVerdict = Literal["freed_before_read", "handover_mismatch"]
"""The verdicts on a hand-over (violation kinds of the checker)."""

MAX_HANDOVERS: Final = 200_000
"""Sides kept for joining per check (each a few hundred bytes); more are counted, not
joined (``HandoverJoin.dropped``)."""
CLOCK_SLACK_S: Final = 0.005
"""How much two logs' wall clocks may disagree before a verdict compares them."""


def block_digest(blocks: Iterable[int]) -> str:
    """The digest a writer records for a hand-over's block ids (8 hex digits, CRC-32 of
    their decimal list): equal on both sides when both name the same blocks in order."""
    text = ",".join(str(int(b)) for b in blocks)
    return f"{zlib.crc32(text.encode()):08x}"


@dataclass
class HandoverSide:
    """One server's lifecycle of a handed-over request, as its log tells it."""

    file: str  # the log file it was read from ("" for bare records)
    segment: int
    serial: int
    rid: str
    engine: str  # the prefill engine's id
    key_rid: str  # the id both sides name the request by
    blocks: int | None = None
    digest: str | None = None
    #: wall-clock seconds: the ticket (delayed free or load) opened, ended; the lifecycle's end
    opened: float | None = None
    op: int | None = None
    closed: float | None = None
    closed_ok: bool | None = None
    closed_by: str = ""  # the report or cut that ended the ticket
    ended: float | None = None
    ended_how: str = ""  # finish, abort
    overdue: bool = False
    seq: int | None = None  # the record that opened the ticket
    #: How the side's log segment ended (``closed``, ``cut``, ``open``, ``unknown``; see
    #: the checker's ``SegmentEnding``); set when the checker finishes.
    log_ending: str = ""


@dataclass
class Handover:
    """A request handed over from a prefill side to decode sides (either may be missing
    from the logs given), and the verdicts on it."""

    engine: str
    rid: str  # the id both sides name it by (the prefill side's request id)
    prefill: HandoverSide | None = None
    decode: list[HandoverSide] = field(default_factory=list)
    verdicts: list[tuple[HandoverVerdict, HandoverSide, str]] = field(default_factory=list)

    @property
    def held_s(self) -> float | None:
        """How long the prefill side held the blocks: from its finish (or its delayed
        free's start) to the end of its delayed free."""
        p = self.prefill
        if p is None or p.closed is None:
            return None
        start = p.opened if p.opened is not None else p.ended
        return None if start is None else p.closed - start

    def involves(self, rid: str) -> bool:
        """Whether ``rid`` is either side's request id."""
        return (self.prefill is not None and self.prefill.rid == rid) or any(
            d.rid == rid for d in self.decode
        )


Clock = tuple[float, int]
"""A segment's clock anchor: its header's ``wall_start`` and ``t_ns_start``, taken at one
moment, which put its records' ``t_ns`` on the wall clock."""


def anchor(header: AuditHeader) -> Clock:
    """``header``'s clock anchor."""
    return (header.wall_start, header.t_ns_start)


def wall(t_ns: int, clock: Clock) -> float:
    """A record's ``t_ns`` as wall-clock seconds, by its segment's anchor."""
    wall_start, t_ns_start = clock
    return wall_start + (t_ns - t_ns_start) / 1e9


def moved(t_ns: int, there: Clock, here: Clock) -> int:
    """A ``t_ns`` of a segment anchored ``there`` as a ``t_ns`` of one anchored ``here``
    (the same moment on the wall clock; integer nanoseconds)."""
    return t_ns + round((there[0] - here[0]) * 1e9) - there[1] + here[1]


def _text(value: DetailValue) -> str | None:
    return value if isinstance(value, str) and value else None


class HandoverJoin:
    """Joins the prefill and decode sides of handed-over requests across logs: fed the
    records of every segment (``segment()`` at each segment's start, ``record()`` for
    each accepted record), then ``finish()``. Keeps one small side per handed-over
    request (at most [`MAX_HANDOVERS`][kvlife.fsm.audit.handover.MAX_HANDOVERS]).

    A segment is known by the file it began in and its index, so several checkers (one
    per log followed, as ``kvlife audit watch`` runs them) can feed one join, each calling
    ``segment()`` again before it feeds records of its own segment. With
    ``track_changes``, ``changed()`` names the identities whose sides changed since it was
    last called, and ``finish(keys)`` judges only those: a join that is judged while the
    logs are still being written."""

    def __init__(self, *, track_changes: bool = False) -> None:
        self._base: Clock = (0.0, 0)
        self._file = ""
        self._index = 0
        #: The segment being fed: (the file it began in, its index).
        self.at: tuple[str, int] = ("", 0)
        self.prefill: dict[tuple[str, str], list[HandoverSide]] = {}
        self.decode: dict[tuple[str, str], list[HandoverSide]] = {}
        self._by_serial: dict[tuple[str, int, int], HandoverSide] = {}  # segment, serial
        #: The tickets of sides still open, by (segment's file, segment, copy number).
        self.open: dict[tuple[str, int, int], HandoverSide] = {}
        self.sides = 0
        self.dropped = 0
        self._track = track_changes
        self._changed: set[tuple[str, str]] = set()

    def segment(self, header: AuditHeader | None, file: str, index: int) -> None:
        """Segment ``index`` begins (read from ``file``), or is fed again: its clock
        anchor (none for bare records without a header)."""
        self._base = anchor(header) if header is not None else (0.0, 0)
        self._file = file
        self._index = index
        self.at = (file, index)

    def changed(self) -> set[tuple[str, str]]:
        """The (engine, id) of the hand-overs whose sides changed since the last call
        (with ``track_changes``; else always empty)."""
        keys, self._changed = self._changed, set()
        return keys

    def _touch(self, side: HandoverSide) -> None:
        if self._track:
            self._changed.add((side.engine, side.key_rid))

    def record(self, r: AuditRecord) -> None:
        """Take an accepted record (only those with a transfer identity, and the
        completions of their tickets, change anything)."""
        trigger = r.trigger
        if trigger == "ack" or trigger == "fail":  # noqa: PLR1714
            if self.open and r.op is not None:
                side = self.open.pop((self._file, self._index, r.op), None)
                if side is not None:
                    self._touch(side)
                    side.closed = wall(r.t_ns, self._base)
                    side.closed_ok = trigger == "ack"
                    detail = r.detail
                    cut = detail.get("cut_by")
                    said = detail.get("report") or (f"cut by {cut}" if cut else trigger)
                    side.closed_by = str(said)
            return
        detail = r.detail
        if not detail or r.serial is None:
            return
        prefill = HANDOFF_ENGINE in detail
        if not prefill and PEER_ENGINE not in detail:
            return
        side = self._side(r, prefill)
        if side is None:
            return
        when = wall(r.t_ns, self._base)
        if trigger == "start_offload":
            side.opened = when
            side.op = r.op
            side.seq = r.seq
            if r.op is not None:
                self.open[(self._file, self._index, r.op)] = side
            self._touch(side)
        elif trigger == "finish" or trigger == "abort":  # noqa: PLR1714
            side.ended = when
            side.ended_how = trigger
            self._touch(side)

    def overdue(self, r: AuditRecord) -> None:
        """An ``overdue`` record: marks the side whose ticket it names."""
        if r.op is not None:
            side = self.open.get((self._file, self._index, r.op))
            if side is not None:
                side.overdue = True

    def _side(self, r: AuditRecord, prefill: bool) -> HandoverSide | None:
        key = (self._file, self._index, r.serial or 0)
        side = self._by_serial.get(key)
        if side is not None:
            return side
        detail = r.detail
        names = (
            (HANDOFF_ENGINE, HANDOFF_RID, HANDOFF_BLOCKS, HANDOFF_DIGEST)
            if prefill
            else (PEER_ENGINE, PEER_RID, PEER_BLOCKS, PEER_DIGEST)
        )
        engine = _text(detail.get(names[0]))
        key_rid = _text(detail.get(names[1])) or (r.rid if prefill else None)
        if engine is None or key_rid is None:
            return None
        if self.sides >= MAX_HANDOVERS:
            self.dropped += 1
            return None
        blocks = detail.get(names[2])
        side = HandoverSide(
            self._file,
            self._index,
            r.serial or 0,
            r.rid or "",
            engine,
            key_rid,
            blocks if isinstance(blocks, int) and not isinstance(blocks, bool) else None,
            _text(detail.get(names[3])),
        )
        self._by_serial[key] = side
        self.sides += 1
        self._touch(side)
        (self.prefill if prefill else self.decode).setdefault((engine, key_rid), []).append(side)
        return side

    def finish(self, keys: Iterable[tuple[str, str]] | None = None) -> list[Handover]:
        """The hand-overs, each prefill side with the decode sides that named it (a decode
        side goes to the latest prefill side of its identity that finished before its load
        began, else the first), and the verdicts on each: of every identity, or of the
        (engine, id) ``keys`` given. It changes nothing: call it as often as wanted."""
        handovers: list[Handover] = []
        if keys is None:
            keys = list(dict.fromkeys([*self.prefill, *self.decode]))
        for engine, rid in keys:
            prefills = sorted(
                self.prefill.get((engine, rid), []), key=lambda s: s.ended or s.opened or 0.0
            )
            groups = [Handover(engine, rid, p) for p in prefills] or [Handover(engine, rid)]
            for d in self.decode.get((engine, rid), []):
                began = d.opened if d.opened is not None else d.ended
                chosen = groups[0]
                for group in groups:
                    p = group.prefill
                    done = None if p is None else (p.ended or p.opened)
                    if done is not None and began is not None and done <= began + CLOCK_SLACK_S:
                        chosen = group
                chosen.decode.append(d)
            for group in groups:
                _judge(group)
            handovers += groups
        return handovers


def _judge(h: Handover) -> None:
    p = h.prefill
    if p is None:
        return
    for d in h.decode:
        if p.closed is not None and d.opened is not None and d.opened > p.closed + CLOCK_SLACK_S:
            h.verdicts.append(
                (
                    "freed_before_read",
                    d,
                    f"the prefill side ({_where(p)} #{p.serial}) "
                    f"freed the blocks of {h.rid!r} ({p.closed_by}) "
                    f"{d.opened - p.closed:.3f} s before this load of them began",
                )
            )
        if p.digest is not None and d.digest is not None and p.digest != d.digest:
            h.verdicts.append(
                (
                    "handover_mismatch",
                    d,
                    f"this load names blocks {d.digest} ({d.blocks}) of {h.rid!r}; the "
                    f"prefill side handed over {p.digest} ({p.blocks})",
                )
            )


def _where(side: HandoverSide) -> str:
    """The side's log: its file's name, or its segment for records read without one."""
    return PurePath(side.file).name if side.file else f"segment {side.segment}"


def clock(wall: float | None) -> str:
    """A wall-clock time as ``HH:MM:SS.mmm`` UTC (``?`` when unknown)."""
    if wall is None:
        return "?"
    return datetime.fromtimestamp(wall, UTC).strftime("%H:%M:%S.%f")[:-3]


def _after(t: float | None, t0: float | None) -> str:
    if t is None or t0 is None:
        return "?"
    return f"{t - t0:+.3f} s"


def tell_handover(h: Handover) -> list[str]:
    """A hand-over as lines of text: what each side did, when, relative to the prefill
    side's finish, and the verdicts."""
    p = h.prefill
    t0 = None
    if p is not None:
        t0 = p.ended if p.ended is not None else p.opened
    elif h.decode:
        t0 = h.decode[0].opened or h.decode[0].ended
    lines = [f"hand-over of {h.rid!r} from prefill engine {h.engine!r} (t0 {clock(t0)} UTC):"]
    if p is None:
        lines.append("  prefill: no lifecycle with this identity in the logs given")
    else:
        blocks = f", {p.blocks} block(s) handed over" if p.blocks is not None else ""
        lines.append(
            f"  prefill {_where(p)} #{p.serial} rid {p.rid!r}: "
            f"{p.ended_how or 'finished'} at t0{blocks}"
        )
        if p.op is not None:
            if p.closed is None:
                end = "still open at the end of its log (the blocks were never freed)"
            else:
                how = "ended" if p.closed_ok else "failed"
                end = f"{how} {_after(p.closed, t0)} by {p.closed_by}"
                held = h.held_s
                if held is not None:
                    end += f": the prefill side held the blocks {held:.3f} s"
            over = " (told overdue while it ran)" if p.overdue else ""
            lines.append(f"    delayed free (copy {p.op}) {end}{over}")
        else:
            lines.append("    no delayed free: the blocks were freed at the finish")
    if not h.decode:
        lines.append("  decode: no lifecycle read it in the logs given")
    for d in h.decode:
        lines.append(f"  decode {_where(d)} #{d.serial} rid {d.rid!r}:")
        events: list[tuple[float, str]] = []  # told in the order they happened
        if d.op is not None:
            events.append((d.opened or 0.0, f"load (copy {d.op}) began {_after(d.opened, t0)}"))
            if d.closed is not None:
                how = "completed" if d.closed_ok else "failed"
                events.append(
                    (
                        d.closed,
                        f"load {how} {_after(d.closed, t0)} ({d.closed_by}), "
                        f"{d.closed - (d.opened or d.closed):.3f} s after it began",
                    )
                )
        if d.ended is not None:
            during = d.op is not None and (d.closed is None or d.ended < d.closed)
            load = " while the load was in flight" if during else ""
            events.append((d.ended, f"{d.ended_how} {_after(d.ended, t0)}{load}"))
        lines += [f"    {text}" for _, text in sorted(events, key=lambda e: e[0])]
        if d.op is None:
            lines.append("    no load: the request never read the blocks")
        elif d.closed is None:
            lines.append("    ... and the load was still open at the end of its log")
    sides = [("prefill", p)] if p is not None else []
    for name, side in [*sides, *(("decode", d) for d in h.decode)]:
        if side.log_ending == "cut":
            lines.append(
                f"  the {name} side's log ({_where(side)}) was cut short: its server stopped "
                "without closing it, so what it did not write did not happen before the cut"
            )
        elif side.log_ending == "open":
            lines.append(f"  the {name} side's log ({_where(side)}) is still being written")
    for kind, side, message in h.verdicts:
        lines.append(f"  !! VIOLATION {kind} (decode #{side.serial} rid {side.rid!r}): {message}")
    return lines


__all__ = [
    "CLOCK_SLACK_S",
    "HANDOFF_BLOCKS",
    "HANDOFF_DIGEST",
    "HANDOFF_ENGINE",
    "HANDOFF_RID",
    "MAX_HANDOVERS",
    "PEER_BLOCKS",
    "PEER_DIGEST",
    "PEER_ENGINE",
    "PEER_RID",
    "Clock",
    "Handover",
    "HandoverJoin",
    "HandoverSide",
    "HandoverVerdict",
    "anchor",
    "block_digest",
    "clock",
    "moved",
    "tell_handover",
    "wall",
]

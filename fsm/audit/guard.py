"""What a registry does when an audit sink fails: never let it change the registry.

A transition is applied whole before its record is built; the record then goes to every
sink. A sink that raises is not allowed to undo or interrupt anything: the registry hands
the failure to the sink's [`SinkGuard`][kvlife.fsm.audit.guard.SinkGuard], which

* counts it (``errors``, in ``LifecycleRegistry.statistics().sinks``),
* logs the first failure through `logging` (logger ``kvlife.fsm.sinks``, once per
  failure episode, and once more when the sink recovers),
* keeps the records the sink could not take in a bounded backlog and offers them again,
  oldest first, on later writes (at most every ``retry_s`` seconds), on
  ``registry.flush()`` and at interpreter exit (then what is still refused is logged
  with its ``seq`` range),
* and when the backlog overflows drops its oldest records, remembering their ``seq``
  range: once the sink takes records again, a [`LostRecords`][kvlife.fsm.audit.records.LostRecords]
  marker naming that range is written before the rest (``write_lost``), so the log says
  what it is missing and the checker reports "records lost (sink error)".

The account is exact: at any moment every record the registry built for a sink is in the
sink's file, or buffered inside the sink (``buffered``: records it took and has not
written, for a sink that buffers, like ``JsonLinesSink``), or in the backlog (``pending``),
or counted lost with its ``seq`` range (``dropped``, ``lost``). When the guard gives up on
a sink (``detach``, interpreter exit), what it still holds and what the sink still buffers
become lost, and the message logged names the same ranges.

While every sink is healthy the record goes to ``sink.write`` directly: a guard costs
nothing until its sink first fails.

[`AuditPath`][kvlife.fsm.audit.guard.AuditPath] is a registry's one way to its sinks: the
one place that builds a record (``emit``), hands it to every sink that takes records now,
and hands a failure to that sink's guard. [`Births`][kvlife.fsm.audit.guard.Births] keeps
when the registry's lifecycles were registered, for the age of the oldest one in its
statistics, at a fixed cost: it samples the clock, it keeps no time per lifecycle.
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvlife.fsm.audit.records import (
    AuditRecord,
    DetailValue,
    LostRecords,
    StateName,
    TriggerName,
)
from kvlife.fsm.errors import Reason

_log: Final = logging.getLogger("kvlife.fsm.sinks")


@dataclass(frozen=True)
class SinkStatistics:
    """How one attached sink is doing."""

    #: ``repr`` of the sink.
    sink: str
    #: Failed calls to the sink (writes, markers and flushes) since it was attached.
    errors: int
    #: Records held for the sink, waiting to be offered again.
    pending: int
    #: Records lost for good: dropped because the backlog was full (each range is marked
    #: in the log once the sink takes records again), or given up on with the sink.
    dropped: int
    #: The last error, as ``"Type: message"``, or ``None`` if it never failed.
    last_error: str | None
    #: Records the sink took and holds in its own buffer, not written yet (a sink that
    #: buffers reports them with a ``buffered`` attribute; 0 for others).
    buffered: int = 0
    #: The ``seq`` ranges (first, last) of the ``dropped`` records, merged, oldest first.
    lost: tuple[tuple[int, int], ...] = ()


def seq_ranges(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted ``seqs`` as merged (first, last) ranges: ``[1, 2, 3, 7]`` -> ``[(1, 3), (7, 7)]``."""
    return merge_ranges((seq, seq) for seq in seqs)


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or adjacent (first, last) ranges merged, sorted."""
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(last, merged[-1][1]))
        else:
            merged.append((first, last))
    return merged


def format_ranges(ranges: Iterable[tuple[int, int]], limit: int = 10) -> str:
    """``seq 3-9, 12, 20-31`` (at most ``limit`` ranges, then how many more)."""
    items = list(ranges)
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in items[:limit])
    if len(items) > limit:
        text += f" and {len(items) - limit} more ranges"
    return f"seq {text}" if items else "none"


class SinkGuard:
    """One attached sink and its failure bookkeeping. Made by the registry."""

    __slots__ = (
        "_active",
        "_backlog",
        "_flush_owed",
        "_last_try",
        "_lost",
        "_lost_ranges",
        "_reported",
        "active",
        "backlog_limit",
        "dropped",
        "errors",
        "gated",
        "last_error",
        "retry_s",
        "sink",
    )

    def __init__(self, sink: Any, backlog_limit: int, retry_s: float) -> None:
        self.sink = sink
        self.backlog_limit = backlog_limit
        self.retry_s = retry_s
        self.errors = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._backlog: deque[AuditRecord] = deque()
        self._lost: tuple[int, int] | None = None  # seq range dropped and not yet marked
        self._lost_ranges: list[tuple[int, int]] = []  # every range lost for good
        self._last_try = 0.0
        self._flush_owed = False  # the sink failed since its last successful flush
        self._reported = False  # the current failure episode was logged
        # A sink with an active() method can be off (a LoggingSink whose logger is
        # disabled): then the registry leaves it out and builds no record for it alone.
        self._active = getattr(sink, "active", None)
        self.gated = callable(self._active)
        self.active = True
        if self.gated:
            self.refresh_active()

    def refresh_active(self) -> bool:
        """Ask the sink whether it takes records now; return whether that changed. A
        sink whose active() raises is kept on (and the failure counted)."""
        try:
            active = bool(self._active())  # type: ignore[misc]
        except Exception as exc:
            self.failed(None, exc, "active")
            active = True
        changed = active != self.active
        self.active = active
        return changed

    @property
    def healthy(self) -> bool:
        """Nothing is waiting: records may go straight to the sink."""
        return not self._backlog and self._lost is None

    def failed(self, record: AuditRecord | None, exc: Exception, what: str = "write") -> None:
        """The sink raised ``exc``; ``record`` (if any) was not taken."""
        self.errors += 1
        self._flush_owed = True
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._last_try = time.monotonic()
        if not self._reported:
            self._reported = True
            _log.error(
                "audit sink %r failed (%s): %s; records are kept (up to %d) and retried",
                self.sink,
                what,
                self.last_error,
                self.backlog_limit,
            )
        if record is not None:
            self._keep(record)

    def _keep(self, record: AuditRecord) -> None:
        backlog = self._backlog
        backlog.append(record)
        while len(backlog) > self.backlog_limit:
            seq = backlog.popleft().seq
            self.dropped += 1
            first = seq if self._lost is None else self._lost[0]
            self._lost = (first, seq)
            self._add_lost(seq, seq)

    def _add_lost(self, first: int, last: int) -> None:
        ranges = self._lost_ranges
        if ranges and first == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], last)
        else:
            ranges.append((first, last))

    def keep_all(self, records: Iterable[AuditRecord]) -> None:
        """The sink did not take ``records`` (its ``write_many`` raised, and the failure
        was counted with ``failed``): keep them for a retry, in order."""
        for record in records:
            self._keep(record)

    def write_many(self, records: list[AuditRecord]) -> None:
        """Give the sink ``records`` in order, behind any backlog: together through its
        ``write_many`` while it is healthy and has one, else one at a time; never
        raises."""
        many = getattr(self.sink, "write_many", None)
        if many is None or not self.healthy:
            for record in records:
                self.write(record)
            return
        try:
            many(records)
        except Exception as exc:
            self.failed(records[0], exc)
            self.keep_all(records[1:])

    def write(self, record: AuditRecord) -> None:
        """Give the sink ``record``, behind any backlog (retried at most every
        ``retry_s``); never raises."""
        if not self.healthy and time.monotonic() - self._last_try >= self.retry_s:
            self.retry()
        if self.healthy:
            try:
                self.sink.write(record)
            except Exception as exc:
                self.failed(record, exc)
        else:
            self._keep(record)

    def retry(self) -> bool:
        """Offer the lost-range marker and the backlog to the sink again, oldest first;
        stop at the first failure. Returns whether the guard is healthy afterwards."""
        self._last_try = time.monotonic()
        if self._lost is not None:
            first, last = self._lost
            marker = LostRecords(last - first + 1, first, last, self.last_error or "?")
            write_lost = getattr(self.sink, "write_lost", None)
            try:
                if callable(write_lost):
                    write_lost(marker)
                else:
                    _log.error(
                        "audit sink %r cannot record lost records: seq %d-%d (%d) lost: %s",
                        self.sink,
                        first,
                        last,
                        marker.kvlife_lost,
                        marker.error,
                    )
            except Exception as exc:
                self.failed(None, exc, "write_lost")
                return False
            self._lost = None
        backlog = self._backlog
        write = self.sink.write
        while backlog:
            try:
                write(backlog[0])
            except Exception as exc:
                self.failed(None, exc)
                return False
            backlog.popleft()
        if self._reported:
            self._reported = False
            _log.warning("audit sink %r recovered after %d errors", self.sink, self.errors)
        return True

    def flush(self) -> bool:
        """Retry the backlog, then flush the sink; never raises. Returns whether both
        succeeded (everything the sink was given is written)."""
        if not self.healthy and not self.retry():
            return False
        flush = getattr(self.sink, "flush", None)
        if callable(flush):
            try:
                flush()
            except Exception as exc:
                self.failed(None, exc, "flush")
                return False
        self._flush_owed = False
        return True

    def settle(self) -> None:
        """Last chance (detach, interpreter exit) for a sink that failed: offer what is
        owed once more and flush; if that fails, give up on what it never wrote
        (``abandon``)."""
        if (not self.healthy or self._flush_owed) and not self.flush():
            self.abandon(discard_buffered=True)

    def abandon(self, *, discard_buffered: bool = False) -> None:
        """Give up on the records the sink never wrote: those in the backlog and, with
        ``discard_buffered``, those the sink still buffers (a sink with
        ``discard_buffered()``); count them as lost and log their ranges, with the ranges
        dropped before."""
        discard = getattr(self.sink, "discard_buffered", None)
        buffered: list[int] = []
        if discard_buffered and callable(discard):
            try:
                buffered = list(discard())
            except Exception as exc:
                self.failed(None, exc, "discard_buffered")
        if self.healthy and not buffered:
            return
        given_up = [r.seq for r in self._backlog] + buffered
        self.dropped += len(given_up)
        self._lost_ranges = merge_ranges([*self._lost_ranges, *seq_ranges(given_up)])
        _log.error(
            "audit sink %r is given up on: %d records were never written (%s)",
            self.sink,
            self.dropped,
            format_ranges(self._lost_ranges),
        )
        self._backlog.clear()
        self._lost = None

    def statistics(self) -> SinkStatistics:
        """A snapshot of this guard's counters (and of the sink's ``buffered`` count)."""
        buffered = getattr(self.sink, "buffered", 0)
        return SinkStatistics(
            repr(self.sink),
            self.errors,
            len(self._backlog),
            self.dropped,
            self.last_error,
            buffered if isinstance(buffered, int) else 0,
            tuple(self._lost_ranges),
        )


_now = time.monotonic_ns

Emit = Callable[
    [
        str | None,
        int | None,
        TriggerName,
        StateName | None,
        StateName | None,
        Reason | None,
        int | None,
        int,
        dict[str, DetailValue],
    ],
    None,
]
"""The type of [`AuditPath.emit`][kvlife.fsm.audit.guard.AuditPath.emit]."""


class AuditPath:
    """A registry's sinks, and the one path its records take to them.

    ``emit`` builds the record of one accepted or refused transition (the next ``seq``,
    the clock, the fields it is given) and hands it to every sink that takes records now.
    While there is one such sink and it is healthy, the record goes to its ``write``
    directly; otherwise through each sink's [`SinkGuard`][kvlife.fsm.audit.guard.SinkGuard],
    which keeps what a failing sink could not take. ``emit`` never raises for a sink.

    A registry calls ``emit`` only while ``active`` is true (some sink takes records):
    with none, no record is built and no ``seq`` is spent.

    Args:
        backlog: most records kept per failing sink for a retry.
        retry_s: least time between two retries of a failing sink on the write path.
    """

    __slots__ = (
        "_backlog",
        "_gated",
        "_guards",
        "_retry_s",
        "_write",
        "_write_many",
        "_writing",
        "gated",
        "records",
    )

    def __init__(self, backlog: int, retry_s: float) -> None:
        self._backlog = backlog
        self._retry_s = retry_s
        self._guards: list[SinkGuard] = []
        self._gated: tuple[SinkGuard, ...] = ()  # sinks with an active() method
        self._writing: tuple[SinkGuard, ...] = ()  # sinks that take records now
        self._write: Callable[[AuditRecord], object] | None = None
        # the one healthy sink's write_many while it is the only one and has one
        self._write_many: Callable[[list[AuditRecord]], object] | None = None
        #: Records built so far: the next record's ``seq``.
        self.records = 0
        #: Whether some sink can be switched off (has an ``active()`` method): then the
        #: registry asks ``regate()`` once per registration.
        self.gated = False

    @property
    def active(self) -> bool:
        """Whether some sink takes records now (else ``emit`` must not be called)."""
        return self._write is not None

    @property
    def sinks(self) -> tuple[Any, ...]:
        """The attached sinks, in attach order."""
        return tuple(guard.sink for guard in self._guards)

    def attach(self, sink: Any) -> None:
        """Send records to ``sink`` from now on.

        Raises:
            TypeError: ``sink`` has no ``write(record)`` method. Nothing attached.
        """
        if not callable(getattr(sink, "write", None)):
            raise TypeError(f"an audit sink needs a write(record) method, got {sink!r}")
        self._guards.append(SinkGuard(sink, self._backlog, self._retry_s))
        self._rewire()

    def detach(self, sink: Any) -> bool:
        """Stop sending records to ``sink`` (found by identity), after a last retry of
        what it has not taken yet (what it still refuses is logged as lost). Returns
        whether it was attached (nothing changes when it was not)."""
        for index, guard in enumerate(self._guards):
            if guard.sink is sink:
                guard.settle()
                del self._guards[index]
                self._rewire()
                return True
        return False

    def regate(self) -> bool:
        """Ask the sinks that can be off whether they take records now; returns whether
        ``active`` may have changed."""
        changed = False
        for guard in self._gated:
            if guard.refresh_active():
                changed = True
        if changed:
            self._rewire()
        return changed

    def _rewire(self) -> None:
        self._gated = tuple(g for g in self._guards if g.gated)
        self.gated = bool(self._gated)
        guards = self._writing = tuple(g for g in self._guards if g.active)
        self._write_many = None
        if not guards:
            self._write = None
        elif len(guards) == 1 and guards[0].healthy:
            self._write = guards[0].sink.write  # the fast path: no guard until it fails
            many = getattr(guards[0].sink, "write_many", None)
            self._write_many = many if callable(many) else None
        else:
            self._write = self._fan_out

    def _fan_out(self, record: AuditRecord) -> None:
        """Every sink gets the record; a failure is its guard's business."""
        guards = self._writing
        for guard in guards:
            guard.write(record)
        if len(guards) == 1 and guards[0].healthy:  # recovered: back to the fast path
            self._rewire()

    def emit(
        self,
        rid: str | None,
        serial: int | None,
        trigger: TriggerName,
        src: StateName | None,
        dst: StateName | None,
        reason: Reason | None,
        op: int | None,
        inflight: int,
        detail: dict[str, DetailValue],
    ) -> None:
        """Build the next record (accepted when ``reason`` is ``None``) and hand it to
        every sink that takes records. Never raises for a sink."""
        seq = self.records
        self.records = seq + 1
        record = AuditRecord(
            seq,
            _now(),
            rid,
            serial,
            trigger,
            src,
            dst,
            reason is None,
            reason,
            op,
            inflight,
            detail,
        )
        try:
            self._write(record)  # type: ignore[misc]  # emit is called only while active
        except Exception as exc:  # only the fast path raises: the one sink writing now
            self._writing[0].failed(record, exc)
            self._rewire()

    def hand_over(self, records: list[AuditRecord]) -> None:
        """Hand a batch's records (built by the registry's ``apply``, numbered from
        ``records`` on, in order) to every sink that takes records: together to a sink
        with ``write_many`` (it takes all or none), else one at a time. Never raises for a
        sink; what a failing sink did not take is kept for it."""
        seq = self.records
        if records[0].seq != seq or records[-1].seq != seq + len(records) - 1:
            raise ValueError(
                f"a batch's records must be numbered {seq} on, got {records[0].seq}-"
                f"{records[-1].seq}; nothing handed over"
            )
        self.records = seq + len(records)
        many = self._write_many
        if many is not None:
            try:
                many(records)
            except Exception as exc:  # the one sink writing now: all of them kept for it
                guard = self._writing[0]
                guard.failed(records[0], exc)
                guard.keep_all(records[1:])
                self._rewire()
            return
        if self._write != self._fan_out:  # one healthy sink without write_many
            for index, record in enumerate(records):
                try:
                    self._write(record)  # type: ignore[misc]  # called only while active
                except Exception as exc:
                    guard = self._writing[0]
                    guard.failed(record, exc)
                    guard.keep_all(records[index + 1 :])
                    self._rewire()
                    return
            return
        guards = self._writing
        for guard in guards:
            guard.write_many(records)
        if len(guards) == 1 and guards[0].healthy:  # recovered: back to the fast path
            self._rewire()

    def flush(self) -> None:
        """Offer every failing sink its backlog again, then flush every sink that can be
        flushed. Never raises for a sink."""
        for guard in self._guards:
            guard.flush()
        self._rewire()

    def settle(self) -> None:
        """Last chance for every sink that failed (interpreter exit, the registry
        collected): see [`SinkGuard.settle()`][kvlife.fsm.audit.guard.SinkGuard.settle]."""
        for guard in self._guards:
            guard.settle()

    def statistics(self) -> tuple[SinkStatistics, ...]:
        """Each attached sink's counters, in attach order."""
        return tuple(guard.statistics() for guard in list(self._guards))


class RegistryLifetime:
    """Lives exactly as long as its registry (which holds the only reference to it), and
    stands in for the registry where a weak reference is needed: a compiled registry takes
    none (see [`kvlife.fsm.native`][kvlife.fsm.native]).

    When it is collected, or at interpreter exit, ``settle`` runs (the audit path's last
    chance for failing sinks); ``closing_state`` is what a sink's closing record counts,
    held weakly by the sink.
    """

    __slots__ = ("__weakref__", "_by_id", "_shadowed")

    def __init__(
        self, by_id: Mapping[int, Any], shadowed: Mapping[int, Any], settle: Callable[[], None]
    ) -> None:
        self._by_id = by_id  # the registry's own dicts of live lifecycles, read only
        self._shadowed = shadowed
        weakref.finalize(self, settle)

    def snapshot(self) -> list[Any]:
        """The registry's unreleased lifecycles: safe from any thread, or a signal handler,
        without a lock (``list()`` copies in C without running Python code; a snapshot may
        be a transition behind)."""
        return list(self._by_id.values()) + list(self._shadowed.values())

    def closing_state(self) -> tuple[int, int]:
        """(live lifecycles, copies in flight), from a ``snapshot()``."""
        lifecycles = self.snapshot()
        return len(lifecycles), sum(lc.inflight for lc in lifecycles)


#: Lifecycles registered within this many seconds of each other share one birth time.
BIRTH_RESOLUTION_S: Final = 0.05
_MAX_BIRTH_MARKS: Final = 4096


class Births:
    """When a registry's lifecycles were registered, without a time per lifecycle (a float
    is 32 of the ~260 bytes a live lifecycle costs): (first serial, time) marks, one at
    the first registration after each ``BIRTH_RESOLUTION_S``. A lifecycle's birth is its
    mark's time, at most that much early. At ``_MAX_BIRTH_MARKS`` every other old mark is
    dropped, so the error grows only for lifecycles older than thousands of marks."""

    __slots__ = ("serials", "times")

    def __init__(self) -> None:
        self.serials: list[int] = []
        self.times: list[float] = []

    def mark(self, serial: int, now: float) -> float:
        """``serial`` was registered at ``now``; returns when the next mark is due."""
        if len(self.serials) >= _MAX_BIRTH_MARKS:
            half = len(self.serials) // 2  # thin the older half, keep the newer one whole
            self.serials[:half] = self.serials[:half:2]
            self.times[:half] = self.times[:half:2]
        self.serials.append(serial)
        self.times.append(now)
        return now + BIRTH_RESOLUTION_S

    def age(self, serial: int, now: float) -> float:
        """Seconds from ``serial``'s registration to ``now`` (never less than the truth)."""
        index = bisect.bisect_right(self.serials, serial) - 1
        return now - self.times[max(index, 0)]


__all__ = [
    "BIRTH_RESOLUTION_S",
    "AuditPath",
    "Births",
    "Emit",
    "RegistryLifetime",
    "SinkGuard",
    "SinkStatistics",
    "format_ranges",
    "merge_ranges",
    "seq_ranges",
]

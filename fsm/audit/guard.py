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

While every sink is healthy the registry calls ``sink.write`` directly: a guard costs
nothing until its sink first fails.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from kvlife.fsm.audit.records import AuditRecord, LostRecords

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


__all__ = ["SinkGuard", "SinkStatistics", "format_ranges", "merge_ranges", "seq_ranges"]

"""What a registry does when an audit sink fails: never let it change the registry.

A transition is applied whole before its record is built; the record then goes to every
sink. A sink that raises is not allowed to undo or interrupt anything: the registry hands
the failure to the sink's [`SinkGuard`][kvlife.fsm.sink_guard.SinkGuard], which

* counts it (``errors``, in ``LifecycleRegistry.statistics().sinks``),
* logs the first failure through `logging` (logger ``kvlife.fsm.sinks``, once per
  failure episode, and once more when the sink recovers),
* keeps the records the sink could not take in a bounded backlog and offers them again,
  oldest first, on later writes (at most every ``retry_s`` seconds), on
  ``registry.flush()`` and at interpreter exit (then what is still refused is logged
  with its ``seq`` range),
* and when the backlog overflows drops its oldest records, remembering their ``seq``
  range: once the sink takes records again, a [`LostRecords`][kvlife.fsm.records.LostRecords]
  marker naming that range is written before the rest (``write_lost``), so the log says
  what it is missing and the checker reports "records lost (sink error)".

While every sink is healthy the registry calls ``sink.write`` directly: a guard costs
nothing until its sink first fails.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Final

from kvlife.fsm.records import AuditRecord, LostRecords

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
    #: Records dropped for good because the backlog was full (each range is marked).
    dropped: int
    #: The last error, as ``"Type: message"``, or ``None`` if it never failed.
    last_error: str | None


class SinkGuard:
    """One attached sink and its failure bookkeeping. Made by the registry."""

    __slots__ = (
        "_active",
        "_backlog",
        "_last_try",
        "_lost",
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
        self._last_try = 0.0
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

    def flush(self) -> None:
        """Retry the backlog, then flush the sink; never raises."""
        if not self.healthy and not self.retry():
            return
        flush = getattr(self.sink, "flush", None)
        if callable(flush):
            try:
                flush()
            except Exception as exc:
                self.failed(None, exc, "flush")

    def settle(self) -> None:
        """Last chance (detach, interpreter exit): offer what is owed once more, then log
        what the sink still refused as lost."""
        if not self.healthy:
            self.flush()
            self.abandon()

    def abandon(self) -> None:
        """Give up on the records the sink never took: log them as lost."""
        if self.healthy:
            return
        first = self._lost[0] if self._lost is not None else self._backlog[0].seq
        last = self._backlog[-1].seq if self._backlog else self._lost[1]  # type: ignore[index]
        _log.error(
            "audit sink %r is given up on: records seq %d-%d were never written",
            self.sink,
            first,
            last,
        )
        self.dropped += len(self._backlog)
        self._backlog.clear()
        self._lost = None

    def statistics(self) -> SinkStatistics:
        """A snapshot of this guard's counters."""
        return SinkStatistics(
            repr(self.sink), self.errors, len(self._backlog), self.dropped, self.last_error
        )


__all__ = ["SinkGuard", "SinkStatistics"]

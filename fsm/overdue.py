"""Tickets open too long, told while the engine runs.

A ticket that never completes is a leak (a delayed free vLLM never frees, a load a
request waits on for ever). After the fact, ``kvlife audit check`` finds it open at the
end of the log (``unreported``); an operator needs it while the engine runs.
[`OverdueWatch`][kvlife.fsm.overdue.OverdueWatch] keeps the open tickets of one registry
in the order they were opened and, at each
[`check()`][kvlife.fsm.overdue.OverdueWatch.check], writes an ``overdue`` record (rid,
kind, age, limit; the ticket's copy number as ``op``) for every ticket that crossed the
limit since the last check and is still open, once per ticket.

The limit is one number for every ticket, so deadlines come in the order tickets were
opened: the queue is a FIFO (a deque), and a check looks only at its head. A check with
nothing due costs one clock read and one comparison, and the completed tickets at the
head are dropped then; the queue is compacted when it holds more than twice the open
tickets it held at the last compaction, and at least 256 (completed tickets behind one
that stays open), amortized O(1) per ticket. The queue is four deques side by side
(deadline, opening time, ticket, kind) rather than one of tuples, and completed tickets
leave it at the next check rather than at their deadline: a watched ticket adds no object
the garbage collector tracks, and keeps none (nor its lifecycle) alive for long (a tuple
per ticket, and tickets kept until their deadline, made the young collections of a
serving engine's scheduler come more often).

In the log, ``overdue`` is a protocol reason: a refused record that changes nothing. The
checker counts it as a violation only if the ticket never completed afterwards (or with
``overdue_fails``); ``why`` tells it on the ticket's lifecycle.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Final, TypeVar

from kvlife.fsm.registry import LifecycleRegistry, Ticket
from kvlife.fsm.table import Trigger

DEFAULT_OVERDUE_S: Final = 120.0
"""The default limit: a quarter of NIXL's abort timeout in the vLLM releases that have one
(``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s), so a stuck hand-over is told before NIXL gives
up on it (vLLM 0.32's NIXL frees an unread prefill after a 30 s lease instead: set a limit
below it to hear of those); far above what a healthy store or load to host memory takes
(milliseconds) or a delayed free waits for a decode server under load (seconds)."""

_COMPACT_MIN: Final = 256
_T = TypeVar("_T")


class OverdueWatch:
    """The open tickets of ``registry``, and the ``overdue`` records of those open longer
    than ``limit_s``.

    Args:
        registry: the registry the tickets belong to (records are written through it,
            from its owner thread).
        limit_s: seconds a ticket may stay open; ``None`` or ``0`` turns the watch off
            (``opened`` and ``check`` then do nothing).
        clock: seconds, monotonic (``time.monotonic``; tests pass their own).

    Raises:
        ValueError: ``limit_s`` is negative or not a number.
    """

    __slots__ = (
        "_clock",
        "_compact_at",
        "_deadlines",
        "_kinds",
        "_late",
        "_opened",
        "_tickets",
        "limit_s",
        "overdue_total",
        "registry",
    )

    def __init__(
        self,
        registry: LifecycleRegistry,
        limit_s: float | None = DEFAULT_OVERDUE_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit_s is not None and (
            isinstance(limit_s, bool)
            or not isinstance(limit_s, (int, float))
            or not limit_s >= 0  # NaN too: it would never be reached, silently
        ):
            raise ValueError(f"limit_s must be a number >= 0 or None, got {limit_s!r}")
        self.registry = registry
        #: Seconds a ticket may stay open (``None``: the watch is off).
        self.limit_s: float | None = float(limit_s) if limit_s else None
        self._clock = clock
        # the queue, in the order opened (deadlines ascend): entry i of each deque is the
        # deadline, opening time, ticket and kind of one watched ticket
        self._deadlines: deque[float] = deque()
        self._opened: deque[float] = deque()
        self._tickets: deque[Ticket] = deque()
        self._kinds: deque[str] = deque()
        # the overdue tickets not completed yet: (opened at, ticket), oldest first
        self._late: list[tuple[float, Ticket]] = []
        self._compact_at = _COMPACT_MIN
        #: Tickets written as overdue so far.
        self.overdue_total = 0

    def opened(self, ticket: Ticket, kind: str) -> None:
        """Watch ``ticket`` (just returned by ``start_offload``), of ``kind`` (``store``,
        ``load``, ``delayed_free``, ...)."""
        limit = self.limit_s
        if limit is None:
            return
        now = self._clock()
        tickets = self._tickets
        self._deadlines.append(now + limit)
        self._opened.append(now)
        tickets.append(ticket)
        self._kinds.append(kind)
        if len(tickets) > self._compact_at:
            self._compact()

    def _compact(self) -> None:
        kept = [i for i, ticket in enumerate(self._tickets) if not ticket.done]
        _keep(self._deadlines, kept)
        _keep(self._opened, kept)
        _keep(self._tickets, kept)
        _keep(self._kinds, kept)
        self._compact_at = max(_COMPACT_MIN, 2 * len(kept))

    def _pop(self) -> None:
        """Drop the head of the queue."""
        self._deadlines.popleft()
        self._opened.popleft()
        self._tickets.popleft()
        self._kinds.popleft()

    def _drop_done(self) -> None:
        """Drop the completed tickets at the head of the queue."""
        tickets = self._tickets
        while tickets and tickets[0].done:
            self._pop()

    def check(self, now: float | None = None) -> int:
        """Write an ``overdue`` record for each open ticket that crossed the limit since
        the last check; return how many. Call it from the registry's owner thread (a
        connector call, a scheduler step).

        Raises:
            WrongThreadError: called from a thread other than the registry's owner
                (nothing written).
        """
        self._drop_done()
        deadlines = self._deadlines
        if not deadlines:
            return 0
        if now is None:
            now = self._clock()
        if deadlines[0] > now:
            return 0
        found = 0
        record = self.registry.record_violation
        while deadlines and deadlines[0] <= now:
            ticket, kind = self._tickets[0], self._kinds[0]
            if not ticket.done:
                age = now - self._opened[0]
                lc = ticket.lifecycle
                record(
                    "overdue",
                    Trigger.ACK,
                    f"{kind} ticket (copy {ticket.op}) of {lc.rid!r} open {age:.1f} s, "
                    f"longer than {self.limit_s:g} s",
                    lifecycle=lc,
                    op=ticket.op,
                    kind=kind,
                    age_s=round(age, 3),
                    limit_s=self.limit_s,
                )
                self._late.append((self._opened[0], ticket))
                found += 1
            self._pop()
        self.overdue_total += found
        return found

    def _late_open(self) -> list[tuple[float, Ticket]]:
        late = self._late
        if late and any(ticket.done for _, ticket in late):
            late[:] = [entry for entry in late if not entry[1].done]
        return late

    def open_overdue(self) -> int:
        """Tickets written as overdue that are still open now."""
        return len(self._late_open())

    def oldest_age(self, now: float | None = None) -> float:
        """Seconds the oldest ticket still open has been open (0.0 when none is)."""
        if now is None:
            now = self._clock()
        late = self._late_open()
        if late:
            return now - late[0][0]
        self._drop_done()
        return now - self._opened[0] if self._tickets else 0.0

    def __len__(self) -> int:
        """Tickets watched (open ones, and completed ones not yet dropped)."""
        return len(self._tickets) + len(self._late)

    def __repr__(self) -> str:
        return (
            f"<OverdueWatch limit_s={self.limit_s} watched={len(self)} "
            f"overdue_total={self.overdue_total}>"
        )


def _keep(column: deque[_T], kept: list[int]) -> None:
    """Keep the entries of ``column`` at the positions ``kept`` (ascending), in order."""
    values = list(column)
    column.clear()
    column.extend([values[i] for i in kept])


__all__ = ["DEFAULT_OVERDUE_S", "OverdueWatch"]

"""Lifecycles, tickets and the identity registry (design §3).

One [`LifecycleRegistry`][kvlife.fsm.registry.LifecycleRegistry] owns every lifecycle of one
offload manager. It is the only maker of [`Lifecycle`][kvlife.fsm.registry.Lifecycle]
objects (``register``) and of [`Ticket`][kvlife.fsm.registry.Ticket] objects
(``start_offload``). Every change of a lifecycle goes through one of its methods, which
looks the change up in the compiled table of [`kvlife.fsm.table`][kvlife.fsm.table] and
either applies it whole or refuses it with a typed error that changed nothing.

Identity: a request is found by ``id()`` in a dict whose entries exist only while the
registry holds a strong reference to the request, so the id cannot be recycled under the
entry; ``==`` and ``hash`` of the request are never called. A completion is delivered with
its ticket, which names the exact lifecycle instance and copy, so a late ack of an old
request can only ever complete the old request's copy.

Threads: a registry belongs to one thread, the one that made it (or the last that called
[`LifecycleRegistry.adopt_thread()`][kvlife.fsm.registry.LifecycleRegistry.adopt_thread]). Every
call that changes something checks this
first and raises [`WrongThreadError`][kvlife.fsm.errors.WrongThreadError] from any other thread,
having changed nothing. Completions produced on other threads (CUDA host callbacks,
worker threads) are queued and delivered from the owner thread, as the completion pump
does. Read-only calls (``statistics``, ``len``, ``live``) may come from any thread.

Audit sinks never change what the registry does: see
[`kvlife.fsm.audit.guard`][kvlife.fsm.audit.guard].

Why one module: every call here changes one lifecycle under the same rules (found by
identity, checked against the table, its tickets and the owner thread, applied whole or
not at all, then audited), and ``apply`` runs the same steps for a batch; the rules are
not split across files so that a reader checks each transition in one place. What does
not decide a transition lives elsewhere: the table (``table``), the records and sinks
(``kvlife.fsm.audit``), the overdue watch (``overdue``), hooks (``hooks``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, NoReturn, cast, final

from kvlife.fsm.audit.guard import AuditPath, Births, Emit, RegistryLifetime, SinkStatistics
from kvlife.fsm.audit.records import (
    REGISTER,
    AuditRecord,
    DetailValue,
    StateName,
    TriggerName,
)
from kvlife.fsm.errors import (
    PROTOCOL_REASONS,
    REASONS,
    CompletionRaceError,
    DuplicateAckError,
    DuplicateRegistrationError,
    InvalidTransitionError,
    LifecycleError,
    ProtocolViolationError,
    Reason,
    RidConflictError,
    StaleInstanceError,
    UnknownRequestError,
    WrongThreadError,
)
from kvlife.fsm.hooks import run_all
from kvlife.fsm.table import LIFECYCLE, STATES, Row, State, Trigger

Outcome = Literal["finished", "aborted"]

# The hot path keeps a lifecycle's state as an index into STATES; where a trigger leads is
# one lookup in the table's compiled rows, row[state][copies in flight before, clamped to
# 2] (see kvlife.fsm.table.Row): None means the table refuses it.
_NAMES: Final[tuple[StateName, ...]] = tuple(s.value for s in STATES)
_ALLOCATED: Final = STATES.index(State.ALLOCATED)
_OFFLOADING: Final = STATES.index(State.OFFLOADING)
_RELEASED: Final = STATES.index(State.RELEASED)
_START: Final = LIFECYCLE.rows[Trigger.START_OFFLOAD]
_ACK: Final = LIFECYCLE.rows[Trigger.ACK]
_FAIL: Final = LIFECYCLE.rows[Trigger.FAIL]
# What finish and abort look up: (trigger, its name, its rows, the outcome). An enum
# member read off its class costs about 70 ns in CPython 3.11: none is read on a hot path.
_End = tuple[Trigger, TriggerName, Row, Outcome]
_FINISH: Final[_End] = (Trigger.FINISH, "finish", LIFECYCLE.rows[Trigger.FINISH], "finished")
_ABORT: Final[_End] = (Trigger.ABORT, "abort", LIFECYCLE.rows[Trigger.ABORT], "aborted")
# Invariant: a lifecycle in one of these states has not finished; its rid and its request
# object cannot be registered again.
_UNFINISHED: Final = (_ALLOCATED, _OFFLOADING)
# The triggers a batch takes, read once (compared by identity in apply's loop).
_T_START: Final = Trigger.START_OFFLOAD
_T_ACK: Final = Trigger.ACK
_T_FAIL: Final = Trigger.FAIL
_T_FINISH: Final = Trigger.FINISH
_T_ABORT: Final = Trigger.ABORT

BatchOp = tuple[Any, ...]
"""One group of a [`LifecycleRegistry.apply()`][kvlife.fsm.registry.LifecycleRegistry.apply]
batch: ``(trigger, targets)`` or ``(trigger, targets, details)``."""

_now = time.monotonic_ns


_NO_DETAIL: Final = itertools.repeat(None)


def _check_group(group: object) -> None:
    """Raise TypeError (before anything is applied) for a malformed group of a batch."""
    if type(group) is not tuple or not 2 <= len(group) <= 3:
        raise TypeError(
            f"a batch group is (trigger, targets[, details]), got {group!r:.80}; nothing changed"
        )
    kind, targets = group[0], group[1]
    if type(targets) is not list and type(targets) is not tuple:
        raise TypeError(
            f"a batch group's targets must be a list or tuple, got {type(targets).__name__}; "
            "nothing changed"
        )
    if kind is _T_ACK or kind is _T_FAIL:
        for ticket in targets:
            if type(ticket) is not Ticket:
                raise TypeError(
                    f"{kind.value} needs Tickets, got {type(ticket).__name__}; nothing changed"
                )
    elif kind is not _T_START and kind is not _T_FINISH and kind is not _T_ABORT:
        raise TypeError(
            "a batch group's trigger must be start_offload, ack, fail, finish or abort, "
            f"got {kind!r:.80}; nothing changed"
        )
    if len(group) == 3:
        details = group[2]
        if (type(details) is not list and type(details) is not tuple) or len(details) != len(
            targets
        ):
            raise TypeError(
                f"a batch group's details must be a list with one entry per target, got "
                f"{details!r:.80}; nothing changed"
            )
        for detail in details:
            if detail is not None:
                if not isinstance(detail, dict):
                    raise TypeError(f"a detail must be a dict or None, got {detail!r:.80}")
                _check_detail(detail)


def _collector(records: list[AuditRecord], seq: int, now: int) -> Emit:
    """A batch's ``emit``, for the refusals within it: the record is built in its place
    among the batch's records (its ``seq`` follows theirs, its ``t_ns`` is the batch's)
    and handed to the sinks with them."""

    def collect(*row: Any) -> None:  # AuditPath.emit's nine arguments
        (rid, serial, trigger, src, dst, reason, op, inflight, detail) = row
        records.append(
            AuditRecord(
                seq + len(records), now, rid, serial, trigger, src, dst, reason is None,
                reason, op, inflight, detail,
            )
        )  # fmt: skip

    return collect


_clock = time.monotonic
_get_ident = threading.get_ident

ReleaseHook = Callable[["Lifecycle", Any], None]


class _Maker:
    """The key to Lifecycle's and Ticket's constructors: only this module holds one."""

    __slots__ = ()


_MAKER: Final = _Maker()


def _not_made_here(cls: str, made_by: str) -> NoReturn:
    raise TypeError(f"{cls} objects are made only by {made_by}")


@final
class Lifecycle:
    """The lifecycle of one request instance: its state, copies in flight and outcome.

    Made only by
    [`LifecycleRegistry.register()`][kvlife.fsm.registry.LifecycleRegistry.register]
    (calling the class raises ``TypeError``; it cannot be subclassed); every
    attribute is read-only and every change goes through the registry. A lifecycle that
    reached ``released`` stays readable (its final state and outcome) but holds no reference
    to its request.
    """

    __slots__ = (
        "_inflight",
        "_older",
        "_outcome",
        "_registry",
        "_req",
        "_rid",
        "_s",
        "_serial",
        "_started",
    )

    # Declared for the type checker; set by LifecycleRegistry.register.
    _registry: LifecycleRegistry
    _serial: int
    _rid: str
    _req: Any
    _s: int  # index into STATES
    _inflight: int  # Invariant: == its open tickets; 0 in allocated, >= 1 in offloading
    _started: int  # copies started so far
    _outcome: Outcome | None
    # The next older lifecycle holding the same rid. Releases do not unlink a lifecycle
    # from the middle of the chain (that would walk it); released ones are skipped and
    # unlinked when the newest releases or a new lifecycle takes the rid, so a release
    # costs O(1) amortized however many share a rid, and the chain stays short.
    _older: Lifecycle | None

    def __init__(
        self,
        maker: object,
        registry: LifecycleRegistry,
        serial: int,
        rid: str,
        req: Any,
        older: Lifecycle | None,
    ) -> None:
        if maker is not _MAKER:
            _not_made_here("Lifecycle", "LifecycleRegistry.register()")
        # register() makes the same stores inline on the pure build: keep the two alike
        self._registry = registry
        self._serial = serial
        self._rid = rid
        self._req = req
        self._s = _ALLOCATED
        self._inflight = 0
        self._started = 0
        self._outcome = None
        self._older = older

    def __init_subclass__(cls) -> None:  # compiled, the class is no base type at all
        raise TypeError(
            "kvlife.fsm.registry.Lifecycle cannot be subclassed: its objects are made by "
            "LifecycleRegistry.register() only"
        )

    @property
    def rid(self) -> str:
        """The request id this lifecycle was registered under (a label, never a key)."""
        return self._rid

    @property
    def serial(self) -> int:
        """Registry-wide, increasing, never-reused number of this lifecycle."""
        return self._serial

    @property
    def state(self) -> State:
        """The current state."""
        return STATES[self._s]

    @property
    def inflight(self) -> int:
        """Copies started and not yet acked or failed."""
        return self._inflight

    @property
    def outcome(self) -> Outcome | None:
        """``None`` until finish/abort, then ``"finished"`` or ``"aborted"``."""
        return self._outcome

    @property
    def req(self) -> Any:
        """The request object; ``None`` once released."""
        return self._req

    @property
    def copies_started(self) -> int:
        """How many copies this lifecycle has started in all."""
        return self._started

    @property
    def released(self) -> bool:
        """Whether the lifecycle reached ``released``."""
        return self._s == _RELEASED

    @property
    def registry(self) -> LifecycleRegistry:
        """The registry that owns this lifecycle."""
        return self._registry

    def __repr__(self) -> str:
        return (
            f"<Lifecycle serial={self._serial} rid={self._rid!r} state={_NAMES[self._s]} "
            f"inflight={self._inflight} outcome={self._outcome}>"
        )


@final
class Ticket:
    """Names one copy of one lifecycle instance. Returned by ``start_offload``.

    Deliver it exactly once, with
    [`LifecycleRegistry.complete()`][kvlife.fsm.registry.LifecycleRegistry.complete] (or
    ``deliver``), when the copy's completion event is done (``ok=True``) or the copy failed
    (``ok=False``). Tickets are immutable and made only by the registry.
    """

    __slots__ = ("_lc", "_op", "_open")

    _lc: Lifecycle
    _op: int
    _open: bool  # Invariant: True until its completion was applied; a ticket is used once

    def __init__(self, maker: object, lc: Lifecycle, op: int) -> None:
        if maker is not _MAKER:
            _not_made_here("Ticket", "LifecycleRegistry.start_offload()")
        # start_offload() and apply() make the same stores inline on the pure build
        self._lc = lc
        self._op = op
        self._open = True

    def __init_subclass__(cls) -> None:  # compiled, the class is no base type at all
        raise TypeError(
            "kvlife.fsm.registry.Ticket cannot be subclassed: its objects are made by "
            "LifecycleRegistry.start_offload() only"
        )

    @property
    def lifecycle(self) -> Lifecycle:
        """The lifecycle instance this copy belongs to."""
        return self._lc

    @property
    def op(self) -> int:
        """The copy's registry-wide, never-reused number."""
        return self._op

    @property
    def rid(self) -> str:
        """The rid of the ticket's lifecycle."""
        return self._lc._rid

    @property
    def done(self) -> bool:
        """Whether its completion (``ack`` or ``fail``) was applied."""
        return not self._open

    @property
    def serial(self) -> int:
        """The serial of the ticket's lifecycle."""
        return self._lc._serial

    def __repr__(self) -> str:
        return f"<Ticket op={self._op} serial={self._lc._serial} rid={self._lc._rid!r}>"

    # A copy of a ticket would be a second key to the same copy: copying gives the ticket
    # itself, and tickets cannot be pickled.
    def __copy__(self) -> Ticket:
        return self

    def __deepcopy__(self, memo: object) -> Ticket:
        return self

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Ticket cannot be pickled: it names a copy in this process only")


_DETAIL_TYPES: Final = (int, float, str, bool, type(None))


def _check_detail(detail: Mapping[str, object]) -> None:
    """Audit detail must be small scalars: no live objects, no prompt content."""
    for key, value in detail.items():
        if not isinstance(value, _DETAIL_TYPES):
            raise TypeError(
                f"audit detail {key}={type(value).__name__} is not a scalar "
                "(int, float, str, bool or None); nothing changed"
            )


def _skip_released(lc: Lifecycle | None) -> Lifecycle | None:
    """The first unreleased lifecycle from ``lc`` down its rid chain; the released ones
    passed over are unlinked (each is passed over once: O(1) amortized)."""
    while lc is not None and lc._s == _RELEASED:
        skipped = lc
        lc = skipped._older
        skipped._older = None
    return lc


def _by_serial(lc: Lifecycle) -> int:
    return lc._serial


_new_lifecycle = object.__new__
_new_ticket = object.__new__


def _plain(cls: type) -> bool:
    """Whether ``cls`` is a plain Python class, whose objects the registry may make with
    ``object.__new__`` and attribute stores (the pure build: about half the cost of calling
    the class). A compiled class refuses ``object.__new__``; it is made by its keyed
    constructor."""
    try:
        _new_lifecycle(cls)
    except TypeError:
        return False
    return True


_PLAIN: Final = _plain(Lifecycle) and _plain(Ticket)


@dataclass(frozen=True)
class RegistryStatistics:
    """A snapshot of a registry, for leak hunting and dashboards."""

    #: Unreleased lifecycles per state (``released`` is always 0).
    live: Mapping[State, int]
    #: Lifecycles registered / released since the registry was made.
    registered: int
    released: int
    #: Accepted transitions (registrations not included).
    transitions: int
    #: Refused calls per reason (every reason present, zero or not).
    refusals: Mapping[str, int]
    #: Copies in flight over all live lifecycles.
    inflight: int
    #: Age in seconds of the oldest unreleased lifecycle, or ``None`` when none is live.
    #: Never less than the true age, and at most 50 ms more for lifecycles registered in
    #: the last few thousand 50 ms periods (older ones: a little more, see
    #: [`Births`][kvlife.fsm.audit.guard.Births]).
    oldest_live_age_s: float | None
    #: rid and serial of the oldest unreleased lifecycle, or ``None``.
    oldest_live: tuple[str, int] | None
    #: Each attached sink's failures, backlog and drops, in attach order.
    sinks: tuple[SinkStatistics, ...] = ()
    #: Audit records built so far (their seqs are 0 to ``records - 1``; none are built
    #: while no sink is attached). Per sink, each is in its file, ``buffered``,
    #: ``pending`` or ``dropped`` (see ``SinkStatistics``).
    records: int = 0


class LifecycleRegistry:
    """All lifecycles of one offload manager, keyed by request identity.

    Args:
        sinks: audit sinks (objects with a ``write(record)`` method, see
            [`kvlife.fsm.audit.sinks`][kvlife.fsm.audit.sinks]). With none, no audit record
            is built.
        sink_backlog: most records kept per failing sink for a retry; older ones are
            dropped and marked as lost in the log.
        sink_retry_s: least time between two retries of a failing sink on the write path
            (``flush()`` always retries).

    Every method that changes something either applies one transition of the table whole
    (state, in-flight count, references, counters, audit record, release hooks) or raises
    a [`LifecycleError`][kvlife.fsm.errors.LifecycleError] subclass and changes nothing except the
    refusal counters and the audit log. A failing sink never raises out of a registry
    call: see [`kvlife.fsm.audit.guard`][kvlife.fsm.audit.guard], which also holds the one
    path every record takes ([`AuditPath`][kvlife.fsm.audit.guard.AuditPath]).

    Called from a thread other than its owner, every changing method raises
    [`WrongThreadError`][kvlife.fsm.errors.WrongThreadError] and changes nothing (not even a
    counter).
    """

    def __init__(
        self,
        *,
        sinks: tuple[Any, ...] | list[Any] = (),
        sink_backlog: int = 65536,
        sink_retry_s: float = 0.1,
    ) -> None:
        if not isinstance(sink_backlog, int) or isinstance(sink_backlog, bool) or sink_backlog < 0:
            raise ValueError(f"sink_backlog must be an int >= 0, got {sink_backlog!r}")
        if not isinstance(sink_retry_s, (int, float)) or not sink_retry_s >= 0:
            raise ValueError(f"sink_retry_s must be a number >= 0, got {sink_retry_s!r}")
        self._owner = _get_ident()
        self._by_id: dict[int, Lifecycle] = {}  # id(req) -> the request's current lifecycle
        # Unreleased lifecycles that are no longer their request's current one (the request
        # was re-admitted while they were finished_pending), by serial. Few, if any: the
        # live set is _by_id's values plus these, without a third dict of everything.
        self._shadowed: dict[int, Lifecycle] = {}
        self._by_rid: dict[str, Lifecycle] = {}  # rid -> newest unreleased lifecycle
        self._next_serial = 0
        self._births = Births()
        self._next_mark = 0.0
        self._next_op = 0
        self._released = 0
        self._refusals: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._refusal_view = MappingProxyType(self._refusals)
        self._hooks: list[ReleaseHook] = []
        self._audit = AuditPath(sink_backlog, float(sink_retry_s))
        # At interpreter exit (or when the registry is collected), records a failing sink
        # still owes are offered once more, and what it still refuses is logged as lost;
        # the weak references go to an object that lives as long as the registry (a
        # compiled registry takes none itself).
        self._lifetime = RegistryLifetime(self._by_id, self._shadowed, self._audit.settle)
        # The audit path's emit while a sink takes records; None when none does: then no
        # record is ever built. Every record is built there, nowhere else.
        self._emit: Emit | None = None
        for sink in sinks:
            self.attach(sink)

    # ------------------------------------------------------------------ configuration

    def attach(self, sink: Any) -> None:
        """Attach an audit sink; it receives every record from now on.

        Raises:
            TypeError: ``sink`` has no ``write(record)`` method. Nothing attached.
            WrongThreadError: called from a thread other than the owner.
        """
        self._check_thread("attach")
        self._audit.attach(sink)
        bind = getattr(sink, "bind_state", None)
        if callable(bind):  # the closing record counts what is still live and in flight
            bind(self._lifetime.closing_state)
        self._rewire()

    def detach(self, sink: Any) -> None:
        """Stop sending records to ``sink`` (found by identity), after a last retry of
        what it has not taken yet (what it still refuses is logged as lost).

        Raises:
            ValueError: ``sink`` is not attached. Nothing changed.
            WrongThreadError: called from a thread other than the owner.
        """
        self._check_thread("detach")
        if not self._audit.detach(sink):
            raise ValueError(f"{sink!r} is not attached to {self!r}")
        self._rewire()

    def _rewire(self) -> None:
        self._emit = self._audit.emit if self._audit.active else None

    @property
    def audited(self) -> bool:
        """Whether a sink is attached, i.e. whether records (and their detail) are built.
        Callers can skip computing audit detail when it is not."""
        return self._emit is not None

    @property
    def sinks(self) -> tuple[Any, ...]:
        """The attached audit sinks."""
        return self._audit.sinks

    def adopt_thread(self) -> None:
        """Make the calling thread the registry's owner (for a registry built on one
        thread and driven from another). The caller must make sure the old owner no
        longer calls it."""
        self._owner = _get_ident()

    @property
    def owner_thread(self) -> int:
        """``threading.get_ident()`` of the thread allowed to change the registry."""
        return self._owner

    def _check_thread(self, call: str) -> None:
        if _get_ident() != self._owner:
            self._wrong_thread(call)

    def _wrong_thread(self, call: str) -> NoReturn:
        raise WrongThreadError(
            f"{call}() called from thread {threading.current_thread().name!r} "
            f"(ident {_get_ident()}), but {self!r} belongs to thread ident {self._owner}; "
            "nothing changed. Queue the call to the owner thread, or call adopt_thread() "
            "there if ownership really moved."
        )

    def on_release(self, hook: ReleaseHook) -> ReleaseHook:
        """Call ``hook(lifecycle, req)`` exactly once per lifecycle, when it reaches
        ``released`` (after the registry dropped its references; ``req`` is the request
        object it held). Usable as a decorator.

        Hooks run in the order added. If one raises, the others still run, the release
        stays applied and audited, and the first exception is re-raised afterwards.
        """
        self._check_thread("on_release")
        if not callable(hook):
            raise TypeError(f"on_release needs a callable, got {hook!r}")
        self._hooks.append(hook)
        return hook

    # ------------------------------------------------------------------ lookups

    def __len__(self) -> int:
        """Unreleased lifecycles."""
        return len(self._by_id) + len(self._shadowed)

    def __contains__(self, req: object) -> bool:
        """Whether ``req`` (by identity) has an unreleased current lifecycle here; a
        [`Lifecycle`][kvlife.fsm.registry.Lifecycle] is contained while it is unreleased and owned
        by this registry."""
        if type(req) is Lifecycle:
            return req._registry is self and req._s != _RELEASED
        return id(req) in self._by_id

    def lifecycle(self, req: object, *, audit_as: Trigger | None = None) -> Lifecycle:
        """The current (newest) lifecycle of the request object ``req``.

        ``audit_as``: the trigger the caller is about to ask for. A miss is then a refusal
        of that trigger: counted in ``statistics().refusals`` and audited, exactly as the
        registry's own calls do (the offload manager looks requests up this way).

        Raises:
            UnknownRequestError: ``req`` (by identity) has no unreleased lifecycle here.
                Its ``trigger`` is ``audit_as`` (or ``"lookup"``). Nothing changed but
                the refusal counter and the audit log when ``audit_as`` is given.
            WrongThreadError: ``audit_as`` is given and the caller is not the owner.
        """
        lc = self._by_id.get(id(req))
        if lc is None:
            if audit_as is not None and _get_ident() != self._owner:
                self._wrong_thread(audit_as.value)
            raise self._unknown(req, audit_as, audit=audit_as is not None)
        return lc

    def live(self, rid: str) -> Lifecycle | None:
        """The newest unreleased lifecycle holding ``rid``, or ``None``."""
        return self._by_rid.get(rid)

    def lifecycles(self) -> list[Lifecycle]:
        """Every unreleased lifecycle, oldest first."""
        return sorted(self._snapshot(), key=_by_serial)

    def _snapshot(self) -> list[Lifecycle]:
        return self._lifetime.snapshot()  # our two dicts, read without a lock

    # ------------------------------------------------------------------ transitions

    def register(self, req: object, rid: str | None = None) -> Lifecycle:
        """Make a lifecycle for ``req`` in state ``allocated``.

        ``rid`` defaults to ``req.rid`` and must be a ``str``. Any object works as a
        request: it is found by identity only.

        Raises:
            TypeError: the rid is missing or not a str, or ``req`` is ``None`` or a
                Lifecycle/Ticket. Nothing registered, nothing audited.
            DuplicateRegistrationError: ``req``'s current lifecycle is ``allocated`` or
                ``offloading``. Nothing registered.
            RidConflictError: a lifecycle that has not finished holds ``rid``. Nothing
                registered.
            WrongThreadError: called from a thread other than the owner. Nothing changed.
        """
        if _get_ident() != self._owner:
            self._wrong_thread("register")
        audit = self._audit
        if audit.gated and audit.regate():  # a LoggingSink's logger switched on or off
            self._rewire()
        if rid is None:
            found: object = getattr(req, "rid", None)  # checked here, not by mypyc's cast
            if found is None:
                raise TypeError(
                    f"{type(req).__name__} object has no .rid attribute (or it is None): "
                    "pass rid=... to register(); nothing registered"
                )
            if not isinstance(found, str):
                raise TypeError(f"a rid must be a str, got {type(found).__name__} {found!r:.80}")
            rid = found
        elif not isinstance(rid, str):
            raise TypeError(f"a rid must be a str, got {type(rid).__name__} {rid!r:.80}")
        if req is None or type(req) in (Lifecycle, Ticket):
            raise TypeError(f"cannot register {req!r} as a request")
        key = id(req)
        current = self._by_id.get(key)
        if current is not None and current._s in _UNFINISHED:
            self._refuse(
                DuplicateRegistrationError,
                current,
                REGISTER,
                f"{req!r:.80} is already registered: its lifecycle {current!r} has not finished",
                rid=rid,
            )
        newest = self._by_rid.get(rid)
        if newest is not None and newest._s in _UNFINISHED:
            self._refuse(
                RidConflictError,
                newest,
                REGISTER,
                f"rid {rid!r} is held by {newest!r}, which has not finished",
                rid=rid,
            )
        serial = self._next_serial
        self._next_serial = serial + 1
        if _PLAIN:  # pure Python: the stores inline cost half of calling the class
            lc: Lifecycle = _new_lifecycle(Lifecycle)
            lc._registry = self
            lc._serial = serial
            lc._rid = rid
            lc._req = req
            lc._s = _ALLOCATED
            lc._inflight = 0
            lc._started = 0
            lc._outcome = None
            lc._older = newest
        else:
            lc = Lifecycle(_MAKER, self, serial, rid, req, newest)
        now = _clock()
        if now >= self._next_mark:  # birth times are kept per 50 ms, not per lifecycle
            self._next_mark = self._births.mark(serial, now)
        if newest is not None and newest._older is not None and newest._older._s == _RELEASED:
            newest._older = _skip_released(newest._older)  # keep the chain short
        if current is not None:  # re-admitted: the old lifecycle releases on its own
            self._shadowed[current._serial] = current
        self._by_id[key] = lc
        self._by_rid[rid] = lc
        emit = self._emit
        if emit is not None:
            emit(rid, serial, REGISTER, None, "allocated", None, None, 0, {})
        return lc

    def start_offload(self, target: object, **detail: DetailValue) -> Ticket:
        """Record that a copy of ``target``'s KV was launched; return its ticket.

        ``target`` is the request object or its
        [`Lifecycle`][kvlife.fsm.registry.Lifecycle]. ``detail`` (small scalars: tokens,
        bytes, pages) goes into the audit record. Call this only after the copy's completion
        event was recorded. On any error no ticket exists and nothing changed.

        Raises:
            UnknownRequestError: ``target`` is not registered here (or was released).
            StaleInstanceError: ``target`` is a released lifecycle.
            InvalidTransitionError: the state refuses it (``finished_pending``).
            TypeError: a ``detail`` value is not a scalar.
            WrongThreadError: called from a thread other than the owner.
        """
        if _get_ident() != self._owner:
            self._wrong_thread("start_offload")
        if detail:
            _check_detail(detail)
        lc = self._by_id.get(id(target))
        if lc is None:
            lc = self._resolve(target, Trigger.START_OFFLOAD)
        s = lc._s
        inflight = lc._inflight
        dst = _START[s][inflight if inflight < 2 else 2]
        if dst is None:
            self._refuse_table(lc, Trigger.START_OFFLOAD, None)
        lc._started += 1
        inflight = lc._inflight = inflight + 1
        lc._s = dst
        op = self._next_op
        self._next_op = op + 1
        if _PLAIN:
            ticket: Ticket = _new_ticket(Ticket)
            ticket._lc = lc
            ticket._op = op
            ticket._open = True
        else:
            ticket = Ticket(_MAKER, lc, op)
        emit = self._emit
        if emit is not None:
            emit(
                lc._rid,
                lc._serial,
                "start_offload",
                _NAMES[s],
                _NAMES[dst],
                None,
                op,
                inflight,
                detail,
            )
        return ticket

    def require(self, lc: Lifecycle, trigger: Trigger) -> None:
        """Refuse now what ``trigger`` would be refused on ``lc`` (the table's
        [`permits`][kvlife.fsm.table.LifecycleTable.permits]), for a caller about to
        allocate or launch something for it (a copy's host pages): the same typed error,
        counted and audited as the registry's own call would be. Changes nothing when
        the trigger is permitted.

        Raises:
            InvalidTransitionError: the state refuses ``trigger``.
            StaleInstanceError: ``lc`` was released.
            UnknownRequestError: ``lc`` belongs to another registry.
            WrongThreadError: called from a thread other than the owner.
        """
        self._check_thread(trigger.value)
        if lc._registry is not self or lc._s == _RELEASED:
            self._resolve(lc, trigger)
        if not LIFECYCLE.permits(STATES[lc._s], trigger):
            self._refuse_table(lc, trigger, None)

    def complete(self, ticket: Ticket, ok: bool = True, **detail: DetailValue) -> Lifecycle:
        """Deliver a copy's completion: ``ack`` if ``ok`` else ``fail``.

        Completes exactly the copy the ticket names, on exactly the lifecycle instance
        that started it, whatever rids, ids or ``__eq__`` say. The last completion of a
        finished/aborted lifecycle releases it (and runs the ``on_release`` hooks).
        Returns the ticket's lifecycle. On any error nothing changed.

        Raises:
            TypeError: ``ticket`` is not a Ticket, ``ok`` is not a bool, or a ``detail``
                value is not a scalar (not audited).
            UnknownRequestError: the ticket belongs to another registry.
            StaleInstanceError: the ticket's lifecycle was already released.
            DuplicateAckError: this ticket was already delivered.
            WrongThreadError: called from a thread other than the owner.
        """
        if _get_ident() != self._owner:
            self._wrong_thread("complete")
        if type(ticket) is not Ticket:
            raise TypeError(f"complete() needs a Ticket, got {type(ticket).__name__}")
        if ok is not True and ok is not False:
            raise TypeError(f"ok must be True or False, got {ok!r:.80}; nothing changed")
        if detail:
            _check_detail(detail)
        lc = ticket._lc
        if lc._registry is not self or not ticket._open:
            self._refuse_ticket(ticket, ok)
        s = lc._s
        inflight = lc._inflight
        dst = (_ACK if ok else _FAIL)[s][inflight if inflight < 2 else 2]
        if dst is None:  # pragma: no cover - an open ticket implies a copy in flight
            self._refuse_table(lc, Trigger.ACK if ok else Trigger.FAIL, ticket._op)
        ticket._open = False
        lc._inflight = inflight - 1
        lc._s = dst
        emit = self._emit
        if emit is not None:
            trigger: TriggerName = "ack" if ok else "fail"
            emit(
                lc._rid,
                lc._serial,
                trigger,
                _NAMES[s],
                _NAMES[dst],
                None,
                ticket._op,
                inflight - 1,
                detail,
            )
        if dst == _RELEASED:
            self._release(lc)
        return lc

    def deliver(self, ticket: Ticket, ok: bool = True, **detail: DetailValue) -> Reason | None:
        """Like [`complete()`][kvlife.fsm.registry.LifecycleRegistry.complete] but for the
        completion pump: a refusal is counted and audited and its reason returned instead of
        raised. Returns ``None`` when applied.

        Raises:
            TypeError: ``ticket`` is not a Ticket or ``ok`` is not a bool (a bug in the
                caller, never a race). Nothing changed.
            WrongThreadError: called from a thread other than the owner.
        """
        if type(ticket) is Ticket and (ticket._lc._registry is not self or not ticket._open):
            try:  # refused: complete() checks it, counts, audits and raises the refusal
                self.complete(ticket, ok, **detail)
            except (UnknownRequestError, CompletionRaceError) as exc:
                return exc.reason
        self.complete(ticket, ok, **detail)
        return None

    def refuse_spent(self, rid: str, serial: int, op: int, ok: bool = True) -> Reason:
        """A completion reported again for copy ``op`` of lifecycle ``serial`` (rid
        ``rid``), whose ticket was delivered already and which the caller no longer keeps:
        refused, counted and audited as ``deliver`` refuses a spent ticket, and its reason
        returned: ``duplicate_ack`` on the lifecycle while it is unreleased,
        ``stale_instance`` once it was released. For a component that remembers many
        ended copies (a planner refusing late worker reports) without keeping their
        tickets, and so their lifecycles, alive.

        The caller vouches that ``op`` was a copy of that lifecycle and was delivered;
        the registry checks that both numbers were handed out by it.

        Raises:
            TypeError: ``rid`` is not a str, ``serial`` or ``op`` not an int, or ``ok`` not
                a bool. Nothing written.
            ValueError: this registry never made lifecycle ``serial`` or copy ``op``.
                Nothing written.
            WrongThreadError: called from a thread other than the owner.
        """
        if _get_ident() != self._owner:
            self._wrong_thread("refuse_spent")
        if type(rid) is not str:
            raise TypeError(f"rid must be a str, got {type(rid).__name__}; nothing written")
        for name, number in (("serial", serial), ("op", op)):
            if type(number) is not int:
                raise TypeError(f"{name} must be an int, got {number!r:.80}; nothing written")
        if ok is not True and ok is not False:
            raise TypeError(f"ok must be True or False, got {ok!r:.80}; nothing written")
        if not 0 <= serial < self._next_serial or not 0 <= op < self._next_op:
            raise ValueError(
                f"lifecycle {serial} / copy {op}: this registry made lifecycles "
                f"0-{self._next_serial - 1} and copies 0-{self._next_op - 1}; nothing written"
            )
        lc = self._unreleased(rid, serial)
        if lc is None:
            reason, state, inflight = StaleInstanceError.reason, _NAMES[_RELEASED], 0
        else:
            reason, state, inflight = DuplicateAckError.reason, _NAMES[lc._s], lc._inflight
        self._count_refusal(reason, serial, rid, "ack" if ok else "fail", state, op, inflight)
        return reason

    def _unreleased(self, rid: str, serial: int) -> Lifecycle | None:
        """Lifecycle ``serial`` of ``rid`` while it is unreleased, else ``None`` (its rid
        chain holds every unreleased lifecycle of the rid, newest first)."""
        lc = self._by_rid.get(rid)
        while lc is not None and lc._serial > serial:
            lc = lc._older
        if lc is not None and lc._serial == serial and lc._s != _RELEASED:
            return lc
        return None

    def finish(self, target: object, **detail: DetailValue) -> Lifecycle:
        """The request finished: its host copies are kept (published) on release.

        From ``allocated`` it releases at once; from ``offloading`` it moves to
        ``finished_pending`` and releases when the last copy resolves. A final flush is
        ``start_offload`` then ``finish``. Returns the lifecycle. On any error nothing
        changed.

        Raises:
            UnknownRequestError: ``target`` is not registered here (or was released).
            StaleInstanceError: ``target`` is a released lifecycle.
            InvalidTransitionError: the lifecycle already finished or aborted.
            WrongThreadError: called from a thread other than the owner.
        """
        return self._end(target, _FINISH, detail)

    def abort(self, target: object, **detail: DetailValue) -> Lifecycle:
        """The request was aborted: its host copies are discarded on release.

        Same transitions and errors as [`finish()`][kvlife.fsm.registry.LifecycleRegistry.finish];
        only the outcome differs.
        """
        return self._end(target, _ABORT, detail)

    def _end(
        self,
        target: object,
        end: _End,
        detail: dict[str, DetailValue],
    ) -> Lifecycle:
        trigger, name, rows, outcome = end
        if _get_ident() != self._owner:
            self._wrong_thread(name)
        if detail:
            _check_detail(detail)
        lc = self._by_id.get(id(target))
        if lc is None:
            lc = self._resolve(target, trigger)
        s = lc._s
        inflight = lc._inflight
        dst = rows[s][inflight if inflight < 2 else 2]
        if dst is None:
            self._refuse_table(lc, trigger, None)
        lc._s = dst
        lc._outcome = outcome
        emit = self._emit
        if emit is not None:
            emit(lc._rid, lc._serial, name, _NAMES[s], _NAMES[dst], None, None, inflight, detail)
        if dst == _RELEASED:
            self._release(lc)
        return lc

    def apply(self, batch: Sequence[BatchOp]) -> list[Ticket | Lifecycle | LifecycleError]:
        """Apply a batch of transitions in one call: a scheduler step's reports and orders.
        ``batch`` is a sequence of groups, applied in order, each ``(trigger, targets)`` or
        ``(trigger, targets, details)``, its targets in order:

        - ``(Trigger.START_OFFLOAD, requests or lifecycles[, details])``: each result is
          the new [`Ticket`][kvlife.fsm.registry.Ticket];
        - ``(Trigger.ACK, tickets[, details])`` / ``(Trigger.FAIL, tickets[, details])``:
          completions, as ``complete(ticket, ok)``; each result is the ticket's lifecycle;
        - ``(Trigger.FINISH, requests or lifecycles[, details])`` /
          ``(Trigger.ABORT, ...)``: as ``finish`` / ``abort``; each result is the
          lifecycle.

        ``details``, when given, has one entry per target: ``None`` or a dict of small
        scalars (copied into the record). Returns one result per target, in order; a
        refused one's result is its [`LifecycleError`][kvlife.fsm.errors.LifecycleError]
        (not raised), counted and audited exactly as the single call refuses it, and the
        rest still run. Each transition sees the ones before it applied: the states,
        refusals, records (same order, same ``seq`` numbers) and release hooks are those
        of the same single calls one after the other. What a batch saves: one owner-thread
        check, one clock read (every record of the batch has the same ``t_ns``), no call
        and no keyword dict per transition, and the records handed to each sink together
        (``write_many`` where the sink has it), built only when a sink takes records.

        A failing sink gets the same treatment as on single calls: the batch is applied
        whole, and what the sink did not take is kept for a retry (a sink's
        ``write_many`` takes all of the batch's records or none).

        Raises:
            TypeError: a group is not a 2- or 3-tuple, its trigger is not one of the five,
                its targets are not a list or tuple, a completion's target is not a
                Ticket, or its details are not one ``None`` or dict of scalars per target.
                Checked before anything is applied: nothing changed.
            WrongThreadError: called from a thread other than the owner. Nothing changed.
            Exception: the first exception a release hook raised, after the whole batch
                was applied and audited (as single calls re-raise it after their release).
        """
        if _get_ident() != self._owner:
            self._wrong_thread("apply")
        for group in batch:  # checked whole before anything is applied
            _check_group(group)
        emit = self._emit
        records: list[AuditRecord] | None = None
        seq = now = nxt = 0  # nxt: the seq of the batch's next record
        if emit is not None:
            records = []
            now = _now()
            seq = nxt = self._audit.records
            # the single calls' refusal paths emit through self._emit: their records are
            # built in order, with the batch's clock read, beside the accepted ones'
            self._emit = _collector(records, seq, now)
        results: list[Ticket | Lifecycle | LifecycleError] = []
        append = results.append
        by_id = self._by_id
        first_error: Exception | None = None
        try:
            for group in batch:
                kind = group[0]
                # without details: None for each (repeat is endless); no strict= keyword:
                # compiled, a keyword argument makes zip() a generic call
                pairs = zip(group[1], group[2] if len(group) == 3 else _NO_DETAIL)  # noqa: B905
                if kind is _T_START:
                    for target, detail in pairs:
                        try:
                            lc = by_id.get(id(target))
                            if lc is None:
                                lc = self._resolve(target, _T_START)
                            s = lc._s
                            inflight = lc._inflight
                            dst = _START[s][inflight if inflight < 2 else 2]
                            if dst is None:
                                self._refuse_table(lc, _T_START, None)
                        except LifecycleError as exc:
                            append(exc)
                            nxt = seq + len(records) if records is not None else 0  # a refusal's
                            continue
                        lc._started += 1
                        inflight = lc._inflight = inflight + 1
                        lc._s = dst
                        op = self._next_op
                        self._next_op = op + 1
                        if _PLAIN:
                            ticket: Ticket = _new_ticket(Ticket)
                            ticket._lc = lc
                            ticket._op = op
                            ticket._open = True
                        else:
                            ticket = Ticket(_MAKER, lc, op)
                        if records is not None:
                            records.append(
                                AuditRecord(nxt, now, lc._rid, lc._serial,
                                            "start_offload", _NAMES[s], _NAMES[dst], True, None,
                                            op, inflight, dict(detail) if detail else {})
                            )  # fmt: skip
                            nxt += 1
                        append(ticket)
                    continue
                if kind is _T_ACK or kind is _T_FAIL:
                    ok = kind is _T_ACK
                    rows = _ACK if ok else _FAIL
                    name: TriggerName = "ack" if ok else "fail"
                    for ticket, detail in pairs:
                        lc = ticket._lc
                        if lc._registry is not self or not ticket._open:
                            try:
                                self._refuse_ticket(ticket, ok)
                            except LifecycleError as exc:
                                append(exc)
                                nxt = (
                                    seq + len(records) if records is not None else 0
                                )  # a refusal's
                                continue
                        s = lc._s
                        inflight = lc._inflight
                        dst = rows[s][inflight if inflight < 2 else 2]
                        ticket._open = False
                        lc._inflight = inflight - 1
                        lc._s = dst  # type: ignore[assignment]  # an open ticket: a copy
                        if records is not None:
                            records.append(
                                AuditRecord(nxt, now, lc._rid, lc._serial, name,
                                            _NAMES[s], _NAMES[dst], True, None, ticket._op,  # type: ignore[index]
                                            inflight - 1, dict(detail) if detail else {})
                            )  # fmt: skip
                            nxt += 1
                        append(lc)
                        if dst == _RELEASED:
                            first_error = self._release_in_batch(lc, first_error)
                            nxt = seq + len(records) if records is not None else 0  # a hook's
                    continue
                end = _FINISH if kind is _T_FINISH else _ABORT
                outcome = end[3]
                for target, detail in pairs:
                    try:
                        lc = by_id.get(id(target))
                        if lc is None:
                            lc = self._resolve(target, kind)
                        s = lc._s
                        inflight = lc._inflight
                        dst = end[2][s][inflight if inflight < 2 else 2]
                        if dst is None:
                            self._refuse_table(lc, kind, None)
                    except LifecycleError as exc:
                        append(exc)
                        nxt = seq + len(records) if records is not None else 0  # a refusal's
                        continue
                    lc._s = dst
                    lc._outcome = outcome
                    if records is not None:
                        records.append(
                            AuditRecord(nxt, now, lc._rid, lc._serial, end[1],
                                        _NAMES[s], _NAMES[dst], True, None, None, inflight,
                                        dict(detail) if detail else {})
                        )  # fmt: skip
                        nxt += 1
                    append(lc)
                    if dst == _RELEASED:
                        first_error = self._release_in_batch(lc, first_error)
                        nxt = seq + len(records) if records is not None else 0  # a hook's
        finally:
            if records is not None:
                self._emit = emit
                if records:
                    self._audit.hand_over(records)
        if first_error is not None:
            raise first_error
        return results

    def _release_in_batch(self, lc: Lifecycle, first: Exception | None) -> Exception | None:
        """Release ``lc`` within a batch: a hook's exception is kept (the first one of
        the batch), not raised, and the release stands."""
        try:
            self._release(lc)
        except Exception as exc:
            return first if first is not None else exc
        return first

    def _release(self, lc: Lifecycle) -> None:
        req = lc._req
        lc._req = None
        key = id(req)
        if self._by_id.get(key) is lc:
            del self._by_id[key]
        else:
            del self._shadowed[lc._serial]
        rid = lc._rid
        if self._by_rid[rid] is lc:
            older = _skip_released(lc._older)
            if older is None:
                del self._by_rid[rid]
            else:
                self._by_rid[rid] = older
            lc._older = None
        self._released += 1
        if self._hooks:
            run_all(self._hooks, lc, req)

    # ------------------------------------------------------------------ refusals

    def _resolve(self, target: object, trigger: Trigger) -> Lifecycle:
        """Slow path of a look-up that missed the identity dict."""
        if type(target) is Lifecycle:
            if target._registry is not self:
                raise self._unknown(target, trigger, audit=True)
            if target._s == _RELEASED:
                self._refuse(
                    StaleInstanceError,
                    target,
                    trigger.value,
                    f"{target!r} was released; {trigger.value} refused",
                )
            return target
        raise self._unknown(target, trigger, audit=True)

    def _unknown(self, target: object, trigger: Trigger | None, *, audit: bool) -> LifecycleError:
        rid = target._rid if type(target) is Lifecycle else getattr(target, "rid", None)
        rid = rid if isinstance(rid, str) else None
        holder = self._by_rid.get(rid) if rid is not None else None
        why = "is not registered here (never registered, or released)"
        if type(target) is Lifecycle:
            why = "belongs to another registry"
        elif holder is not None:
            why = f"is not the object registered under rid {rid!r} ({holder!r})"
        name = trigger.value if trigger is not None else "lookup"
        error = UnknownRequestError(f"{target!r:.80} {why}; {name} refused", rid=rid, trigger=name)
        if audit and trigger is not None:
            self._count_refusal("unknown_request", None, rid, name, None, None, 0)
        return error

    def _refuse_table(self, lc: Lifecycle, trigger: Trigger, op: int | None) -> NoReturn:
        self._refuse(
            InvalidTransitionError,
            lc,
            trigger.value,
            f"can't {trigger.value} when state={_NAMES[lc._s]} ({lc!r})",
            op=op,
        )

    def _refuse_ticket(self, ticket: Ticket, ok: bool) -> NoReturn:
        lc = ticket._lc
        trigger = "ack" if ok else "fail"
        error: LifecycleError
        if lc._registry is not self:
            error = UnknownRequestError(
                f"{ticket!r} belongs to another registry; {trigger} refused",
                rid=lc._rid,
                trigger=trigger,
                op=ticket._op,
            )
            self._count_refusal("unknown_request", None, lc._rid, trigger, None, ticket._op, 0)
            raise error
        if lc._s == _RELEASED:
            cls: type[LifecycleError] = StaleInstanceError
            message = f"{ticket!r} is stale: its lifecycle was released"
        else:
            cls = DuplicateAckError
            message = f"{ticket!r} was already delivered"
        self._refuse(cls, lc, trigger, message, op=ticket._op)

    def _refuse(
        self,
        cls: type[LifecycleError],
        lc: Lifecycle,
        trigger: str,
        message: str,
        *,
        op: int | None = None,
        rid: str | None = None,
    ) -> NoReturn:
        rid = lc._rid if rid is None else rid
        state = _NAMES[lc._s]
        self._count_refusal(cls.reason, lc._serial, rid, trigger, state, op, lc._inflight)
        raise cls(message, serial=lc._serial, rid=rid, state=state, trigger=trigger, op=op)

    def _count_refusal(
        self,
        reason: Reason,
        serial: int | None,
        rid: str | None,
        trigger: str,
        state: str | None,
        op: int | None,
        inflight: int,
        detail: dict[str, DetailValue] | None = None,
    ) -> None:
        self._refusals[reason] += 1
        emit = self._emit
        if emit is not None:
            trigger_name = cast(TriggerName, trigger)
            src = cast(StateName | None, state)
            emit(rid, serial, trigger_name, src, None, reason, op, inflight, detail or {})

    def record_violation(
        self,
        reason: Reason,
        trigger: Trigger,
        message: str,
        *,
        lifecycle: Lifecycle | None = None,
        rid: str | None = None,
        op: int | None = None,
        serial: int | None = None,
        **detail: DetailValue,
    ) -> ProtocolViolationError:
        """Write down that a component this registry watches broke its protocol: a refused
        record with ``reason`` (one of
        [`PROTOCOL_REASONS`][kvlife.fsm.errors.PROTOCOL_REASONS]), on ``lifecycle`` when
        the violation concerns one (live or released: it is told in that lifecycle's
        story), else on ``rid`` alone. ``trigger`` is the transition the reported thing
        would have been (``ack`` for a completion report); ``detail`` says what was
        reported. ``kvlife audit check`` counts such a record as a violation.

        ``serial`` (with ``rid``, instead of ``lifecycle``) names the lifecycle by number,
        for a watcher that remembers released lifecycles without keeping them alive: the
        record is the one ``lifecycle=`` writes, whether it still lives or was released.

        Returns the error (not raised: a watcher decides whether the call goes on).
        Changes nothing but the refusal counter and the audit log.

        Raises:
            ValueError: ``reason`` is not a protocol reason; ``serial`` given with
                ``lifecycle``, without ``rid``, or never made here. Nothing written.
            TypeError: a ``detail`` value is not a scalar, or ``serial`` not an int.
                Nothing written.
            WrongThreadError: called from a thread other than the owner.
        """
        self._check_thread(trigger.value)
        if reason not in PROTOCOL_REASONS:
            raise ValueError(
                f"{reason!r} is not a protocol reason ({', '.join(sorted(PROTOCOL_REASONS))}); "
                "nothing written"
            )
        if detail:
            _check_detail(detail)
        state = None
        inflight = 0
        if serial is not None:
            if type(serial) is not int:
                raise TypeError(f"serial must be an int, got {serial!r:.80}; nothing written")
            if lifecycle is not None or rid is None or not 0 <= serial < self._next_serial:
                raise ValueError(
                    f"serial {serial!r} names a lifecycle this registry made, with its rid "
                    "and without lifecycle=; nothing written"
                )
            lifecycle = self._unreleased(rid, serial)
            state = _NAMES[_RELEASED]  # unless it lives: below
        if lifecycle is not None:
            serial, state, inflight = lifecycle._serial, _NAMES[lifecycle._s], lifecycle._inflight
            rid = lifecycle._rid if rid is None else rid
        self._count_refusal(reason, serial, rid, trigger.value, state, op, inflight, detail)
        return ProtocolViolationError(
            message,
            reason=reason,
            serial=serial,
            rid=rid,
            state=state,
            trigger=trigger.value,
            op=op,
        )

    # ------------------------------------------------------------------ introspection

    @property
    def refusals(self) -> Mapping[str, int]:
        """Refused calls per reason so far, every reason present (a live read-only view:
        O(1), unlike [`statistics()`][kvlife.fsm.registry.LifecycleRegistry.statistics])."""
        return self._refusal_view

    def sink_statistics(self) -> tuple[SinkStatistics, ...]:
        """Each attached audit sink's counters (errors, backlog, records dropped), in
        attach order: what ``statistics().sinks`` holds, O(sinks), without walking the
        lifecycles."""
        return self._audit.statistics()

    def statistics(self) -> RegistryStatistics:
        """A snapshot: live per state, totals, refusals per reason, oldest live age."""
        live = dict.fromkeys(State, 0)
        inflight = ended = 0
        lifecycles = self._snapshot()
        for lc in lifecycles:
            live[STATES[lc._s]] += 1
            inflight += lc._inflight
            ended += lc._outcome is not None
        oldest = min(lifecycles, key=_by_serial) if lifecycles else None
        # Counted from what the hot path keeps anyway, not by a counter per transition:
        # every copy number was an accepted start_offload; every copy not in flight was
        # acked or failed (a lifecycle releases only when none is); every released or
        # ended lifecycle took one finish/abort.
        started = self._next_op
        return RegistryStatistics(
            live=live,
            registered=self._next_serial,
            released=self._released,
            transitions=2 * started - inflight + self._released + ended,
            refusals=dict(self._refusals),
            inflight=inflight,
            oldest_live_age_s=None
            if oldest is None
            else self._births.age(oldest._serial, _clock()),
            oldest_live=None if oldest is None else (oldest._rid, oldest._serial),
            sinks=self.sink_statistics(),
            records=self._audit.records,
        )

    def flush(self) -> None:
        """Offer every failing sink its backlog again, then flush every sink that can be
        flushed. Never raises for a sink: failures are counted in ``statistics().sinks``.

        Raises:
            WrongThreadError: called from a thread other than the owner.
        """
        self._check_thread("flush")
        self._audit.flush()
        self._rewire()

    def __repr__(self) -> str:
        return f"<LifecycleRegistry live={len(self)} registered={self._next_serial}>"

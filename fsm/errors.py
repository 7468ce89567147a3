"""kvlife's exceptions, split by who is at fault.

Two branches under [`LifecycleError`][kvlife.fsm.errors.LifecycleError]: the caller asked for
something the table or the registry does not allow
([`InvalidTransitionError`][kvlife.fsm.errors.InvalidTransitionError],
[`UnknownRequestError`][kvlife.fsm.errors.UnknownRequestError],
[`RidConflictError`][kvlife.fsm.errors.RidConflictError],
[`DuplicateRegistrationError`][kvlife.fsm.errors.DuplicateRegistrationError]), or a completion
came late or twice ([`CompletionRaceError`][kvlife.fsm.errors.CompletionRaceError]:
[`StaleInstanceError`][kvlife.fsm.errors.StaleInstanceError],
[`DuplicateAckError`][kvlife.fsm.errors.DuplicateAckError]): the engine's timing, which a
completion pump counts and drops (as ``LifecycleRegistry.deliver`` does).

Every refused transition raises a subclass of
[`LifecycleError`][kvlife.fsm.errors.LifecycleError] that carries the data of the refusal as
attributes (``serial``, ``rid``, ``state``, ``trigger``, ``reason``, ``op``) and
**changes nothing**: no state, no counter, no ticket, no record of the registry is modified,
except that the refusal itself is counted in ``statistics().refusals`` and written to the
audit sinks.

``reason`` is one of the closed set in [`Reason`][kvlife.fsm.errors.Reason], the same string the
audit log uses.
"""

from __future__ import annotations

from typing import Literal, get_args

Reason = Literal[
    "invalid_transition",
    "stale_instance",
    "duplicate_ack",
    "unknown_request",
    "rid_conflict",
    "duplicate_registration",
    "stray_report",
    "connector_raised",
    "event_mismatch",
    "overdue",
    "credited_elsewhere",
    "inherited_state",
    "host_freed_in_flight",
    "failed_write_backed",
    "unbalanced_lock",
    "pending_overwritten",
]
"""Why a transition was refused. The audit log's ``reason`` field uses exactly these strings.

The first six are the registry's own refusals. The others are verdicts on a component
kvlife watches (see [`ProtocolViolationError`][kvlife.fsm.errors.ProtocolViolationError]):
``kvlife audit check`` counts them as violations, except ``overdue`` (a ticket open longer
than its limit, see [`OverdueWatch`][kvlife.fsm.overdue.OverdueWatch]), a violation only
when the ticket never completed afterwards (or when asked to count every one).
``credited_elsewhere``: a copy's completion credited to another request object than the
one it was issued for; ``inherited_state``: a request whose state in the component belongs
to another request object with the same id. The last four are verdicts on a hierarchical
cache (SGLang's HiCache lens): ``host_freed_in_flight``, host memory freed while a copy
still reads or writes it; ``failed_write_backed``, a node committed as backed by a write
that failed; ``unbalanced_lock``, a lock released that no increment explains;
``pending_overwritten``, a pending copy's entry replaced while the copy was in flight."""

PROTOCOL_REASONS: frozenset[Reason] = frozenset(get_args(Reason)[6:])  # after the registry's six
"""The reasons that are verdicts on a watched component, not refusals of the registry."""

REASONS: tuple[Reason, ...] = get_args(Reason)
"""The closed set of refusal reasons, in a fixed order."""


class LifecycleError(Exception):
    """Base class of every refusal kvlife raises.

    Attributes:
        serial: the lifecycle's registry-wide serial, or ``None`` when no lifecycle was
            found (an unknown request).
        rid: the request id involved, or ``None`` when the request had none.
        state: the lifecycle's state name when the refusal happened, or ``None``.
        trigger: the trigger that was refused (``"register"`` for registrations).
        reason: one of [`REASONS`][kvlife.fsm.errors.REASONS].
        op: the ticket's copy number for ``ack``/``fail`` refusals, else ``None``.

    A refusal leaves the registry and every lifecycle exactly as they were; only the
    refusal counters and the audit log record it.
    """

    reason: Reason = "invalid_transition"

    def __init__(
        self,
        message: str,
        *,
        serial: int | None = None,
        rid: str | None = None,
        state: str | None = None,
        trigger: str | None = None,
        op: int | None = None,
    ) -> None:
        super().__init__(message)
        self.serial = serial
        self.rid = rid
        self.state = state
        self.trigger = trigger
        self.op = op


class InvalidTransitionError(LifecycleError):
    """The transition table refuses this trigger in the lifecycle's current state.

    Raised, for example, by ``start_offload`` on a ``finished_pending`` lifecycle or by
    ``finish`` on one that already finished. Nothing changed.
    """

    reason: Reason = "invalid_transition"


class CompletionRaceError(LifecycleError):
    """A completion (or another call) arrived for a lifecycle or ticket that is already
    done with it: the engine's timing, not the caller's misuse. Catch this to count and
    drop late or repeated deliveries; catch
    [`InvalidTransitionError`][kvlife.fsm.errors.InvalidTransitionError],
    [`UnknownRequestError`][kvlife.fsm.errors.UnknownRequestError],
    [`RidConflictError`][kvlife.fsm.errors.RidConflictError] and
    [`DuplicateRegistrationError`][kvlife.fsm.errors.DuplicateRegistrationError] for calls
    the table refuses because the caller asked for the wrong thing. Nothing changed.
    """


class StaleInstanceError(CompletionRaceError):
    """The lifecycle this call names has already been released.

    Typical cause: a late or repeated delivery of a ticket whose lifecycle has finished
    and released, or a scheduler that kept a [`Lifecycle`][kvlife.fsm.registry.Lifecycle] after its
    release. Nothing changed; in particular no newer lifecycle with the same rid was
    touched.
    """

    reason: Reason = "stale_instance"


class DuplicateAckError(CompletionRaceError):
    """This ticket was already delivered (acked or failed) once.

    A ticket is single use. Nothing changed: the copy it names was completed by the first
    delivery.
    """

    reason: Reason = "duplicate_ack"


class UnknownRequestError(LifecycleError, LookupError):
    """The registry holds no live lifecycle for this request object (or lifecycle, or ticket).

    Raised for a request that was never registered, whose lifecycle has been released, or
    that is a different object from the one registered under its rid (equality and hash
    are never consulted), and for a lifecycle or ticket that belongs to another registry.
    Nothing changed.
    """

    reason: Reason = "unknown_request"


class RidConflictError(LifecycleError):
    """``register`` was refused: a lifecycle that has not finished already holds this rid.

    A rid may be reused once the lifecycle holding it has finished or aborted (it may
    still be ``finished_pending``). Nothing was registered.
    """

    reason: Reason = "rid_conflict"


class DuplicateRegistrationError(LifecycleError):
    """``register`` was refused: this object's current lifecycle has not finished.

    The same object may be registered again once its lifecycle has finished or aborted.
    Nothing was registered.
    """

    reason: Reason = "duplicate_registration"


class ProtocolViolationError(LifecycleError):
    """A component kvlife watches (a connector it wraps) did what its protocol does not
    allow, and kvlife wrote it down
    ([`LifecycleRegistry.record_violation()`][kvlife.fsm.registry.LifecycleRegistry.record_violation]).

    ``reason`` is one of ``"stray_report"`` (a completion report that no open ticket
    explains), ``"connector_raised"`` (the component raised while handling the
    lifecycle), ``"event_mismatch"`` (an event it published contradicts what the engine
    holds), ``"overdue"`` (a ticket open longer than its limit), ``"credited_elsewhere"``
    and ``"inherited_state"`` (see [`Reason`][kvlife.fsm.errors.Reason]). Returned, not
    raised, by the registry: the caller decides what to do. Nothing
    changed but the refusal counter and the audit log.
    """

    def __init__(self, message: str, *, reason: Reason, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.reason = reason


class TableDefinitionError(ValueError):
    """A transition table failed the definition checks when it was built.

    Raised by
    [`kvlife.fsm.table.build_lifecycle_table()`][kvlife.fsm.table.build_lifecycle_table];
    the message names the check and the offending states or edges. Nothing is built.
    """


class WrongThreadError(RuntimeError):
    """A registry was called from a thread other than the one that owns it.

    A registry is not shared between threads: its owner (the thread that made it, or the
    last to call ``adopt_thread``) drives it, and completions from other threads are
    queued to the owner. The refused call changed nothing, not even a counter, and wrote
    no audit record. Not a [`LifecycleError`][kvlife.fsm.errors.LifecycleError]: no transition was
    asked, the caller's
    threading is wrong.
    """

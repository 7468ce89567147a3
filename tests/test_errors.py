"""The error hierarchy: who is at fault, and the data each refusal carries."""

from __future__ import annotations

import pytest

from kvlife.fsm import errors
from kvlife.fsm.errors import (
    PROTOCOL_REASONS,
    REASONS,
    CompletionRaceError,
    DuplicateAckError,
    DuplicateRegistrationError,
    InvalidTransitionError,
    LifecycleError,
    ProtocolViolationError,
    RidConflictError,
    StaleInstanceError,
    TableDefinitionError,
    UnknownRequestError,
)

ALL = [
    InvalidTransitionError,
    StaleInstanceError,
    DuplicateAckError,
    UnknownRequestError,
    RidConflictError,
    DuplicateRegistrationError,
]


def test_hierarchy() -> None:
    assert all(issubclass(cls, LifecycleError) for cls in ALL)
    # two branches: the caller's misuse, and a completion the engine sent late or twice
    for race in (StaleInstanceError, DuplicateAckError):
        assert issubclass(race, CompletionRaceError)
        assert not issubclass(race, InvalidTransitionError)
    for misuse in (
        InvalidTransitionError,
        UnknownRequestError,
        RidConflictError,
        DuplicateRegistrationError,
    ):
        assert not issubclass(misuse, CompletionRaceError)
    assert issubclass(UnknownRequestError, LookupError)
    assert issubclass(TableDefinitionError, ValueError)
    assert not issubclass(TableDefinitionError, LifecycleError)


def test_each_reason_belongs_to_exactly_one_error_class() -> None:
    """The registry's refusals have a class each; the verdicts on a watched component
    share ProtocolViolationError, which carries its reason per instance."""
    assert sorted(cls.reason for cls in ALL) == sorted(set(REASONS) - PROTOCOL_REASONS)
    assert REASONS == (
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
    )
    assert {
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
    } == PROTOCOL_REASONS


def test_a_protocol_violation_carries_its_own_reason() -> None:
    exc = ProtocolViolationError("late", reason="stray_report", rid="a", trigger="ack", op=4)
    assert (exc.reason, exc.rid, exc.trigger, exc.op, str(exc)) == (
        "stray_report",
        "a",
        "ack",
        4,
        "late",
    )
    assert isinstance(exc, LifecycleError)
    assert "Nothing\n    changed" in (ProtocolViolationError.__doc__ or "")


@pytest.mark.parametrize("cls", ALL)
def test_errors_carry_their_data(cls: type[LifecycleError]) -> None:
    exc = cls("why", serial=3, rid="a", state="offloading", trigger="ack", op=9)
    assert (exc.serial, exc.rid, exc.state, exc.trigger, exc.op) == (3, "a", "offloading", "ack", 9)
    assert exc.reason in REASONS and str(exc) == "why"


def test_module_documents_what_errors_leave_behind() -> None:
    assert "changes nothing" in (errors.__doc__ or "")
    for cls in ALL:
        assert "Nothing" in (cls.__doc__ or ""), cls

"""The transition table: design §2, definition checks, and compiled == reference engine."""

from __future__ import annotations

import random

import pytest
from transitions import MachineError

from kvlife.fsm import LIFECYCLE, LIFECYCLE_EDGES, Edge, Guard, State, TableDefinitionError, Trigger
from kvlife.fsm.table import build_lifecycle_table, check_definition, reference_model, table_digest

A, O, F, R = State.ALLOCATED, State.OFFLOADING, State.FINISHED_PENDING, State.RELEASED
START, ACK, FAIL, FINISH, ABORT = (
    Trigger.START_OFFLOAD,
    Trigger.ACK,
    Trigger.FAIL,
    Trigger.FINISH,
    Trigger.ABORT,
)

# The table of design §2, written out independently: (state, trigger, inflight) -> dst.
CONTRACT = {
    (A, START): lambda n: O,
    (A, FINISH): lambda n: R,
    (A, ABORT): lambda n: R,
    (O, START): lambda n: O,
    (O, ACK): lambda n: O if n > 1 else A,
    (O, FAIL): lambda n: O if n > 1 else A,
    (O, FINISH): lambda n: F,
    (O, ABORT): lambda n: F,
    (F, ACK): lambda n: F if n > 1 else R,
    (F, FAIL): lambda n: F if n > 1 else R,
}


def test_enum_values_are_the_contract_names() -> None:
    assert [s.value for s in State] == ["allocated", "offloading", "finished_pending", "released"]
    assert [t.value for t in Trigger] == ["start_offload", "ack", "fail", "finish", "abort"]


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("trigger", list(Trigger))
@pytest.mark.parametrize("inflight", [1, 2, 3])
def test_compiled_table_matches_contract(state: State, trigger: Trigger, inflight: int) -> None:
    expected = CONTRACT.get((state, trigger))
    got = LIFECYCLE.next_state(state, trigger, inflight)
    assert got == (None if expected is None else expected(inflight))


def _reference(state: State, trigger: Trigger, inflight: int) -> State | None:
    """Drive the transitions machine (static pattern) as the reference engine."""
    model = reference_model(state, inflight)
    try:
        moved = LIFECYCLE.machine.events[trigger.value].trigger(model)
    except MachineError:
        return None
    return State(model.state) if moved else None


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("trigger", list(Trigger))
@pytest.mark.parametrize("inflight", [0, 1, 2, 5])
def test_compiled_table_agrees_with_transitions_machine(
    state: State, trigger: Trigger, inflight: int
) -> None:
    # A completion with nothing in flight passes neither guard: refused by both engines.
    assert LIFECYCLE.next_state(state, trigger, inflight) == _reference(state, trigger, inflight)


def test_random_walks_agree_with_transitions_machine() -> None:
    rng = random.Random(20261129)
    walks = steps = 0
    while walks < 2000:
        state, inflight = A, 0
        model = reference_model(A, 0)
        for _ in range(rng.randint(1, 30)):
            trigger = rng.choice(list(Trigger))
            compiled = LIFECYCLE.next_state(state, trigger, inflight)
            try:
                moved = LIFECYCLE.machine.events[trigger.value].trigger(model)
            except MachineError:
                moved = False
            assert (compiled is not None) == bool(moved), (state, trigger, inflight)
            if compiled is not None:
                assert State(model.state) == compiled
                state = compiled
                inflight += 1 if trigger is START else -1 if trigger in (ACK, FAIL) else 0
                model.inflight = inflight
            steps += 1
            if state is R:
                break
        walks += 1
    assert steps > 2000


def test_guards_are_shown_as_conditions_on_the_machine() -> None:
    conditions = {
        (src, t.dest, tuple(c.func for c in t.conditions))
        for src, ts in LIFECYCLE.machine.events["ack"].transitions.items()
        for t in ts
    }
    assert ("offloading", "allocated", ("last_in_flight",)) in conditions
    assert ("finished_pending", "finished_pending", ("more_in_flight",)) in conditions


def test_no_auto_transitions_and_no_model() -> None:
    assert set(LIFECYCLE.machine.events) == {t.value for t in Trigger}
    assert LIFECYCLE.machine.models == []


def test_digest_is_stable_and_order_independent() -> None:
    shuffled = list(LIFECYCLE_EDGES)
    random.Random(1).shuffle(shuffled)
    assert table_digest(shuffled, A, R) == LIFECYCLE.digest
    changed = [e for e in LIFECYCLE_EDGES if e != Edge(A, ABORT, R)]
    assert table_digest([*changed, Edge(A, ABORT, O)], A, R) != LIFECYCLE.digest


# --- definition checks: each one rejects a broken table --------------------------------


def _without(*edges: Edge) -> tuple[Edge, ...]:
    return tuple(e for e in LIFECYCLE_EDGES if e not in edges)


BROKEN = {
    "edge out of terminal": ((*LIFECYCLE_EDGES, Edge(R, START, O)), A, R, "leave the terminal"),
    "initial is terminal": (LIFECYCLE_EDGES, R, R, "also terminal"),
    "unreachable state": (
        tuple(e for e in LIFECYCLE_EDGES if F not in (e.src, e.dst)),
        A,
        R,
        "unreachable",
    ),
    "trap state": (
        tuple(e._replace(dst=F) if e.src is F else e for e in LIFECYCLE_EDGES),
        A,
        R,
        "never reach",
    ),
    "guard half missing": (
        _without(Edge(O, ACK, A, Guard.LAST_IN_FLIGHT)),
        A,
        R,
        "not deterministic",
    ),
    "guard duplicated": (
        (*LIFECYCLE_EDGES, Edge(O, ACK, F, Guard.MORE_IN_FLIGHT)),
        A,
        R,
        "not deterministic",
    ),
    "guarded and unguarded mixed": (
        (*LIFECYCLE_EDGES, Edge(O, ACK, O)),
        A,
        R,
        "mixes an unguarded",
    ),
    "guard on a non-completion trigger": (
        (
            *_without(Edge(O, START, O)),
            Edge(O, START, O, Guard.MORE_IN_FLIGHT),
            Edge(O, START, O, Guard.LAST_IN_FLIGHT),
        ),
        A,
        R,
        "only ack/fail",
    ),
    "malformed edge": (
        (*LIFECYCLE_EDGES, ("allocated", "ack", "released", None)),
        A,
        R,
        "malformed",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_definition_check_rejects_broken_table(name: str) -> None:
    edges, initial, terminal, message = BROKEN[name]
    with pytest.raises(TableDefinitionError, match=message):
        build_lifecycle_table(edges, initial, terminal)  # type: ignore[arg-type]


def test_the_contract_table_passes_its_checks() -> None:
    check_definition(LIFECYCLE_EDGES, A, R)
    assert LIFECYCLE.initial is A and LIFECYCLE.terminal is R


def test_permits_is_the_one_question_before_a_copy_starts() -> None:
    from kvlife.fsm import LIFECYCLE, State, Trigger  # noqa: PLC0415

    starts = {s for s in State if LIFECYCLE.permits(s, Trigger.START_OFFLOAD)}
    assert starts == {State.ALLOCATED, State.OFFLOADING}
    assert LIFECYCLE.permits(State.OFFLOADING, Trigger.ACK)  # with a copy in flight
    assert not LIFECYCLE.permits(State.ALLOCATED, Trigger.ACK)
    assert not LIFECYCLE.permits(State.RELEASED, Trigger.FINISH)

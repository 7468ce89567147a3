"""The lifecycle transition table: the one place where transitions are decided.

Rule 1 (after h11's ``_state.py``): everything that affects which transition a trigger takes
lives here, as data. [`LIFECYCLE_EDGES`][kvlife.fsm.table.LIFECYCLE_EDGES] is the table of
design §2 (docs/design.md);
[`build_lifecycle_table()`][kvlife.fsm.table.build_lifecycle_table] checks its definition,
builds it into a ``transitions`` machine (the reference engine, also used for the diagrams)
and compiles that machine into the tuple-indexed table the hot path runs.

Guards: ``ack`` and ``fail`` complete one in-flight copy. Their guards are evaluated on the
in-flight count *before* the completion: ``more_in_flight`` is ``inflight > 1``,
``last_in_flight`` is ``inflight == 1``.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Final, NamedTuple, TypeVar

from transitions import Machine

from kvlife.fsm.errors import TableDefinitionError


class State(str, Enum):
    """A lifecycle's state. Values are the lower-case names used in logs and diagrams."""

    #: Registered; no copy in flight. The initial state.
    ALLOCATED = "allocated"
    #: At least one copy in flight; the request is still running.
    OFFLOADING = "offloading"
    #: Finished or aborted with copies still in flight; releases when the last resolves.
    FINISHED_PENDING = "finished_pending"
    #: Terminal. The registry has dropped every reference to the request.
    RELEASED = "released"


class Trigger(str, Enum):
    """What can be asked of a lifecycle."""

    #: A copy of some of the request's KV was launched: a store of its pages to host
    #: memory, or a load of host pages back into its device blocks (a vLLM host-cache hit:
    #: ``detail.kind = "load"``). Both are copies in flight that read or write the
    #: request's blocks, and both end with ``ack`` or ``fail``.
    START_OFFLOAD = "start_offload"
    #: A copy completed (its CUDA event is done on every rank).
    ACK = "ack"
    #: A copy failed; its host pages are freed.
    FAIL = "fail"
    #: The request finished; its host copies are kept.
    FINISH = "finish"
    #: The request was aborted; its host copies are discarded.
    ABORT = "abort"


class Guard(str, Enum):
    """Guards on completion edges, evaluated on ``inflight`` before the completion."""

    #: ``inflight > 1``: other copies stay in flight after this one.
    MORE_IN_FLIGHT = "more_in_flight"
    #: ``inflight == 1``: this is the last copy in flight.
    LAST_IN_FLIGHT = "last_in_flight"


class Edge(NamedTuple):
    """One allowed transition: ``src --trigger [guard]--> dst``."""

    src: State
    trigger: Trigger
    dst: State
    guard: Guard | None = None


EdgeTable = tuple[Edge, ...]
"""The table's shape: a tuple of edges. Any (state, trigger) pair not listed is refused."""

_A, _O, _F, _R = State.ALLOCATED, State.OFFLOADING, State.FINISHED_PENDING, State.RELEASED
_MORE, _LAST = Guard.MORE_IN_FLIGHT, Guard.LAST_IN_FLIGHT

LIFECYCLE_EDGES: Final[EdgeTable] = (
    Edge(_A, Trigger.START_OFFLOAD, _O),
    Edge(_A, Trigger.FINISH, _R),
    Edge(_A, Trigger.ABORT, _R),
    Edge(_O, Trigger.START_OFFLOAD, _O),
    Edge(_O, Trigger.ACK, _O, _MORE),
    Edge(_O, Trigger.ACK, _A, _LAST),
    Edge(_O, Trigger.FAIL, _O, _MORE),
    Edge(_O, Trigger.FAIL, _A, _LAST),
    Edge(_O, Trigger.FINISH, _F),
    Edge(_O, Trigger.ABORT, _F),
    Edge(_F, Trigger.ACK, _F, _MORE),
    Edge(_F, Trigger.ACK, _R, _LAST),
    Edge(_F, Trigger.FAIL, _F, _MORE),
    Edge(_F, Trigger.FAIL, _R, _LAST),
)
"""The lifecycle table of design §2. Released is terminal: it has no edges."""

COMPLETION_TRIGGERS: Final = frozenset({Trigger.ACK, Trigger.FAIL})
"""The triggers that complete a copy; the only ones that may carry guards."""

STATES: Final[tuple[State, ...]] = tuple(State)
"""States in a fixed order; the hot path stores a lifecycle's state as an index into this."""
TRIGGERS: Final[tuple[Trigger, ...]] = tuple(Trigger)
"""Triggers in a fixed order."""


class _GuardModel:
    """What a ``transitions`` model needs to evaluate the guards (reference engine)."""

    state: str
    inflight: int

    def more_in_flight(self) -> bool:
        return self.inflight > 1

    def last_in_flight(self) -> bool:
        return self.inflight == 1


Row = tuple[tuple[int | None, int | None, int | None], ...]
"""Where one trigger leads, indexed by the source state's index in
[`STATES`][kvlife.fsm.table.STATES], then by the copies in flight before it, clamped to 2
(``row[s][min(inflight, 2)]``: 0, 1 = last in flight, 2 = more in flight): the destination
state's index, or ``None`` when the table refuses it. The guards are evaluated here, once,
when the table is compiled: a completion with nothing in flight is refused, a guarded pair
splits on the last copy, an unguarded edge goes to the same place from any count.
"""


@dataclass(frozen=True)
class LifecycleTable:
    """A checked table: its edges, the ``transitions`` machine built from them, and the
    compiled rows the hot path uses.

    Attributes:
        edges: the table as data, in declaration order.
        initial: the initial state.
        terminal: the terminal state.
        machine: a ``transitions.Machine(model=None, auto_transitions=False)`` built from
            the edges; the reference engine and the source of the diagrams.
        rows: per trigger, the compiled [`Row`][kvlife.fsm.table.Row].
        digest: a short hash of the table (edges, initial, terminal), written into audit
            log headers so a log can be matched to the table that produced it.
    """

    edges: EdgeTable
    initial: State
    terminal: State
    machine: Machine
    rows: Mapping[Trigger, Row]
    digest: str

    def next_state(self, state: State, trigger: Trigger, inflight: int) -> State | None:
        """The state ``trigger`` leads to from ``state`` with ``inflight`` copies in flight
        (before the trigger), or ``None`` if the table refuses it. A completion with
        nothing in flight passes neither guard and is refused."""
        dst = self.rows[trigger][STATES.index(state)][min(max(inflight, 0), 2)]
        return None if dst is None else STATES[dst]

    def permits(self, state: State, trigger: Trigger) -> bool:
        """Whether the table lets ``trigger`` happen in ``state`` at all (a completion:
        with a copy in flight to complete). The one question an offload manager or an
        engine adapter asks before it allocates or launches anything for a copy."""
        return self.next_state(state, trigger, 1) is not None


def sorted_edges(edges: Iterable[Edge]) -> list[Edge]:
    """Edges in a stable order (state order, then trigger order, then guard)."""
    return sorted(
        edges,
        key=lambda e: (
            STATES.index(e.src),
            TRIGGERS.index(e.trigger),
            "" if e.guard is None else e.guard.value,
        ),
    )


def table_digest(edges: Iterable[Edge], initial: State, terminal: State) -> str:
    """A 16-hex-digit SHA-256 prefix of the canonical form of a table."""
    lines = [f"initial={initial.value}", f"terminal={terminal.value}"]
    lines += [
        f"{e.src.value} {e.trigger.value} {e.guard.value if e.guard else '-'} {e.dst.value}"
        for e in sorted_edges(edges)
    ]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def check_definition(edges: EdgeTable, initial: State, terminal: State) -> None:
    """Run the definition checks of design §2 on a table; raise
    [`TableDefinitionError`][kvlife.fsm.errors.TableDefinitionError].

    Checks: edges are well typed; exactly one initial state, distinct from the terminal
    one; no edge leaves the terminal state; every state is reachable from the initial
    state; every non-terminal state can reach the terminal state; each (state, trigger)
    pair is deterministic (one unguarded edge, or exactly the two complementary guards,
    and guards only on completion triggers).
    """
    if not isinstance(initial, State) or not isinstance(terminal, State):
        raise TableDefinitionError("the initial and terminal states must be State members")
    if initial is terminal:
        raise TableDefinitionError(f"the initial state {initial.value!r} is also terminal")
    for edge in edges:
        if not (
            isinstance(edge, Edge)
            and isinstance(edge.src, State)
            and isinstance(edge.dst, State)
            and isinstance(edge.trigger, Trigger)
            and (edge.guard is None or isinstance(edge.guard, Guard))
        ):
            raise TableDefinitionError(f"malformed edge {edge!r}")
    leaving = [e for e in edges if e.src is terminal]
    if leaving:
        raise TableDefinitionError(
            f"edges leave the terminal state {terminal.value!r}: {[tuple(e) for e in leaving]}"
        )
    pairs: dict[tuple[State, Trigger], list[Guard | None]] = {}
    for edge in edges:
        pairs.setdefault((edge.src, edge.trigger), []).append(edge.guard)
    for (src, trigger), guards in pairs.items():
        where = f"({src.value}, {trigger.value})"
        if guards == [None]:
            continue
        if None in guards:
            raise TableDefinitionError(f"{where} mixes an unguarded edge with others: {guards}")
        if trigger not in COMPLETION_TRIGGERS:
            raise TableDefinitionError(f"{where}: only ack/fail edges may carry guards")
        if sorted(g.value for g in guards if g is not None) != sorted(g.value for g in Guard):
            raise TableDefinitionError(
                f"{where} is not deterministic: needs exactly one edge per guard, got {guards}"
            )
    successors: dict[State, set[State]] = {s: set() for s in State}
    predecessors: dict[State, set[State]] = {s: set() for s in State}
    for edge in edges:
        successors[edge.src].add(edge.dst)
        predecessors[edge.dst].add(edge.src)
    reachable = _closure(initial, successors)
    unreachable = [s.value for s in State if s not in reachable]
    if unreachable:
        raise TableDefinitionError(f"states unreachable from {initial.value!r}: {unreachable}")
    can_finish = _closure(terminal, predecessors)
    trapped = [s.value for s in State if s not in can_finish]
    if trapped:
        raise TableDefinitionError(f"states that can never reach {terminal.value!r}: {trapped}")


def _closure(start: State, step: Mapping[State, set[State]]) -> set[State]:
    seen = {start}
    todo = deque([start])
    while todo:
        for nxt in step[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def build_machine(edges: EdgeTable, initial: State) -> Machine:
    """Build the table into a ``transitions`` machine (``model=None``, no auto transitions).

    Edges are added in a stable order so every rendering of the machine is deterministic.
    Guards become ``conditions`` naming methods of the model (``more_in_flight``,
    ``last_in_flight``); see [`reference_model()`][kvlife.fsm.table.reference_model].
    """
    return add_edges(
        Machine(
            model=None,
            states=[s.value for s in State],
            initial=initial.value,
            auto_transitions=False,
            send_event=False,
        ),
        edges,
    )


MachineT = TypeVar("MachineT", bound=Machine)


def add_edges(machine: MachineT, edges: Iterable[Edge]) -> MachineT:
    """Add ``edges`` to a ``transitions`` machine (any subclass: GraphMachine for the
    diagrams) in the stable order, guards as ``conditions``; return the machine."""
    for edge in sorted_edges(edges):
        machine.add_transition(
            edge.trigger.value,
            edge.src.value,
            edge.dst.value,
            conditions=[edge.guard.value] if edge.guard else None,
        )
    return machine


#: The guard each in-flight bucket (0, 1, 2 = two or more, before the trigger) passes.
_BUCKET_GUARDS: Final[tuple[frozenset[Guard | None], ...]] = (
    frozenset(),
    frozenset({None, Guard.LAST_IN_FLIGHT}),
    frozenset({None, Guard.MORE_IN_FLIGHT}),
)


def _compile(edges: Iterable[Edge]) -> dict[Trigger, Row]:
    """Compile checked ``edges`` into [`Row`][kvlife.fsm.table.Row]s: for each trigger,
    state and in-flight bucket, the edge that applies (a completion needs a copy in flight
    to complete; other triggers do not look at the count)."""
    found: dict[tuple[Trigger, State, int], int] = {}
    for edge in edges:
        dst = STATES.index(edge.dst)
        for bucket, passing in enumerate(_BUCKET_GUARDS):
            if edge.trigger not in COMPLETION_TRIGGERS or edge.guard in passing:
                found[(edge.trigger, edge.src, bucket)] = dst
    rows: dict[Trigger, Row] = {}
    for trigger in Trigger:
        rows[trigger] = tuple(
            (
                found.get((trigger, state, 0)),
                found.get((trigger, state, 1)),
                found.get((trigger, state, 2)),
            )
            for state in STATES
        )
    return rows


def build_lifecycle_table(
    edges: EdgeTable = LIFECYCLE_EDGES,
    initial: State = State.ALLOCATED,
    terminal: State = State.RELEASED,
) -> LifecycleTable:
    """Check ``edges``, build them into a ``transitions`` machine and compile it.

    Raises:
        TableDefinitionError: a definition check failed; nothing is built.
    """
    check_definition(edges, initial, terminal)
    machine = build_machine(edges, initial)
    return LifecycleTable(
        edges=edges,
        initial=initial,
        terminal=terminal,
        machine=machine,
        rows=_compile(edges),
        digest=table_digest(edges, initial, terminal),
    )


def reference_model(state: State = State.ALLOCATED, inflight: int = 0) -> _GuardModel:
    """A plain model for driving `LifecycleTable.machine` as a reference engine:
    ``table.machine.events[trigger].trigger(model)`` (the static-machine pattern)."""
    model = _GuardModel()
    model.state = state.value
    model.inflight = inflight
    return model


LIFECYCLE: Final[LifecycleTable] = build_lifecycle_table()
"""The table every registry uses, built and checked at import."""

"""Exhaustive small-scope check of OffloadManager and its registry.

Random tests sample interleavings; this one covers every small case. Scope: two request
objects, two rids, at most two copies per lifecycle, two copy streams, completions held
back and run (or failed) in any order, polls, finish/abort, and a stale re-delivery of
the newest delivered ticket. Every sequence of these operations up to ``DEPTH`` is run
on the real manager (breadth first, each distinct state expanded once) and compared
after every step with a plain model: the error raised (or none), every live lifecycle's
state, in-flight count and outcome, which lifecycles handed their device slots back, the
host pages in use, and the audit log's replay.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from kvlife.fsm import (
    DuplicateRegistrationError,
    InvalidTransitionError,
    LifecycleRegistry,
    MemorySink,
    RidConflictError,
    State,
    Ticket,
    UnknownRequestError,
    check_audit,
)
from kvlife.offload import KVLayout
from tests.builds import patches_compiled
from tests.engine import FakeEngine
from tests.strategies import Req

A, O, F, R = State.ALLOCATED, State.OFFLOADING, State.FINISHED_PENDING, State.RELEASED
# 9 is the largest depth that runs in CI within 60 s (about 30 s here); `make soak` runs 10.
DEPTH = int(os.environ.get("KVLIFE_EXHAUSTIVE_DEPTH", "9"))
LAYOUT = KVLayout("per_layer", layers=1, slots=256, heads=1, head_dim=1, dtype=torch.float32,
                  page_size=1)  # fmt: skip
OBJECTS = ("A", "B")
RIDS = ("r0", "r1")
MAX_COPIES = 2


# --- the plain model -----------------------------------------------------------------------


@dataclass(frozen=True)
class MInst:
    serial: int
    obj: str
    rid: str
    state: State = A
    inflight: int = 0
    outcome: str | None = None
    started: int = 0


@dataclass(frozen=True)
class MJob:
    serial: int
    stream: int
    launch: int  # launch number: copies of one lifecycle cover its tokens in this order
    ran: bool = False
    failed: bool = False


@dataclass(frozen=True)
class Model:
    insts: tuple[MInst, ...] = ()  # unreleased, oldest first
    current: tuple[tuple[str, int], ...] = ()  # object -> serial of its unreleased lifecycle
    jobs: tuple[MJob, ...] = ()  # launched and not delivered, launch order
    launches: int = 0
    next_serial: int = 0
    last_delivered: int | None = None  # serial of the newest delivered ticket's lifecycle
    released: frozenset[int] = frozenset()
    pages: int = 0  # host pages held: undelivered copies, acked copies, kept results
    acked: tuple[tuple[int, int, bool], ...] = ()  # (serial, launch, failed): resolved, live

    def inst(self, serial: int) -> MInst:
        return next(i for i in self.insts if i.serial == serial)

    def of(self, obj: str) -> MInst | None:
        serial = dict(self.current).get(obj)
        return None if serial is None else self.inst(serial)

    def key(self) -> str:
        """The state up to renaming serials and swapping the two objects or the two rids
        (symmetric by construction): what decides every future step."""
        return min(
            repr(self._key(objects, rids))
            for objects in (OBJECTS, OBJECTS[::-1])
            for rids in (RIDS, RIDS[::-1])
        )

    def _key(self, objects: tuple[str, ...], rids: tuple[str, ...]) -> tuple[object, ...]:
        obj = dict(zip(OBJECTS, objects, strict=True))
        rid = dict(zip(RIDS, rids, strict=True))
        index = {inst.serial: n for n, inst in enumerate(self.insts)}
        last = self.last_delivered
        return (
            tuple(
                (obj[i.obj], rid[i.rid], i.state.value, i.inflight, i.outcome, i.started)
                for i in self.insts
            ),
            tuple(sorted((obj[o], index[s]) for o, s in self.current)),
            tuple((index[j.serial], j.stream, j.ran, j.failed) for j in self.jobs),
            self.launches % 2,  # the next copy's stream
            None if last is None else index.get(last, "released"),
            tuple(sorted((index[s], launch, failed) for s, launch, failed in self.acked)),
        )


def _set(model: Model, inst: MInst) -> Model:
    return replace(model, insts=tuple(inst if i.serial == inst.serial else i for i in model.insts))


def _release(model: Model, inst: MInst) -> Model:
    resolved = [failed for s, _, failed in sorted(model.acked) if s == inst.serial]
    kept = 0
    if inst.outcome == "finished":  # the prefix of copies before the first failed one
        for failed in resolved:
            if failed:
                break
            kept += 1
    freed = sum(1 for failed in resolved if not failed) - kept
    return replace(
        model,
        insts=tuple(i for i in model.insts if i.serial != inst.serial),
        current=tuple((o, s) for o, s in model.current if s != inst.serial),
        released=model.released | {inst.serial},
        acked=tuple(a for a in model.acked if a[0] != inst.serial),
        pages=model.pages - freed,
    )


Expected = tuple[type[BaseException] | None, Model]


def m_admit(model: Model, obj: str, rid: str) -> Expected:
    mine = model.of(obj)
    if mine is not None and mine.state in (A, O):
        return DuplicateRegistrationError, model
    holders = [i for i in model.insts if i.rid == rid]
    if holders and holders[-1].state in (A, O):
        return RidConflictError, model
    inst = MInst(model.next_serial, obj, rid)
    current = (*((o, s) for o, s in model.current if o != obj), (obj, inst.serial))
    return None, replace(
        model, insts=(*model.insts, inst), current=current, next_serial=inst.serial + 1
    )


def m_step(model: Model, obj: str) -> Expected:
    inst = model.of(obj)
    if inst is None:
        return UnknownRequestError, model
    if inst.outcome is not None:
        return InvalidTransitionError, model
    job = MJob(inst.serial, model.launches % 2, model.launches)
    inst = replace(inst, state=O, inflight=inst.inflight + 1, started=inst.started + 1)
    model = _set(model, inst)
    return None, replace(
        model, jobs=(*model.jobs, job), launches=model.launches + 1, pages=model.pages + 1
    )


def m_end(model: Model, obj: str, outcome: str) -> Expected:
    inst = model.of(obj)
    if inst is None:
        return UnknownRequestError, model
    if inst.outcome is not None:
        return InvalidTransitionError, model
    if inst.inflight == 0:
        return None, _release(model, replace(inst, state=R, outcome=outcome))
    return None, _set(model, replace(inst, state=F, outcome=outcome))


def m_run(model: Model, n: int, fail: bool) -> Expected:
    jobs = list(model.jobs)
    jobs[n] = replace(jobs[n], ran=True, failed=fail)
    return None, replace(model, jobs=tuple(jobs))


def m_poll(model: Model) -> Expected:
    for stream in (0, 1):
        while True:
            head = next((j for j in model.jobs if j.stream == stream), None)
            if head is None or not head.ran:
                break
            jobs = list(model.jobs)
            jobs.remove(head)
            inst = model.inst(head.serial)
            pages = model.pages - (1 if head.failed else 0)
            model = replace(
                model,
                jobs=tuple(jobs),
                last_delivered=head.serial,
                pages=pages,
                acked=(*model.acked, (head.serial, head.launch, head.failed)),
            )
            last = inst.inflight == 1
            if last and inst.state is F:
                model = _release(model, replace(inst, state=R, inflight=0))
            else:
                state = A if last else inst.state
                model = _set(model, replace(inst, state=state, inflight=inst.inflight - 1))
    return None, model


# --- the real system, driven by a path of operations ----------------------------------------


Op = tuple[Any, ...]


@dataclass
class System:
    engine: FakeEngine
    sink: MemorySink
    objects: dict[str, Req]
    real_deliver: Any = None
    tickets: list[Ticket] = field(default_factory=list)  # launch order
    delivered: list[Ticket] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # launch indexes not yet delivered

    @classmethod
    def new(cls) -> System:
        sink = MemorySink()
        engine = FakeEngine(
            LAYOUT, host_pages=64, streams=2, defer=True, stride_pages=1,
            registry=LifecycleRegistry(sinks=[sink]),
        )  # fmt: skip
        system = cls(engine, sink, {name: Req("unset") for name in OBJECTS})
        real = system.real_deliver = engine.manager.registry.deliver

        def deliver(ticket: Ticket, ok: bool = True, **detail: Any) -> Any:
            system.delivered.append(ticket)
            system.pending.remove(system.tickets.index(ticket))
            return real(ticket, ok, **detail)

        engine.manager.registry.deliver = deliver  # type: ignore[method-assign]
        return system

    def apply(self, op: Op) -> type[BaseException] | None:
        manager = self.engine.manager
        try:
            kind = op[0]
            if kind == "admit":  # the same object each time: re-admission is in scope
                req = self.objects[op[1]]
                req.rid = op[2]
                self.engine.admit(req)
            elif kind == "step":
                req = self.objects[op[1]]
                if req in manager.registry and manager.registry.lifecycle(req).outcome is None:
                    self.engine.decode(req, 1)
                ticket = manager.step(req)
                assert ticket is not None
                self.tickets.append(ticket)
                self.pending.append(len(self.tickets) - 1)
            elif kind in ("finish", "abort"):
                getattr(manager, kind)(self.objects[op[1]])
            elif kind in ("run", "fail"):
                job = self.engine.jobs[self.pending[op[1]]][0]
                if kind == "fail":
                    job._run = _raise  # type: ignore[attr-defined]
                job.run()
            elif kind == "poll":
                manager.poll()
            elif kind == "redeliver":
                reason = self.real_deliver(self.delivered[-1])
                assert reason in ("stale_instance", "duplicate_ack"), reason
            else:  # pragma: no cover - a typo in the op list
                raise AssertionError(op)
        except (InvalidTransitionError, UnknownRequestError, RidConflictError) as exc:
            return type(exc)
        except DuplicateRegistrationError:
            return DuplicateRegistrationError
        return None


def _raise() -> None:
    raise OSError("injected copy failure")


def _ops(model: Model) -> list[tuple[Op, Callable[[Model], Expected]]]:
    ops: list[tuple[Op, Callable[[Model], Expected]]] = []
    for obj in OBJECTS:
        for rid in RIDS:
            ops.append((("admit", obj, rid), lambda m, o=obj, r=rid: m_admit(m, o, r)))
        inst = model.of(obj)
        if inst is None or inst.started < MAX_COPIES:
            ops.append((("step", obj), lambda m, o=obj: m_step(m, o)))
        ops.append((("finish", obj), lambda m, o=obj: m_end(m, o, "finished")))
        ops.append((("abort", obj), lambda m, o=obj: m_end(m, o, "aborted")))
    for n, job in enumerate(model.jobs):
        if not job.ran:
            ops.append((("run", n), lambda m, n=n: m_run(m, n, False)))
            ops.append((("fail", n), lambda m, n=n: m_run(m, n, True)))
    if any(j.ran for j in model.jobs):
        ops.append((("poll",), m_poll))
    if model.last_delivered is not None:
        ops.append((("redeliver",), lambda m: (None, m)))
    return ops


def _compare(system: System, model: Model, path: list[Op]) -> None:
    registry = system.engine.manager.registry
    got = [(lc.serial, lc.state, lc.inflight, lc.outcome) for lc in registry.lifecycles()]
    want = [(i.serial, i.state, i.inflight, i.outcome) for i in model.insts]
    assert got == want, path
    assert set(system.engine.released_serials) == model.released, path
    assert len(system.engine.released_serials) == len(model.released), path  # once each
    assert system.engine.host.in_use == model.pages, path
    assert system.engine.manager.inflight == len(model.jobs), path


def explore(depth: int) -> tuple[int, int, float]:
    """Breadth first over every operation sequence up to ``depth``; each distinct model
    state is expanded once. Returns (distinct states, steps run, seconds)."""
    t0 = time.perf_counter()
    seen = {Model().key()}
    frontier: list[tuple[list[Op], Model]] = [([], Model())]
    steps = 0
    for _ in range(depth):
        following: list[tuple[list[Op], Model]] = []
        for path, model in frontier:
            for op, expect in _ops(model):
                system = System.new()
                for earlier in path:
                    system.apply(earlier)
                error, after = expect(model)
                try:
                    got = system.apply(op)
                except AssertionError as exc:
                    raise AssertionError(f"{[*path, op]}: {exc}") from exc
                steps += 1
                assert got is error, ([*path, op], got, error)
                _compare(system, after, [*path, op])
                key = after.key()
                if key in seen:
                    continue
                seen.add(key)
                report = check_audit(system.sink.records())
                assert report.ok, ([*path, op], report.violations[:2])
                following.append(([*path, op], after))
        frontier = following
    return len(seen), steps, time.perf_counter() - t0


@patches_compiled  # System.new wraps the registry's deliver
def test_every_interleaving_up_to_the_depth_matches_the_model() -> None:
    states, steps, seconds = explore(DEPTH)
    print(f"\nexhaustive: depth {DEPTH}, {states} distinct states, {steps} steps, {seconds:.1f} s")
    assert states > 1000 if DEPTH >= 8 else states > 10


@patches_compiled
def test_a_planted_bug_is_caught_within_a_few_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its refusal pre-check the manager launches a copy for a finished request
    before the registry refuses it: the copy's host page leaks. The search finds it."""
    monkeypatch.setattr(LifecycleRegistry, "require", lambda self, lc, trigger: None)
    with pytest.raises(AssertionError) as info:
        explore(4)
    message = str(info.value)
    assert "'step'" in message and ("'finish'" in message or "'abort'" in message), message

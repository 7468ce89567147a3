"""Reliability across modules: bad input, completions from other threads, a writer killed
mid-log, and a flood of stale deliveries."""

from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlife.fsm import (
    DuplicateAckError,
    DuplicateRegistrationError,
    LifecycleRegistry,
    MemorySink,
    RidConflictError,
    UnknownRequestError,
    check_audit,
    read_audit,
)
from kvlife.fsm.audit import AuditFormatError, JsonLinesSink
from kvlife.fsm.errors import InvalidTransitionError
from kvlife.offload import (
    CompletionQueue,
    CopyEngine,
    DoubleFreeError,
    ForeignPageError,
    HostPagePool,
    HostPages,
    KVLayout,
    LayoutError,
    ReportCountError,
)
from tests.builds import refused
from tests.crash import kill_midway
from tests.engine import FakeEngine
from tests.strategies import Req

SMALL = KVLayout("per_layer", layers=2, slots=512, heads=2, head_dim=4, dtype=torch.float32,
                 page_size=4)  # fmt: skip


# --- bad input: a typed error and nothing changed --------------------------------------


@dataclass
class World:
    """A small system with something in every state, and a way to fingerprint it."""

    engine: FakeEngine
    sink: MemorySink
    other: LifecycleRegistry
    running: Req
    pending: Req
    used_ticket: Any
    foreign_ticket: Any
    foreign_pages: HostPages
    spare_one: HostPages
    spare_two: HostPages
    live_ticket: Any

    @property
    def registry(self) -> LifecycleRegistry:
        return self.engine.manager.registry

    def fingerprint(self) -> tuple[Any, ...]:
        reg = self.registry
        stats = reg.statistics()
        planner = self.engine.manager.planner
        reports = [
            (op, planner.order(op).reported, planner.order(op).failed) for op in planner.ops()
        ]
        return (
            tuple(reports),
            len(reg),
            stats.registered,
            stats.released,
            stats.transitions,
            stats.inflight,
            dict(stats.live),
            tuple((lc.serial, lc.state, lc.inflight, lc.outcome) for lc in reg.lifecycles()),
            self.engine.host.available,
            tuple(self.engine.host.is_allocated(i) for i in range(self.engine.host.capacity)),
            self.engine.manager.stats,
            self.engine.manager.inflight,
            len(self.engine.free_slots),
        )


def _world() -> World:
    sink = MemorySink()
    engine = FakeEngine(SMALL, defer=True, stride_pages=1, host_pages=32,
                        registry=LifecycleRegistry(sinks=[sink]))  # fmt: skip
    running, pending = Req("running"), Req("pending")
    for req in (running, pending):
        engine.admit(req)
        engine.decode(req, 4)
    used_ticket = engine.manager.step(running)
    engine.run_all()
    engine.manager.poll()  # delivered: the ticket is used up
    engine.decode(running, 4)
    live_ticket = engine.manager.step(running)  # a copy in flight
    engine.manager.step(pending)
    engine.manager.finish(pending)  # finished_pending
    other = LifecycleRegistry()
    foreign_ticket = other.start_offload(other.register(Req("elsewhere")))
    foreign_pool = HostPagePool(SMALL, 2, pin_memory=False)
    foreign_pages = foreign_pool.alloc(1)
    spare_one, spare_two = engine.host.alloc(1), engine.host.alloc(2)
    assert foreign_pages is not None and spare_one is not None and spare_two is not None
    return World(engine, sink, other, running, pending, used_ticket, foreign_ticket,
                 foreign_pages, spare_one, spare_two, live_ticket)  # fmt: skip


def _bad_audit_file(tmp: Path, text: str) -> Callable[[World], object]:
    def call(w: World) -> object:
        path = tmp / "bad.jsonl"
        path.write_text(text)
        return read_audit(path, strict=True)

    return call


BAD_INPUTS: list[tuple[str, Callable[[World], object], type[BaseException]]] = [
    ("unregistered request", lambda w: w.registry.start_offload(Req("never")), UnknownRequestError),
    ("unregistered request finish", lambda w: w.registry.finish(object()), UnknownRequestError),
    ("another registry's ticket", lambda w: w.registry.complete(w.foreign_ticket), UnknownRequestError),
    ("another registry's lifecycle", lambda w: w.registry.abort(w.foreign_ticket.lifecycle), UnknownRequestError),
    ("a ticket delivered twice", lambda w: w.registry.complete(w.used_ticket), DuplicateAckError),
    ("not a ticket", lambda w: w.registry.complete("ticket"), TypeError),
    ("non-str rid", lambda w: w.registry.register(object(), rid=42), TypeError),
    ("bytes rid", lambda w: w.registry.register(object(), rid=b"r"), TypeError),
    ("no rid at all", lambda w: w.registry.register(object()), TypeError),
    ("ok that is not a bool", lambda w: w.registry.complete(w.live_ticket, ok="no"), TypeError),
    ("ok that is not a bool, pump", lambda w: w.registry.deliver(w.live_ticket, ok=0), TypeError),
    ("None as a request", lambda w: w.registry.register(None, rid="x"), TypeError),
    ("rid held by a running request", lambda w: w.registry.register(Req("running")), RidConflictError),
    ("same object twice", lambda w: w.registry.register(w.running), DuplicateRegistrationError),
    ("offload after finish", lambda w: w.engine.manager.step(w.pending), InvalidTransitionError),
    ("finish twice", lambda w: w.engine.manager.finish(w.pending), InvalidTransitionError),
    ("non-scalar audit detail", lambda w: w.registry.start_offload(w.running, req=w.running), TypeError),
    ("zero stride", lambda w: type(w.engine.manager)(w.engine, w.engine.copier, stride_pages=0), ValueError),
    ("negative page count", lambda w: w.engine.host.alloc(-1), ValueError),
    ("fractional page count", lambda w: w.engine.host.alloc(1.5), ValueError),
    ("a host page from another pool", lambda w: w.engine.host.free(w.foreign_pages), ForeignPageError),
    ("a host page index out of range", lambda w: w.engine.host.pages((999,)), ForeignPageError),
    ("a host page freed twice", lambda w: w.engine.host.free(w.engine.host.pages((31,))), DoubleFreeError),
    ("slot indices out of range", lambda w: w.engine.copier.launch([0, 1, 2, 9999], w.spare_one), ValueError),
    ("negative slot index", lambda w: w.engine.copier.launch([-1, 0, 1, 2], w.spare_one), ValueError),
    ("length not filling its pages", lambda w: w.engine.copier.launch([0, 1], w.spare_two), ValueError),
    ("pages of another pool for a copy", lambda w: w.engine.copier.launch([0, 1, 2, 3], w.foreign_pages), ValueError),
    ("layout with negative layers", lambda w: KVLayout("per_layer", -1, 8, 1, 1, torch.float32), LayoutError),
    ("KV tensors of the wrong dtype", lambda w: SMALL.component_views([t.double() for t in SMALL.allocate()]), LayoutError),
    ("a report from no worker", lambda w: w.engine.manager.planner.report(w.live_ticket.op, True, 0), ReportCountError),
    ("a negative count of workers", lambda w: w.engine.manager.planner.report(w.live_ticket.op, False, -1), ReportCountError),
    ("completion queue with no streams", lambda w: CompletionQueue(streams=0), ValueError),
    ("copy engine for another layout", lambda w: CopyEngine(KVLayout.mla(1, 8, 4, torch.float32), [torch.zeros(8, 4)], w.engine.host), ValueError),
]  # fmt: skip


def _audit_bad_inputs(
    tmp: Path,
) -> list[tuple[str, Callable[[World], object], type[BaseException]]]:
    good = json.dumps({"seq": 0, "t_ns": 1, "rid": "a", "serial": 0, "trigger": "register",
                       "src": None, "dst": "allocated", "ok": True, "reason": None, "op": None,
                       "inflight": 0, "detail": {}})  # fmt: skip
    header = json.dumps({"kvlife_audit": 1})
    return [
        ("garbage audit file", _bad_audit_file(tmp, "\x00\x01garbage\n"), AuditFormatError),
        ("wrong-schema audit record", _bad_audit_file(tmp, f'{header}\n{{"seq": 0}}\n'), AuditFormatError),
        ("audit file of a future schema", _bad_audit_file(tmp, '{"kvlife_audit": 9}\n'), AuditFormatError),
        ("record before any header", _bad_audit_file(tmp, good + "\n"), AuditFormatError),
    ]  # fmt: skip


def test_there_are_at_least_twenty_bad_inputs(tmp_path: Path) -> None:
    assert len(BAD_INPUTS) + len(_audit_bad_inputs(tmp_path)) >= 20


@pytest.mark.parametrize(("name", "call", "error"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_typed_error_and_changes_nothing(
    name: str, call: Callable[[World], object], error: type[BaseException]
) -> None:
    w = _world()
    before = w.fingerprint()
    host_bytes = w.engine.host.tensor.clone()
    with refused(error):
        call(w)
    assert w.fingerprint() == before
    assert torch.equal(w.engine.host.tensor.nan_to_num(), host_bytes.nan_to_num())
    assert check_audit(w.sink.records()).ok


def test_bad_audit_files_raise_typed_errors(tmp_path: Path) -> None:
    w = _world()
    for _, call, error in _audit_bad_inputs(tmp_path):
        with pytest.raises(error):
            call(w)


# --- completions from other threads ----------------------------------------------------


def test_completions_from_eight_threads_are_applied_once_each() -> None:
    """The host-callback mode's shape: copies finish on 8 worker threads (which only mark
    them done) while the scheduler thread offloads and polls; 80,000 copies."""
    total, workers = 80_000, 8
    layout = KVLayout("per_layer", layers=1, slots=64, heads=1, head_dim=2, dtype=torch.float32,
                      page_size=1)  # fmt: skip
    sink = MemorySink(capacity=1 << 20)
    registry = LifecycleRegistry(sinks=[sink])
    host = HostPagePool(layout, 4096, pin_memory=False)
    copier = CopyEngine(layout, layout.allocate(), host, streams=workers, defer=True)
    queue = CompletionQueue(streams=workers)
    work: list[list[Any]] = [[] for _ in range(workers)]
    locks = [threading.Lock() for _ in range(workers)]
    done = threading.Event()
    acked: list[int] = []

    def worker(i: int) -> None:
        while not done.is_set() or work[i]:
            with locks[i]:
                batch, work[i] = work[i], []
            for job in batch:
                job.run()  # the copy, then "done": all a host callback may do
            if not batch:
                time.sleep(0.0002)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    reqs = [Req(f"r{i}") for i in range(64)]
    for req in reqs:
        registry.register(req)
    launched = 0
    try:
        while launched < total or len(queue):
            for _ in range(min(256, total - launched)):
                req = reqs[launched % len(reqs)]
                pages = host.alloc(1)
                if pages is None:
                    break
                job = copier.launch([launched % 64], pages)
                ticket = registry.start_offload(req)

                def complete(job: Any, ticket: Any = ticket) -> None:
                    host.free(job.pages)
                    assert registry.deliver(ticket, ok=job.error is None) is None
                    acked.append(ticket.op)

                queue.push(job, complete)
                with locks[job.stream]:
                    work[job.stream].append(job)
                launched += 1
            queue.poll()
    finally:
        done.set()
        for t in threads:
            t.join()
    queue.poll()
    assert len(acked) == total and len(set(acked)) == total
    assert registry.statistics().refusals == dict.fromkeys(registry.statistics().refusals, 0)
    assert all(lc.inflight == 0 for lc in registry.lifecycles())
    records = sink.records()
    assert [r.seq for r in records] == list(range(len(records)))
    assert check_audit(records).ok and host.available == host.capacity


# --- a writer killed mid-log -------------------------------------------------------------


def _writer(path: Path, report_fd: int) -> None:  # pragma: no cover - runs in the child
    sink = JsonLinesSink(path, fsync="record")
    registry = LifecycleRegistry(sinks=[sink])
    i = 0
    while True:
        req = Req(f'crash-{i}\n"\u2028')
        lc = registry.register(req)
        os.write(report_fd, f"{lc.serial}\n".encode())  # its record's write call returned
        registry.finish(req)
        os.write(report_fd, f"{lc.serial}.\n".encode())
        i += 1


def test_sigkill_at_200_points_loses_no_returned_record(tmp_path: Path) -> None:
    rng = random.Random(11)
    torn_seen = appended = 0
    for point in range(200):
        path = tmp_path / f"crash-{point % 4}.jsonl"  # reopened for append after a crash
        before = len(read_audit(path).records) if path.exists() else 0
        returned = kill_midway(
            lambda fd, path=path: _writer(path, fd), rng.randint(1, 40), rng.random() * 0.002
        )  # lines the child finished reporting
        log = read_audit(path)
        assert not log.problems, log.problems
        torn_seen += log.torn_tail > 0
        segment = log.segments[-1].records
        assert len(log.records) >= before
        # every record whose write call returned is there, in order
        assert len(segment) >= len(returned)
        for line, record in zip(returned, segment, strict=False):
            serial = int(line.rstrip("."))
            assert record.serial == serial
            assert record.trigger == ("finish" if line.endswith(".") else "register")
        assert check_audit(log).ok
        appended += 1
    assert appended == 200
    print(f"\ncrash: 200 SIGKILLs, {torn_seen} left a torn last record, none lost a returned one")
    for i in range(4):  # reopening trims any torn tail before appending
        path = tmp_path / f"crash-{i}.jsonl"
        JsonLinesSink(path).close()
        log = read_audit(path)
        assert log.torn_tail == 0 and not log.problems


# --- a flood of stale and duplicate deliveries ---------------------------------------------


def test_a_million_stale_or_duplicate_deliveries_touch_nothing_and_retain_no_memory() -> None:
    ring = MemorySink(capacity=2048)  # every refusal is audited; the ring keeps the newest
    registry = LifecycleRegistry(sinks=[ring])
    live = [Req(f"live-{i}") for i in range(4)]
    live_tickets = [registry.start_offload(registry.register(r)) for r in live]
    snapshot = [(t.lifecycle.state, t.lifecycle.inflight) for t in live_tickets]
    stale = []
    for i in range(64):
        req = Req(f"gone-{i}")
        t = registry.start_offload(registry.register(req))
        registry.finish(req)
        registry.complete(t)
        stale.append(t)
    dup_req = Req("dup")
    dup = registry.start_offload(registry.register(dup_req))
    registry.start_offload(dup_req)  # keeps the lifecycle offloading
    registry.complete(dup)
    tickets = [*stale, dup]
    deliver = registry.deliver
    for t in tickets * 40:  # warm-up: the ring fills to capacity
        deliver(t)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        n = len(tickets)
        for i in range(1_000_000):
            deliver(tickets[i % n])
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    refusals = registry.statistics().refusals
    assert refusals["stale_instance"] + refusals["duplicate_ack"] == 1_000_000 + len(tickets) * 40
    assert [(t.lifecycle.state, t.lifecycle.inflight) for t in live_tickets] == snapshot
    print(f"\nflood: 1,000,000 refused deliveries, all audited (ring of 2048), "
          f"{grown / 1024:.1f} KiB retained")  # fmt: skip
    assert grown < 1 << 20, grown
    assert len(ring) == 2048 and ring.records()[-1].ok is False

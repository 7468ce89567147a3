"""OverdueWatch: a ticket open longer than its limit is written down once, while it is
open, and the checker and ``why`` tell whether it completed later."""

from __future__ import annotations

import gc
import threading

import pytest

from kvlife.fsm import LifecycleRegistry, MemorySink, OverdueWatch, WrongThreadError
from kvlife.fsm.audit.checker import check_audit
from kvlife.fsm.audit.explain import read_story, tell
from tests.builds import COMPILED, refused


class Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watched(
    limit: float | None = 10.0,
) -> tuple[LifecycleRegistry, MemorySink, OverdueWatch, Clock]:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    clock = Clock()
    return registry, sink, OverdueWatch(registry, limit, clock=clock), clock


def _overdue(sink: MemorySink) -> list[object]:
    return [r for r in sink.records() if r.reason == "overdue"]


def test_a_ticket_open_past_its_limit_is_written_once_with_rid_kind_and_age() -> None:
    registry, sink, watch, clock = _watched()
    req = Req("a")
    registry.register(req)
    ticket = registry.start_offload(req)
    watch.opened(ticket, "delayed_free")
    clock.now += 9.9
    assert watch.check() == 0 and not _overdue(sink)
    clock.now += 0.2
    assert watch.check() == 1
    (record,) = _overdue(sink)
    assert (record.rid, record.serial, record.op) == ("a", 0, ticket.op)
    assert record.detail == {"kind": "delayed_free", "age_s": 10.1, "limit_s": 10.0}
    assert record.ok is False and record.src == "offloading"
    clock.now += 100
    assert watch.check() == 0 and len(_overdue(sink)) == 1  # once
    assert watch.overdue_total == 1 and watch.open_overdue() == 1
    assert watch.oldest_age() == pytest.approx(110.1)
    registry.complete(ticket)
    assert watch.open_overdue() == 0 and watch.oldest_age() == 0.0
    assert registry.lifecycle(req).state.value == "allocated"  # the record changed nothing


def test_a_ticket_completed_in_time_is_never_written() -> None:
    registry, sink, watch, clock = _watched()
    req = Req("a")
    registry.register(req)
    for _ in range(3):
        ticket = registry.start_offload(req)
        watch.opened(ticket, "store")
        clock.now += 4
        registry.complete(ticket)
    clock.now += 60
    assert watch.check() == 0 and not _overdue(sink) and len(watch) == 0


def test_the_oldest_open_ticket_age_skips_completed_ones() -> None:
    registry, _, watch, clock = _watched(limit=1000)
    req = Req("a")
    registry.register(req)
    first = registry.start_offload(req)
    watch.opened(first, "store")
    clock.now += 5
    second = registry.start_offload(req)
    watch.opened(second, "store")
    clock.now += 1
    assert watch.oldest_age() == pytest.approx(6)
    registry.complete(first)
    assert watch.oldest_age() == pytest.approx(1)


def test_a_limit_of_none_or_zero_watches_nothing_and_a_bad_limit_is_refused() -> None:
    for limit in (None, 0):
        registry, _, watch, clock = _watched(limit)
        req = Req("a")
        registry.register(req)
        watch.opened(registry.start_offload(req), "store")
        clock.now += 10_000
        assert watch.check() == 0 and len(watch) == 0
    nan = float("nan")  # before: accepted, and no ticket was ever overdue
    for bad in (-1, "10", nan) if COMPILED else (-1, "10", nan, True):  # compiled, True is 1.0
        with refused(ValueError, match="limit_s"):
            OverdueWatch(LifecycleRegistry(), bad)  # type: ignore[arg-type]


def test_the_queue_is_compacted_as_tickets_complete() -> None:
    registry, _, watch, clock = _watched(limit=1e9)
    req = Req("a")
    registry.register(req)
    for _ in range(20_000):
        ticket = registry.start_offload(req)
        watch.opened(ticket, "store")
        registry.complete(ticket)
    assert len(watch) <= 257  # not 20,000: completed tickets do not pile up
    clock.now += 1
    assert watch.oldest_age() == 0.0


def test_a_ticket_open_for_long_keeps_no_completed_one_behind_it_past_the_floor() -> None:
    registry, _, watch, clock = _watched(limit=1e9)
    req = Req("a")
    registry.register(req)
    stuck = registry.start_offload(req)  # a delayed free a decode server never reads
    watch.opened(stuck, "delayed_free")
    for _ in range(5_000):
        ticket = registry.start_offload(req)
        watch.opened(ticket, "store")
        registry.complete(ticket)
        assert watch.check() == 0
        assert len(watch) <= 257  # compacted around the ticket that stays open
    clock.now += 3
    assert watch.oldest_age() == pytest.approx(3.0)


def test_completed_tickets_leave_at_the_next_check_with_their_lifecycles() -> None:
    """A ticket kept until its deadline (two minutes by default) kept its lifecycle alive:
    objects that outlive many steps make a scheduler's young collections come often."""
    registry, _, watch, clock = _watched(limit=60.0)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(200):
        req = Req(f"r{i}")
        registry.register(req)
        ticket = registry.start_offload(req)
        watch.opened(ticket, "store")
        registry.finish(req)
        registry.complete(ticket)  # released
        del req, ticket
    assert len(watch) == 200  # dropped at the next check, not as they complete
    clock.now += 1
    assert watch.check() == 0 and len(watch) == 0
    gc.collect()
    assert len(gc.get_objects()) - before < 20  # not 400: tickets and lifecycles are gone


def test_watching_a_ticket_adds_no_object_the_garbage_collector_tracks() -> None:
    """A serving engine's scheduler opens a ticket per copy: a tracked object per watched
    ticket, kept until its deadline, made its young collections come more often."""
    registry, _, watch, clock = _watched(limit=60.0)
    req = Req("a")
    registry.register(req)
    tickets = [registry.start_offload(req) for _ in range(1000)]
    gc.collect()
    before = len(gc.get_objects())
    for ticket in tickets:
        watch.opened(ticket, "store")
    assert len(gc.get_objects()) - before < 10  # not one per ticket
    assert len(watch) == 1000
    for ticket in tickets[:500]:
        registry.complete(ticket)
    clock.now += 61
    assert watch.check() == 500  # the open ones, once each, oldest first
    assert len(watch) == 500 and watch.open_overdue() == 500
    assert watch.oldest_age() == pytest.approx(61.0)


def test_check_from_another_thread_writes_nothing() -> None:
    registry, sink, watch, clock = _watched()
    req = Req("a")
    registry.register(req)
    watch.opened(registry.start_offload(req), "load")
    clock.now += 11
    raised: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(watch.check, raised))
    thread.start()
    thread.join()
    assert isinstance(raised[0], WrongThreadError) and not _overdue(sink)
    assert watch.check() == 1  # still due on the owner thread


def _catch(call: object, into: list[BaseException]) -> None:
    try:
        call()  # type: ignore[operator]
    except BaseException as exc:  # handed to the test thread
        into.append(exc)


def test_the_checker_counts_an_overdue_ticket_that_completed_later_as_no_violation() -> None:
    registry, sink, watch, clock = _watched()
    late, stuck = Req("late"), Req("stuck")
    for req in (late, stuck):
        registry.register(req)
    t_late = registry.start_offload(late)
    watch.opened(t_late, "load")
    watch.opened(registry.start_offload(stuck), "delayed_free")
    registry.finish(stuck)
    clock.now += 30
    assert watch.check() == 2
    registry.complete(t_late)
    report = check_audit(sink.records())
    assert (report.overdue, report.overdue_completed) == (2, 1)
    (violation,) = report.violations
    assert violation.kind == "overdue" and violation.rid == "stuck"
    assert "never completed" in violation.message and "delayed_free" in violation.message
    strict = check_audit(sink.records(), overdue_fails=True)
    assert sorted(v.rid or "" for v in strict.violations) == ["late", "stuck"]


def test_why_tells_an_overdue_ticket_and_whether_it_completed() -> None:
    registry, sink, watch, clock = _watched()
    req = Req("a")
    registry.register(req)
    ticket = registry.start_offload(req, kind="delayed_free")
    watch.opened(ticket, "delayed_free")
    clock.now += 12
    watch.check()
    text = tell(*read_story(sink.records(), "a"))
    assert "OVERDUE delayed free 0: the delayed_free ticket" in text
    assert "never completed in the log" in text
    registry.complete(ticket)
    text = tell(*read_story(sink.records(), "a"))
    assert "it completed later" in text and "longer than the 10.0 s limit" in text

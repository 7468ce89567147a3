"""The scheduler half on its own: orders, reports from several workers, refusals that
change nothing, stores that never copy a held block, and a page account that always sums
to the capacity."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlife.fsm import InvalidTransitionError, Lifecycle, LifecycleRegistry, MemorySink, State
from kvlife.fsm.audit import TICKET_DETAIL
from kvlife.offload.planner import (
    LoadOrder,
    OffloadPlanner,
    PageAccount,
    ReportCountError,
    StoreOrder,
    UnknownOrderError,
)
from tests.strategies import raised_in_thread


class Req:
    """A request object: the planner knows it by identity, never by its id."""

    def __init__(self, rid: str) -> None:
        self.rid = rid


def _hashes(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def _admitted(planner: OffloadPlanner, rid: str, blocks: int, first_slot: int = 0) -> Lifecycle:
    req = Req(rid)
    lc = planner.admit(req, rid)
    planner.add_slots(lc, range(first_slot, first_slot + blocks))
    return lc


def _done(planner: OffloadPlanner, orders: list[StoreOrder], ok: bool = True) -> None:
    for order in orders:
        assert planner.report(order.op, ok) is True


def test_the_scheduler_half_imports_no_torch() -> None:
    code = "import sys, kvlife.offload.planner; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_store_orders_the_full_blocks_and_its_pages_join_the_cache_when_reported() -> None:
    planner = OffloadPlanner(8)
    lc = _admitted(planner, "a", 4, first_slot=10)
    (order,) = planner.store(lc, 3, _hashes("p", 4))
    assert (order.slots, order.pages, order.first) == ((10, 11, 12), (0, 1, 2), 0)
    assert planner.account() == PageAccount(capacity=8, free=5, cached=0, pinned=0, storing=3)
    assert planner.store(lc, 3, _hashes("p", 4)) == []  # nothing new is full
    _done(planner, [order])
    assert planner.account() == PageAccount(capacity=8, free=5, cached=3, pinned=0, storing=0)
    assert planner.counters()["stores"] == 1 and planner.counters()["stored_blocks"] == 3


def test_a_store_never_copies_a_block_the_host_cache_holds() -> None:
    planner = OffloadPlanner(16)
    p, q = _hashes("p", 3), _hashes("q", 2)
    first = _admitted(planner, "P", 3)
    _done(planner, planner.store(first, 3, p))
    second = _admitted(planner, "PQ", 5, first_slot=3)
    (order,) = planner.store(second, 5, p + q)  # P is held: only Q is copied
    assert (order.first, order.slots) == (3, (6, 7))
    _done(planner, [order])
    third = _admitted(planner, "PQ again", 5, first_slot=8)
    assert planner.store(third, 5, p + q) == []  # everything is held
    counts = planner.counters()
    assert counts["stored_blocks"] == 5 and counts["held_blocks"] == 3 + 5
    assert planner.account().cached == 5


def test_two_requests_storing_one_prefix_at_once_copy_it_once() -> None:
    planner = OffloadPlanner(16)
    a, b = _admitted(planner, "a", 4), _admitted(planner, "b", 4, first_slot=4)
    (order,) = planner.store(a, 4, _hashes("p", 4))
    assert planner.store(b, 4, _hashes("p", 4)) == []  # a is copying every block of it
    assert planner.account().storing == 4
    _done(planner, [order])
    assert planner.account().cached == 4 and planner.counters()["held_blocks"] == 4


def test_a_block_stored_by_another_order_is_skipped_in_the_middle_of_a_run() -> None:
    planner = OffloadPlanner(16)
    a = _admitted(planner, "a", 1, first_slot=1)
    (mid,) = planner.store(a, 1, ["h1"])
    b = _admitted(planner, "b", 3, first_slot=10)
    orders = planner.store(b, 3, ["h0", "h1", "h2"])  # h1 is being stored by a
    assert [(o.first, o.slots) for o in orders] == [(0, (10,)), (2, (12,))]
    _done(planner, [mid, *orders])
    assert planner.account().cached == 3


def test_a_held_block_needed_again_is_the_most_recently_used() -> None:
    planner = OffloadPlanner(3)
    a = _admitted(planner, "a", 3)
    _done(planner, planner.store(a, 3, ["x", "y", "z"]))
    b = _admitted(planner, "b", 1, first_slot=3)
    assert planner.store(b, 1, ["x"]) == []  # x is held: refreshed, not copied
    c = _admitted(planner, "c", 1, first_slot=4)
    _done(planner, planner.store(c, 1, ["w"]))  # the cache is full: evicts y, not x
    assert "x" in planner.cache and "y" not in planner.cache


def test_an_order_is_over_when_every_worker_reported_it_and_failed_if_one_failed() -> None:
    planner = OffloadPlanner(8, reporters=2)
    lc = _admitted(planner, "a", 2)
    (order,) = planner.store(lc, 2, _hashes("p", 2))
    assert planner.report(order.op, True) is False and lc.inflight == 1
    assert planner.report(order.op, False) is True and lc.inflight == 0
    assert planner.counters()["store_failures"] == 1
    assert planner.account() == PageAccount(capacity=8, free=8, cached=0, pinned=0, storing=0)
    assert planner.store(lc, 2, _hashes("p", 2)) == []  # not retried: those blocks are passed


def test_a_repeated_report_is_refused_by_the_registry_and_changes_nothing() -> None:
    planner = OffloadPlanner(8)
    lc = _admitted(planner, "a", 2)
    (order,) = planner.store(lc, 2, _hashes("p", 2))
    _done(planner, [order])
    before = planner.account()
    assert planner.report(order.op) is False
    assert planner.registry.refusals["duplicate_ack"] == 1 and planner.account() == before
    with pytest.raises(UnknownOrderError, match="copy 99, which this planner never ordered"):
        planner.report(99)
    assert planner.account() == before and planner.counters()["stores"] == 1


def test_a_count_of_workers_that_is_not_positive_is_refused_and_changes_nothing() -> None:
    planner = OffloadPlanner(8, reporters=2)
    lc = _admitted(planner, "a", 4)
    first, second = planner.store(lc, 2, _hashes("p", 2)) + planner.store(lc, 4, _hashes("p", 4))
    before = planner.account()
    for count in (0, -1):
        with pytest.raises(ReportCountError, match=f"from {count} workers"):
            planner.report(first.op, True, count)
    # in one batch: the bad ones are returned (never raised between its reports), the
    # others taken
    reports = {first.op: -2, second.op: 1, 10_000: None, "x": 1}  # type: ignore[dict-item]
    problems = planner.report_many(reports, {first.op: 1.5})  # type: ignore[dict-item]
    assert [(type(p), p.op) for p in problems] == [
        (ReportCountError, first.op),
        (ReportCountError, 10_000),
        (UnknownOrderError, "x"),
        (ReportCountError, first.op),
    ]
    assert planner.order(first.op).reported == 0 and planner.order(second.op).reported == 1
    assert planner.account() == before and lc.inflight == 2
    assert planner.registry.refusals.get("duplicate_ack", 0) == 0
    assert planner.report(first.op, True, 2) is True  # it still ends when both report
    # a bad count after a report that ends its order: that order's ticket is delivered
    # (before: the TypeError left the order ended and its ticket open for good)
    (problem,) = planner.report_many({second.op: 1, 10_001: None})  # type: ignore[dict-item]
    assert isinstance(problem, ReportCountError) and lc.inflight == 0


@pytest.mark.parametrize("many", [False, True])
def test_more_reports_than_workers_end_the_order_and_the_rest_is_refused(many: bool) -> None:
    """A worker that reported twice: the order ends with the reports it waited for, and
    the rest is refused as a repeated report (counted and audited), after the delivery."""
    sink = MemorySink()
    planner = OffloadPlanner(8, registry=LifecycleRegistry(sinks=[sink]), reporters=2)
    lc = _admitted(planner, "a", 2)
    (order,) = planner.store(lc, 2, _hashes("p", 2))
    assert planner.report(order.op, True) is False
    if many:
        assert planner.report_many({}, {order.op: 2}) == []
    else:
        assert planner.report(order.op, False, 2) is True
    assert planner.counters()["store_failures"] == 1 and lc.inflight == 0
    assert planner.account() == PageAccount(capacity=8, free=8, cached=0, pinned=0, storing=0)
    assert planner.registry.refusals["duplicate_ack"] == 1
    last = [(r.trigger, r.ok, r.reason) for r in sink.records()][-2:]
    assert last == [("fail", True, None), ("fail", False, "duplicate_ack")]


def test_without_pages_a_store_waits_and_nothing_changes() -> None:
    planner = OffloadPlanner(2)
    lc = _admitted(planner, "a", 3)
    assert planner.store(lc, 3, _hashes("p", 3)) == []
    assert planner.counters()["skipped_stores"] == 1 and lc.copies_started == 0
    assert planner.account().free == 2


def test_a_store_of_a_finished_request_is_refused_by_the_table() -> None:
    planner = OffloadPlanner(8)
    lc = _admitted(planner, "a", 2)
    planner.end(lc)
    assert lc.state is State.RELEASED
    with pytest.raises(KeyError):
        planner.store(lc, 2, _hashes("p", 2))  # released: no progress left to plan on


def test_a_finished_requests_blocks_are_fenced_until_its_stores_are_over() -> None:
    planner = OffloadPlanner(8)
    lc = _admitted(planner, "a", 2, first_slot=5)
    (order,) = planner.store(lc, 2, _hashes("p", 2))
    planner.end(lc)
    assert lc.state is State.FINISHED_PENDING and planner.fenced == {5, 6}
    other = _admitted(planner, "b", 0)
    assert planner.add_slots(other, [6, 9]) == {order.op}  # finish a's store first
    assert planner.fenced == {5}
    _done(planner, [order])
    assert lc.state is State.RELEASED and planner.fenced == frozenset()


def test_a_preempted_request_names_its_copies_in_flight_and_resumes_on_new_blocks() -> None:
    planner = OffloadPlanner(8)
    lc = _admitted(planner, "a", 2)
    (order,) = planner.store(lc, 2, _hashes("p", 2))
    assert planner.preempted(lc) == {order.op} and planner.slots(lc) == []
    planner.add_slots(lc, [7, 8, 9], fresh=True)
    assert planner.slots(lc) == [7, 8, 9]


def test_a_load_writes_the_blocks_after_those_the_engine_supplied() -> None:
    planner = OffloadPlanner(8)
    a = _admitted(planner, "a", 3)
    _done(planner, planner.store(a, 3, _hashes("p", 3)))
    planner.end(a)
    b = planner.admit(Req("b"), "b")
    assert planner.lookup(b, 1, _hashes("p", 3)[1:3]) == 2  # the engine holds block 0
    order = planner.load(b, 2, [20, 21, 22, 23])
    assert order is not None and (order.first, order.slots) == (1, (21, 22))
    assert order.pages == (1, 2) and planner.account().pinned == 2
    assert planner.store(b, 3, _hashes("p", 3)) == []  # loaded blocks are not stored again
    assert planner.report(order.op) is True
    assert planner.account() == PageAccount(capacity=8, free=5, cached=3, pinned=0, storing=0)
    assert planner.counters()["loaded_blocks"] == 2


def test_a_load_larger_than_the_lookup_is_refused_and_changes_nothing() -> None:
    planner = OffloadPlanner(8)
    a = _admitted(planner, "a", 1)
    _done(planner, planner.store(a, 1, ["h"]))
    b = planner.admit(Req("b"), "b")
    assert planner.lookup(b, 0, ["h"]) == 1
    with pytest.raises(ValueError, match="a load of 2 blocks from block 0"):
        planner.load(b, 2, [4, 5])
    assert planner.account().pinned == 0 and b.copies_started == 0
    assert planner.load(b, 1, [4]) is not None  # the lookup's note is still there


def test_a_load_of_a_negative_count_is_refused_and_changes_nothing() -> None:
    """Before: ``count=-1`` made an order of every device block but the last onto every
    page but the last (three slots, two pages)."""
    planner = OffloadPlanner(8)
    a = _admitted(planner, "a", 3)
    _done(planner, planner.store(a, 3, _hashes("p", 3)))
    b = planner.admit(Req("b"), "b")
    assert planner.lookup(b, 0, _hashes("p", 3)) == 3
    before = planner.account()
    with pytest.raises(ValueError, match="a load of -1 blocks from block 0"):
        planner.load(b, -1, [5, 6, 7, 8])
    assert planner.account() == before and b.copies_started == 0 and planner.ops() == []
    order = planner.load(b, 3, [5, 6, 7, 8])  # the lookup's note is still there
    assert order is not None and (order.slots, order.pages) == ((5, 6, 7), (0, 1, 2))


def test_a_lookup_from_a_negative_block_is_refused_and_changes_nothing() -> None:
    planner = OffloadPlanner(8)
    a = _admitted(planner, "a", 2)
    _done(planner, planner.store(a, 2, _hashes("p", 2)))
    b = planner.admit(Req("b"), "b")
    with pytest.raises(ValueError, match=r"a lookup from block -2 .* blocks count from 0"):
        planner.lookup(b, -2, _hashes("p", 2))
    assert planner.counters()["hit_blocks"] == 0
    assert planner.load(b, 0, []) is None  # no lookup was noted


@pytest.mark.parametrize("stride", [0, -1])
def test_a_stride_below_one_is_refused_and_changes_nothing(stride: int) -> None:
    planner = OffloadPlanner(8)
    a = _admitted(planner, "a", 2)
    with pytest.raises(ValueError, match=f"stride must be a positive int, got {stride}"):
        planner.store(a, 2, _hashes("p", 2), stride=stride)
    with pytest.raises(ValueError, match=f"stride must be a positive int, got {stride}"):
        planner.store_many([(a, 2, _hashes("p", 2))], stride=stride)
    assert planner.account().free == 8 and a.copies_started == 0
    assert len(planner.store(a, 2, _hashes("p", 2))) == 1  # nothing was marked covered


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="reporters must be a positive int"):
        OffloadPlanner(4, reporters=0)
    with pytest.raises(ValueError, match="pages must be a positive int"):
        OffloadPlanner(0)


def test_a_given_registry_is_used() -> None:
    registry = LifecycleRegistry()
    planner = OffloadPlanner(4, registry=registry)
    lc = _admitted(planner, "a", 1)
    assert registry.lifecycle(lc.req) is lc


def test_a_reset_frees_what_no_copy_reads_and_says_whether_the_cache_is_empty() -> None:
    planner = OffloadPlanner(8)
    a = _admitted(planner, "a", 3)
    _done(planner, planner.store(a, 3, _hashes("p", 3)))
    assert planner.reset() is True
    assert planner.account() == PageAccount(capacity=8, free=8, cached=0, pinned=0, storing=0)
    b = _admitted(planner, "b", 2, first_slot=3)
    (store,) = planner.store(b, 2, _hashes("q", 2))
    _done(planner, planner.store(_admitted(planner, "c", 1, first_slot=5), 1, ["r"]))
    c = planner.admit(Req("d"), "d")
    assert planner.lookup(c, 0, ["r"]) == 1
    load = planner.load(c, 1, [9])
    assert load is not None
    assert planner.reset() is False  # a store and a load are in flight
    assert planner.account().pinned == 1  # the page the load reads stays cached
    _done(planner, [store])  # ordered before the reset: its pages are freed, not cached
    assert "q0" not in planner.cache and planner.account().storing == 0
    assert planner.report(load.op) is True
    assert planner.account().cached == 1 and planner.reset() is True
    assert planner.account().free == 8


def test_cache_events_tell_what_joined_and_left_the_cache_in_order() -> None:
    planner = OffloadPlanner(3, events=True)
    a = _admitted(planner, "a", 3)
    _done(planner, planner.store(a, 3, ["x", "y", "z"]))
    b = _admitted(planner, "b", 2, first_slot=3)
    (order,) = planner.store(b, 2, ["x", "w"])  # x is held (now the most recently used)
    _done(planner, [order])
    events = planner.take_events()
    assert [(e.kind, e.keys, e.first) for e in events] == [
        ("stored", ("x", "y", "z"), 0),
        ("removed", ("y",), 0),  # the least recently used (x was needed again)
        ("stored", ("w",), 1),
    ]
    assert events[0].req is a.req and events[2].req is b.req
    assert planner.take_events() == []
    planner.reset()
    assert [(e.kind, set(e.keys)) for e in planner.take_events()] == [("removed", {"x", "z", "w"})]
    assert OffloadPlanner(3).take_events() == []  # none kept unless asked for


class PlannerModel(RuleBasedStateMachine):
    """Requests over a shared vocabulary of blocks (ids reused, aborts, preemptions,
    reports held back, repeated and failed, two workers): after every step each host page
    is in exactly one place of the account, and the orders in flight write distinct
    pages."""

    def __init__(self) -> None:
        super().__init__()
        self.planner = OffloadPlanner(6, reporters=2)
        self.live: dict[str, Lifecycle] = {}  # rid -> lifecycle
        self.ever: list[int] = []  # copy numbers ever ordered
        self.open: dict[int, StoreOrder | LoadOrder] = {}  # not yet over
        self.slot = 0

    @rule(rid=st.sampled_from("abc"), blocks=st.integers(0, 4))
    def admit(self, rid: str, blocks: int) -> None:
        if rid in self.live:
            return
        lc = self.planner.admit(Req(rid), rid)
        self.planner.add_slots(lc, range(self.slot, self.slot + blocks))
        self.slot += blocks
        self.live[rid] = lc

    def _ordered(self, order: StoreOrder | LoadOrder) -> None:
        self.ever.append(order.op)
        self.open[order.op] = order

    @rule(rid=st.sampled_from("abc"), full=st.integers(0, 4), base=st.sampled_from("pq"))
    def store(self, rid: str, full: int, base: str) -> None:
        lc = self.live.get(rid)
        if lc is not None:
            for order in self.planner.store(lc, full, _hashes(base, 4)):
                self._ordered(order)

    @rule(rid=st.sampled_from("abc"), base=st.sampled_from("pq"), count=st.integers(0, 3))
    def load(self, rid: str, base: str, count: int) -> None:
        lc = self.live.get(rid)
        if lc is None or lc.outcome is not None:
            return
        hit = self.planner.lookup(lc, 0, _hashes(base, 3))
        order = self.planner.load(lc, min(count, hit), list(range(100, 104)))
        if order is not None:
            self._ordered(order)

    @rule(rid=st.sampled_from("abc"), aborted=st.booleans())
    def end(self, rid: str, aborted: bool) -> None:
        lc = self.live.pop(rid, None)
        if lc is not None:
            self.planner.end(lc, aborted=aborted)

    @rule(rid=st.sampled_from("abc"))
    def preempt(self, rid: str) -> None:
        lc = self.live.get(rid)
        if lc is not None:
            self.planner.preempted(lc)
            self.planner.add_slots(lc, range(self.slot, self.slot + 4), fresh=True)
            self.slot += 4

    @rule()
    def reset(self) -> None:
        empty = self.planner.reset()
        assert empty == (not self.open and not len(self.planner.cache))

    @precondition(lambda self: self.ever)
    @rule(data=st.data(), ok=st.booleans())
    def report(self, data: st.DataObject, ok: bool) -> None:
        op = data.draw(st.sampled_from(self.ever))
        if self.planner.report(op, ok):  # late and repeated reports: refused, not raised
            del self.open[op]

    @invariant()
    def every_page_is_in_one_place(self) -> None:
        account = self.planner.account()
        assert account.balanced, account
        stores = [o for o in self.open.values() if isinstance(o, StoreOrder)]
        loads = [o for o in self.open.values() if isinstance(o, LoadOrder)]
        written = [page for order in stores for page in order.pages]
        assert account.storing == len(written) == len(set(written))
        read = {page for order in loads for page in order.pages}
        assert account.pinned == len(read) and not read & set(written)
        assert self.planner.inflight == len(self.open)


test_planner_model = PlannerModel.TestCase


# --- owner mode: what OffloadManager composes --------------------------------------------


def _owner(pages: int = 8, **kwargs: object) -> tuple[OffloadPlanner, list[tuple[str, list]]]:
    handed: list[tuple[str, list]] = []

    def hand_over(lc: Lifecycle, req: object, orders: list) -> None:
        handed.append((lc.rid, [(o.first, o.pages, o.hashes) for o in orders]))

    return OffloadPlanner(pages, hand_over=hand_over, **kwargs), handed  # type: ignore[arg-type]


def test_an_owner_copies_every_block_and_hands_its_pages_over_at_release() -> None:
    planner, handed = _owner()
    a, b = planner.admit(Req("a"), "a"), planner.admit(Req("b"), "b")
    first = planner.store_owned(a, 2, ["h0", "h1"])
    same = planner.store_owned(b, 2, ["h0", "h1"])  # equal content: copied all the same
    assert first is not None and same is not None
    assert (first.slots, first.pages, same.pages) == ((), (0, 1), (2, 3))
    tail = planner.store_owned(a, 3, [None])  # a partial last block
    assert tail is not None and tail.pages == (4,)
    for op in (first.op, same.op, tail.op):
        planner.report(op)
    assert planner.account() == PageAccount(8, free=3, cached=0, pinned=0, storing=0, kept=5)
    planner.end(a)
    assert handed == [("a", [(0, (0, 1), ("h0", "h1")), (2, (4,), (None,))])]
    assert planner.account().kept == 2 and planner.allocator.available == 3  # a's are out
    planner.end(b, aborted=True)  # an aborted lifecycle hands nothing over: freed here
    assert handed[-1] == ("b", []) and planner.allocator.available == 5


def test_an_owner_hands_over_the_run_before_the_first_failed_store() -> None:
    planner, handed = _owner()
    lc = planner.admit(Req("a"), "a", covered=1)  # block 0 was stored elsewhere
    orders = [planner.store_owned(lc, n, [f"h{n}"]) for n in (2, 3, 4)]
    ops = [order.op for order in orders if order is not None]
    assert [order.first for order in orders if order is not None] == [1, 2, 3]
    planner.report(ops[2])
    planner.report(ops[1], ok=False)  # its pages go back at once
    planner.report(ops[0])
    assert planner.account().kept == 2 and planner.allocator.available == 6
    planner.end(lc)
    assert handed == [("a", [(1, (0,), ("h2",))])]  # block 3 follows the failed block 2
    assert planner.allocator.available == 7  # block 3's page was freed, block 1's handed


def test_an_owner_store_a_caller_took_is_not_kept() -> None:
    planner, handed = _owner()
    lc = planner.admit(Req("a"), "a")
    order = planner.store_owned(lc, 1, ["h0"])
    assert order is not None
    planner.report(order.op, taken=True)
    assert planner.account().kept == 0 and planner.allocator.available == 7
    planner.end(lc)
    assert handed == [("a", [])] and planner.allocator.available == 7  # still the caller's


def test_owner_stores_that_cannot_be_made_change_nothing() -> None:
    planner, _ = _owner(pages=2)
    lc = planner.admit(Req("a"), "a")
    with pytest.raises(ValueError, match="one each"):
        planner.store_owned(lc, 2, ["h0"])
    assert planner.store_owned(lc, 3, ["h0", "h1", "h2"]) is None  # 3 pages of 2
    assert planner.counters()["skipped_stores"] == 1
    assert planner.progress(lc).covered == 0 and planner.allocator.available == 2
    assert planner.store_owned(lc, 0, []) is None
    planner.end(lc)
    with pytest.raises(KeyError):
        planner.store_owned(lc, 1, ["h0"])
    with pytest.raises(RuntimeError, match="owner-mode"):
        OffloadPlanner(2).store_owned(lc, 1, ["h0"])
    with pytest.raises(TypeError, match="hand_over"):
        OffloadPlanner(2, hand_over="not callable")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="covered"):
        planner.admit(Req("b"), "b", covered=-1)
    assert planner.allocator.available == 2 and "b" not in {
        x.rid for x in planner.registry.lifecycles()
    }


def test_an_owner_store_the_state_refuses_takes_no_page() -> None:
    planner, _ = _owner()
    lc = planner.admit(Req("a"), "a")
    first = planner.store_owned(lc, 1, ["h0"])
    assert first is not None
    planner.end(lc)  # finished, its store still in flight
    with pytest.raises(InvalidTransitionError):
        planner.store_owned(lc, 2, ["h1"])
    assert planner.allocator.available == 7 and planner.progress(lc).covered == 1


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic collector off: what is still reachable only through a cycle stays."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_cyclic_gc")
def test_a_released_request_is_dropped_at_once_in_either_mode() -> None:
    """Released means released: no reference to the request is left once its lifecycle
    is, not even one a cycle holds until the cyclic collector runs."""
    for owner in (False, True):
        planner = _owner()[0] if owner else OffloadPlanner(8)
        req = Req("a")
        lc = planner.admit(req, "a")
        planner.add_slots(lc, range(3))
        if owner:
            orders = [planner.store_owned(lc, 2, ["h0", "h1"]), planner.store_owned(lc, 3, [None])]
        else:
            orders = planner.store(lc, 3, ["h0", "h1", "h2"])
        for order in orders:
            assert order is not None
            planner.report(order.op)
        gone = weakref.ref(req)
        planner.end(lc)
        del req, orders, order
        assert lc.released and gone() is None, f"owner={owner}: {gc.get_referrers(gone())}"


def test_store_and_load_records_speak_the_one_ticket_vocabulary() -> None:
    sink = MemorySink()
    planner = OffloadPlanner(8, registry=LifecycleRegistry(sinks=[sink]))
    a = _admitted(planner, "a", 3)
    _done(planner, planner.store(a, 3, _hashes("p", 3)))
    planner.end(a)
    b = planner.admit(Req("b"), "b")
    planner.lookup(b, 1, _hashes("p", 3)[1:3])
    planner.load(b, 2, [20, 21, 22, 23])
    started = [r.detail for r in sink.records() if r.trigger == "start_offload"]
    assert started == [
        {"kind": "store", "blocks": 3, "first_block": 0},
        {"kind": "load", "blocks": 2, "first_block": 1},
    ]
    assert all(set(detail) <= set(TICKET_DETAIL) for detail in started)


def test_a_late_report_after_a_release_and_an_id_reuse_is_refused_on_the_old_lifecycle() -> None:
    sink = MemorySink()
    planner = OffloadPlanner(8, registry=LifecycleRegistry(sinks=[sink]))
    old = _admitted(planner, "a", 2)
    (order,) = planner.store(old, 2, _hashes("p", 2))
    planner.end(old)
    assert planner.report(order.op) is True and old.state is State.RELEASED
    new = _admitted(planner, "a", 2, first_slot=4)  # the id reused
    before = planner.account()
    assert planner.report(order.op) is False  # late: refused, counted, audited
    assert planner.report_many({order.op: 1}, {order.op: 1}) == []  # twice more
    refused = [(r.serial, r.trigger, r.reason, r.op) for r in sink.records() if not r.ok]
    assert refused == [
        (old.serial, "ack", "stale_instance", order.op),
        (old.serial, "ack", "stale_instance", order.op),
        (old.serial, "fail", "stale_instance", order.op),
    ]
    assert new.state is State.ALLOCATED and planner.account() == before


def test_orders_remembered_after_they_end_keep_no_ticket_or_lifecycle_alive() -> None:
    """A late report is refused on the right lifecycle by its serial and rid: the planner
    keeps no ticket for it (a scheduler step's young collections came more often while
    every ended copy's ticket and lifecycle stayed alive)."""
    planner = OffloadPlanner(4096)

    def alive() -> int:
        gc.collect()
        return sum(type(o) is Lifecycle or type(o).__name__ == "Ticket" for o in gc.get_objects())

    before = alive()
    for i in range(300):
        lc = _admitted(planner, f"r{i}", 2, first_slot=2 * i)
        (order,) = planner.store(lc, 2, _hashes(f"r{i}", 2))
        planner.end(lc)
        assert planner.report(order.op) is True
        del lc, order
    assert alive() - before < 5  # not 600
    assert planner.report(0) is False and planner.registry.refusals["stale_instance"] == 1


def _reported_run(
    plan: list[tuple[int, bool, int]], many: bool
) -> tuple[OffloadPlanner, MemorySink, list[object]]:
    """Six requests with one store each (two workers report every order), then ``plan``'s
    reports (order index, ok, workers; index 6 names a copy never ordered, a count below
    1 is refused, one above what the order waits for ends it and is refused for the
    rest): one at a time, or (``many``) in one ``report_many`` per three reports."""
    sink = MemorySink()
    planner = OffloadPlanner(64, registry=LifecycleRegistry(sinks=[sink]), reporters=2)
    ops = []
    for i in range(6):
        lc = _admitted(planner, f"r{i}", 4, first_slot=4 * i)
        ops += [order.op for order in planner.store(lc, 4, _hashes(f"r{i}", 4))]
    unknown: list[object] = []
    chunk: tuple[dict[int, int], dict[int, int]] = ({}, {})
    for index, (which, ok, count) in enumerate(plan):
        op = ops[which] if which < len(ops) else 10_000
        if not many:
            try:
                planner.report(op, ok, count)
            except (UnknownOrderError, ReportCountError) as exc:
                unknown.append(exc.op)
            continue
        reports = chunk[0 if ok else 1]
        if op in reports:  # a mapping names each copy once: send what is gathered first
            unknown += [exc.op for exc in planner.report_many(*chunk)]
            chunk = ({}, {})
            reports = chunk[0 if ok else 1]
        reports[op] = count
        if index % 3 == 2 or index == len(plan) - 1:
            unknown += [exc.op for exc in planner.report_many(*chunk)]
            chunk = ({}, {})
    return planner, sink, unknown


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.booleans(), st.integers(-1, 3)), max_size=30))
def test_report_many_gives_what_one_report_after_another_gives(
    plan: list[tuple[int, bool, int]],
) -> None:
    # report_many takes a chunk's done reports before its failed ones: the single run
    # takes them in that order too
    ordered: list[tuple[int, bool, int]] = []
    for start in range(0, len(plan), 3):
        part = plan[start : start + 3]
        ordered += [r for r in part if r[1]] + [r for r in part if not r[1]]
    one, one_sink, one_unknown = _reported_run(ordered, many=False)
    many, many_sink, many_unknown = _reported_run(ordered, many=True)
    assert many_unknown == one_unknown
    assert many.counters() == one.counters() and many.account() == one.account()
    fields = [(r.seq, r.trigger, r.serial, r.op, r.ok, r.reason, r.detail) for r in one_sink]
    assert [(r.seq, r.trigger, r.serial, r.op, r.ok, r.reason, r.detail) for r in many_sink] == (
        fields
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 8)), min_size=1, max_size=12),
    st.integers(1, 2),
    st.integers(6, 40),
)
def test_store_many_gives_what_one_store_after_another_gives(
    plan: list[tuple[int, int]], stride: int, pages: int
) -> None:
    """Items (request, full blocks) of shared and distinct hashes, on a host cache that
    may run short: the same orders, records, counters and account either way."""

    def run(many: bool) -> tuple[list[StoreOrder], OffloadPlanner, MemorySink]:
        sink = MemorySink()
        planner = OffloadPlanner(pages, registry=LifecycleRegistry(sinks=[sink]))
        lcs = [_admitted(planner, f"r{i}", 8, first_slot=8 * i) for i in range(5)]
        hashes = [_hashes("shared" if i % 2 else f"own{i}", 8) for i in range(5)]
        items = [(lcs[i], full, hashes[i]) for i, full in plan]
        if many:
            orders = planner.store_many(items, stride=stride)
        else:
            orders = [o for lc, full, h in items for o in planner.store(lc, full, h, stride=stride)]
        return orders, planner, sink

    one_orders, one, one_sink = run(False)
    many_orders, many, many_sink = run(True)
    assert many_orders == one_orders
    assert many.counters() == one.counters() and many.account() == one.account()
    assert [(r.seq, r.trigger, r.serial, r.op, r.detail) for r in many_sink] == [
        (r.seq, r.trigger, r.serial, r.op, r.detail) for r in one_sink
    ]


def test_store_many_from_another_thread_takes_no_page() -> None:
    from kvlife.fsm import WrongThreadError  # noqa: PLC0415

    planner = OffloadPlanner(8)
    lc = _admitted(planner, "a", 4)
    error = raised_in_thread(lambda: planner.store_many([(lc, 4, _hashes("a", 4))]))
    assert isinstance(error, WrongThreadError)
    assert planner.account().free == 8 and planner.inflight == 0

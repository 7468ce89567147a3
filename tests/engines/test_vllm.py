"""kvlife against vLLM 0.33.0's real scheduler on CPU (run in ``.venv-vllm`` by
``make test-vllm``; in the main environment this module skips).

The first test pins down the failure kvlife exists to prevent, on vLLM's own
``OffloadingConnector``: it keys its state by request id, so a store that completes after
its request finished and the id was reused resolves to the new request, and the scheduler
raises inside ``update_from_output`` (in a server, the engine core dies). It is a strict
xfail: if vLLM fixes it, the test says so.
"""

from __future__ import annotations

import logging
import random
from typing import Any, ClassVar

import pytest
import torch

pytest.importorskip("vllm", reason="runs in the vLLM environment: make test-vllm")

from tests.engines.vllm_harness import KVLIFE, make_request, make_scheduler, step, vllm_caches


@pytest.mark.xfail(raises=KeyError, strict=True, reason="vLLM keys offload state by request id")
def test_vllms_offloading_connector_dies_on_a_late_store_after_an_id_reuse() -> None:
    scheduler = make_scheduler("OffloadingConnector", extra={"cpu_bytes_to_use": 64 << 20})
    old = make_request("0", max_tokens=2)
    scheduler.add_request(old)
    out = step(scheduler)  # prefill: a store of its full blocks is launched
    jobs = list(out.kv_connector_metadata.store_jobs)
    assert jobs and all(job.req_id == "0" for job in out.kv_connector_metadata.store_jobs.values())
    step(scheduler)  # its last token: finished, with the store still in flight
    assert old.is_finished() and not scheduler.running
    scheduler.add_request(make_request("0", first=5000))  # the id is reused at once
    step(scheduler)
    step(scheduler, completed=jobs)  # the old store completes: KeyError in the scheduler


@pytest.mark.xfail(raises=KeyError, strict=True, reason="vLLM removes a job id only once")
def test_vllms_offloading_connector_dies_on_a_repeated_store_report() -> None:
    scheduler = make_scheduler("OffloadingConnector", extra={"cpu_bytes_to_use": 64 << 20})
    scheduler.add_request(make_request("0", max_tokens=8))
    jobs = list(step(scheduler).kv_connector_metadata.store_jobs)  # prefill: stores start
    assert jobs
    step(scheduler, completed=jobs)  # the workers report the stores done
    step(scheduler, completed=jobs)  # and the same report again: KeyError in the scheduler


from vllm.v1.request import RequestStatus  # noqa: E402

from kvlife.fsm import AuditReader, State, check_audit, read_audit  # noqa: E402
from kvlife.offload.watch.vllm.exercise import prefill_chunks  # noqa: E402
from tests.builds import patches_compiled  # noqa: E402
from tests.engines.vllm_harness import TOKEN, Engine  # noqa: E402


def _free_blocks(engine: Engine) -> int:
    return int(engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def test_a_finished_requests_blocks_are_fenced_until_its_stores_are_over(tmp_path: Any) -> None:
    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(blocks=4, audit_log=str(audit))  # three usable blocks: all reused
    free_at_start = _free_blocks(engine)
    request = make_request("a", prompt=40, max_tokens=2)
    store = engine.prefill_holding_its_store(request)  # 40 tokens: two full blocks
    assert len(store.slots) == 2
    engine.step()  # the last token: finished with the store in flight
    lc = engine.connector.registry.lifecycles()[0]
    assert request.is_finished() and lc.state is State.FINISHED_PENDING
    # vLLM has the blocks and the id back at once; kvlife fences the blocks instead
    assert "a" not in engine.scheduler.requests and _free_blocks(engine) == free_at_start
    assert set(engine.connector.planner.fenced) == set(store.slots)
    engine.scheduler.add_request(make_request("c", prompt=40, max_tokens=2, first=3000))
    out = engine.step()  # c is given a's blocks: the workers finish a's store first
    assert out.kv_connector_metadata.wait_jobs == {store.op}
    assert not engine.connector.planner.fenced
    engine.hold_all = False
    engine.step(release=[store.op])  # the copy is over: the lifecycle is released
    assert lc.state is State.RELEASED
    engine.run_until_idle()
    engine.connector.registry.flush()
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 2, report.violations


def test_the_id_reuse_race_is_harmless_with_kvlife(tmp_path: Any) -> None:
    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(audit_log=str(audit))
    store = engine.prefill_holding_its_store(make_request("0", max_tokens=2))
    engine.step()  # "0" finished, its store in flight
    old_lc = engine.connector.registry.lifecycles()[0]
    new = make_request("0", first=5000)
    engine.scheduler.add_request(new)  # the id is free at once: vLLM takes it
    engine.step()
    new_lc = engine.connector.registry.lifecycle(new)
    assert new_lc is not old_lc and old_lc.state is State.FINISHED_PENDING
    before = (new_lc.state, new_lc.inflight, new_lc.copies_started)
    engine.hold_all = False
    engine.step(release=[store.op])  # the old copy lands: the old lifecycle alone
    assert old_lc.state is State.RELEASED
    assert (new_lc.state, new_lc.inflight, new_lc.copies_started) == before
    engine.step(release=[store.op])  # the old job's completion, late and again
    engine.step(release=[store.op])
    stats = engine.connector.registry.statistics()
    assert stats.refusals["stale_instance"] == 2
    engine.connector.registry.flush()
    refused = [r for r in read_audit(audit).records if not r.ok]
    assert [(r.trigger, r.reason, r.serial, r.op) for r in refused] == [
        ("ack", "stale_instance", 0, store.op)
    ] * 2  # each late delivery named the old lifecycle and its copy


@patches_compiled
def test_a_step_looks_only_at_requests_whose_blocks_changed_or_filled() -> None:
    """build_connector_meta does Python work (``_look``) for a request only in a step
    where it is new, got blocks, or its computed tokens reach its next store: in most
    decode steps of eight requests, none; and every block that filled is stored."""
    engine = Engine(blocks=128, host_pages=128)
    side = engine.connector._scheduler
    looked: list[str] = []
    look = side._look

    def counted(req_id: str, *args: Any) -> Any:
        looked.append(req_id)
        return look(req_id, *args)

    side._look = counted
    rng = random.Random(3)
    for i in range(8):
        engine.scheduler.add_request(
            make_request(f"r{i}", prompt=rng.randint(20, 60), max_tokens=40, first=1000 * i)
        )
    looked_at = scheduled = 0
    while engine.scheduler.requests:
        before = {rid: r.num_computed_tokens for rid, r in engine.scheduler.requests.items()}
        looked.clear()
        out = engine.step(release=list(engine.held))
        cached = out.scheduled_cached_reqs
        got_blocks = {
            rid for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True) if ids
        }
        filled = {  # a block became full in this step
            rid
            for rid, n in out.num_scheduled_tokens.items()
            if (before[rid] + n) // 16 > before[rid] // 16
        }
        new = {r.req_id for r in out.scheduled_new_reqs}
        assert set(looked) <= new | got_blocks | filled, (looked, new, got_blocks, filled)
        assert filled <= set(looked)  # nothing that filled was passed over
        looked_at += len(looked)
        scheduled += len(out.num_scheduled_tokens)
    # 16 tokens a block: a decoding request fills one every 16 steps and gets one the step
    # after; the walk over every scheduled request looked at each every step
    assert looked_at < scheduled / 4, (looked_at, scheduled)
    stored = sum(len(store.slots) for store in engine.stores)
    assert stored == engine.connector.counters["stored_blocks"] > 0


def test_the_log_is_current_between_steps_and_written_twice_a_step(tmp_path: Any) -> None:
    """A request added or aborted between steps is in the file at once (an idle or paused
    engine's log is current); within a step the records go out at the end of each half,
    not after every call."""
    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(audit_log=str(audit), audit_flush_s=3600)
    sink = engine.connector._scheduler.sink
    writes: list[int] = []
    write_out = sink.write_out

    def counted() -> None:
        writes.append(len(sink._file.buffer))
        write_out()

    sink.write_out = counted
    engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=4))
    assert [r.trigger for r in read_audit(audit).records] == ["register"]
    engine.scheduler.add_request(make_request("b", prompt=40, max_tokens=4, first=3000))
    engine.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert [r.trigger for r in read_audit(audit).records][-1] == "abort"
    writes.clear()
    for _ in range(3):
        engine.step(release=list(engine.held))
    assert 0 < len(writes) <= 2 * 3  # at most twice a step, whatever the calls in it
    assert not sink.waiting  # nothing held back at the end of a step
    engine.run_until_idle()
    assert check_audit(AuditReader(audit), expect_released=True).ok


def test_an_abort_with_a_store_in_flight_releases_after_the_copy() -> None:
    engine = Engine()
    store = engine.prefill_holding_its_store(make_request("a", max_tokens=50))
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    lc = engine.connector.registry.lifecycles()[0]
    assert lc.state is State.FINISHED_PENDING and lc.outcome == "aborted"
    assert "a" not in engine.scheduler.requests  # vLLM freed it; its blocks are fenced
    assert engine.connector.account().storing == 2  # the copy still writes its pages
    engine.hold_all = False
    engine.step(release=[store.op])
    assert lc.state is State.RELEASED
    # the whole copy of its two full blocks is named by their hashes: cached, not lost
    account = engine.connector.account()
    assert (account.free, account.cached, account.storing, account.pinned) == (62, 2, 0, 0)


def test_a_failed_store_is_a_fail_and_gives_its_pages_back() -> None:
    engine = Engine()
    engine.scheduler.add_request(make_request("a", max_tokens=2))
    engine.fail = {0}
    engine.step()
    lc = engine.connector.registry.lifecycles()[0]
    assert lc.copies_started == 1 and lc.inflight == 0 and lc.state is State.ALLOCATED
    assert engine.connector.free_host_pages == 64
    engine.step()
    assert lc.state is State.RELEASED
    assert not any(engine.connector.registry.statistics().refusals.values())


def test_every_worker_must_report_a_store() -> None:
    engine = Engine(tensor_parallel=2)  # two workers: each reports its own copy
    store = engine.prefill_holding_its_store(make_request("a", max_tokens=3))
    engine.hold_all = False
    lc = engine.connector.registry.lifecycles()[0]
    engine.step(release=[store.op])  # one worker
    assert lc.inflight == 1
    engine.step(release=[store.op])  # the other, a step later
    assert lc.inflight == 0


def test_a_report_from_too_many_workers_or_none_is_told_and_never_raised_into_vllm() -> None:
    """Worker metadata that names a store from three workers of two (one reported twice)
    and a copy from -1 workers: the store ends once, the extra report is refused (counted
    as a repeated report), the bad count is logged, and vLLM's step goes on."""
    engine = Engine(tensor_parallel=2)
    store = engine.prefill_holding_its_store(make_request("a", max_tokens=3))
    engine.hold_all = False
    lc = engine.connector.registry.lifecycles()[0]
    engine.held[store.op], engine.held[424242] = 3, -1  # the counts the step reports
    told = _Told()
    logger = logging.getLogger("vllm.kvlife")
    logger.addHandler(told)
    try:
        engine.step(release=[store.op, 424242])
    finally:
        logger.removeHandler(told)
    assert lc.inflight == 0 and lc.copies_started == 1
    assert engine.connector.registry.statistics().refusals["duplicate_ack"] == 1
    assert told.lines == ["kvlife: a report for copy 424242 from -1 workers: a report counts a "
                          "positive int of workers"]  # fmt: skip
    engine.run_until_idle()


class _Told(logging.Handler):
    """The lines a logger wrote (vLLM's loggers do not propagate to pytest's)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_preemption_names_the_stores_that_read_its_blocks(tmp_path: Any, runner: str) -> None:
    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(blocks=8, audit_log=str(audit), runner=runner)  # room for two requests
    free_at_start = _free_blocks(engine)
    engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=60))
    engine.scheduler.add_request(make_request("b", prompt=40, max_tokens=60, first=3000))
    engine.hold_all = True
    for _ in range(40):
        out = engine.step()
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"b"}
    meta = out.kv_connector_metadata
    in_flight_of_b = set(engine.connector.planner.inflight_of(engine.connector.registry.live("b")))
    assert in_flight_of_b and meta.wait_jobs == in_flight_of_b
    engine.hold_all = False
    engine.step(release=list(engine.held))  # every copy lands
    resumed_as = set()
    for _ in range(200):  # both finish; b resumes and is recomputed
        out = engine.step()
        if "b" in out.scheduled_cached_reqs.resumed_req_ids:
            resumed_as.add("resumed id")  # model runner V1's shape
        if any(new.req_id == "b" for new in out.scheduled_new_reqs):
            resumed_as.add("new request data")  # V2's
        if not engine.scheduler.requests:
            break
    assert resumed_as == {"resumed id" if runner == "v1" else "new request data"}
    assert not engine.scheduler.requests and _free_blocks(engine) == free_at_start
    assert len(engine.expected) == len(engine.stores) > 4  # each checked at its launch
    engine.connector.registry.flush()
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 2, report.violations


def _cached_prefix(engine: Engine, prompt: int = 48) -> Any:
    """Run request "a" of ``prompt`` tokens to its end, so that its full blocks are in the
    host cache, then clear vLLM's own prefix cache so that only kvlife can supply them."""
    engine.scheduler.add_request(make_request("a", prompt=prompt, max_tokens=2))
    engine.run_until_idle()
    assert engine.scheduler.reset_prefix_cache()
    return [s for s in engine.stores]


def test_a_finished_requests_blocks_are_loaded_back_for_the_same_prefix() -> None:
    engine = Engine()
    stores = _cached_prefix(engine)
    assert sum(len(s.slots) for s in stores) == 3  # 50 tokens: three full blocks
    b = make_request("b", prompt=48, max_tokens=2)  # the same 48 prompt tokens
    engine.scheduler.add_request(b)
    out = engine.step()  # a hit of two blocks (vLLM computes the 48th token itself)
    (load,) = out.kv_connector_metadata.loads
    lc = engine.connector.registry.lifecycle(b)
    assert load.first == 0 and len(load.slots) == 2
    # the load is a copy on b's own lifecycle, scheduled with b in the same step; its
    # third block, which b computes itself, is not stored: the host cache holds a's
    assert lc.copies_started == 1 and out.kv_connector_metadata.stores == []
    loaded = [engine.device_block(block).clone() for block in load.slots]
    stored = {p: engine.expected[s.op][i] for s in stores for i, p in enumerate(s.pages)}
    for page, block in zip(load.pages, loaded, strict=True):  # a's bytes, now b's blocks
        assert torch.equal(engine.host_block(page), block)
        assert torch.equal(block, stored[page])
    engine.run_until_idle()
    assert b.num_computed_tokens >= 48 and lc.state is State.RELEASED
    assert not engine.connector.planner.cache.pinned  # nothing pinned once loads are over


def test_a_different_prompt_is_a_miss() -> None:
    engine = Engine()
    _cached_prefix(engine)
    engine.scheduler.add_request(make_request("c", prompt=48, max_tokens=2, first=7000))
    out = engine.step()
    assert out.kv_connector_metadata.loads == []


def test_an_abort_while_loading_releases_only_after_the_load() -> None:
    engine = Engine()
    _cached_prefix(engine)
    b = make_request("b", prompt=48, max_tokens=2)
    engine.scheduler.add_request(b)
    engine.hold_all = True  # the load does not finish yet
    out = engine.step()
    assert len(out.kv_connector_metadata.loads) == 1
    lc = engine.connector.registry.lifecycle(b)
    engine.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert lc.state is State.FINISHED_PENDING and "b" not in engine.scheduler.requests
    assert engine.connector.planner.cache.pinned  # the pages it reads cannot be evicted
    engine.run_until_idle()  # the late load completion: b alone is released, then freed
    assert lc.state is State.RELEASED and not engine.connector.planner.cache.pinned
    assert not engine.scheduler.requests


def test_a_page_being_loaded_is_never_evicted_and_an_evicted_page_is_a_miss() -> None:
    engine = Engine(host_pages=4)
    _cached_prefix(engine)  # three cached pages, one free
    b = make_request("b", prompt=48, max_tokens=2)
    engine.scheduler.add_request(b)
    engine.hold_all = True
    engine.step()  # b's load pins two pages
    sched = engine.connector.planner
    pinned = sched.cache.pinned
    engine.scheduler.add_request(make_request("d", prompt=48, max_tokens=40, first=7000))
    engine.step()  # d wants three pages: one free and one evictable are not enough
    assert sched.counters()["skipped_stores"] >= 1 and sched.cache.pinned == pinned
    assert len(sched.cache) == 3  # the pinned pages are still cached
    engine.run_until_idle()  # now d's stores evict what no load reads
    engine.scheduler.reset_prefix_cache()
    e = make_request("e", prompt=48, max_tokens=2)
    engine.scheduler.add_request(e)
    out = engine.step()
    hit = sum(len(load.slots) for load in out.kv_connector_metadata.loads)
    assert hit < 2  # a's first blocks were evicted for d's: a miss from there on


def _stored_blocks(engine: Engine) -> int:
    return sum(len(store.slots) for store in engine.stores)


def test_a_store_never_copies_a_block_the_host_cache_holds() -> None:
    engine = Engine()
    p = make_request("p", prompt=48, max_tokens=1)  # P: three full blocks
    engine.scheduler.add_request(p)
    engine.run_until_idle()
    for rid in ("pq", "pq again"):  # P+Q (two more blocks), then the same again
        engine.scheduler.add_request(make_request(rid, prompt=80, max_tokens=1))
        engine.run_until_idle()
    assert _stored_blocks(engine) == 5  # 3 + 2 + 0: each distinct block once
    counts = engine.connector.counters
    assert counts["stored_blocks"] == 5 and counts["held_blocks"] == 3 + 5
    account = engine.connector.account()
    assert account.cached == 5 and account.balanced


def test_a_chat_that_resends_its_conversation_copies_each_block_once() -> None:
    engine = Engine(blocks=128, host_pages=64)
    for turn in range(10):  # each turn re-sends the conversation and adds two blocks
        request = make_request(f"turn {turn}", prompt=32 * (turn + 1), max_tokens=1)
        engine.scheduler.add_request(request)
        engine.run_until_idle()
    assert _stored_blocks(engine) == engine.connector.counters["stored_blocks"] == 20


def test_two_requests_storing_one_prefix_at_once_copy_it_once() -> None:
    engine = Engine()
    store = engine.prefill_holding_its_store(make_request("a", prompt=48, max_tokens=1))
    assert len(store.slots) == 3
    assert engine.scheduler.reset_prefix_cache()  # vLLM's own cache cannot supply b
    b = make_request("b", prompt=48, max_tokens=1)
    engine.scheduler.add_request(b)
    out = engine.step()  # a's store is still in flight: b stores none of those blocks
    assert out.kv_connector_metadata.stores == [] and out.kv_connector_metadata.loads == []
    assert engine.connector.account().storing == 3
    engine.run_until_idle()
    assert _stored_blocks(engine) == 3 and engine.connector.account().cached == 3


def test_a_load_after_the_blocks_vllm_supplies_lands_in_the_right_blocks() -> None:
    engine = Engine()
    a_stores = _cached_prefix(engine)  # a's 48 prompt tokens: three blocks on the host
    a_blocks = {
        store.first + i: engine.expected[store.op][i]
        for store in a_stores
        for i in range(len(store.slots))
    }
    engine.scheduler.add_request(make_request("z", prompt=17, max_tokens=1))
    engine.run_until_idle()  # vLLM's own prefix cache holds block 0 now, and only it
    loads_before = len(engine.loads)
    b = make_request("b", prompt=64, max_tokens=1)  # a's three blocks, then a fourth
    engine.scheduler.add_request(b)
    out = engine.step()
    (load,) = engine.loads[loads_before:]
    assert load.first == 1 and len(load.slots) == 2  # vLLM supplied block 0 itself
    (scheduled,) = out.scheduled_new_reqs
    b_blocks = scheduled.block_ids[0]
    assert load.slots == tuple(b_blocks[1:3])
    for index in range(3):  # block 0 from vLLM's cache, 1 and 2 loaded: all a's bytes
        assert torch.equal(engine.device_block(b_blocks[index]), a_blocks[index]), index
    (store,) = out.kv_connector_metadata.stores  # b's fourth block is its own: stored
    assert store.first == 3 and store.slots == (b_blocks[3],)
    engine.run_until_idle()


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_page_account_sums_to_the_capacity_after_every_step(runner: str) -> None:
    """Under both shapes of vLLM's scheduler output (V2: a preempted request resumes as
    new request data)."""
    for seed in range(3):
        rng = random.Random(seed)
        engine = Engine(blocks=24, host_pages=12, runner=runner)
        checked = 0
        for _ in range(120):
            live = set(engine.scheduler.requests)
            if len(live) < 4 and rng.random() < 0.5:
                rid = rng.choice("abcdef")  # a small id space: ids come back
                if rid not in live:
                    prefix = rng.choice((1000, 2000))  # two shared prefixes
                    request = make_request(
                        rid, prompt=rng.randint(10, 80), max_tokens=rng.randint(1, 40), first=prefix
                    )
                    engine.scheduler.add_request(request)
            if live and rng.random() < 0.1:
                engine.scheduler.finish_requests(
                    rng.choice(sorted(live)), RequestStatus.FINISHED_ABORTED
                )
            engine.hold_all = rng.random() < 0.3  # reports held back, then released
            release = [] if engine.hold_all else list(engine.held)
            engine.step(release=release)
            account = engine.connector.account()
            assert account.balanced and account.capacity == 12, (seed, account)
            checked += 1
        engine.run_until_idle(400)
        account = engine.connector.account()
        assert account.balanced and account.storing == account.pinned == 0
        assert not engine.connector.planner.fenced and engine.connector.planner.inflight == 0
        assert checked == 120


def test_under_async_scheduling_every_copy_moves_its_bytes_and_every_lifecycle_ends(
    tmp_path: Any,
) -> None:
    """vLLM's ``AsyncScheduler``, as a CUDA deployment runs by default: step N+1 is planned
    (stores, loads, the copies to wait for) before step N's output and the workers' reports
    of step N come back. Ids come back, requests are aborted with a step in flight, vLLM
    preempts, and its own prefix cache is emptied when idle now and then so that kvlife
    loads: every store's host pages hold the device blocks it was given, every load's
    blocks the pages it read, the page account balances at every step, and the log checks
    clean."""
    loaded = preempted = aborted = 0
    for seed in range(3):
        rng = random.Random(seed)
        audit = tmp_path / f"kvlife-{seed}.jsonl"
        engine = Engine(blocks=16, host_pages=16, runner="v2-async", audit_log=str(audit))
        for n in range(160):
            if n % 40 == 39:  # idle now and then, vLLM's own prefix cache emptied
                engine.run_until_idle(400)
                assert engine.scheduler.reset_prefix_cache()  # only kvlife's hits remain
            live = set(engine.scheduler.requests)
            if len(live) < 5 and rng.random() < 0.5:
                rid = rng.choice("abcdef")  # a small id space: ids come back
                if rid not in live:
                    first = rng.choice((1000, 2000, 3000))  # three prompts' worth of prefixes
                    engine.scheduler.add_request(
                        make_request(
                            rid, prompt=rng.randint(20, 70), max_tokens=rng.randint(1, 60),
                            first=first,
                        )
                    )  # fmt: skip
            if live and rng.random() < 0.05:
                aborted += len(
                    engine.scheduler.finish_requests(
                        rng.choice(sorted(live)), RequestStatus.FINISHED_ABORTED
                    )
                )
            engine.hold_all = rng.random() < 0.3
            engine.step(release=[] if engine.hold_all else list(engine.held))
            account = engine.connector.account()
            assert account.balanced and account.capacity == 16, (seed, account)
        engine.run_until_idle(400)
        account = engine.connector.account()
        assert account.balanced and account.storing == account.pinned == 0
        assert not engine.connector.planner.fenced and engine.connector.planner.inflight == 0
        assert engine.loads and len(engine.expected) == len(engine.stores) > 10, seed
        engine.connector.registry.flush()
        report = check_audit(AuditReader(audit), expect_released=True)
        assert report.ok and report.lifecycles > 20, (seed, report.violations)
        assert not any(engine.connector.registry.statistics().refusals.values())
        loaded, preempted = loaded + len(engine.loads), preempted + engine.preemptions
    assert loaded > 5 and preempted > 5 and aborted > 5, (loaded, preempted, aborted)


@pytest.mark.parametrize("runner", ["v1", "v2", "v2-async"])
def test_every_full_block_is_stored_by_the_end_under_every_runner(runner: str) -> None:
    """A request of 40 prompt tokens stores every block its computed tokens fill (40 +
    max_tokens - 1: the last sampled token is never computed), whichever step filled it.
    Under async scheduling the block the last step fills is named (hashed) only when that
    step's output comes back, after the next step was planned: it is stored when the
    request finishes (``last_stores``), launched before the next forward pass, and its
    bytes are the request's (checked at launch)."""
    for max_tokens in (8, 9, 24, 25, 30):
        engine = Engine(runner=runner)
        engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=max_tokens))
        engine.run_until_idle()
        want = (40 + max_tokens - 1) // 16
        assert engine.connector.counters["stored_blocks"] == want, (max_tokens, runner)
        assert len(engine.expected) == len(engine.stores)  # every store's bytes checked


@pytest.mark.parametrize("runner", ["v1", "v2-async"])
def test_a_last_store_reads_its_blocks_before_their_next_request_writes_them(
    runner: str, tmp_path: Any
) -> None:
    """A KV cache of four blocks (three usable): request ``a`` (three blocks, its third
    filled by its last step) finishes and ``b`` waits for blocks. vLLM hands ``a``'s
    blocks to ``b`` in the step after ``a`` finished (async: the one after that), whose
    forward pass writes them; ``a``'s last store is launched before it (its bytes checked
    at launch are ``a``'s), the step waits for it, and the log checks clean."""
    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(blocks=4, runner=runner, stride_blocks=4, audit_log=str(audit))
    engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=9))
    engine.step()
    engine.scheduler.add_request(make_request("b", prompt=40, max_tokens=2, first=5000))
    last = []
    while engine.scheduler.has_requests() or engine.queue:
        out = engine.step()
        meta = None if out is None else out.kv_connector_metadata
        if meta is not None and meta.last_stores:
            last.append(meta)
    meta, then = last  # a's three blocks, short of a stride of four: stored at its end
    (store,) = meta.last_stores
    assert store.slots == (1, 2, 3) and store.op in meta.wait_jobs  # b got them this step
    assert [s.slots for s in then.last_stores] == [(3, 2)]  # b's two, in the step after it
    assert engine.connector.counters["stored_blocks"] == 5
    engine.connector.registry.flush()
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 2, report.violations


@pytest.mark.parametrize("runner", ["v1", "v2-async"])
def test_a_prompt_computed_in_chunks_samples_nothing_until_its_last_chunk(runner: str) -> None:
    """Two prompts of 600 tokens in one step of 1024: vLLM computes the second in two
    chunks. The model runner discards what it samples for a chunk that does not end the
    prompt (``prefill_chunks``), so that the request's first output comes after its whole
    prompt (under ``AsyncScheduler`` a token for a chunk is an output placeholder vLLM
    never counted: vLLM 0.32 asserts on it)."""
    engine = Engine(blocks=128, host_pages=128, runner=runner)
    for rid, first in (("a", 1000), ("b", 5000)):
        engine.scheduler.add_request(make_request(rid, prompt=600, max_tokens=4, first=first))
    a, b = engine.scheduler.requests.values()
    out = engine.step()
    assert prefill_chunks(engine.scheduler, out) == {"b"}
    if runner == "v2-async":
        engine.step()  # the first step's output comes back once the second is scheduled
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 0)  # b: its first chunk only
    engine.run_until_idle()
    assert [list(r.output_token_ids) for r in (a, b)] == [[TOKEN] * 4] * 2
    assert engine.connector.counters["stored_blocks"] == 2 * (604 // 16)


def test_a_prefix_cache_reset_with_the_connector_empties_the_host_cache() -> None:
    engine = Engine()
    _cached_prefix(engine)  # a's three blocks in the host cache, vLLM's own emptied
    assert engine.connector.account().cached == 3
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    account = engine.connector.account()
    assert (account.free, account.cached) == (64, 0)
    engine.scheduler.add_request(make_request("b", prompt=48, max_tokens=2))
    assert engine.step().kv_connector_metadata.loads == []  # nothing left to load
    engine.run_until_idle()


def test_a_reset_while_a_load_reads_the_cache_says_it_could_not() -> None:
    engine = Engine()
    _cached_prefix(engine)
    engine.scheduler.add_request(make_request("b", prompt=48, max_tokens=2))
    engine.hold_all = True
    engine.step()  # b's load pins two pages
    assert engine.connector.reset_cache() is False
    assert engine.connector.account().pinned == 2  # still read: still cached
    engine.run_until_idle()
    assert engine.connector.reset_cache() is True
    assert engine.connector.account().free == 64


def _tier(events: list[Any], medium: str | None, kind: str) -> list[Any]:
    return [e for e in events if type(e).__name__ == kind and e.medium == medium]


def _medium(event: Any) -> str | None:
    return getattr(event, "medium", None)  # vLLM's AllBlocksCleared has none


def test_the_host_tier_is_published_as_kv_events_a_router_can_match_to_the_device() -> None:
    engine = Engine(kv_events=True, host_pages=4)
    engine.scheduler.add_request(make_request("a", prompt=48, max_tokens=2))
    engine.run_until_idle()
    device = {h: e for e in _tier(engine.events, None, "BlockStored") for h in e.block_hashes}
    device |= {h: e for e in _tier(engine.events, "GPU", "BlockStored") for h in e.block_hashes}
    (stored,) = _tier(engine.events, "CPU", "BlockStored")  # one store of three blocks
    assert len(stored.block_hashes) == 3 and stored.parent_block_hash is None
    assert stored.block_size == 16 and len(stored.token_ids) == 48
    for i, block_hash in enumerate(stored.block_hashes):  # the device's hash, same tokens
        assert block_hash in device, i
        on_device = device[block_hash]
        start = on_device.block_hashes.index(block_hash) * on_device.block_size
        assert on_device.token_ids[start : start + 16] == stored.token_ids[i * 16 : i * 16 + 16]
    view: set[Any] = set()  # a router's view of the host tier, from the events alone

    def router_view() -> set[Any]:
        for event in engine.events:
            if _medium(event) != "CPU":
                continue
            if type(event).__name__ == "BlockStored":
                view.update(event.block_hashes)
            else:  # a removal names only blocks the tier was said to hold
                assert set(event.block_hashes) <= view
                view.difference_update(event.block_hashes)
        engine.events.clear()
        return view

    assert router_view() == set(stored.block_hashes)
    engine.scheduler.reset_prefix_cache()
    engine.scheduler.add_request(make_request("b", prompt=48, max_tokens=20, first=5000))
    engine.run_until_idle()  # b's four blocks need the pages: a's three are evicted
    assert _tier(engine.events, "CPU", "BlockRemoved")
    b_stored = _tier(engine.events, "CPU", "BlockStored")
    assert b_stored[0].parent_block_hash is None and len(b_stored) >= 2
    assert b_stored[1].parent_block_hash == b_stored[0].block_hashes[-1]  # one chain
    held = router_view()
    assert len(held) == engine.connector.account().cached == 4
    assert not held & set(stored.block_hashes)
    assert engine.connector.reset_cache() is True
    engine.scheduler.add_request(make_request("c", prompt=8, max_tokens=1, first=9000))
    engine.run_until_idle()  # the reset's removals are published with the next step
    assert router_view() == set()


def test_without_kv_events_the_connector_publishes_none() -> None:
    engine = Engine(host_pages=4)
    engine.scheduler.add_request(make_request("a", prompt=48, max_tokens=2))
    engine.run_until_idle()
    assert list(engine.connector.take_events()) == []


def test_a_request_the_connector_never_saw_is_refused_not_raised() -> None:
    engine = Engine()
    stranger = make_request("x")
    assert engine.connector.get_num_new_matched_tokens(stranger, 0) == (0, False)
    assert engine.connector.request_finished(stranger, []) == (False, None)
    assert engine.connector.registry.statistics().refusals["unknown_request"] == 1


# ------------------------------------------------------------ layouts (worker side)

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvlife.offload import LayoutError  # noqa: E402
from kvlife.offload.engines.vllm import (  # noqa: E402
    STAT_KEYS,
    ConnectorConfig,
    KVLifeConnector,
    KVLifeConnectorMetadata,
    KVLifeConnectorStats,
)
from kvlife.offload.engines.vllm_common.stats import AUDIT_COUNTERS  # noqa: E402
from kvlife.offload.planner import LoadOrder, StoreOrder  # noqa: E402

LAYOUT_BLOCKS, LAYOUT_LAYERS = 12, 3


def _vllm_caches(
    layout: KVCacheLayout, kernel_block: int | None = None
) -> tuple[KVCacheConfig, dict[str, torch.Tensor], torch.Tensor]:
    """Three layers' caches from vLLM's own allocator in ``layout``, random bytes in every
    block. Returns the config, the per-layer views and the buffer under them."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    config, caches = vllm_caches(
        layout, spec, layers=LAYOUT_LAYERS, blocks=LAYOUT_BLOCKS, kernel_block=kernel_block
    )
    generator = torch.Generator().manual_seed(layout.value[0] * 10 + layout.value[2])
    first = next(iter(caches.values()))
    raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return config, caches, raw


def _worker(config: KVCacheConfig, layout: str | None, host_pages: int = 8) -> KVLifeConnector:
    vllm_config = make_scheduler(
        "KVLifeConnector", "kvlife.offload.engines.vllm", {"host_pages": host_pages}
    ).vllm_config
    vllm_config.cache_config.kv_cache_layout = layout
    return KVLifeConnector(vllm_config, KVConnectorRole.WORKER, config)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers: random bytes hold NaNs, which equal nothing."""
    return tensor.contiguous().view(torch.int16)


def _run_jobs(worker: KVLifeConnector, meta: KVLifeConnectorMetadata) -> dict[int, int]:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    worker.wait_for_save()
    done = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    assert done is not None and not done.failed
    return dict(done.done)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_every_vllm_layout_stores_and_loads_blocks_byte_for_byte(layout: KVCacheLayout) -> None:
    config, caches, raw = _vllm_caches(layout)
    worker = _worker(config, layout.name)
    worker.register_kv_caches(caches)
    before = {name: view.clone() for name, view in caches.items()}
    stored, pages = [3, 7, 1], [0, 1, 2]
    assert _run_jobs(
        worker, KVLifeConnectorMetadata(stores=[StoreOrder(5, tuple(stored), tuple(pages), 0)])
    ) == {5: 1}
    host = worker.host_pages.tensor
    for page, block in zip(pages, stored, strict=True):
        for layer, view in enumerate(caches.values()):
            # a host page holds the block's bytes; for layouts whose block interior is
            # contiguous, exactly the bytes vLLM's buffer holds for that block
            held = _bits(host[page, layer].reshape(-1))
            if layout.is_block_outermost:
                continue  # a block of every layer as vLLM holds it: checked below
            assert torch.equal(held.sort().values, _bits(view[block]).reshape(-1).sort().values)
            if layout.is_block_contiguous:
                start = (view[block].data_ptr() - raw.data_ptr()) // view.element_size()
                assert torch.equal(held, _bits(raw).view(-1)[start : start + held.numel()])
    copier = worker._worker_side().ready().copier  # type: ignore[union-attr]
    assert copier.path == ("direct" if layout.is_block_outermost else "gather")
    if layout.is_block_outermost:  # the page is the block's bytes in vLLM's buffer
        first = next(iter(caches.values()))
        size = host[0].numel() * host.element_size()
        for page, block in zip(pages, stored, strict=True):
            start = first[block].data_ptr() - raw.data_ptr()
            assert torch.equal(host[page].reshape(-1).view(torch.uint8), raw[start : start + size])
    targets = [9, 4, 10]  # loaded into other blocks, as vLLM allocates them for a hit
    loads = [LoadOrder(6, tuple(targets), tuple(pages), 0)]
    assert _run_jobs(worker, KVLifeConnectorMetadata(loads=loads)) == {6: 1}
    for name, view in caches.items():
        for source, target in zip(stored, targets, strict=True):
            assert torch.equal(_bits(view[target]), _bits(before[name][source]))
        untouched = [b for b in range(LAYOUT_BLOCKS) if b not in targets]
        assert torch.equal(_bits(view[untouched]), _bits(before[name][untouched]))


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_every_vllm_layout_copies_a_hybrid_models_groups_byte_for_byte(
    layout: KVCacheLayout,
) -> None:
    """Two KV cache groups (a sliding window and full attention, two layers each) made by
    vLLM's own allocator in ``layout``: each group's column of a row is stored into the
    same host page and loaded back into the rows' blocks; a group with no block in a row
    (``None``, behind a sliding window) is neither read nor written."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: PLC0415

    kwargs = {"block_size": 16, "num_kv_heads": 2, "head_size": 8, "dtype": torch.float16}
    specs = (SlidingWindowSpec(sliding_window=32, **kwargs), FullAttentionSpec(**kwargs))
    configs, caches = [], {}
    for spec, prefix in zip(specs, ("swa", "full"), strict=True):
        config, group = vllm_caches(layout, spec, layers=2, blocks=LAYOUT_BLOCKS, prefix=prefix)
        configs.append(config)
        for view in group.values():  # random bytes in every block
            raw = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        caches.update(group)
    config = KVCacheConfig(
        num_blocks=LAYOUT_BLOCKS,
        kv_cache_tensors=[t for c in configs for t in c.kv_cache_tensors],
        kv_cache_groups=[c.kv_cache_groups[0] for c in configs],
    )
    config.kv_cache_groups[0] = KVCacheGroupSpec(config.kv_cache_groups[0].layer_names, specs[0])
    worker = _worker(config, layout.name)
    worker.register_kv_caches(caches)
    groups = [list(g.layer_names) for g in config.kv_cache_groups]
    before = {name: view.clone() for name, view in caches.items()}
    rows, pages = ((3, 5), (7, 2), (1, 8)), (0, 1, 2)
    stores = [StoreOrder(5, rows, pages, 0)]
    assert _run_jobs(worker, KVLifeConnectorMetadata(stores=stores)) == {5: 1}
    hosts = worker._worker_side().ready().hosts  # type: ignore[union-attr]
    for page, row in zip(pages, rows, strict=True):
        for group, names in enumerate(groups):
            # the group's part of the page holds its layers' bytes of the block (in vLLM's
            # byte order where the layout is block-outermost: one run copied whole)
            held = _bits(hosts[group].tensor[page].reshape(-1)).sort().values
            device = torch.cat([_bits(caches[name][row[group]]).reshape(-1) for name in names])
            assert torch.equal(held, device.sort().values), (page, group)
    targets: tuple[tuple[int | None, int], ...] = ((9, 4), (None, 10), (11, 0))
    loads = [LoadOrder(6, targets, pages, 0)]
    assert _run_jobs(worker, KVLifeConnectorMetadata(loads=loads)) == {6: 1}
    for group, names in enumerate(groups):
        written = [row[group] for row in targets if row[group] is not None]
        for name in names:
            view = caches[name]
            for source, target in zip(rows, targets, strict=True):
                if target[group] is not None:
                    assert torch.equal(
                        _bits(view[target[group]]), _bits(before[name][source[group]])
                    )
            untouched = [b for b in range(LAYOUT_BLOCKS) if b not in written]
            assert torch.equal(_bits(view[untouched]), _bits(before[name][untouched]))


def test_kernel_blocks_that_split_a_vllm_block_are_copied_as_one_block() -> None:
    config, caches, _ = _vllm_caches(KVCacheLayout.LBHNC, kernel_block=8)
    view = next(iter(caches.values()))
    assert view.shape[0] == 2 * LAYOUT_BLOCKS  # two kernel blocks per vLLM block
    worker = _worker(config, "LBHNC")
    worker.register_kv_caches(caches)
    before = {name: v.clone() for name, v in caches.items()}
    _run_jobs(worker, KVLifeConnectorMetadata(stores=[StoreOrder(1, (5,), (0,), 0)]))
    _run_jobs(worker, KVLifeConnectorMetadata(loads=[LoadOrder(2, (2,), (0,), 0)]))
    for name, v in caches.items():  # vLLM block 5 is kernel blocks 10 and 11
        assert torch.equal(_bits(v[4:6]), _bits(before[name][10:12]))


def test_unsupported_caches_are_refused_at_registration_naming_them() -> None:
    config, caches, _ = _vllm_caches(KVCacheLayout.LBHNC)
    worker = _worker(config, "LBHNC")
    flat = {name: view.reshape(LAYOUT_BLOCKS, -1) for name, view in caches.items()}
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.attn.*shape \(12, 512\)"):
        worker.register_kv_caches(flat)
    uneven = dict(caches)
    uneven["model.layers.2.attn"] = torch.zeros(LAYOUT_BLOCKS, 1, 16, 16, dtype=torch.float16)
    with pytest.raises(LayoutError, match=r"one block shape.*model\.layers\.2\.attn"):
        worker.register_kv_caches(uneven)
    odd = {"layer": torch.zeros(LAYOUT_BLOCKS + 1, 2, 16, 16, dtype=torch.float16)}
    with pytest.raises(LayoutError, match="13 blocks is not a multiple of the engine's 12"):
        worker.register_kv_caches(odd)
    with pytest.raises(LayoutError, match="no KV cache tensors"):
        worker.register_kv_caches({})
    # caches strided as LBNHC while vLLM says LBHNC: the block interior is not vLLM's
    other_config, other, _ = _vllm_caches(KVCacheLayout.LBNHC)
    with pytest.raises(LayoutError, match=r"LBHNC layout.*do not follow"):
        _worker(other_config, "LBHNC").register_kv_caches(other)
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        _ = worker.host_pages  # nothing was built by the refused calls


def test_a_kv_cache_group_kvlife_cannot_copy_is_refused_at_start_naming_it() -> None:
    from vllm.v1.kv_cache_interface import MambaSpec  # noqa: PLC0415

    config, _, _ = _vllm_caches(KVCacheLayout.LBHNC)
    group = config.kv_cache_groups[0]
    ssm = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float16,))
    config.kv_cache_groups = [group, KVCacheGroupSpec(["ssm.0"], ssm)]
    with pytest.raises(LayoutError, match=r"group 1 of this model is a MambaSpec \(layers ssm.0\)"):
        _worker(config, "LBHNC")


def test_a_hybrid_models_groups_are_stored_and_loaded_byte_for_byte() -> None:
    """Two KV cache groups (a sliding window of 4 blocks and full attention), vLLM's
    hybrid KV cache manager on: each store copies every group's block into one host page;
    after vLLM's own prefix cache is emptied, the same prompt loads every full-attention
    block and the sliding window's blocks inside its window, byte for byte."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA  # noqa: PLC0415

    from tests.engines.vllm_harness import BLOCK, HEAD_DIM, HEADS, model_output  # noqa: PLC0415

    blocks, names = 128, ("swa", "full")
    scheduler = make_scheduler(
        "KVLifeConnector",
        "kvlife.offload.engines.vllm",
        {"host_pages": 64},
        blocks=blocks,
        window=64,
    )
    assert isinstance(scheduler.connector, SupportsHMA)
    assert not scheduler.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    worker = KVLifeConnector(
        scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config
    )
    kv = {
        name: torch.zeros((2, blocks, BLOCK, HEADS, HEAD_DIM), dtype=torch.float16)
        for name in names
    }
    worker.register_kv_caches(kv)
    hosts = worker._worker_side().ready().hosts  # type: ignore[union-attr]

    def step() -> Any:
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        for req_id, count in out.num_scheduled_tokens.items():  # the forward pass
            ids = scheduler.kv_cache_manager.get_block_ids(req_id)
            start = scheduler.requests[req_id].num_computed_tokens - count  # advanced already
            for position in range(start, start + count):
                for group, name in enumerate(names):
                    block = ids[group][position // BLOCK]
                    if block:
                        kv[name][:, block, position % BLOCK] = position + 1000 * group + 1
        worker.handle_preemptions(meta)
        worker.wait_for_save()
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        scheduler.update_from_output(out, model_output(out, worker_meta))
        return meta

    stored: dict[int, list[torch.Tensor]] = {}  # block index -> each group's host bytes
    scheduler.add_request(make_request("a", prompt=200, max_tokens=1))
    for _ in range(3):
        for store in step().stores:
            for i, (row, page) in enumerate(zip(store.slots, store.pages, strict=True)):
                assert all(block is not None for block in row)  # every group holds it
                parts = [hosts[g].page_view(page, 1)[0].clone() for g in range(2)]
                for group, name in enumerate(names):  # the host page is the device block
                    device = kv[name][:, row[group]].reshape(-1).view(torch.uint8)
                    assert torch.equal(parts[group].reshape(-1).view(torch.uint8), device)
                stored[store.first + i] = parts
    assert sorted(stored) == list(range(12))  # 200 tokens: 12 full blocks

    assert scheduler.reset_prefix_cache()  # vLLM's own cache only: kvlife's host cache stays
    for tensor in kv.values():
        tensor.zero_()
    scheduler.add_request(make_request("b", prompt=200, max_tokens=1))
    meta = step()
    (load,) = meta.loads
    assert load.first == 0 and len(load.slots) == 12
    loaded_windows = 0
    for j, row in enumerate(load.slots):
        assert row[1] is not None  # full attention: every block
        for group, name in enumerate(names):
            if row[group] is None:
                continue
            loaded_windows += group == 0
            device = kv[name][:, row[group]].reshape(-1).view(torch.uint8)
            assert torch.equal(stored[j][group].reshape(-1).view(torch.uint8), device), (j, group)
    assert 0 < loaded_windows < 12  # the window's blocks, not those behind it


def _multi(children: list[dict[str, Any]]) -> Any:
    """A vLLM config whose connector is vLLM's MultiConnector of ``children``."""
    vllm_config = make_scheduler("KVLifeConnector", KVLIFE).vllm_config
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children},
    )
    return vllm_config


KVLIFE_CHILD = {
    "kv_connector": "KVLifeConnector",
    "kv_connector_module_path": KVLIFE,
    "kv_role": "kv_both",
}


def test_the_connector_asks_for_a_block_outermost_layout_with_the_backends_interior(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvlife.offload.engines.vllm.layouts import block_layout_wish  # noqa: PLC0415

    vllm_config = make_scheduler("KVLifeConnector", KVLIFE).vllm_config
    assert block_layout_wish(vllm_config, cuda=True, capability=9) == "BLNHC"  # NHD
    assert block_layout_wish(vllm_config, cuda=True, capability=10) == "BLHNC"  # FlashInfer
    assert block_layout_wish(vllm_config, cuda=False) is None  # CPU_ATTN: LBHNC only
    assert KVLifeConnector.get_required_kvcache_layout(vllm_config) is None  # this machine
    off = make_scheduler("KVLifeConnector", KVLIFE, {"block_layout": False}).vllm_config
    assert block_layout_wish(off, cuda=True, capability=9) is None
    monkeypatch.setattr(type(vllm_config.model_config), "use_mla", property(lambda self: True))
    assert block_layout_wish(vllm_config, cuda=True, capability=9) is None


def _hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's platform says CUDA, compute capability 9.0 (the wish is made on CUDA only)."""
    from vllm.platforms import current_platform  # noqa: PLC0415
    from vllm.platforms.interface import DeviceCapability  # noqa: PLC0415

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.setattr(
        type(current_platform),
        "get_device_capability",
        classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)),
    )


def test_vllm_resolves_the_wish_when_the_backend_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: PLC0415

    _hopper(monkeypatch)
    vllm_config = make_scheduler("KVLifeConnector", KVLIFE).vllm_config
    vllm_config.cache_config.kv_cache_layout = None
    every = [[layout.name for layout in KVCacheLayout]]
    assert resolve_kv_cache_layout(vllm_config, every).name == "BLNHC"
    # a backend that takes only LBHNC (vLLM's CPU one): the wish is dropped, LBHNC it is
    vllm_config.cache_config.kv_cache_layout = None
    assert resolve_kv_cache_layout(vllm_config, [["LBHNC"]]).name == "LBHNC"


@pytest.mark.parametrize("sibling", ["NixlConnector", "OffloadingConnector"])
def test_inside_a_multi_connector_kvlife_withdraws_its_wish_and_the_engine_starts(
    sibling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NixlConnector and OffloadingConnector wish LBHNC; vLLM's MultiConnector refuses
    children that wish different layouts. kvlife's wish is withdrawn there (first or
    second child, or behind the audit wrapper), and vLLM resolves its siblings' layout."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: PLC0415
        MultiConnector,
    )
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: PLC0415

    _hopper(monkeypatch)
    wrapped = {
        "kv_connector": "KVLifeAuditConnector",
        "kv_connector_module_path": KVLIFE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connector": KVLIFE_CHILD},
    }
    other = {"kv_connector": sibling, "kv_role": "kv_both"}
    for children in ([KVLIFE_CHILD, other], [other, KVLIFE_CHILD], [wrapped, other]):
        vllm_config = _multi(children)
        assert MultiConnector.get_required_kvcache_layout(vllm_config) == "LBHNC"
        vllm_config.cache_config.kv_cache_layout = None
        every = [[layout.name for layout in KVCacheLayout]]
        assert resolve_kv_cache_layout(vllm_config, every).name == "LBHNC"
    alone = _multi([KVLIFE_CHILD])  # nothing to agree with, still withdrawn: no guess
    assert MultiConnector.get_required_kvcache_layout(alone) is None
    top = make_scheduler("KVLifeConnector", KVLIFE).vllm_config  # kvlife on its own asks
    assert KVLifeConnector.get_required_kvcache_layout(top) == "BLNHC"


# ------------------------------------------------------------ configuration and stats


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"hostpages": 4}, "unknown kv_connector_extra_config key 'hostpages'"),
        ({"host_pages": 0}, "host_pages must be a positive integer, got 0"),
        ({"host_pages": "4"}, "host_pages must be a positive integer, got '4'"),
        ({"host_bytes": 1 << 20, "host_pages": 4}, "host_pages or host_bytes, not both"),
        ({"stride_blocks": True}, "stride_blocks must be a positive integer"),
        ({"audit_flush_s": 0}, "audit_flush_s must be a positive number"),
        ({"audit_fsync": "always"}, "audit_fsync must be one of never, batch, record"),
        ({"audit_backups": -1}, "audit_backups must be an integer >= 0"),
        ({"audit_log": ""}, "audit_log must be a file path"),
        ({"stats_interval_s": -1}, "stats_interval_s must be a number >= 0"),
    ],
)
def test_bad_extra_config_stops_the_engine_with_a_line_naming_the_key(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_scheduler("KVLifeConnector", "kvlife.offload.engines.vllm", extra)


def test_each_data_parallel_engine_core_writes_its_own_audit_log() -> None:
    from kvlife.offload.engines.vllm import audit_path  # noqa: PLC0415

    config = make_scheduler("KVLifeConnector", "kvlife.offload.engines.vllm").vllm_config
    assert audit_path("/logs/kvlife.jsonl", config) == "/logs/kvlife.jsonl"  # one engine core
    # vLLM marks a data-parallel rank's engine id, and for a dense model resets the rank's
    # own parallel config to one rank: the mark is what tells the ranks apart
    config.kv_transfer_config.engine_id = "3f2c_dp1"
    assert audit_path("/logs/kvlife.jsonl", config) == "/logs/kvlife.dp1.jsonl"
    assert audit_path("/logs/kvlife", config) == "/logs/kvlife.dp1"
    config.kv_transfer_config.engine_id = "3f2c"
    config.parallel_config.data_parallel_size = 2  # a rank whose config says so (MoE)
    config.parallel_config.data_parallel_rank = 1
    assert audit_path("/logs/kvlife.jsonl", config) == "/logs/kvlife.dp1.jsonl"


def test_host_bytes_is_as_many_whole_blocks_as_fit() -> None:
    spec_bytes = 2 * 16 * 12 * 64 * 2  # K and V, 16 tokens, 12 heads of 64, fp16: one layer
    engine = make_scheduler(
        "KVLifeConnector", "kvlife.offload.engines.vllm", {"host_bytes": 5 * spec_bytes + 7}
    )
    assert engine.connector.free_host_pages == 5
    with pytest.raises(ValueError, match="holds no block"):
        make_scheduler("KVLifeConnector", "kvlife.offload.engines.vllm", {"host_bytes": 100})
    assert ConnectorConfig.parse(None).pages(spec_bytes) == 1024


def test_stats_are_the_counters_growth_and_aggregate_as_vllm_expects() -> None:
    engine = Engine(stats_interval_s=0)  # at every step
    engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=2))
    engine.run_until_idle()  # vLLM took each step's growth through the stats hook
    counts = engine.connector.counters
    assert counts["stores"] == 1 and counts["stored_blocks"] == 2
    assert engine.connector.get_kv_connector_stats() is None  # nothing new since
    rebuilt = KVLifeConnector.build_kv_connector_stats({"stores": 2, "loads": 1})
    assert isinstance(rebuilt, KVLifeConnectorStats)
    total = rebuilt.aggregate(KVLifeConnectorStats(data={"stores": 1, "evictions": 4}))
    assert total.reduce()["stores"] == 3 and total.reduce()["evictions"] == 4
    assert not total.is_empty() and KVLifeConnector.build_kv_connector_stats().is_empty()


def test_stats_are_handed_over_once_per_interval_and_lose_no_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]  # vLLM's clock stands still unless the test moves it
    monkeypatch.setattr("kvlife.offload.engines.vllm.scheduler.monotonic", lambda: now[0])
    engine = Engine(stats_interval_s=10)
    connector = engine.connector
    engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=1))
    engine.step()  # a's store is done: vLLM is handed the first growth in this step
    first = dict(connector.counters)
    assert first["stores"] == 1
    engine.scheduler.add_request(make_request("b", prompt=40, max_tokens=1, first=3000))
    engine.run_until_idle()  # b's store and its report, within the interval
    assert connector.get_kv_connector_stats() is None
    now[0] += 10
    stats = connector.get_kv_connector_stats()
    assert stats is not None
    growth = stats.reduce()
    assert {key: growth[key] for key in first} == {
        key: connector.counters[key] - first[key] for key in first
    }
    assert growth["stores"] == 1 and growth["host_pages_cached"] == 4
    assert connector.get_kv_connector_stats() is None  # nothing new in this interval


class _Metric:
    """A stand-in for a prometheus_client metric class: records what it was given."""

    made: ClassVar[dict[str, _Metric]] = {}

    def __init__(self, name: str, documentation: str, labelnames: list[str], **_: Any) -> None:
        assert documentation and labelnames[:2] == ["engine", "model_name"]
        self.values: dict[tuple[Any, ...], float] = {}
        self.made[name] = self
        self._labels: tuple[Any, ...] = ()

    def labels(self, *values: Any) -> _Metric:
        self._labels = values
        return self

    def inc(self, value: float) -> None:
        self.values[self._labels] = self.values.get(self._labels, 0) + value

    def set(self, value: float) -> None:
        self.values[self._labels] = value


def test_kvlifes_stats_reach_prometheus_with_vllms_labels() -> None:
    from prometheus_client import Counter, Gauge, Histogram  # noqa: PLC0415

    _Metric.made.clear()  # another test's metrics are not this one's
    vllm_config = make_scheduler("KVLifeConnector", "kvlife.offload.engines.vllm").vllm_config
    labels = {0: ["0", "m"], 1: ["1", "m"]}
    prom = KVLifeConnector.build_prom_metrics(
        vllm_config,
        {Counter: _Metric, Gauge: _Metric, Histogram: _Metric},
        ["engine", "model_name"],
        labels,
    )
    prom.observe({"stores": 2, "stored_bytes": 100, "host_pages_free": 7}, engine_idx=1)
    prom.observe({"stores": 3, "host_pages_free": 5, "lifecycles_allocated": 4}, engine_idx=1)
    made = _Metric.made
    assert made["vllm:kvlife_stores"].values == {("1", "m"): 5}  # counters add up
    assert made["vllm:kvlife_stored_bytes"].values == {("1", "m"): 100}
    assert made["vllm:kvlife_host_pages_free"].values == {("1", "m"): 5}  # gauges: latest
    assert made["vllm:kvlife_lifecycles_allocated"].values == {("1", "m"): 4}
    exported = (*STAT_KEYS, *AUDIT_COUNTERS, "verdicts")  # the last two for the alert rules
    assert set(made) == {f"vllm:kvlife_{key}" for key in exported}


def test_stats_carry_bytes_and_the_lifecycles_live_per_state() -> None:
    engine = Engine(stats_interval_s=0)
    connector = engine.connector
    handed: list[dict[str, Any]] = []  # what vLLM's stats hook was given, step by step
    take = connector.get_kv_connector_stats

    def hook() -> Any:
        stats = take()
        if stats is not None:
            handed.append(stats.reduce())
        return stats

    connector.get_kv_connector_stats = hook
    engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=30))
    engine.hold_all = True
    engine.step()  # a's store is in flight: a is offloading
    assert handed[-1]["lifecycles_offloading"] == 1 and handed[-1]["host_pages_storing"] == 2
    engine.run_until_idle()
    assert handed[-1]["lifecycles_allocated"] == handed[-1]["lifecycles_offloading"] == 0
    stored = sum(h["stored_blocks"] for h in handed)
    per_block = connector._scheduler.bytes_per_block
    assert sum(h["stored_bytes"] for h in handed) == stored * per_block > 0
    assert per_block == 2 * 16 * 12 * 64 * 2  # the scheduler's spec: K+V, 12 x 64, fp16


def test_every_connector_call_leaves_its_records_in_the_file(tmp_path: Any) -> None:
    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(audit_log=str(audit), audit_flush_s=3600)  # nothing on a timer
    engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=2))
    engine.run_until_idle()
    # no flush, no close: what a killed engine core leaves is the whole story so far
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 1 and report.records == 4
    assert (tmp_path / "kvlife.jsonl.open").exists()  # the log was not closed
    engine.connector.shutdown()
    assert not (tmp_path / "kvlife.jsonl.open").exists()


def test_the_scheduler_benchmark_runs_every_config_on_the_same_steps() -> None:
    from tests.engines.vllm_bench import CONFIGS, copy_speed, measure  # noqa: PLC0415

    result = measure(rounds=1, requests=40, concurrent=8)
    steps = {result[config]["steps"] for config in CONFIGS}
    assert len(steps) == 1 and steps.pop() > 40  # one workload, one schedule, every config
    for config in CONFIGS[1:]:
        assert result[config]["median_us"] > 0 and result[config]["p99_ratio"] > 0
    assert all(result[config]["young_gcs"] >= 0 for config in CONFIGS)
    speed = copy_speed(layers=2, blocks=64, copied=8, reps=3)
    assert speed["store_gbs"] > 0 and speed["load_gbs"] > 0 and speed["mib"] == 1.0


def test_vllms_ipc_sockets_go_to_the_test_sessions_own_directory() -> None:
    """vLLM leaves its ZMQ socket files behind: the engine tests' session directory
    (``tests/engines/conftest.py``) takes them, not the temporary directory."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from vllm.utils.network_utils import get_open_zmq_ipc_path  # noqa: PLC0415

    from tests.engines.conftest import RPC_PREFIX  # noqa: PLC0415

    where = Path(get_open_zmq_ipc_path().removeprefix("ipc://")).parent
    assert where == Path(os.environ["VLLM_RPC_BASE_PATH"]) and where.is_dir()
    assert where.name.startswith(RPC_PREFIX) and where != Path(tempfile.gettempdir())


def test_the_scheduler_benchmark_runs_every_config_once_unkept_before_its_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first runs of a process are slower: a run of every config that is not kept
    comes first, so that the config that runs first in the rounds does not pay for them."""
    from tests.engines import vllm_bench  # noqa: PLC0415

    ran: list[tuple[str, int, int]] = []

    def run(config: str, *, seed: int, requests: int, **_: Any) -> list[float]:
        ran.append((config, seed, requests))
        return [float(len(ran))]

    monkeypatch.setattr(vllm_bench, "run", run)
    kept = list(
        vllm_bench._interleaved(("none", "kvlife"), rounds=2, seed=5, requests=40, concurrent=8)
    )
    assert ran == [
        ("none", 7, 8),  # not kept: concurrent requests, a seed no round uses
        ("kvlife", 7, 8),
        ("none", 5, 40),
        ("kvlife", 5, 40),
        ("kvlife", 6, 40),  # every other round reversed
        ("none", 6, 40),
    ]
    assert [(config, steps) for config, steps, _, _ in kept] == [
        ("none", [3.0]),
        ("kvlife", [4.0]),
        ("kvlife", [5.0]),
        ("none", [6.0]),
    ]


def test_the_scheduler_benchmark_counts_only_the_collections_inside_timed_steps() -> None:
    import gc  # noqa: PLC0415

    from tests.engines.vllm_bench import Collections  # noqa: PLC0415

    with Collections() as seen:
        gc.collect(0)  # outside a step: not counted
        seen.on = True
        gc.collect(0)
        gc.collect(1)
        seen.on = False
        gc.collect(0)
    gc.collect(0)  # uninstalled
    assert [generation for generation, _ in seen.seen] == [0, 1]
    assert all(seconds > 0 for _, seconds in seen.seen) and seen not in gc.callbacks


def test_the_benchmarks_source_config_runs_the_scheduler_side_from_its_source() -> None:
    """``kvlife@source``: the same connector with its scheduler side from the ``.py`` (what
    compiling the adapter gains, side by side); the connector module is left as it was."""
    import sys  # noqa: PLC0415

    from kvlife.fsm import native  # noqa: PLC0415
    from kvlife.offload.engines.vllm import connector, scheduler  # noqa: PLC0415
    from tests.engines import vllm_bench  # noqa: PLC0415

    source = vllm_bench._scheduler("kvlife@source", 64, "").connector._scheduler
    built = vllm_bench._scheduler("kvlife", 64, "").connector._scheduler
    assert type(source).__module__ == vllm_bench.SOURCE
    assert type(built) is scheduler.SchedulerSide is connector.SchedulerSide
    assert native.loaded()[scheduler.__name__] is native.compiled
    assert str(sys.modules[vllm_bench.SOURCE].__file__).endswith("scheduler.py")


def test_the_scheduler_benchmark_breaks_kvlifes_calls_down_and_runs_another_tree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pathlib import Path  # noqa: PLC0415

    from tests.engines.vllm_bench import SCHEDULER_CALLS, breakdown, main  # noqa: PLC0415

    calls = breakdown(("kvlife",), requests=30, concurrent=6)["kvlife"]
    assert set(calls) == {*SCHEDULER_CALLS, "total"}
    assert calls["build_connector_meta"] > 0 and calls["update_connector_output"] > 0
    assert calls["total"] == pytest.approx(sum(calls[name] for name in SCHEDULER_CALLS))
    root = Path(__file__).resolve().parents[2]  # this tree, loaded again as the "before"
    argv = ["--configs", "kvlife", "--rounds", "1", "--requests", "30", "--concurrent", "6"]
    assert main([*argv, "--no-copy", "--against", str(root)]) == 0
    out = capsys.readouterr().out
    assert "kvlife@before" in out and "per-call breakdown" in out
    assert "kvlife: now / before median" in out


def test_in_an_engine_core_process_a_termination_signal_settles_the_log_first(
    tmp_path: Any,
) -> None:
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415

    seen: list[int] = []

    def vllms_handler(signum: int, frame: Any) -> None:  # as vLLM's engine core has
        seen.append(signum)

    before = signal.signal(signal.SIGTERM, vllms_handler)
    try:
        audit = tmp_path / "kvlife.jsonl"
        engine = Engine(audit_log=str(audit), audit_flush_s=3600)
        engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=2))
        engine.step()
        assert (tmp_path / "kvlife.jsonl.open").exists()
        os.kill(os.getpid(), signal.SIGTERM)  # the server stops: a kill follows at once
        assert seen == [signal.SIGTERM]  # vLLM's own handler still ran, after kvlife's
        assert not (tmp_path / "kvlife.jsonl.open").exists()
        assert check_audit(AuditReader(audit)).ok  # every record so far, settled
        settled = len(read_audit(audit).records)
        # vLLM aborts or drains the running requests after the signal: their records end
        # with a closing record too, so a kill that comes now leaves the log closed
        engine.run_until_idle()
        [ending] = check_audit(AuditReader(audit)).endings
        assert (ending.status, ending.how) == ("closed", "signal"), ending
        assert len(read_audit(audit).records) > settled  # written after the signal
        engine.connector.shutdown()
        assert signal.getsignal(signal.SIGTERM) is vllms_handler  # kvlife's handler gone
        assert check_audit(AuditReader(audit), expect_released=True).lifecycles == 1
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_signal_that_lands_during_a_write_is_settled_at_the_next_write_out(
    tmp_path: Any,
) -> None:
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415

    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # vLLM's engine core
    try:
        audit = tmp_path / "kvlife.jsonl"
        engine = Engine(audit_log=str(audit), audit_flush_s=3600)
        engine.scheduler.add_request(make_request("a", prompt=40, max_tokens=2))
        engine.step()
        lock = engine.connector._scheduler.sink._file.lock
        with lock:  # the signal interrupts a write of the log: the handler writes nothing
            os.kill(os.getpid(), signal.SIGTERM)
        [ending] = check_audit(AuditReader(audit)).endings
        assert ending.status == "open" and (tmp_path / "kvlife.jsonl.open").exists()
        engine.connector._scheduler.log.written()  # the next write-out, nothing new to write
        [ending] = check_audit(AuditReader(audit)).endings
        assert (ending.status, ending.how) == ("closed", "signal"), ending
        closings = audit.read_text().count('"kvlife_closed"')
        engine.connector._scheduler.log.written()  # settled already: nothing written again
        assert audit.read_text().count('"kvlife_closed"') == closings
        engine.connector.shutdown()
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_second_engine_given_the_first_ones_audit_log_refuses_to_start(tmp_path: Any) -> None:
    from kvlife.fsm.audit import AuditLogBusyError  # noqa: PLC0415

    audit = tmp_path / "kvlife.jsonl"
    first = Engine(audit_log=str(audit))
    written = audit.read_bytes()
    with pytest.raises(AuditLogBusyError, match=r"kvlife\.jsonl is being written by another"):
        Engine(audit_log=str(audit))  # before: both wrote, interleaved, in one file
    assert audit.read_bytes() == written
    first.connector.shutdown()
    Engine(audit_log=str(audit)).connector.shutdown()  # the file is free once it is closed
    assert check_audit(AuditReader(str(audit))).ok


def test_an_audit_log_in_a_directory_not_made_yet_is_written_there(tmp_path: Any) -> None:
    """Before: ``FileNotFoundError`` and no engine, where SGLang's adapters made it."""
    audit = tmp_path / "var" / "log" / "kvlife" / "kvlife.jsonl"
    engine = Engine(audit_log=str(audit))
    engine.connector.shutdown()
    assert check_audit(AuditReader(str(audit))).ok


def test_outside_an_engine_core_process_no_signal_handler_changes(tmp_path: Any) -> None:
    import signal  # noqa: PLC0415

    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    engine = Engine(audit_log=str(tmp_path / "kvlife.jsonl"))
    assert engine.connector._scheduler.log.stop_hint(_stopping_in(0)) is None  # no kill
    engine.connector.shutdown()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def _stopping_in(seconds: int) -> Any:
    """A vLLM config whose ``shutdown_timeout`` is ``seconds``."""
    from types import SimpleNamespace  # noqa: PLC0415

    return SimpleNamespace(shutdown_timeout=seconds)


def test_an_engine_core_that_vllm_kills_at_once_at_a_stop_is_told_at_start(
    tmp_path: Any,
) -> None:
    """vLLM's default shutdown timeout (0 s) kills the engine core right after its
    signal: the start-up hint says the log may read cut short, and how to avoid it; a
    timeout of a few seconds, or no audit log, says nothing."""
    import signal  # noqa: PLC0415

    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # vLLM's engine core
    try:
        engine = Engine(audit_log=str(tmp_path / "kvlife.jsonl"))
        log = engine.connector._scheduler.log
        hint = log.stop_hint(_stopping_in(0))
        assert hint is not None and "cut short" in hint and "--shutdown-timeout" in hint
        assert log.stop_hint(_stopping_in(10)) is None
        assert log.stop_hint(object()) is None  # a vLLM without the setting
        engine.connector.shutdown()
        assert Engine().connector._scheduler.log.stop_hint(_stopping_in(0)) is None  # no log
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_store_held_back_past_audit_overdue_s_is_written_and_counted(tmp_path: Any) -> None:
    import time  # noqa: PLC0415

    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(audit_log=str(audit), audit_overdue_s=0.05, stats_interval_s=0)
    handed: list[dict[str, Any]] = []
    take = engine.connector.get_kv_connector_stats

    def hook() -> Any:
        stats = take()
        if stats is not None:
            handed.append(stats.reduce())
        return stats

    engine.connector.get_kv_connector_stats = hook
    (op, *_) = engine.prefill_holding_its_store(make_request("a", prompt=40, max_tokens=30))
    time.sleep(0.1)
    engine.step()  # the next step tells it: the store is still in flight
    (said,) = [r for r in read_audit(audit).records if r.reason == "overdue"]
    assert (said.rid, said.op, said.detail["kind"]) == ("a", op, "store")
    assert handed[-1]["tickets_overdue_open"] == 1 and handed[-1]["overdue_tickets"] == 1
    assert handed[-1]["verdict_overdue"] == 1  # the counter by verdict, for the rules
    engine.run_until_idle()  # reported late: no violation, the watch forgets it
    assert handed[-1]["tickets_overdue_open"] == 0
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and (report.overdue, report.overdue_completed) == (1, 1)
    assert not check_audit(AuditReader(audit), overdue_fails=True).ok


def test_a_released_request_is_dropped_at_once() -> None:
    """Released means released: with the cyclic collector off, nothing of the connector
    holds a finished request (whose store completed) once vLLM freed it."""
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    engine = Engine()
    request = make_request("a", prompt=40, max_tokens=3)
    engine.scheduler.add_request(request)
    gone = weakref.ref(request)
    del request
    gc.collect()
    gc.disable()
    try:
        engine.run_until_idle()
        assert engine.stores and not engine.scheduler.requests
        engine.stores.clear()
        assert gone() is None, [type(r) for r in gc.get_referrers(gone())]
    finally:
        gc.enable()


def test_each_verdict_reaches_prometheus_as_a_labelled_counter() -> None:
    """``verdict_<reason>`` keys add up over intervals and become one counter,
    ``vllm:kvlife_verdicts_total{verdict=...}``; the audit sinks' losses and errors are
    counters of their own (what ``kvlife metrics rules --for vllm`` reads)."""
    from prometheus_client import Counter, Gauge, Histogram  # noqa: PLC0415

    from kvlife.offload.engines.vllm import KVLifeConnectorStats  # noqa: PLC0415

    _Metric.made.clear()
    vllm_config = make_scheduler("KVLifeConnector", "kvlife.offload.engines.vllm").vllm_config
    prom = KVLifeConnector.build_prom_metrics(
        vllm_config,
        {Counter: _Metric, Gauge: _Metric, Histogram: _Metric},
        ["engine", "model_name"],
        {0: ["0", "m"]},
    )
    first = KVLifeConnectorStats(data={"verdict_stale_instance": 2, "records_lost": 3})
    second = KVLifeConnectorStats(data={"verdict_stale_instance": 1, "verdict_duplicate_ack": 1})
    both = first.aggregate(second)
    assert not both.is_empty()
    reduced = both.reduce()
    assert reduced["verdict_stale_instance"] == 3 and reduced["verdict_duplicate_ack"] == 1
    prom.observe(both.data, engine_idx=0)
    made = _Metric.made
    assert made["vllm:kvlife_verdicts"].values == {
        ("0", "m", "stale_instance"): 3,
        ("0", "m", "duplicate_ack"): 1,
    }
    assert made["vllm:kvlife_records_lost"].values == {("0", "m"): 3}
    assert made["vllm:kvlife_sink_errors"].values == {}

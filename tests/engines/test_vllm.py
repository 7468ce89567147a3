"""kvlife against vLLM 0.33.0's real scheduler on CPU (run in ``.venv-vllm`` by
``make test-vllm``; in the main environment this module skips).

The first test pins down the failure kvlife exists to prevent, on vLLM's own
``OffloadingConnector``: it keys its state by request id, so a store that completes after
its request finished and the id was reused resolves to the new request, and the scheduler
raises inside ``update_from_output`` (in a server, the engine core dies). It is a strict
xfail: if vLLM fixes it, the test says so.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="runs in the vLLM environment: make test-vllm")

from tests.engines.vllm_harness import make_request, make_scheduler, step


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


from vllm.v1.request import RequestStatus  # noqa: E402

from kvlife.fsm import AuditReader, State, check_audit, read_audit  # noqa: E402
from tests.engines.vllm_harness import Engine  # noqa: E402


def _free_blocks(engine: Engine) -> int:
    return int(engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def test_a_finished_requests_blocks_are_fenced_until_its_stores_are_over(tmp_path: Any) -> None:
    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(blocks=4, audit_log=str(audit))  # three usable blocks: all reused
    free_at_start = _free_blocks(engine)
    request = make_request("a", prompt=40, max_tokens=2)
    store = engine.prefill_holding_its_store(request)  # 40 tokens: two full blocks
    assert len(store.block_ids) == 2
    engine.step()  # the last token: finished with the store in flight
    lc = engine.connector.registry.lifecycles()[0]
    assert request.is_finished() and lc.state is State.FINISHED_PENDING
    # vLLM has the blocks and the id back at once; kvlife fences the blocks instead
    assert "a" not in engine.scheduler.requests and _free_blocks(engine) == free_at_start
    assert set(engine.connector._scheduler.fenced) == set(store.block_ids)
    engine.scheduler.add_request(make_request("c", prompt=40, max_tokens=2, first=3000))
    out = engine.step()  # c is given a's blocks: the workers finish a's store first
    assert out.kv_connector_metadata.wait_jobs == {store.job_id}
    assert not engine.connector._scheduler.fenced
    engine.hold_all = False
    engine.step(release=[store.job_id])  # the copy is over: the lifecycle is released
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
    engine.step(release=[store.job_id])  # the old copy lands: the old lifecycle alone
    assert old_lc.state is State.RELEASED
    assert (new_lc.state, new_lc.inflight, new_lc.copies_started) == before
    engine.step(release=[store.job_id])  # the old job's completion, late and again
    engine.step(release=[store.job_id])
    stats = engine.connector.registry.statistics()
    assert stats.refusals["stale_instance"] == 2
    engine.connector.registry.flush()
    refused = [r for r in read_audit(audit).records if not r.ok]
    assert [(r.trigger, r.reason, r.serial, r.op) for r in refused] == [
        ("ack", "stale_instance", 0, store.job_id)
    ] * 2  # each late delivery named the old lifecycle and its copy


def test_an_abort_with_a_store_in_flight_releases_after_the_copy() -> None:
    engine = Engine()
    store = engine.prefill_holding_its_store(make_request("a", max_tokens=50))
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    lc = engine.connector.registry.lifecycles()[0]
    assert lc.state is State.FINISHED_PENDING and lc.outcome == "aborted"
    assert "a" not in engine.scheduler.requests  # vLLM freed it; its blocks are fenced
    assert engine.connector.free_host_pages < 64  # the copy still writes its pages
    engine.hold_all = False
    engine.step(release=[store.job_id])
    assert lc.state is State.RELEASED
    assert engine.connector.free_host_pages == 64  # every host page back


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
    engine.step(release=[store.job_id])  # one worker
    assert lc.inflight == 1
    engine.step(release=[store.job_id])  # the other, a step later
    assert lc.inflight == 0


def test_a_preemption_names_the_stores_that_read_its_blocks(tmp_path: Any) -> None:
    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(blocks=8, audit_log=str(audit))  # room for 128 tokens: two requests
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
    in_flight_of_b = {
        job_id
        for job_id, job in engine.connector._scheduler.jobs.items()
        if job.ticket.lifecycle.rid == "b"
    }
    assert in_flight_of_b and meta.wait_jobs == in_flight_of_b
    engine.hold_all = False
    engine.step(release=list(engine.held))  # every copy lands
    for _ in range(200):  # both finish; b resumes and is recomputed
        engine.step()
        if not engine.scheduler.requests:
            break
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
    assert sum(len(s.block_ids) for s in stores) == 3  # 50 tokens: three full blocks
    b = make_request("b", prompt=48, max_tokens=2)  # the same 48 prompt tokens
    engine.scheduler.add_request(b)
    out = engine.step()  # a hit of two blocks (vLLM computes the 48th token itself)
    (load,) = out.kv_connector_metadata.loads
    assert load.req_id == "b" and len(load.block_ids) == 2
    lc = engine.connector.registry.lifecycle(b)
    # the load is a copy on b's own lifecycle, scheduled with b in the same step (so is
    # the store of its third block, which b computes itself)
    assert lc.copies_started == 2
    loaded = [engine.device_block(block).clone() for block in load.block_ids]
    stored = {p: engine.expected[s.job_id][i] for s in stores for i, p in enumerate(s.pages)}
    for page, block in zip(load.pages, loaded, strict=True):  # a's bytes, now b's blocks
        assert torch.equal(engine.host_block(page), block)
        assert torch.equal(block, stored[page])
    engine.run_until_idle()
    assert b.num_computed_tokens >= 48 and lc.state is State.RELEASED
    assert not engine.connector._scheduler.pins  # nothing pinned once loads are over


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
    assert engine.connector._scheduler.pins  # the pages it reads cannot be evicted
    engine.run_until_idle()  # the late load completion: b alone is released, then freed
    assert lc.state is State.RELEASED and not engine.connector._scheduler.pins
    assert not engine.scheduler.requests


def test_a_page_being_loaded_is_never_evicted_and_an_evicted_page_is_a_miss() -> None:
    engine = Engine(host_pages=4)
    _cached_prefix(engine)  # three cached pages, one free
    b = make_request("b", prompt=48, max_tokens=2)
    engine.scheduler.add_request(b)
    engine.hold_all = True
    engine.step()  # b's load pins two pages
    sched = engine.connector._scheduler
    pinned = set(sched.pins)
    engine.scheduler.add_request(make_request("d", prompt=48, max_tokens=40, first=7000))
    engine.step()  # d wants three pages: one free and one evictable are not enough
    assert sched.counts["skipped_stores"] >= 1 and set(sched.pins) == pinned
    assert all(page in sched.cache.values() for page in pinned)
    engine.run_until_idle()  # now d's stores evict what no load reads
    engine.scheduler.reset_prefix_cache()
    e = make_request("e", prompt=48, max_tokens=2)
    engine.scheduler.add_request(e)
    out = engine.step()
    hit = sum(len(load.block_ids) for load in out.kv_connector_metadata.loads)
    assert hit < 2  # a's first blocks were evicted for d's: a miss from there on


def test_a_request_the_connector_never_saw_is_refused_not_raised() -> None:
    engine = Engine()
    stranger = make_request("x")
    assert engine.connector.get_num_new_matched_tokens(stranger, 0) == (0, False)
    assert engine.connector.request_finished(stranger, []) == (False, None)
    assert engine.connector.registry.statistics().refusals["unknown_request"] == 1

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

from kvlife.fsm import AuditReader, State, check_audit  # noqa: E402
from tests.engines.vllm_harness import Engine  # noqa: E402


def _free_blocks(engine: Engine) -> int:
    return int(engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def test_stores_delay_the_free_until_the_last_copy_is_over(tmp_path: Any) -> None:
    audit = tmp_path / "kvlife.jsonl"
    engine = Engine(audit_log=str(audit))
    free_at_start = _free_blocks(engine)
    request = make_request("a", prompt=40, max_tokens=2)
    store = engine.prefill_holding_its_store(request)  # 40 tokens: two full blocks
    assert len(store.block_ids) == 2
    engine.step()  # the last token: finished with the store in flight
    lc = engine.connector.registry.lifecycles()[0]
    assert request.is_finished() and lc.state is State.FINISHED_PENDING
    assert "a" in engine.scheduler.requests  # vLLM keeps the blocks for the copy
    assert _free_blocks(engine) < free_at_start
    engine.hold_all = False
    engine.step(release=[store.job_id])  # the copy is over: the lifecycle is released
    assert lc.state is State.RELEASED
    engine.step()  # the worker reports "a" finished sending; vLLM frees the blocks
    assert "a" not in engine.scheduler.requests and _free_blocks(engine) == free_at_start
    engine.assert_host_copies_exact([store])
    engine.connector.registry.flush()
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 1, report.violations


def test_the_id_reuse_race_is_harmless_with_kvlife() -> None:
    engine = Engine()
    store = engine.prefill_holding_its_store(make_request("0", max_tokens=2))
    engine.step()  # "0" finished, its store in flight: vLLM keeps the id
    new = make_request("0", first=5000)
    with pytest.raises(AssertionError):  # vLLM's own duplicate-id refusal holds it off
        engine.scheduler.add_request(new)
    engine.hold_all = False
    engine.step(release=[store.job_id])  # the old copy lands: the old lifecycle alone
    engine.step()  # "0" reported finished sending: its blocks are freed
    engine.scheduler.add_request(new)  # now the id is free
    engine.step()
    new_lc = engine.connector.registry.lifecycle(new)
    before = (new_lc.state, new_lc.inflight, new_lc.copies_started)
    engine.step(release=[store.job_id])  # the old job's completion, late and again
    engine.step(release=[store.job_id])
    assert (new_lc.state, new_lc.inflight, new_lc.copies_started) == before
    stats = engine.connector.registry.statistics()
    assert stats.refusals["stale_instance"] == 2 and stats.released == 1


def test_an_abort_with_a_store_in_flight_releases_after_the_copy() -> None:
    engine = Engine()
    store = engine.prefill_holding_its_store(make_request("a", max_tokens=50))
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    lc = engine.connector.registry.lifecycles()[0]
    assert lc.state is State.FINISHED_PENDING and lc.outcome == "aborted"
    engine.hold_all = False
    engine.step(release=[store.job_id])
    assert lc.state is State.RELEASED
    engine.step()
    assert "a" not in engine.scheduler.requests
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
    assert in_flight_of_b and meta.preempted_jobs == in_flight_of_b
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

"""kvlife's SGLang drop-in against SGLang 0.5.23's real classes on CPU (run in
``.venv-sglang`` by ``make test-sglang``; in the main environment this module skips).

What is real and what is substituted is listed in ``tests/engines/sglang_harness.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import require_sglang

require_sglang("0.5.23", "test-sglang")

from kvlife.fsm import (
    AuditReader,
    JsonLinesSink,
    LifecycleRegistry,
    State,
    check_audit,
    read_audit,
)
from kvlife.offload import CopyEngine, HostPagePool, LayoutError, OffloadManager
from kvlife.offload.engines.sglang import (
    SGLangKVSource,
    kv_layout,
    storage_page,
)
from tests.engines.sglang_harness import (
    FINISH_ABORT,
    PAGE,
    JobRecorder,
    Pools,
    Release,
    Req,
    RequestsMixedUp,
    RidKeyedReq,
    admit,
    close,
    decode,
    decode_steps,
    decode_to_end,
    kvlife_manager,
    late_completion_scenario_on_kvlife,
    late_completion_scenario_on_sglang,
    make_pools,
    publish_args,
    request_row,
    run_workload,
    settle_backups,
    sglang_manager,
    sglang_on_cpu,
    storage_files,
)


@pytest.fixture
def pools() -> Pools:
    return make_pools()


# ---------------------------------------------------------------------------- the adapter


def test_host_pages_equal_the_device_kv_byte_for_byte(pools: Pools) -> None:
    layout, tensors = kv_layout(pools.kv, PAGE)
    assert (layout.kind, layout.layers, layout.heads, layout.head_dim) == ("per_layer", 3, 2, 8)
    assert layout.slots == pools.kv.size + PAGE  # SGLang's padded first page included
    host = HostPagePool(layout, 64)
    source = SGLangKVSource(pools.r2t, pools.tree)
    manager = OffloadManager(source, CopyEngine(layout, tensors, host), stride_pages=2)
    results: list[Any] = []
    manager.on_release(lambda req, result: results.append((req, result)))
    req = admit(pools, "a", prompt=13, max_new=20)
    manager.register(req)
    for t in range(19):
        decode(pools, req, 1000 + t)
        manager.step(req)
    slots = pools.r2t.req_to_token[request_row(req), : source.committed(req)].long()
    device = pools.slot_kv(slots)  # read before the release hands the slots back
    manager.finish(req)
    manager.poll()
    [(_, result)] = results
    assert result.tokens == source.committed(req) == 13 + 20 - 1  # 20 outputs, the last not in KV
    host_kv = torch.cat([host.read_tokens(c.pages, c.tokens) for c in result.copies], dim=1)
    assert torch.equal(host_kv.view(torch.int16), device.view(torch.int16))  # K and V, all layers
    assert pools.releases == [Release("a", pools.releases[0].row, pools.releases[0].slots)]
    assert len(pools.releases[0].slots) == 36  # every slot it was given: 33 tokens, in pages


def test_an_mla_pool_is_an_mla_layout_and_round_trips(tmp_path: Path) -> None:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (  # noqa: PLC0415
        build_kv_host_pool,
    )
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: PLC0415

    pool = MLATokenToKVPool(
        size=64,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    for buf in pool.kv_buffer:
        buf.normal_()
    layout, tensors = kv_layout(pool, PAGE)
    assert (layout.kind, layout.layers, layout.head_dim, layout.slots) == ("mla", 2, 24, 68)
    host = HostPagePool(layout, 4)
    pages = host.alloc(2)
    assert pages is not None
    slots = torch.tensor([9, 10, 11, 12, 30, 31, 32, 33])
    CopyEngine(layout, tensors, host).launch(slots, pages)
    for layer in range(2):
        want = pool.kv_buffer[layer][slots, 0]
        assert torch.equal(host.read_tokens(pages, 8)[layer], want)
    # The storage page equals what SGLang's own MLA host pool hands its storage backend
    # (get_data_page) when it holds the same tokens: its kv_buffer is [layers, tokens, 1,
    # dim] (layer_first) or [tokens, layers, 1, dim] (page_first).
    for page_format in ("layer_first", "page_first"):
        publish_args(tmp_path, layout=page_format)
        with sglang_on_cpu():
            theirs = build_kv_host_pool(kv_pool=pool, page_size=PAGE, use_mla=True)
        assert theirs.layout == page_format
        at = 2 * PAGE  # a page-aligned host index
        for layer in range(2):
            tokens = pool.kv_buffer[layer][slots]  # [8, 1, dim]
            if page_format == "layer_first":
                theirs.kv_buffer[layer, at : at + 8] = tokens
            else:
                theirs.kv_buffer[at : at + 8, layer] = tokens
        for i, page in enumerate(pages.indices):
            ours = storage_page(layout, host, page, page_format)
            assert torch.equal(ours, theirs.get_data_page(at + i * PAGE, flat=True))


def test_pools_and_layouts_kvlife_cannot_copy_are_refused(pools: Pools, tmp_path: Path) -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: PLC0415

    class QuantizedPool(MHATokenToKVPool):  # type: ignore[misc]
        pass

    other = QuantizedPool(
        size=16,
        page_size=PAGE,
        dtype=torch.float16,
        head_num=2,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    with pytest.raises(LayoutError, match="cannot copy a QuantizedPool"):
        kv_layout(other, PAGE)
    layout, _ = kv_layout(pools.kv, PAGE)
    with pytest.raises(LayoutError, match="not 'page_head'"):
        storage_page(layout, HostPagePool(layout, 1), 0, "page_head")
    registry = LifecycleRegistry()
    with pytest.raises(ValueError, match="zero copy"):
        kvlife_manager(pools, tmp_path, storage_backend="mooncake", registry=registry)
    with pytest.raises(LayoutError, match="page_first_direct"):
        kvlife_manager(pools, tmp_path, layout="page_first_direct", registry=registry)
    assert registry._hooks == []  # nothing was hooked onto the registry


# ------------------------------------------------- a late completion after a rid reuse


@pytest.mark.parametrize("req_class", [Req, RidKeyedReq], ids=["Req", "Req equal by rid"])
def test_a_late_completion_of_an_old_request_releases_it_alone(
    pools: Pools, tmp_path: Path, req_class: type
) -> None:
    late_completion_scenario_on_kvlife(pools, tmp_path, req_class)


def test_sglang_0_5_23s_own_manager_keeps_a_plain_req_apart(pools: Pools, tmp_path: Path) -> None:
    late_completion_scenario_on_sglang(pools, tmp_path, Req)


@pytest.mark.xfail(strict=True, raises=RequestsMixedUp, reason="SGLang keys its state by Req ==")
def test_sglang_0_5_23s_own_manager_mixes_up_reqs_equal_by_rid(
    pools: Pools, tmp_path: Path
) -> None:
    # Its WeakKeyDictionary holds one entry for both: the in-flight counts merge, so the
    # old request is still "in flight" after its copy completed and is never released
    # (its row and slots leak), and the new one's progress is the old one's.
    late_completion_scenario_on_sglang(pools, tmp_path, RidKeyedReq)


# ---------------------------------------------------------------------------- differential

CONFIGS = {
    "page_first, stride 1 page, 3 host pages": {"layout": "page_first", "host_tokens": 8},
    "layer_first, stride 2 pages, 5 host pages": {
        "layout": "layer_first",
        "stride": 8,
        "host_tokens": 16,
    },
    "page_first, 2 host pages": {"layout": "page_first", "stride": 4, "host_tokens": 4},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_same_workload_same_storage_and_releases_as_sglangs_manager(
    tmp_path: Path, config: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.CRITICAL)  # SGLang logs every refused host allocation
    host_gb = config["host_tokens"] * 192 / 1e9  # 192 bytes per token
    args = {"layout": config["layout"], "stride": config.get("stride"), "hicache_size_gb": host_gb}
    theirs_pools, ours_pools = make_pools(seed=1), make_pools(seed=1)
    with sglang_on_cpu():
        theirs = sglang_manager(theirs_pools, tmp_path / "sglang", **args)
        host_pages = theirs.decode_host_mem_pool.available_size() // PAGE
        theirs_run = run_workload(theirs_pools, theirs, seed=3)
    ours = kvlife_manager(ours_pools, tmp_path / "kvlife", host_pages=host_pages, **args)
    ours_run = run_workload(ours_pools, ours, seed=3)
    close(theirs)
    close(ours)

    assert (theirs_run.admitted, theirs_run.aborted) == (ours_run.admitted, ours_run.aborted)
    assert theirs_run.reused_rids > 10 and theirs_run.aborted > 5
    assert theirs_run.offloads == ours_run.offloads
    stored = storage_files(tmp_path / "sglang")
    assert len(stored) > 50
    assert storage_files(tmp_path / "kvlife") == stored  # same pages, same bytes, same names
    assert ours_pools.releases == theirs_pools.releases  # same slots back, same order
    assert len(ours_pools.releases) == ours_run.admitted
    full = make_pools().alloc.available_size()
    assert ours_pools.alloc.available_size() == theirs_pools.alloc.available_size() == full
    assert ours.kvlife.stats.skipped_no_host_memory > 0  # host memory ran out, in both
    assert ours.host.available == ours.host.capacity and not ours.registry.lifecycles()


# ---------------------------------------------------------------------------- scheduler calls


def test_an_abort_with_a_copy_in_flight_releases_after_it(pools: Pools, tmp_path: Path) -> None:
    manager = kvlife_manager(pools, tmp_path / "storage", defer=True)
    jobs = JobRecorder(manager).jobs
    req = admit(pools, "a", prompt=8, max_new=20)
    decode_steps(pools, manager, req, 5)
    req.finished_reason = FINISH_ABORT()
    manager.finalize_release_on_finish(req)
    lc = manager.registry.lifecycles()[0]
    assert (lc.state, lc.outcome) == (State.FINISHED_PENDING, "aborted") and not pools.releases
    assert manager.has_inflight_device_transfer() and len(manager.ongoing_offload) == 1
    with pytest.raises(RuntimeError, match="refusing to retract"):
        manager.drain_before_retraction()
    jobs[0].run()
    manager.drain_before_retraction()  # delivers it: nothing is in flight any more
    assert lc.state is State.RELEASED and len(pools.releases) == 1
    assert not manager.has_inflight_device_transfer()
    settle_backups(manager)
    manager.check_offload_progress()
    assert len(storage_files(tmp_path / "storage")) == 1  # the chunk is backed up, as SGLang's
    close(manager)


def test_a_second_finalize_is_refused_and_audited(pools: Pools, tmp_path: Path) -> None:
    log = tmp_path / "kvlife.jsonl"
    registry = LifecycleRegistry(sinks=[JsonLinesSink(log)])
    manager = kvlife_manager(pools, tmp_path / "storage", registry=registry)
    req = admit(pools, "a", prompt=5, max_new=3)
    decode_to_end(pools, manager, req)
    assert len(pools.releases) == 1 and request_row(req) is None
    manager.finalize_release_on_finish(req)  # again: SGLang's abort path can do this
    assert len(pools.releases) == 1
    refusals = registry.statistics().refusals
    assert refusals["unknown_request"] == sum(refusals.values()) == 1
    close(manager)
    registry.flush()
    assert [(r.trigger, r.reason) for r in read_audit(log).records if not r.ok] == [
        ("finish", "unknown_request")
    ]
    report = check_audit(AuditReader(log), expect_released=True)
    assert report.ok and report.lifecycles == 1, report.violations


def test_the_audit_log_of_a_workload_checks_clean(tmp_path: Path) -> None:
    log = tmp_path / "kvlife.jsonl"
    registry = LifecycleRegistry(sinks=[JsonLinesSink(log)])
    pools = make_pools(seed=2)
    manager = kvlife_manager(pools, tmp_path / "storage", registry=registry)
    run = run_workload(pools, manager, seed=5, steps=60)
    close(manager)
    registry.flush()
    report = check_audit(AuditReader(log), expect_released=True)
    assert report.ok and report.lifecycles == run.admitted, report.violations
    records = read_audit(log).records
    assert sum(r.trigger == "register" for r in records) == run.admitted
    assert sum(r.trigger == "abort" for r in records) == run.aborted > 0


def test_a_failed_backup_frees_its_host_pages(
    pools: Pools, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Storage:
        def __init__(self, fail: BaseException | None) -> None:
            self.fail = fail
            self.calls = 0

        def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> bool:
            self.calls += 1
            if self.fail is not None:
                raise self.fail
            return False

    for error in (None, OSError("disk full")):
        storage = Storage(error)
        manager = kvlife_manager(pools, tmp_path, storage=storage, host_pages=8)
        req = admit(pools, "a", prompt=4, max_new=6)
        with caplog.at_level(logging.WARNING, logger="kvlife.offload.engines.sglang"):
            decode_to_end(pools, manager, req)
            manager.check_offload_progress()
            close(manager)
        assert storage.calls == manager.backups.submitted == manager.backups.failed == 1
        assert manager.host.available == 8
        assert "storage backup of 1 pages of 'a' failed" in caplog.text
        caplog.clear()


def test_the_stride_and_the_prompt_come_from_sglangs_settings(pools: Pools, tmp_path: Path) -> None:
    manager = kvlife_manager(pools, tmp_path, stride=10)  # rounded down to whole pages
    assert manager.offload_stride == 8
    jobs = JobRecorder(manager).jobs
    req = admit(pools, "a", prompt=10, max_new=30)  # pages 0-1 were stored by prefill
    decode_steps(pools, manager, req, 10)  # 19 tokens committed: 8..16 is one stride
    assert [job.tokens for job in jobs] == [8]
    assert dict(manager.ongoing_offload) == {next(iter(manager.ongoing_offload)): req}
    close(manager)


def test_the_scheduler_loop_benchmark_times_both_managers_on_the_same_steps() -> None:
    from tests.engines.sglang_bench import main, measure  # noqa: PLC0415

    got = measure(seed=1, steps=30, rounds=1)
    # the same seeded workload ran through both: the same scheduler steps were timed
    assert got["steps"] == got["sglang_steps"] >= 30
    assert got["sglang_us"] > 0 and got["kvlife_us"] > 0
    assert main(["--steps", "10", "--rounds", "1"]) == 0


def test_tp_ranks_agree_on_completed_copies(tmp_path: Path) -> None:
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    import torch.multiprocessing as mp  # noqa: PLC0415

    from tests.engines.sglang_harness import tp_rank_main  # noqa: PLC0415

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(
        tp_rank_main,
        args=(2, str(tmp_path / "store"), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # check 0: only rank 0's copy is over: nothing moves on either rank
        # check 1: both are over: both ranks deliver it, release, hand the row back
        assert seen == [
            [0, "finished_pending", 0],
            [1, "released", 1],
            [2, "released", 1],
        ], (rank, seen)


def test_a_retracted_request_aborted_while_waiting_is_swept(pools: Pools, tmp_path: Path) -> None:
    log = tmp_path / "kvlife.jsonl"
    registry = LifecycleRegistry(sinks=[JsonLinesSink(log)])
    manager = kvlife_manager(pools, tmp_path / "storage", registry=registry)
    manager.sweep_every = 4
    gone = admit(pools, "gone", prompt=8, max_new=20)
    waits = admit(pools, "waits", prompt=8, max_new=20)
    for req in (gone, waits):
        decode_steps(pools, manager, req, 6)  # a chunk each, copied
    manager.drain_before_retraction()
    for req in (gone, waits):  # SGLang retracts them: it frees their KV itself
        pools.tree.free_kv_row(req.kv, [(0, req.kv.kv_allocated_len)])
        pools.r2t.free(req)
        req.kv.mark_kv_released()
    gone.finished_reason = FINISH_ABORT()  # aborted while it waited; the manager never hears
    assert len(registry.lifecycles()) == 2
    for _ in range(manager.sweep_every):  # some call among any 4 in a row sweeps
        manager.check_offload_progress()
    [left] = registry.lifecycles()
    assert left.req is waits and left.state is State.ALLOCATED  # still waiting: kept
    assert manager.sweep() == 0
    close(manager)
    registry.flush()
    aborts = [r for r in read_audit(log).records if r.trigger == "abort"]
    assert [(r.rid, r.dst) for r in aborts] == [("gone", "released")]


def test_copies_a_rank_does_not_write_are_freed(pools: Pools, tmp_path: Path) -> None:
    manager = kvlife_manager(pools, tmp_path / "storage", host_pages=8)
    manager._writer = False  # as an MLA rank other than the storage writer
    req = admit(pools, "a", prompt=8, max_new=10)
    decode_to_end(pools, manager, req)
    manager.check_offload_progress()
    assert manager.backups.skipped == manager.kvlife.stats.copies_acked == 2
    assert manager.host.available == 8 and not storage_files(tmp_path / "storage")
    close(manager)


def test_pages_a_failed_copy_hook_left_are_freed_at_release(pools: Pools, tmp_path: Path) -> None:
    manager = kvlife_manager(pools, tmp_path / "storage", host_pages=8)
    manager.release_host_resources()  # the backup thread is gone: submitting raises
    req = admit(pools, "a", prompt=8, max_new=6)
    decode_steps(pools, manager, req, 4)
    with pytest.raises(RuntimeError, match="shutdown"):
        manager.check_offload_progress()
    decode_to_end(pools, manager, req)
    assert manager.registry.lifecycles() == [] and manager.host.available == 8


def test_two_live_requests_with_one_rid_are_refused(pools: Pools, tmp_path: Path) -> None:
    from kvlife.fsm import RidConflictError  # noqa: PLC0415

    manager = kvlife_manager(pools, tmp_path / "storage")
    first = admit(pools, "x", prompt=8, max_new=20)
    decode_steps(pools, manager, first, 5)
    lc = manager.registry.lifecycle(first)
    second = admit(pools, "x", prompt=8, max_new=20)
    decode(pools, second, 1)
    with pytest.raises(RidConflictError, match="'x' is held by"):
        manager.offload_kv_cache(second)
    assert second not in manager.registry and manager.registry.lifecycles() == [lc]
    assert manager.offload_kv_cache(first) is False and lc.state is State.OFFLOADING
    close(manager)

"""The HiCache lens on SGLang 0.5.23's real ``UnifiedRadixCache`` on the CPU (both tree
cores): every verdict from a fault injected into the real cache, beside what SGLang does
with the same fault and no kvlife; seeded random workloads that must leave every log
clean and the cache's answers unchanged; a release the lens cannot read gets no lens.

Runs in ``.venv-sglang`` (``make sglang-venv``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs SGLang 0.5.23 (make sglang-venv)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch

    from tests.engines import hicache_harness as H

from kvlife.fsm import MemorySink
from kvlife.fsm.audit.checker import check_audit
from kvlife.fsm.audit.explain import explain
from kvlife.fsm.audit.ranks import compare_ranks
from kvlife.fsm.audit.reader import read_audit
from kvlife.offload.watch.sglang import HiCacheLens, NoLensError, attach, generation_for, unified

WITNESS = "SGLang 0.5.23 UnifiedRadixCache (test)"
TOKENS = list(range(100, 116))


def lensed(
    tmp_path: Path, core: str = "python", policy: str = "write_through", **kwargs: Any
) -> tuple[H.HiCache, HiCacheLens, Path]:
    hc = H.build(core, policy)
    path = tmp_path / f"hicache-{core}.jsonl"
    lens = attach(hc.cache, HiCacheLens(path, WITNESS, **kwargs))
    return hc, lens, path


def built(tmp_path: Path, core: str, with_lens: bool) -> tuple[H.HiCache, Path | None]:
    """A cache with the lens (and its log's path) or without it (``None``)."""
    if not with_lens:
        return H.build(core), None
    hc, _, path = lensed(tmp_path, core)
    return hc, path


def checked(hc: H.HiCache, path: Path) -> Any:
    hc.cache.release_host_resources()
    return check_audit(read_audit(path))


def kinds(report: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for v in report.violations:
        found[v.kind] = found.get(v.kind, 0) + 1
    return found


def written_and_evicted(hc: H.HiCache) -> None:
    """``TOKENS`` inserted, written to host and acked, then evicted from the device."""
    hc.insert(TOKENS)
    hc.poll()
    assert hc.evict(len(TOKENS)) == len(TOKENS)


def loading(hc: H.HiCache) -> Any:
    """A load-back of ``TOKENS`` submitted and not yet polled: its ack waits."""
    written_and_evicted(hc)
    assert hc.load_back(TOKENS)
    hc.cache.ready_to_load_host_cache()
    return hc.cache.cache_controller.ack_load_queue[-1]


def acks_waiting(hc: H.HiCache, queue: str) -> Any:
    """A write of ``TOKENS`` (``queue="write"``) or a load-back of it (``"load"``)
    submitted and not polled: the controller's ack queue its ack waits in."""
    cc = hc.cache.cache_controller
    if queue == "write":
        hc.insert(TOKENS)
        cc.start_writing()
        return cc.ack_write_queue
    loading(hc)
    return cc.ack_load_queue


CORES = pytest.mark.parametrize("core", H.CORES)


# ---------------------------------------------------------------- duplicate acks


@CORES
@pytest.mark.parametrize("queue", ["write", "load"])
def test_without_kvlife_a_duplicate_ack_kills_the_poll(core: str, queue: str) -> None:
    hc = H.build(core)
    q = acks_waiting(hc, queue)
    q.append(q[-1])
    with pytest.raises(KeyError):
        hc.cache.check_hicache_events()


@CORES
@pytest.mark.parametrize("queue", ["write", "load"])
def test_a_duplicate_ack_is_a_stray_report_and_refuse_mode_keeps_the_cache_alive(
    core: str, queue: str, tmp_path: Path
) -> None:
    for mode in ("observe", "refuse"):
        hc, lens, path = lensed(tmp_path / mode, core, mode=mode)
        q = acks_waiting(hc, queue)
        q.append(q[-1])
        if mode == "observe":
            with pytest.raises(KeyError):
                hc.cache.check_hicache_events()
        else:
            hc.cache.check_hicache_events()  # the stray id is taken out: no KeyError
            assert not hc.cache.ongoing_write_through and not hc.cache.ongoing_load_back
            H.run_workload(hc, seed=3, steps=30)  # and the cache goes on working
        report = checked(hc, path)
        found = kinds(report)
        assert found.get("stray_report") == 1, (mode, found)
        stray = next(v for v in report.violations if v.kind == "stray_report")
        assert stray.rid is not None and stray.rid.startswith("node")
        if mode == "observe":  # the raise is written down before it goes on
            assert found.get("connector_raised") == 1
        else:
            assert set(found) == {"stray_report"} and lens.counts.refused_ids == 1


# ---------------------------------------------------------------- lost acks


@CORES
def test_without_kvlife_a_lost_ack_leaves_the_node_locked_silently(core: str) -> None:
    hc = H.build(core)
    loading(hc)
    hc.cache.cache_controller.ack_load_queue.clear()
    for _ in range(20):
        hc.poll()
    assert hc.cache.ongoing_load_back  # pending for ever
    assert hc.cache.protected_size() > 0  # and locked


@CORES
def test_a_lost_ack_is_overdue_while_it_runs_and_unreported_at_the_end(
    core: str, tmp_path: Path
) -> None:
    hc, lens, path = lensed(tmp_path, core, overdue_s=0.05)
    loading(hc)
    hc.cache.cache_controller.ack_load_queue.clear()
    hc.poll()
    assert lens.overdue.open_overdue() == 0
    import time  # noqa: PLC0415

    time.sleep(0.1)
    hc.poll()
    assert lens.overdue.open_overdue() == 1
    report = checked(hc, path)
    assert report.overdue == 1
    found = kinds(report)
    assert found.get("unreported") == 1 and found.get("overdue") == 1, found
    # its story in the cache's words: the copies by kind, what finished the lifecycle
    (node,) = {v.rid for v in report.violations}
    story = explain(read_audit(path).records, str(node))
    assert "start_offload write through 0: allocated -> offloading" in story
    assert "start_offload load back 1:" in story and "OVERDUE load back 1: the load_back" in story
    assert "finish (shutdown): offloading -> finished_pending, 1 in flight" in story


# ---------------------------------------------------------------- host freed in flight


def _load_host_pages(hc: H.HiCache) -> torch.Tensor:
    return hc.cache.cache_controller.load_queue[-1].host_indices.clone()


@CORES
def test_without_kvlife_host_pages_freed_under_a_load_back_go_unnoticed(core: str) -> None:
    hc = H.build(core)
    written_and_evicted(hc)
    assert hc.load_back(TOKENS)
    pages = _load_host_pages(hc)
    pool = hc.cache.cache_controller.mem_pool_host
    before = pool.available_size()
    pool.free(pages)  # what #26728 / #31427 do: host KV freed by an eviction
    assert pool.available_size() == before + len(pages)  # handed back, no error
    hc.poll()  # the load still reads them
    assert not hc.cache.ongoing_load_back


@CORES
def test_host_pages_freed_under_a_load_back_are_host_freed_in_flight(
    core: str, tmp_path: Path
) -> None:
    hc, _, path = lensed(tmp_path, core)
    written_and_evicted(hc)
    assert hc.load_back(TOKENS)
    freed = _load_host_pages(hc)  # host slots (tokens), whole pages of H.PAGE
    hc.cache.cache_controller.mem_pool_host.free(freed)
    hc.poll()
    report = checked(hc, path)
    found = kinds(report)
    assert found == {"host_freed_in_flight": 1}, found
    (v,) = report.violations
    assert "load_back" in v.message and v.rid == f"node{hc.match(TOKENS).best_match_node}"
    # the lens follows pages, not tokens: the verdict counts the pages freed
    assert len(freed) > H.PAGE > 1
    assert v.message.endswith(f"slots={len(freed) // H.PAGE}"), v.message


# ---------------------------------------------------------------- a failed write backed


def _backed_after_a_failed_write(hc: H.HiCache) -> None:
    """SGLang's write fails (no host pages), and a faulty backup commits anyway (#27108's
    shape): the commit is given pages the write never filled."""
    cache = hc.cache
    pool = cache.cache_controller.mem_pool_host
    real_alloc, real_backup = pool.alloc, cache._execute_kv_backup
    pool.alloc = lambda *args, **kwargs: None

    def faulty(node_id: int, device_value: Any, *args: Any) -> Any:
        got = real_backup(node_id, device_value, *args)
        return torch.arange(len(device_value)) if got is None else got

    cache._execute_kv_backup = faulty
    try:
        hc.insert(TOKENS)
    finally:
        pool.alloc, cache._execute_kv_backup = real_alloc, real_backup


@CORES
def test_without_kvlife_a_node_is_backed_by_a_failed_write(core: str) -> None:
    hc = H.build(core)
    _backed_after_a_failed_write(hc)
    node = hc.match(TOKENS).last_device_node
    assert hc.cache.tree_core.is_backuped(node)  # no error: host pages never written


@CORES
def test_a_node_backed_by_a_failed_write_is_failed_write_backed(core: str, tmp_path: Path) -> None:
    hc, _, path = lensed(tmp_path, core)
    _backed_after_a_failed_write(hc)
    hc.poll()
    found = kinds(checked(hc, path))
    assert found.get("failed_write_backed") == 1, found


# ---------------------------------------------------------------- locks


WITH_AND_WITHOUT = pytest.mark.parametrize("with_lens", [False, True], ids=["sglang", "kvlife"])


@CORES
@WITH_AND_WITHOUT
def test_an_unbalanced_lock_release_is_silent_without_kvlife_and_a_verdict_with_it(
    core: str, with_lens: bool, tmp_path: Path
) -> None:
    hc, path = built(tmp_path, core, with_lens)
    hc.insert(TOKENS)
    hc.poll()
    node = hc.match(TOKENS).last_device_node
    hc.cache.inc_lock_ref(node)  # a running request's lock
    params = hc.cache.inc_lock_ref(node).to_dec_params()
    hc.cache.dec_lock_ref(node, params)
    # released again: SGLang takes the running request's count without a word (it
    # asserts only when a count would go below zero, on the Python core)
    hc.cache.dec_lock_ref(node, params)
    assert hc.cache.protected_size() == 0  # the request's prefix is now evictable
    if path is not None:
        assert kinds(checked(hc, path)) == {"unbalanced_lock": 1}


# ---------------------------------------------------------------- overwritten entries


@CORES
@WITH_AND_WITHOUT
def test_an_overwritten_pending_write_leaks_its_lock_without_kvlife_and_is_a_verdict_with_it(
    core: str, with_lens: bool, tmp_path: Path
) -> None:
    hc, path = built(tmp_path, core, with_lens)
    hc.insert(TOKENS)  # a write pending under the node's id, its lock held
    node = hc.match(TOKENS).last_device_node
    hc.cache._track_write_through_node(node, None, [node])  # the entry overwritten
    hc.poll()
    hc.poll()
    if path is None:
        assert hc.cache.protected_size() > 0  # the first entry's lock: never released
        return
    found = kinds(checked(hc, path))
    # the second write is never acked on its own: unreported at the end
    assert found.get("pending_overwritten") == 1 and found.get("unreported") == 1, found


# ---------------------------------------------------------------- no false verdicts


@CORES
@pytest.mark.parametrize("policy", H.POLICIES)
def test_seeded_workloads_leave_every_log_clean_and_the_cache_unchanged(
    core: str, policy: str, tmp_path: Path
) -> None:
    seeds = range(20)
    copies: dict[str, int] = {}
    splits = 0
    for seed in seeds:
        alone = H.run_workload(H.build(core, policy), seed)
        hc, lens, path = lensed(tmp_path / str(seed), core, policy)
        seen = H.run_workload(hc, seed)
        assert seen.answers == alone.answers, seed
        report = checked(hc, path)
        assert report.ok and not report.violations, (seed, [v.line() for v in report.violations])
        assert lens.counts.verdicts == {}
        splits += lens.counts.splits
        for kind, n in lens.counts.copies.items():
            copies[kind] = copies.get(kind, 0) + n
    # the workloads did what they are for: writes, load-backs, host evictions, and nodes
    # split while their write was pending
    assert copies.get("load_back", 0) >= 20 and copies.get(policy, 0) >= 100, copies
    assert splits >= 3 or policy == "write_back", splits  # write-back writes at eviction


@CORES
def test_a_node_split_while_its_write_is_pending_needs_nothing_and_its_ack_says_so(
    core: str, tmp_path: Path
) -> None:
    """A second prompt that shares the first's first page splits the first's node while
    its write is pending (no poll between): SGLang moves the pending entry, the ack still
    names the write's id. No verdict; the ack's record names the nodes the write spans,
    and a load-back after eviction brings the first prompt's own tokens back."""
    hc, lens, path = lensed(tmp_path, core)
    branch = TOKENS[:4] + [t + 50 for t in TOKENS[:8]]
    hc.insert(TOKENS)
    hc.insert(branch)
    assert lens.counts.splits == 1
    hc.poll()
    assert hc.evict(64) > 0 and hc.load_back(TOKENS)
    hc.poll()
    assert hc.device_tokens(TOKENS) == TOKENS
    report = checked(hc, path)
    assert report.ok, [v.line() for v in report.violations]
    (ack,) = [r for r in read_audit(path).records if "split_into" in r.detail]
    assert ack.trigger == "ack" and str(ack.detail["split_into"]).count("node") == 2


@CORES
def test_acks_are_still_seen_after_the_cache_is_reset(core: str, tmp_path: Path) -> None:
    """``reset`` (a cache flush) makes the cache's pending-copy dictionaries again: the
    lens watches the new ones."""
    hc, lens, path = lensed(tmp_path, core)
    hc.cache.reset()
    written_and_evicted(hc)
    assert hc.load_back(TOKENS)
    hc.poll()
    assert lens.counts.acks == 2 and lens.pending() == 0
    assert checked(hc, path).ok


# ---------------------------------------------------------------- which lens


def test_a_cache_kvlife_does_not_know_gets_no_lens() -> None:
    class Other:
        pass

    with pytest.raises(NoLensError, match="kvlife knows UnifiedRadixCache"):
        generation_for(Other())


def test_a_release_that_renamed_what_the_lens_reads_gets_none(tmp_path: Path) -> None:
    hc = H.build("python")
    real = hc.cache.cache_controller.ack_load_queue
    del hc.cache.cache_controller.ack_load_queue
    try:
        with pytest.raises(NoLensError, match=r"controller\.ack_load_queue"):
            attach(hc.cache, HiCacheLens(None, WITNESS, sinks=[MemorySink()]))
        assert not getattr(hc.cache.check_hicache_events, "__kvlife_lens__", False)
    finally:
        hc.cache.cache_controller.ack_load_queue = real
    assert unified.missing(hc.cache) == []


def test_a_cache_gets_one_lens(tmp_path: Path) -> None:
    hc, _, _ = lensed(tmp_path)
    with pytest.raises(ValueError, match="already has"):
        attach(hc.cache, HiCacheLens(None, WITNESS))


def test_bad_lens_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="mode"):
        HiCacheLens(None, WITNESS, mode="fix")
    with pytest.raises(ValueError, match="overdue_s"):
        HiCacheLens(None, WITNESS, overdue_s=0)


# ---------------------------------------------------------------- the plugin


def test_the_plugin_puts_the_lens_on_every_cache_a_process_builds(tmp_path: Path) -> None:
    """In a fresh process (SGLang's hooks patch the class): KVLIFE_SGLANG_HICACHE=refuse,
    SGLang's plugin loader, a cache built as the scheduler builds it, one log per rank."""
    script = """
import json, warnings
warnings.simplefilter("ignore")
from tests.engines import hicache_harness as H
from sglang.srt.plugins import load_plugins
load_plugins()
hc = H.build("python")
lens = hc.cache.kvlife_lens
H.run_workload(hc, seed=1, steps=20)
hc.cache.release_host_resources()
print(json.dumps({"mode": lens.mode, "path": str(lens.sink.path), "copies": lens.counts.copies}))
"""
    env = dict(
        os.environ,
        KVLIFE_SGLANG_HICACHE="refuse",
        KVLIFE_AUDIT_DIR=str(tmp_path),
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["mode"] == "refuse" and said["copies"].get("write_through", 0) > 0
    assert Path(said["path"]) == tmp_path / "sglang-hicache-tp0.jsonl"
    report = check_audit(read_audit(said["path"]))
    assert report.ok and report.endings[0].status == "closed"


# ---------------------------------------------------------------- TP ranks on gloo


def two_ranks(tmp_path: Path, scenario: str, lens: str = "lens", seed: int = 3) -> list[Any]:
    """Two TP ranks of the real cache in two processes, one gloo group (the cache
    all-reduces its ack counts over it): what each still had pending at the end."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    store = tmp_path / "gloo-store"
    args = ["2", str(store), str(tmp_path), scenario, str(seed), lens]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.engines.hicache_tp", str(rank), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for rank, proc in enumerate(ranks):
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"rank {rank}: {out[-3000:]}"
    return [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]


def rank_logs(tmp_path: Path) -> list[str]:
    return [str(tmp_path / f"sglang-hicache-tp{rank}.jsonl") for rank in range(2)]


def test_without_kvlife_ranks_that_agree_on_a_count_complete_different_nodes(
    tmp_path: Path,
) -> None:
    """A write that gets no host pages on rank 1 only: the all-reduced ack count then
    pops node 10's write on rank 0 and node 11's on rank 1, and rank 0's write of node 11
    stays pending for good. No error on either rank."""
    rank0, rank1 = two_ranks(tmp_path, "write_fails", lens="none")
    assert rank0["pending_writes"] == [11] and rank1["pending_writes"] == []


def test_the_rank_logs_joined_name_the_nodes_two_ranks_disagree_on(tmp_path: Path) -> None:
    rank0, rank1 = two_ranks(tmp_path, "write_fails")
    assert rank0 == {"pending_writes": [11], "locks_held": 1}
    assert rank1 == {"pending_writes": [], "locks_held": 0}
    result = compare_ranks(rank_logs(tmp_path))
    assert not result.agree
    assert [(o.kind, o.index, o.rids) for o in result.order] == [
        ("write_through", 0, ("node10", "node11"))
    ]
    by_rid = {d.rid: [(c.started, c.completed) for c in d.counts] for d in result.disagreements}
    assert by_rid == {"node11": [(1, 0), (1, 1)], "node10": [(1, 1), (0, 0)]}
    assert result.disagreements[0].rid == "node11"  # the one left open comes first
    said = "\n".join(result.lines())
    assert "left open on some ranks only (their pages and locks held there): node11" in said
    # rank 0's own log says it too, without the join: its copy of node 11 never completed
    report = check_audit(read_audit(rank_logs(tmp_path)[0]))
    assert [(v.kind, v.rid) for v in report.violations] == [("unreported", "node11")]
    assert check_audit(read_audit(rank_logs(tmp_path)[1])).ok
    cli = subprocess.run(
        [sys.executable, "-m", "kvlife.diagrams.cli", "audit", "ranks", *rank_logs(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 1 and "node11 write_through" in cli.stdout


def test_two_ranks_running_the_same_workload_agree(tmp_path: Path) -> None:
    assert two_ranks(tmp_path, "clean") == [{"pending_writes": [], "locks_held": 0}] * 2
    result = compare_ranks(rank_logs(tmp_path))
    assert result.agree and result.copies[0] == result.copies[1] > 0, result.lines()
    for log in rank_logs(tmp_path):
        assert check_audit(read_audit(log)).ok


# ---------------------------------------------------------------- L3: the storage backend


def stored(tmp_path: Path, core: str) -> tuple[H.HiCache, HiCacheLens, Path]:
    """A cache with SGLang's ``HiCacheFile`` backend in ``tmp_path/l3``, the lens on it,
    ``TOKENS`` written to host and backed up to storage (both acks in)."""
    hc = H.build(core, storage_dir=str(tmp_path / "l3"))
    hc.cache.prefetch_threshold = H.PAGE
    hc.cache.prefetch_stop_policy = "wait_complete"  # not cut short by a slow machine
    path = tmp_path / f"hicache-{core}.jsonl"
    lens = attach(hc.cache, HiCacheLens(path, WITNESS))
    hc.insert(TOKENS)
    for _ in range(100):
        hc.poll()
        if lens.counts.copies.get("storage_backup") and not lens.pending():
            break
        time.sleep(0.01)
    assert lens.counts.copies == {"write_through": 1, "storage_backup": 1} and not lens.pending()
    return hc, lens, path


def gone_but_stored(hc: H.HiCache) -> Any:
    """Evict ``TOKENS`` from device and host; start a prefetch of it from storage."""
    assert hc.evict(64) == len(TOKENS)
    hc.poll()
    assert hc.evict_host(1000) == len(TOKENS)
    hc.poll()
    m = hc.match(TOKENS)
    assert m.device_prefix_len == 0 and m.host_hit_length == 0
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: PLC0415

    handle = CacheRequestHandle("chat-1", 0)
    hc.cache.prefetch_from_storage(handle, m.last_host_node, array("q", TOKENS))
    assert handle in hc.cache.ongoing_prefetch
    return handle


@CORES
def test_a_backup_to_storage_and_a_prefetch_back_are_lifecycles_with_the_bytes_right(
    core: str, tmp_path: Path
) -> None:
    hc, _, path = stored(tmp_path, core)
    handle = gone_but_stored(hc)
    for _ in range(100):  # a scheduler step: the prefetch's progress, then the poll
        done = hc.cache.check_prefetch_progress(handle)
        hc.poll()
        if done:
            break
        time.sleep(0.01)
    assert hc.cache.pop_prefetch_loaded_tokens(handle) == len(TOKENS)
    assert hc.match(TOKENS).host_hit_length == len(TOKENS) and hc.load_back(TOKENS)
    hc.poll()
    assert hc.device_tokens(TOKENS) == TOKENS  # storage -> host -> device, the same tokens
    report = checked(hc, path)
    assert report.ok, [v.line() for v in report.violations]
    records = read_audit(path).records
    prefetch = [r for r in records if r.rid == "chat-1"]
    assert [(r.trigger, r.detail.get("kind") or r.detail.get("by")) for r in prefetch] == [
        ("register", None),
        ("start_offload", "storage_prefetch"),
        ("ack", None),
        ("finish", "prefetch_done"),
    ]


@CORES
def test_a_request_aborted_during_its_prefetch_gives_the_prefetch_up(
    core: str, tmp_path: Path
) -> None:
    hc, lens, path = stored(tmp_path, core)
    handle = gone_but_stored(hc)
    hc.cache.release_aborted_request(handle)
    assert handle not in hc.cache.ongoing_prefetch and not lens.pending()
    for _ in range(5):
        hc.poll()
    report = checked(hc, path)
    assert report.ok, [v.line() for v in report.violations]
    ended = [r for r in read_audit(path).records if r.rid == "chat-1"][-2:]
    assert [(r.trigger, r.detail.get("by")) for r in ended] == [
        ("fail", None),
        ("finish", "prefetch_given_up"),
    ]


@CORES
def test_an_unknown_storage_ack_is_dropped_by_sglang_and_a_stray_report_with_kvlife(
    core: str, tmp_path: Path
) -> None:
    hc, _, path = stored(tmp_path, core)
    cc = hc.cache.cache_controller
    cc.ack_backup_queue.put(SimpleNamespace(id=99_999, completed_tokens=0))
    hc.poll()  # SGLang: ongoing_backup.pop(99999, None), nothing said
    assert cc.ack_backup_queue.qsize() == 0
    found = kinds(checked(hc, path))
    assert found == {"stray_report": 1}, found


@CORES
def test_a_prefetch_entry_removed_that_was_never_registered_is_a_stray_report(
    core: str, tmp_path: Path
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: PLC0415

    ghost = CacheRequestHandle("ghost", 0)
    with pytest.raises(KeyError):  # without kvlife: the cache's dict raises
        del H.build(core).cache.ongoing_prefetch[ghost]
    hc, _, path = stored(tmp_path, core)
    with pytest.raises(KeyError):  # with it: the same KeyError, written down first
        del hc.cache.ongoing_prefetch[ghost]
    assert kinds(checked(hc, path)) == {"stray_report": 1}


def test_the_lens_benchmark_alternates_after_a_round_not_kept(tmp_path: Path) -> None:
    """The first runs of a process are slower: the bench's round -1 is not kept, and the
    run with the lens goes first every other round."""
    from tests.engines import hicache_bench  # noqa: PLC0415

    assert list(hicache_bench.turns(2)) == [
        (-1, True),
        (-1, False),
        (0, False),
        (0, True),
        (1, True),
        (1, False),
    ]
    out = hicache_bench.measure("python", rounds=2, calls=3, tmp=tmp_path)
    assert set(out) == {"match_prefix", "insert (cached)", "check_hicache_events", "workload step"}
    assert all(alone > 0 and lensed > 0 for alone, lensed in out.values())


def test_a_second_lens_given_the_first_ones_audit_log_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers' lenses given one log path: the second waits for the first to close
    it (``SERVER_LOCK_WAIT_S``, shortened here), then refuses with ``AuditLogBusyError``
    and writes nothing; before, both wrote one file."""
    from kvlife.fsm.audit import AuditLogBusyError  # noqa: PLC0415
    from kvlife.offload.watch.sglang import lens as lens_module  # noqa: PLC0415

    monkeypatch.setattr(lens_module, "SERVER_LOCK_WAIT_S", 0.2)
    _, first, path = lensed(tmp_path)
    written = path.read_bytes()
    with pytest.raises(AuditLogBusyError, match="is being written by another writer"):
        HiCacheLens(path, WITNESS)
    assert path.read_bytes() == written
    first.close()
    HiCacheLens(path, WITNESS).close()  # free once the first one closed
    assert check_audit(read_audit(path)).ok

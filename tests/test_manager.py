"""OffloadManager on CPU: exact host bytes, the rid-reuse race with completions held back,
device slots never handed back early, abort, host exhaustion, failed copies, and tensor
parallel agreement over gloo."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import weakref
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlife.fsm import (
    InvalidTransitionError,
    LifecycleRegistry,
    MemorySink,
    State,
    UnknownRequestError,
    check_audit,
)
from kvlife.offload import Blake2bPageHasher, KVLayout, OffloadResult, PageAccount
from kvlife.offload.host_callback import StreamGate
from tests.builds import patches_compiled
from tests.engine import FakeEngine, host_matches
from tests.strategies import EqByRid, Req
from tests.test_layout import LAYOUTS

A, O, F, R = State.ALLOCATED, State.OFFLOADING, State.FINISHED_PENDING, State.RELEASED
SMALL = KVLayout(
    "per_layer", layers=2, slots=512, heads=2, head_dim=4, dtype=torch.float32, page_size=4
)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_finished_request_hands_its_exact_kv_to_the_hook(name: str) -> None:
    engine = FakeEngine(LAYOUTS[name], stride_pages=1, host_pages=16)
    req = Req("a")
    lc = engine.admit(req)
    tickets = []
    for _ in range(3):
        engine.decode(req, 13)
        tickets.append(engine.manager.step(req))
    assert all(t is not None for t in tickets[1:])
    engine.manager.finish(req)  # flushes the partial last page
    engine.manager.poll()
    assert lc.state is R and lc.outcome == "finished"
    [(got_req, result)] = engine.results
    assert got_req is req and isinstance(result, OffloadResult)
    assert result.tokens == 39 and [c.first_token for c in result.copies] == [0, 16, 32]
    assert host_matches(engine, result, engine.admissions[lc.serial])
    assert engine.released_serials == [lc.serial]
    # the hook owns the pages until it frees them
    assert engine.host.in_use == sum(len(p) for p in result.pages)
    for pages in result.pages:
        engine.host.free(pages)
    assert engine.host.available == engine.host.capacity


def test_prefix_hash_chain_is_seeded_by_the_previous_page() -> None:
    engine = FakeEngine(SMALL, stride_pages=2)
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 18)
    engine.manager.step(req)  # pages 0..3 (16 tokens)
    engine.manager.finish(req)  # 2 more tokens: a partial page
    engine.manager.poll()
    [(_, result)] = engine.results
    ids = engine.admissions[lc.serial].token_ids
    prev, want = b"", []
    for first in range(0, 16, 4):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", ids[first : first + 4]).tobytes())
        prev = h.digest()
        want.append(prev)
    assert [h for c in result.copies for h in c.hashes] == [*want, None]


def test_stride_waits_for_enough_full_pages() -> None:
    engine = FakeEngine(SMALL, stride_pages=3)
    req = Req("a")
    engine.admit(req)
    engine.decode(req, 11)  # 2 full pages
    assert engine.manager.step(req) is None
    engine.decode(req, 1)  # 3 full pages
    ticket = engine.manager.step(req)
    assert ticket is not None and engine.manager.stats.copies_launched == 1
    assert engine.manager.step(req) is None


def test_rid_reuse_race_with_completions_held_back_and_released_out_of_order() -> None:
    sink = MemorySink()
    engine = FakeEngine(
        SMALL, defer=True, streams=2, stride_pages=1, registry=LifecycleRegistry(sinks=[sink])
    )
    manager = engine.manager
    old, new = EqByRid("a"), EqByRid("a")
    old_lc = engine.admit(old)
    engine.decode(old, 8)
    manager.step(old)  # stream 0
    manager.finish(old)
    assert old_lc.state is F
    new_lc = engine.admit(new)
    engine.decode(new, 8)
    manager.step(new)  # stream 1
    old_job, new_job = (job for job, _ in engine.jobs)
    new_job.run()  # the new copy completes first
    manager.poll()
    assert new_lc.state is A and old_lc.state is F and old_lc.inflight == 1
    assert engine.released_serials == []  # the old slots are still being read
    old_job.run()
    manager.poll()
    assert old_lc.state is R and new_lc.state is A and new_lc.req is new
    assert engine.released_serials == [old_lc.serial]
    [(req, result)] = engine.results
    assert req is old and result.serial == old_lc.serial
    assert host_matches(engine, result, engine.admissions[old_lc.serial])
    manager.finish(new)
    manager.poll()
    assert new_lc.state is R
    assert check_audit(sink.records(), expect_released=True).ok


def test_device_slots_wait_for_every_copy_that_reads_them() -> None:
    engine = FakeEngine(SMALL, defer=True, stride_pages=1)
    req = Req("a")
    lc = engine.admit(req)
    for _ in range(3):
        engine.decode(req, 4)
        engine.manager.step(req)
    engine.manager.finish(req)
    for i, (job, _) in enumerate(engine.jobs):
        assert engine.released_serials == [], i
        job.run()
        engine.manager.poll()
    assert engine.released_serials == [lc.serial] and lc.state is R


def test_abort_with_copies_in_flight_frees_pages_after_they_complete() -> None:
    engine = FakeEngine(SMALL, defer=True, stride_pages=1)
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 8)
    engine.manager.step(req)
    engine.manager.abort(req)
    assert lc.state is F and engine.host.in_use == 2  # the copy still writes its pages
    engine.run_all()
    engine.manager.poll()
    assert lc.state is R and lc.outcome == "aborted"
    assert engine.host.available == engine.host.capacity
    [(_, result)] = engine.results
    assert result.copies == () and engine.released_serials == [lc.serial]


def test_host_memory_exhausted_skips_and_changes_nothing() -> None:
    sink = MemorySink()
    engine = FakeEngine(
        SMALL, host_pages=2, stride_pages=1, registry=LifecycleRegistry(sinks=[sink])
    )
    hog = engine.host.alloc(2)
    assert hog is not None
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 8)

    def counters() -> tuple[Any, ...]:
        stats = engine.manager.registry.statistics()
        return len(sink), stats.transitions, stats.refusals, stats.live, stats.inflight

    before = counters()
    assert engine.manager.step(req) is None
    assert (lc.state, lc.inflight, lc.copies_started) == (A, 0, 0)
    assert counters() == before
    assert engine.manager.stats.skipped_no_host_memory == 1
    assert engine.manager.stats.copies_launched == 0 and engine.host.available == 0
    engine.host.free(hog)  # memory comes back: the same pages are offloaded next step
    assert engine.manager.step(req) is not None
    engine.manager.finish(req)
    engine.manager.poll()
    [(_, result)] = engine.results
    assert result.tokens == 8


def test_a_copy_that_raises_takes_the_fail_path_and_still_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FakeEngine(SMALL, stride_pages=1, host_pages=8)
    real = engine.copier._copy_cpu
    calls = {"n": 0}

    def second_copy_fails(index: torch.Tensor, pages: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("DMA error")
        real(index, pages)

    monkeypatch.setattr(engine.copier, "_copy_cpu", second_copy_fails)
    req = Req("a")
    lc = engine.admit(req)
    for _ in range(3):
        engine.decode(req, 4)
        engine.manager.step(req)
        engine.manager.poll()
    assert engine.manager.stats.copies_failed == 1 and lc.state is A
    engine.manager.finish(req)
    engine.manager.poll()
    assert lc.state is R
    [(_, result)] = engine.results
    assert [c.first_token for c in result.copies] == [0]  # the prefix before the failure
    assert engine.host.in_use == 1  # the kept page; failed and later pages were freed


def test_step_on_a_finished_request_is_refused_before_allocating() -> None:
    engine = FakeEngine(SMALL, defer=True, stride_pages=1)
    req = Req("a")
    engine.admit(req)
    engine.decode(req, 4)
    engine.manager.step(req)
    engine.manager.finish(req)
    engine.decode(req, 8)
    available = engine.host.available
    with pytest.raises(InvalidTransitionError):
        engine.manager.step(req)
    with pytest.raises(InvalidTransitionError):
        engine.manager.finish(req)
    assert engine.host.available == available


def test_bad_engine_answers_change_nothing() -> None:
    engine = FakeEngine(SMALL, stride_pages=1)
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 4)
    engine.admissions[lc.serial].slot_ids[0] = 10_000  # out of the pool's range
    with pytest.raises(ValueError, match="out of range"):
        engine.manager.step(req)
    assert engine.host.available == engine.host.capacity and lc.state is A
    with pytest.raises(ValueError, match="stride_pages"):
        type(engine.manager)(engine, engine.copier, stride_pages=0)
    # before: built, and the first step raised AttributeError deep inside
    with pytest.raises(TypeError, match=r"source must be a KVSource .* lacks committed, token_ids"):
        type(engine.manager)(object(), engine.copier)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="copier must be a CopyEngine, got None"):
        type(engine.manager)(engine, None)  # type: ignore[arg-type]


def _fingerprint(engine: FakeEngine, lc: Any) -> tuple[object, ...]:
    manager = engine.manager
    return (
        lc.state,
        lc.inflight,
        manager.planner.account(),
        manager.planner.progress(lc).covered,
        manager.stats.copies_launched,
        len(engine.jobs),
    )


@pytest.mark.parametrize(
    ("call", "edit"),
    [
        ("step", lambda slots: slots[:-1]),  # 7 slots fill 2 pages too: token 8 uncopied
        ("finish", lambda slots: [*slots, 0]),  # slot 0 is another request's
        ("step", lambda slots: [float(s) for s in slots]),
        ("step", lambda slots: torch.tensor(slots, dtype=torch.float32) + 0.5),
        ("finish", lambda slots: [True] * len(slots)),
    ],
    ids=["one-short", "one-more", "floats", "float-tensor", "bools"],
)
def test_slots_that_are_not_one_int_per_token_are_refused(call: str, edit: Any) -> None:
    engine = FakeEngine(SMALL, stride_pages=1, host_pages=16)
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 9)
    honest = engine.slots

    def slots(req: Any, start: int, end: int) -> Any:
        return edit(list(honest(req, start, end)))

    engine.slots = slots  # type: ignore[method-assign]
    before = _fingerprint(engine, lc)
    with pytest.raises((ValueError, TypeError), match="slots"):
        getattr(engine.manager, call)(req)
    assert _fingerprint(engine, lc) == before and lc.state is A
    engine.slots = honest  # type: ignore[method-assign]
    engine.manager.finish(req)
    engine.manager.drain()
    [(_, result)] = engine.results
    assert result.tokens == 9 and host_matches(engine, result, engine.admissions[lc.serial])


@pytest.mark.parametrize(
    ("call", "given", "error"),
    [
        ("step", 9.0, TypeError),
        ("finish", "9", TypeError),
        ("finish", None, TypeError),
        ("step", -1, ValueError),
    ],
    ids=["float", "str", "none", "negative"],
)
def test_a_committed_count_that_is_not_a_count_is_refused(
    call: str, given: object, error: type[Exception]
) -> None:
    """Before: a float went on into the page arithmetic (a copy of 9.0 tokens asked of
    the engine), a string or None raised Python's own ``TypeError`` naming an operator."""
    engine = FakeEngine(SMALL, stride_pages=1, host_pages=16)
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 9)
    honest = engine.committed
    engine.committed = lambda req: given  # type: ignore[method-assign,assignment,return-value]
    before = _fingerprint(engine, lc)
    with pytest.raises(error, match=r"committed\(\) (must give an integer|gave -1)"):
        getattr(engine.manager, call)(req)
    assert _fingerprint(engine, lc) == before and lc.state is A
    engine.committed = lambda req: torch.tensor(honest(req))  # type: ignore[method-assign]
    assert engine.manager.step(req) is not None  # an integer tensor is its value
    engine.committed = honest  # type: ignore[method-assign]
    engine.manager.finish(req)
    engine.manager.drain()
    [(_, result)] = engine.results
    assert result.tokens == 9 and host_matches(engine, result, engine.admissions[lc.serial])


# --- tensor parallelism over gloo -------------------------------------------------------


def _local_done(rank: int, world: int, poll: int) -> int:
    """Copies finished on ``rank`` by ``poll``: copy 0 at poll rank+1, copy 1 at poll
    2*(world-rank) (copies on one stream finish in order)."""
    first = poll >= rank + 1
    return int(first) + int(first and poll >= 2 * (world - rank))


def _tp_worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        engine = FakeEngine(SMALL, defer=True, stride_pages=1, group=dist.group.WORLD)
        req = Req("tp")
        lc = engine.admit(req)
        for _ in range(2):
            engine.decode(req, 4)
            engine.manager.step(req)
        engine.manager.finish(req)
        seen = []
        for poll in range(1, 2 * world + 2):
            for i, (job, _) in enumerate(engine.jobs):
                if job.deferred and _local_done(rank, world, poll) > i:
                    job.run()
            engine.manager.poll()
            seen.append([poll, lc.state.value, lc.inflight])
        Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears down first
    finally:
        dist.destroy_process_group()
    # The rank's work is done and written. Skip the interpreter's teardown: under load,
    # gloo's threads can still be joinable when C++ static destructors run, and
    # std::terminate then aborts (SIGABRT) a rank that finished everything.
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_lifecycles_move_only_when_every_rank_is_done(
    world: int, tmp_path: Path
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(
        _tp_worker,
        args=(world, str(tmp_path / "store"), str(tmp_path)),
        nprocs=world,
        start_method="spawn",
    )
    for rank in range(world):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for poll, state, inflight in seen:
            agreed = min(_local_done(r, world, poll) for r in range(world))
            assert inflight == 2 - agreed, (rank, poll, seen)
            assert state == ("released" if agreed == 2 else "finished_pending"), (rank, poll)


# --- on a GPU (tests/gpu/check.sh) ------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_slots_wait_for_a_delayed_copy() -> None:
    """The shape of PyTorch's test_record_stream: a copy held back on its side stream (by
    a gate the test opens) keeps the request's device slots out of the engine's hands
    until its event completes."""
    engine = FakeEngine(SMALL, stride_pages=1, device="cuda")
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 8)
    assert len(engine.copier.copy_streams) == 1
    with StreamGate(engine.copier.copy_streams[0]) as gate:  # the copy queues behind it
        engine.manager.step(req)
        engine.manager.finish(req)
        assert engine.manager.poll() == 0
        assert lc.state is F and engine.released_serials == []
        gate.open()
        engine.manager.drain()
    assert not gate.timed_out
    assert lc.state is R and engine.released_serials == [lc.serial]
    [(_, result)] = engine.results
    assert host_matches(engine, result, engine.admissions[lc.serial])


# --- refusals and hooks: audited like the registry's own, every hook runs ---------------


@pytest.mark.parametrize("call", ["step", "finish", "abort"])
def test_calls_on_unknown_or_released_requests_are_counted_and_audited(call: str) -> None:
    sink = MemorySink()
    engine = FakeEngine(SMALL, registry=LifecycleRegistry(sinks=[sink]))
    done = Req("done")
    engine.admit(done)
    engine.manager.finish(done)  # released at once: nothing was offloaded
    trigger = {"step": "start_offload", "finish": "finish", "abort": "abort"}[call]
    for req in (Req("never"), done):
        with pytest.raises(UnknownRequestError) as info:
            getattr(engine.manager, call)(req)
        assert info.value.trigger == trigger
    assert engine.manager.registry.statistics().refusals["unknown_request"] == 2
    refused = [r for r in sink.records() if not r.ok]
    assert [(r.trigger, r.reason, r.rid) for r in refused] == [
        (trigger, "unknown_request", "never"),
        (trigger, "unknown_request", "done"),
    ]
    assert check_audit(sink.records()).ok


def test_a_raising_release_hook_does_not_stop_the_others_or_the_poll() -> None:
    engine = FakeEngine(SMALL, defer=True, stride_pages=1)
    freed: list[str] = []

    @engine.manager.on_release
    def broken(req: Any, result: OffloadResult) -> None:
        raise RuntimeError(f"hook bug for {req.rid}")

    @engine.manager.on_release
    def frees_pages(req: Any, result: OffloadResult) -> None:
        for pages in result.pages:
            engine.host.free(pages)
        freed.append(req.rid)

    reqs = [Req("a"), Req("b")]
    for req in reqs:
        engine.admit(req)
        engine.decode(req, 8)
        engine.manager.step(req)
        engine.manager.finish(req)
    engine.run_all()
    with pytest.raises(RuntimeError, match="hook bug for a"):
        engine.manager.poll()  # both copies are delivered before the first error is raised
    assert freed == ["a", "b"] and [r.rid for r, _ in engine.results] == ["a", "b"]
    assert engine.host.available == engine.host.capacity  # no page leaked
    assert engine.manager.inflight == 0 and len(engine.manager.registry) == 0
    assert sorted(engine.released_serials) == [0, 1]


def test_a_raising_release_slots_still_runs_the_hooks() -> None:
    engine = FakeEngine(SMALL, stride_pages=1)
    req = Req("a")
    engine.admit(req)

    def broken(req: Any, lifecycle: Any) -> None:
        raise OSError("engine refused the slots")

    engine.release_slots = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="engine refused"):
        engine.manager.finish(req)
    assert [r.rid for r, _ in engine.results] == ["a"]
    assert len(engine.manager.registry) == 0


def test_on_release_needs_a_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        FakeEngine(SMALL).manager.on_release("not a hook")  # type: ignore[arg-type]


def test_a_failing_audit_sink_never_keeps_slots_or_pages_from_going_back() -> None:
    class Full:
        def write(self, record: Any) -> None:
            raise OSError(28, "No space left on device")

    engine = FakeEngine(
        SMALL, defer=True, stride_pages=1, registry=LifecycleRegistry(sinks=[Full()])
    )
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 8)
    assert engine.manager.step(req) is not None  # the ticket is issued although the sink failed
    engine.manager.finish(req)
    engine.run_all()
    assert engine.manager.poll() == 1
    assert lc.state is R and engine.released_serials == [lc.serial]  # release_slots ran
    assert [r.rid for r, _ in engine.results] == ["a"]  # and the hooks
    assert engine.manager.registry.statistics().sinks[0].errors >= 1


def test_audit_detail_is_built_only_when_a_sink_is_attached() -> None:
    sink = MemorySink()
    engine = FakeEngine(SMALL, stride_pages=1, registry=LifecycleRegistry(sinks=[sink]))
    req = Req("a")
    engine.admit(req)
    engine.decode(req, 4)
    engine.manager.step(req)
    [start] = [r for r in sink.records() if r.trigger == "start_offload"]
    assert start.detail == {"kind": "store", "tokens": 4, "blocks": 1, "first_block": 0}


@patches_compiled
def test_no_audit_detail_is_built_without_a_sink() -> None:
    quiet = FakeEngine(SMALL, stride_pages=1)
    assert not quiet.manager.registry.audited
    calls: list[dict[str, Any]] = []
    real = quiet.manager.registry.start_offload

    def spy(target: Any, **detail: Any) -> Any:
        calls.append(detail)
        return real(target, **detail)

    quiet.manager.registry.start_offload = spy  # type: ignore[method-assign]
    req = Req("b")
    quiet.admit(req)
    quiet.decode(req, 4)
    quiet.manager.step(req)
    assert calls == [{}]


# ---------------------------------------------------------------------------- engine hooks


class _SumHasher:
    """A page hash an engine might bring: str hashes chained from a per-request seed."""

    def seed(self, req: Any) -> str:
        return f"seed:{req.rid}"

    def page(self, prior: Any, token_ids: Any) -> str:
        return f"{prior}|{sum(token_ids)}"


def test_a_pluggable_page_hash_chains_from_its_seed() -> None:
    engine = FakeEngine(SMALL, stride_pages=1)
    engine.manager.page_hash = _SumHasher()
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 10)
    engine.manager.finish(req)
    engine.manager.poll()
    [(_, result)] = engine.results
    ids = engine.admissions[lc.serial].token_ids
    pages = [sum(ids[0:4]), sum(ids[4:8])]
    assert [h for c in result.copies for h in c.hashes] == [
        f"seed:a|{pages[0]}",
        f"seed:a|{pages[0]}|{pages[1]}",
        None,  # the partial last page
    ]
    with pytest.raises(TypeError, match="seed"):
        engine.manager.__class__(engine, engine.copier, page_hash=object())  # type: ignore[arg-type]


def test_start_skips_pages_stored_elsewhere_and_continues_their_chain() -> None:
    engine = FakeEngine(SMALL, stride_pages=1)
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 12)
    decode_side = engine.manager.__class__(engine, engine.copier, stride_pages=1)
    for bad in (6, -4, 4.0):
        with pytest.raises(ValueError, match="start"):
            decode_side.register(req, start=bad)  # type: ignore[arg-type]
        assert req not in decode_side.registry  # nothing registered
    decode_side.register(req, start=8)  # pages 0 and 1 were stored by "prefill"
    copies: list[Any] = []
    decode_side.on_copy(lambda r, lc, copy: copies.append(copy) or False)
    assert decode_side.step(req) is not None
    decode_side.poll()
    [copy] = copies
    assert (copy.first_token, copy.tokens) == (8, 4)
    ids = engine.admissions[lc.serial].token_ids
    prev = b""
    for first in (0, 4, 8):
        prev = Blake2bPageHasher().page(prev, ids[first : first + 4])
    assert copy.hashes == (prev,)  # page 2's hash, chained through pages 0 and 1
    results: list[Any] = []
    decode_side.on_release(lambda r, result: results.append(result))
    decode_side.finish(req, flush=False)
    [result] = results
    assert [c.first_token for c in result.copies] == [8] and result.tokens == 4  # handed over


def test_whole_strides_offloads_multiples_of_the_stride_only() -> None:
    engine = FakeEngine(SMALL, stride_pages=2)
    engine.manager.whole_strides = True
    req = Req("a")
    engine.admit(req)
    engine.decode(req, 21)  # 5 full pages waiting
    ticket = engine.manager.step(req)
    assert ticket is not None and engine.jobs[-1][0].tokens == 16  # 4 pages, not 5
    engine.decode(req, 3)  # 6 full pages: 2 waiting
    assert engine.manager.step(req) is not None and engine.jobs[-1][0].tokens == 8
    engine.manager.finish(req, flush=False)  # the partial page is dropped
    engine.manager.poll()
    [(_, result)] = engine.results
    assert result.tokens == 24 and engine.manager.stats.copies_launched == 2


def test_a_copy_hook_may_take_the_pages_of_each_completed_copy() -> None:
    engine = FakeEngine(SMALL, stride_pages=1, defer=True)
    manager = engine.manager
    taken: list[Any] = []
    manager.on_copy(lambda req, lc, copy: taken.append((req, lc, copy)) or True)
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 8)
    first = manager.step(req)
    assert first is not None and dict(manager.inflight_requests) == {first.op: req}
    assert len(manager.inflight_requests) == 1
    with pytest.raises(KeyError):
        manager.inflight_requests[first.op + 1]
    with pytest.raises(TypeError):
        manager.inflight_requests[99] = req  # type: ignore[index]
    engine.jobs[-1][0].run()
    manager.finish(req)
    for job, _ in engine.jobs:
        if job.deferred:
            job.run()
    manager.poll()
    assert lc.state is R and not manager.inflight_requests
    [(_, result)] = engine.results
    assert result.copies == () and manager.stats.copies_taken == 1  # the flush had no pages
    [(got_req, got_lc, copy)] = taken
    assert got_req is req and got_lc is lc and copy.tokens == 8
    assert engine.host.in_use == len(copy.pages)  # the hook owns them now
    engine.host.free(copy.pages)


def test_a_copy_hook_that_raises_takes_nothing_and_delivery_goes_on() -> None:
    engine = FakeEngine(SMALL, stride_pages=1)
    seen: list[int] = []

    def broken(req: Any, lc: Any, copy: Any) -> bool:
        raise RuntimeError("backup queue full")

    engine.manager.on_copy(broken)
    engine.manager.on_copy(lambda req, lc, copy: seen.append(copy.tokens) or False)
    with pytest.raises(TypeError):
        engine.manager.on_copy("not callable")  # type: ignore[arg-type]
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 6)
    engine.manager.finish(req)
    with pytest.raises(RuntimeError, match="backup queue full"):
        engine.manager.poll()
    assert lc.state is R and seen == [6]  # delivered, released, the next hook ran
    [(_, result)] = engine.results
    assert result.tokens == 6 and engine.manager.stats.copies_taken == 0  # still the manager's


def test_the_manager_is_the_two_halves_and_its_page_account_is_public() -> None:
    """The planner (owner mode, over the pool's own page accounting) and the worker
    (over the engine's copy engine) are the manager's; its account shows where every
    host page is: free, written by copies in flight, kept by live requests, or handed to
    the hooks (the rest)."""
    engine = FakeEngine(SMALL, defer=True, stride_pages=1, host_pages=8)
    manager = engine.manager
    assert manager.planner.allocator is engine.host.allocator
    assert manager.worker.copier is engine.copier and manager.registry is manager.planner.registry
    req = Req("a")
    lc = engine.admit(req)
    engine.decode(req, 8)
    ticket = manager.step(req)
    assert ticket is not None and manager.planner.inflight_of(lc) == {ticket.op}
    assert manager.account() == PageAccount(8, free=6, cached=0, pinned=0, storing=2, kept=0)
    assert dict(manager.inflight_requests) == {ticket.op: req}
    engine.run_all()
    assert manager.poll() == 1 and manager.account().kept == 2
    engine.decode(req, 1)
    manager.finish(req)  # the partial last page: a copy of one page
    assert manager.account().storing == 1
    engine.run_all()
    manager.poll()
    [(_, result)] = engine.results
    assert [(c.first_token, c.tokens) for c in result.copies] == [(0, 8), (8, 1)]
    account = manager.account()
    assert (account.free, account.storing, account.kept) == (5, 0, 0)  # 3 with the hook
    assert account.capacity - account.free == sum(len(p) for p in result.pages)


def test_a_released_request_is_dropped_at_once() -> None:
    """Released means released: with the cyclic collector off, nothing of the manager
    (its planner's kept stores, their orders) holds the request after its release."""
    engine = FakeEngine(LAYOUTS["per_layer"], stride_pages=1, host_pages=16)
    req = Req("a")
    engine.admit(req)
    engine.decode(req, 20)
    assert engine.manager.step(req) is not None
    gc.collect()
    gc.disable()
    try:
        engine.manager.finish(req)
        engine.manager.poll()
        engine.results.clear()  # the engine's own hook kept (req, result)
        gone = weakref.ref(req)
        del req
        assert gone() is None, gc.get_referrers(gone())
    finally:
        gc.enable()

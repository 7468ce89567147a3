"""LMCache 0.5.6's ``LMCacheMPConnector`` (what vLLM's ``--kv-offloading-backend lmcache``
turns on) in vLLM 0.33.0's real ``Scheduler``, alone and under ``KVLifeAuditConnector``
(CPU, ``make test-lmcache``).

Everything LMCache runs is real: its scheduler role inside vLLM's scheduler, its worker role
on CPU KV tensors, and a real ``lmcache server`` process (started per module on a free
loopback port, stopped by its pid, its log kept under ``build/test-logs/`` when a test
fails). The model runner is played: each step calls the worker connector as vLLM's
``KVConnectorModelRunnerMixin`` does, and a stand-in forward pass writes a value derived
from (token, position) into each scheduled token's KV slots. The clock is paced, not
raced: each lookup is acknowledged before LMCache asks for its result, and each step waits
for the worker's copies to finish, so what vLLM schedules does not depend on the machine's
speed.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="runs in the LMCache environment: make test-lmcache")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from kvlife.fsm import check_audit, read_audit
from kvlife.fsm.audit import AuditReport
from tests.engines.lmcache_server import Server, lmcache_config, lmcache_server
from tests.engines.test_vllm_audit import _summary
from tests.engines.vllm_harness import BLOCK, TOKEN, make_request, make_scheduler

KVLIFE = "kvlife.offload.engines.vllm"
HEADS, HEAD_DIM = 12, 64  # the harness's model (OPT-125m's config)
LOGS = Path(__file__).resolve().parents[2] / "build" / "test-logs"


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A real ``lmcache server`` (``tests/engines/lmcache_server.py``) for the module; its
    log is copied to ``build/test-logs/`` when a test of the module failed."""
    log = tmp_path_factory.mktemp("lmcache") / "server.log"
    failed = request.session.testsfailed
    try:
        with lmcache_server(log) as running:
            yield running
    finally:
        if request.session.testsfailed > failed:
            LOGS.mkdir(parents=True, exist_ok=True)
            kept = LOGS / f"lmcache-server-{log.parent.name}.log"
            shutil.copyfile(log, kept)
            print(f"lmcache server log kept: {kept}", file=sys.stderr)


def _lmcache(server: Server) -> dict[str, Any]:
    config = lmcache_config(server)  # the prefetch status is read in the step that asks
    del config["kv_role"]  # (its ack is paced below)
    return config


def _value(token: int, position: int) -> float:
    """What the stand-in forward pass writes for a token: exact in float16."""
    return float((token * 31 + position) % 1024)


class LMCacheEngine:
    """vLLM's scheduler with LMCache (alone, or wrapped by kvlife when ``audit`` is given)
    and LMCache's worker role on a CPU KV cache of one layer, ``[2, blocks, 16, 12, 64]``
    (vLLM's LBNHC layout, which LMCache reads as NHD)."""

    def __init__(
        self,
        server: Server,
        audit: Path | None = None,
        *,
        mode: str = "observe",
        blocks: int = 128,
        max_seqs: int = 16,
        **settings: Any,
    ) -> None:
        lmcache = _lmcache(server)
        if audit is None:
            self.scheduler = make_scheduler(
                lmcache["kv_connector"],
                None,
                lmcache["kv_connector_extra_config"],
                blocks=blocks,
                max_seqs=max_seqs,
                layout="LBNHC",
            )
        else:
            extra = {"connector": lmcache, "mode": mode, "audit_log": str(audit), **settings}
            self.scheduler = make_scheduler(
                "KVLifeAuditConnectorHMA",
                KVLIFE,
                extra,
                blocks=blocks,
                max_seqs=max_seqs,
                layout="LBNHC",
            )
        connector = self.scheduler.connector
        self.lmcache = getattr(connector, "wrapped", connector)  # LMCache's scheduler role
        self.worker = type(connector)(
            self.scheduler.vllm_config, KVConnectorRole.WORKER, self.scheduler.kv_cache_config
        )
        self.kv = torch.zeros((2, blocks, BLOCK, HEADS, HEAD_DIM), dtype=torch.float16)
        self.worker.register_kv_caches({"layer": self.kv})
        self.adapter = getattr(self.worker, "wrapped", self.worker).worker_adapter
        self._pace_lookups()
        self.trace: list[tuple[Any, ...]] = []  # what vLLM scheduled, step by step
        self.preempted = 0  # requests vLLM preempted
        self.loaded = 0  # loads LMCache issued

    # ------------------------------------------------------------------ pacing
    def _until(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + 60
        while not ready():
            assert time.monotonic() < deadline, f"LMCache did not {what} in 60 s"
            time.sleep(0.001)

    def _pace_lookups(self) -> None:
        """A lookup is acknowledged before the scheduler asks for its result (as a server
        that answers at once would): LMCache's scheduler role sends a request's lookup and
        polls for the server's acknowledgement in one call, so without this the step that
        admits a request would depend on how fast the server answered."""
        adapter = self.lmcache.scheduler_adapter
        submit = adapter.maybe_submit_lookup_request
        unacked = adapter._unacked_lookups

        def acknowledged(*args: Any, **kwargs: Any) -> Any:
            sent = submit(*args, **kwargs)
            self._until(
                lambda: all(f.query() for a in unacked.values() for f in a.futures.values()),
                "acknowledge a lookup",
            )
            return sent

        adapter.maybe_submit_lookup_request = acknowledged

    def _settle_copies(self) -> None:
        """Wait until every store and retrieve the worker submitted has finished."""
        adapter = self.adapter
        self._until(
            lambda: (
                all(f.query() for f in adapter.store_futures.values())
                and all(f.query() for f, _ in adapter.retrieve_futures.values())
            ),
            "finish a copy",
        )

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Any:
        out = self.scheduler.schedule()
        self.trace.append(_summary(out))
        self.preempted += len(out.preempted_req_ids or ())
        self.loaded += len(self.loads(out))
        return out

    def run_model(self, out: Any) -> ModelRunnerOutput:
        """The model runner's step: the worker connector called as vLLM's
        ``KVConnectorModelRunnerMixin`` calls it, around a stand-in forward pass."""
        meta = out.kv_connector_metadata
        worker = self.worker
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)
        self._forward(out)
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        self._settle_copies()
        results = worker.get_transfer_results(out.finished_req_ids)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_cache_events=worker.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[TOKEN] for _ in req_ids],
            kv_connector_output=output,
        )

    def step(self) -> Any:
        out = self.schedule()
        self.scheduler.update_from_output(out, self.run_model(out))
        return out

    def abort_while_loading(self, rid: str) -> None:
        """vLLM's order with asynchronous scheduling (the engine core's batch queue): the
        step that carries ``rid``'s load is running when the client's abort arrives, and
        the next step is scheduled before the running one's output is handled."""
        out = self.schedule_load(rid)
        output = self.run_model(out)
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        after = self.schedule()
        self.scheduler.update_from_output(out, output)
        self.scheduler.update_from_output(after, self.run_model(after))

    def run_until_idle(self, steps: int = 200) -> None:
        """Step until vLLM holds no request."""
        for _ in range(steps):
            if not self.scheduler.requests:
                return
            self.step()
        raise AssertionError(f"still busy after {steps} steps: {list(self.scheduler.requests)}")

    def loads(self, out: Any) -> list[str]:
        return [
            m.request_id for m in out.kv_connector_metadata.requests if m.direction == "RETRIEVE"
        ]

    def schedule_load(self, rid: str, steps: int = 20) -> Any:
        """Step until vLLM schedules the step that carries ``rid``'s load; returns that
        step's output, not run yet."""
        for _ in range(steps):
            out = self.schedule()
            if rid in self.loads(out):
                return out
            self.scheduler.update_from_output(out, self.run_model(out))
        raise AssertionError(f"{rid} was never loaded")

    # ------------------------------------------------------------------ the model
    def _forward(self, out: Any) -> None:
        for new in out.scheduled_new_reqs:
            self._write(new.req_id, list(new.block_ids[0]), new.num_computed_tokens, out)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            self._write(rid, list(ids), cached.num_computed_tokens[i], out)

    def _write(self, rid: str, block_ids: list[int], start: int, out: Any) -> None:
        tokens = self.scheduler.requests[rid].all_token_ids
        for position in range(start, start + out.num_scheduled_tokens[rid]):
            block, offset = block_ids[position // BLOCK], position % BLOCK
            self.kv[:, block, offset] = self.expected(tokens[position], position)

    def expected(self, token: int, position: int) -> torch.Tensor:
        """One token's KV slots, ``[2, heads, head_dim]``: K and V differ, and so does
        every head, so a copy that mixes them up is caught."""
        base = _value(token, position)
        heads = torch.arange(HEADS, dtype=torch.float16).view(HEADS, 1).expand(HEADS, HEAD_DIM)
        return torch.stack((heads + base, heads + base + 1024))

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def _check(path: Path) -> AuditReport:
    return check_audit(read_audit(path))


def _said(path: Path) -> list[tuple[str, str | None, Any]]:
    """The log's refusals and verdicts, in order: (reason, rid, what was reported)."""
    return [
        (r.reason or "", r.rid, r.detail.get("report") if r.detail else None)
        for r in read_audit(path).records
        if not r.ok
    ]


# ---------------------------------------------------------------------- the tests


@pytest.mark.parametrize("wrapped", [False, True], ids=["alone", "wrapped"])
def test_lmcache_stores_and_retrieves_the_bytes_written(
    server: Server, tmp_path: Path, wrapped: bool
) -> None:
    """A request's prefill is stored to the server; after vLLM's prefix cache is reset and
    the device cache zeroed, a request with the same prompt loads it back: the loaded
    slots hold exactly what the first request's forward pass wrote."""
    path = tmp_path / "a.jsonl"
    engine = LMCacheEngine(server, path if wrapped else None)
    first = 3000 + 100 * wrapped  # a prompt of its own for each run on the shared server
    engine.scheduler.add_request(make_request("writer", prompt=72, max_tokens=2, first=first))
    engine.run_until_idle()
    assert engine.scheduler.reset_prefix_cache()
    engine.kv.zero_()
    reader = make_request("reader", prompt=72, max_tokens=2, first=first)
    engine.scheduler.add_request(reader)
    out = engine.schedule_load("reader")
    engine.scheduler.update_from_output(out, engine.run_model(out))
    blocks = engine.scheduler.kv_cache_manager.get_block_ids("reader")[0]
    loaded = 64  # four whole chunks of the 72-token prompt
    for position in range(loaded):
        got = engine.kv[:, blocks[position // BLOCK], position % BLOCK]
        assert torch.equal(got, engine.expected(first + position, position)), position
    assert reader.num_computed_tokens == loaded
    engine.run_until_idle()
    if wrapped:
        engine.scheduler.shutdown()
        report = _check(path)
        assert report.ok, report.violations[:3]
        assert report.lifecycles == report.released == 2


def _workload(engine: LMCacheEngine, seed: int, base: int) -> None:
    """Requests with shared prefixes, prefix-cache resets (so LMCache loads), aborts while
    running and while loading, and a cache small enough for vLLM to preempt. The prompts'
    tokens start at ``base``: the server keeps what a run stored, so two runs meant to see
    the same cache use prompts of their own (equal in shape, so vLLM's hashes differ but
    its choices do not)."""
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    prompts = [base + 500 * i for i in range(12)]
    serial = 0
    for step in range(70):
        if step < 50 and rng.random() < 0.5:
            rid = f"r{serial}"
            serial += 1
            engine.scheduler.add_request(
                make_request(
                    rid,
                    prompt=rng.choice((40, 72, 104)),
                    max_tokens=rng.randint(20, 60),
                    first=rng.choice(prompts),
                )
            )
        if rng.random() < 0.06:
            engine.scheduler.reset_prefix_cache()
        if engine.scheduler.requests and rng.random() < 0.08:
            victim = rng.choice(sorted(engine.scheduler.requests))
            if not engine.scheduler.requests[victim].is_finished():
                engine.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        engine.step()
    engine.run_until_idle()


@pytest.mark.parametrize("seed", range(4))
def test_a_clean_run_under_the_wrapper_changes_nothing_vllm_schedules_and_checks_clean(
    server: Server, tmp_path: Path, seed: int
) -> None:
    alone = LMCacheEngine(server, blocks=40)
    _workload(alone, seed, base=100_000 + 14_000 * seed)
    path = tmp_path / "a.jsonl"
    wrapped = LMCacheEngine(server, path, blocks=40)
    _workload(wrapped, seed, base=107_000 + 14_000 * seed)
    assert wrapped.trace == alone.trace
    assert not alone.scheduler.requests and not wrapped.scheduler.requests
    assert alone.preempted > 0  # the small cache made vLLM preempt
    assert alone.loaded > 0  # and LMCache loaded after the prefix-cache resets
    wrapped.scheduler.shutdown()
    report = _check(path)
    assert report.ok, report.violations[:3]
    assert report.lifecycles == report.released
    assert report.transitions["start_offload"] > 0  # loads and delayed frees were tickets
    print(  # pytest -s: the figures the docs quote
        f"seed {seed}: {len(alone.trace)} steps, {alone.preempted} preemptions, "
        f"{alone.loaded} loads, {report.lifecycles} lifecycles, "
        f"{report.transitions['start_offload']} tickets, {len(report.violations)} verdicts"
    )


def _abort_while_loading(engine: LMCacheEngine, first: int) -> None:
    """LMCache #4185 / #4938: ``victim`` loads its prefix from LMCache and is aborted while
    the step that carries its load runs; ``other`` runs beside it."""
    engine.scheduler.add_request(make_request("writer", prompt=72, max_tokens=2, first=first))
    engine.run_until_idle()
    assert engine.scheduler.reset_prefix_cache()
    engine.scheduler.add_request(make_request("victim", prompt=72, max_tokens=4, first=first))
    engine.scheduler.add_request(make_request("other", prompt=40, max_tokens=6, first=first + 200))
    engine.abort_while_loading("victim")


def test_an_abort_while_lmcache_loads_kills_vllms_scheduler(server: Server) -> None:
    """The crash bare: LMCache delays the aborted request's free, the worker reports its
    load done (vLLM frees it there), then LMCache's worker reports a ``finished_sending``
    for it: vLLM's scheduler asserts that it still holds the request."""
    engine = LMCacheEngine(server)
    with pytest.raises(AssertionError) as raised:
        _abort_while_loading(engine, first=40_000)
        engine.run_until_idle()
    assert raised.traceback[-1].name == "_update_from_kv_xfer_finished"


def test_observed_the_log_names_the_report_that_kills_vllm(server: Server, tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    engine = LMCacheEngine(server, path)
    with pytest.raises(AssertionError) as raised:
        _abort_while_loading(engine, first=41_000)
        engine.run_until_idle()
    assert raised.traceback[-1].name == "_update_from_kv_xfer_finished"
    # written before vLLM acted on it: the file holds it although vLLM never shut down
    assert ("stray_report", "victim", "finished_sending") in _said(path)
    report = _check(path)
    assert ("stray_report", "victim") in [(v.kind, v.rid) for v in report.violations]


def test_refused_the_report_never_reaches_vllm_and_the_other_request_finishes(
    server: Server, tmp_path: Path
) -> None:
    path = tmp_path / "a.jsonl"
    engine = LMCacheEngine(server, path, mode="refuse")
    _abort_while_loading(engine, first=42_000)
    other = engine.scheduler.requests["other"]
    engine.run_until_idle()
    assert other.status == RequestStatus.FINISHED_LENGTH_CAPPED  # vLLM kept serving
    assert engine.free_blocks() == 127  # every block back (block 0 is vLLM's null block)
    engine.scheduler.shutdown()
    assert _said(path) == [("stray_report", "victim", "finished_sending")]
    (record,) = [r for r in read_audit(path).records if not r.ok]
    assert record.detail["refused"] is True
    report = _check(path)
    assert [(v.kind, v.rid) for v in report.violations] == [("stray_report", "victim")]


def test_a_reused_id_leaks_its_blocks_and_is_told_overdue_while_vllm_runs(
    server: Server, tmp_path: Path
) -> None:
    """LMCache's worker remembers the ids it reported finished in a set of strings: a new
    request that reuses an id never gets its ``finished_sending``, and vLLM holds it,
    finished, with its blocks, for ever. The wrapper tells it while vLLM runs: the
    overdue record is in the file and in the stats hook before shutdown."""
    path = tmp_path / "a.jsonl"
    engine = LMCacheEngine(server, path, audit_overdue_s=0.2, stats_interval_s=0)
    handed: list[dict[str, Any]] = []
    take = engine.scheduler.connector.get_kv_connector_stats

    def hook() -> Any:
        stats = take()
        if stats is not None:
            handed.append(stats.data.get("kvlife") or {})
        return stats

    engine.scheduler.connector.get_kv_connector_stats = hook
    engine.scheduler.add_request(make_request("chat-7", prompt=72, max_tokens=4, first=43_000))
    engine.run_until_idle()  # its free reported: LMCache's worker remembers "chat-7"
    leaked = make_request("chat-7", prompt=72, max_tokens=4, first=43_500)  # the id again
    engine.scheduler.add_request(leaked)
    for _ in range(20):
        engine.step()
    assert leaked.is_finished() and engine.scheduler.requests["chat-7"] is leaked
    assert engine.free_blocks() == 127 - 5  # its five blocks held, for ever
    time.sleep(0.25)
    engine.step()  # vLLM keeps stepping while it holds a finished request
    live = [r for r in read_audit(path).records if r.reason == "overdue"]
    assert [(r.rid, r.detail["kind"]) for r in live] == [("chat-7", "delayed_free")]
    assert live[0].detail["age_s"] >= 0.2
    assert handed[-1]["tickets_overdue_open"] == 1
    assert handed[-1]["oldest_open_ticket_seconds"] >= 0.25
    engine.scheduler.shutdown()
    report = _check(path)
    assert sorted((v.kind, v.rid) for v in report.violations) == [
        ("overdue", "chat-7"),
        ("unreported", "chat-7"),
    ]


def test_kvlife_vllm_exercise_runs_lmcache_and_finds_its_two_known_bugs(
    server: Server, tmp_path: Path
) -> None:
    """``kvlife vllm exercise`` with LMCache's real worker (paced, on CPU caches) and the
    real server: clean where ids are fresh and nothing is aborted (also with preemption,
    reports held back, shared prefixes, two workers); the ``reuse`` family finds the leak of
    a reused id (LMCache's worker keeps the ids it reported: the second request's delayed
    free is never reported, vLLM holds it for ever) and ``abort`` finds the stray report of
    an aborted request (vLLM's scheduler asserts), the two bugs the tests above show by
    hand."""
    from kvlife.offload.watch.vllm.exercise import exercise  # noqa: PLC0415

    families = ["basic", "preempt", "hold", "prefix", "tp2", "reuse", "abort"]
    reports, _ = exercise(lmcache_config(server), families, range(3), 80, tmp_path, runners=["v1"])
    did = {r.family: r for r in reports}
    for family in ("basic", "preempt", "hold", "prefix", "tp2"):
        assert did[family].failed == 0 and did[family].copies > 0, did[family].lines()
    assert did["preempt"].preemptions > 0
    reuse, abort = did["reuse"], did["abort"]
    assert reuse.failed == reuse.runs and reuse.undrained and "unreported" in reuse.verdicts
    assert abort.failed > 0 and "stray_report" in abort.verdicts
    assert any(where.startswith("AssertionError at vllm/") for where in abort.raises)
    for report in reports:
        print("\n".join(report.lines()))


def test_a_seed_replays_the_same_run_whatever_ran_before_on_the_server(
    server: Server, tmp_path: Path
) -> None:
    """The server keeps what every run stored; the exercise salts each run's prompts with
    the run, so that a seed run again on a warm server loads nothing an earlier run stored
    and does what it did the first time (unsalted, the second run of ``resume`` seed 1
    loaded from the first's chunks: 215 copies against 133, and a drain of a fixed length
    called a request that was still finishing undrained)."""
    from kvlife.offload.watch.vllm.exercise import FAMILIES, run_one  # noqa: PLC0415

    config = lmcache_config(server)
    first = run_one(config, FAMILIES["resume"], 1, 120, tmp_path / "first")
    again = run_one(config, FAMILIES["resume"], 1, 120, tmp_path / "again")
    did = [
        (run.lifecycles, run.copies, run.preemptions, run.resumes, run.drain_steps)
        for run in (first, again)
    ]
    assert not first.failed and not again.failed, (first.describe(), again.describe())
    assert did[0] == did[1] and first.copies > 0 and first.resumes > 0, did

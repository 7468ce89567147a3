"""``kvlife vllm exercise`` (``kvlife.offload.watch.vllm.exercise``) and its pytest entry
point (``kvlife.offload.watch.vllm.testing``), in vLLM's environments (``make
test-vllm``, ``make test-vllm-cpu``): kvlife's own connector and a correct connector
written for the tests pass every family; each connector with a planted lifecycle bug
(``tests/engines/vllm_planted.py``) fails the family that should catch it, and passes the
basic one unless that is its family; vLLM's ``OffloadingConnector`` fails ``reuse`` as it
fails in the field, and passes the families with fresh ids.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="runs in the vLLM environment: make test-vllm")

from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvlife.diagrams.cli import main
from kvlife.offload.watch.vllm import exercise as exercise_module
from kvlife.offload.watch.vllm.exercise import (
    FAMILIES,
    RUNNERS,
    ExerciseConfigError,
    exercise,
    parse_config,
    run_one,
)
from kvlife.offload.watch.vllm.exercise_multi import multi_config
from kvlife.offload.watch.vllm.exercise_nixl import NixlPlay, NixlProtocolError, NixlPushPlay
from kvlife.offload.watch.vllm.exercise_workers import transfer_params_of
from kvlife.offload.watch.vllm.lenses.multi import MultiLens
from kvlife.offload.watch.vllm.testing import (
    ConnectorFailure,
    check_connector,
    exercise_cases,
)
from tests.engines.vllm_exercise_report import CONNECTORS
from tests.engines.vllm_harness import copies_started, exercised_clean, run_with_step
from tests.engines.vllm_planted import CAUGHT_BY, PANIC_HOOKS, HoldsPort, config
from tests.engines.vllm_server import free_port

KVLIFE = {
    "kv_connector": "KVLifeConnector",
    "kv_connector_module_path": "kvlife.offload.engines.vllm",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"host_pages": 32},
}
OFFLOADING = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20},
}
SIMPLE_LAZY = dict(CONNECTORS)["vLLM `SimpleCPUOffloadConnector`, lazy"]
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
NIXL_PUSH = {"kv_connector": "NixlPushConnector", "kv_role": "kv_both"}
STEPS = 80
SEEDS = range(8)


@pytest.mark.parametrize(("family", "seed"), exercise_cases(seeds=range(3)))
def test_kvlifes_own_connector_passes_every_family(family: str, seed: int, tmp_path: Path) -> None:
    runs = check_connector(KVLIFE, family, seed, steps=STEPS, directory=tmp_path)
    assert [run.runner for run in runs] == list(RUNNERS)  # every runner, without being asked
    assert all(run.lifecycles > 0 and run.copies > 0 for run in runs)  # stored for real


@pytest.mark.parametrize(("family", "seed"), exercise_cases(seeds=range(3)))
def test_a_correct_connector_passes_every_family(family: str, seed: int, tmp_path: Path) -> None:
    runs = check_connector(config("Planted"), family, seed, steps=STEPS, directory=tmp_path)
    assert all(run.copies > 0 for run in runs)  # delayed frees and loads, each a ticket


def test_the_families_do_what_they_say(tmp_path: Path) -> None:
    """Over a few seeds each family's runs did its thing (kvlife's own connector, whose
    stores may still be in flight when vLLM lets go of a request): ids reused while in
    flight, aborts, preemptions; and a run is the same run again with the same seed."""
    reports, _ = exercise(KVLIFE, list(FAMILIES), range(3), STEPS, tmp_path)
    assert [(r.family, r.runner) for r in reports] == [(f, r) for f in FAMILIES for r in RUNNERS]
    for runner in RUNNERS:
        did = {r.family: r for r in reports if r.runner == runner}
        assert did["reuse"].reuses > 0
        assert did["abort"].aborts > 0 and did["basic"].aborts == 0
        assert did["preempt"].preemptions > 0 and did["basic"].preemptions == 0
        assert did["resume"].resumes > 0 and did["resume"].preemptions > 0
        assert all(r.failed == 0 and not r.clean_under for r in did.values()), runner
    again = [run_one(config("Planted"), FAMILIES["abort"], 1, STEPS, tmp_path) for _ in "ab"]
    assert again[0] == again[1]


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_each_runner_steps_vllms_scheduler_as_its_engine_core_does(
    runner: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``v1`` and ``v2``: each step's output comes back before the next step is scheduled.
    ``v2-async``: vLLM's ``AsyncScheduler``, and step N+1 is scheduled before step N's output
    comes back (the engine core's batch queue of two), so that a request may be aborted with
    a step of it in flight; every step's output still comes back, in order."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: PLC0415
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415

    events: list[tuple[str, Any]] = []
    placeholders: list[int] = []  # each request's output placeholders, at each update
    schedule, update = Scheduler.schedule, Scheduler.update_from_output

    def scheduled(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = schedule(self, *args, **kwargs)
        events.append(("schedule", out))
        return out

    def updated(self: Any, out: Any, output: Any) -> Any:
        events.append(("update", out))
        assert isinstance(self, AsyncScheduler) == (runner == "v2-async")
        placeholders.extend(r.num_output_placeholders for r in self.requests.values())
        return update(self, out, output)

    monkeypatch.setattr(Scheduler, "schedule", scheduled)
    monkeypatch.setattr(Scheduler, "update_from_output", updated)
    run = run_one(KVLIFE, FAMILIES["abort"], 0, STEPS, tmp_path, runner)
    assert not run.failed and run.aborts > 0, run.describe()
    outs = [out for kind, out in events if kind == "schedule"]
    assert [out for kind, out in events if kind == "update"] == outs  # each, in order
    ahead = [  # steps scheduled, less outputs come back, each time an output comes back
        sum(kind == "schedule" for kind, _ in events[:i])
        - sum(k == "update" for k, _ in events[:i])
        for i, (kind, _) in enumerate(events)
        if kind == "update"
    ]
    assert set(ahead) == ({1, 2} if runner == "v2-async" else {1}), sorted(set(ahead))
    assert ahead.count(2) > STEPS // 2 or runner != "v2-async"
    # a generating model (not a pooling one): a step in flight holds a placeholder for the
    # token it samples, two at once when a step's output comes back
    assert max(placeholders) == (2 if runner == "v2-async" else 0)


@pytest.mark.parametrize("planted", sorted(CAUGHT_BY))
def test_each_planted_bug_is_caught_by_its_family(planted: str, tmp_path: Path) -> None:
    family = CAUGHT_BY[planted]
    failures = []
    for seed in SEEDS:
        try:
            check_connector(config(planted), family, seed, steps=STEPS, directory=tmp_path)
        except ConnectorFailure as failure:
            failures.append((seed, str(failure)))
    assert failures, f"{family} never caught {planted} in seeds {list(SEEDS)}"
    seed, said = failures[0]
    print(f"{planted}: caught by {family} in {len(failures)}/{len(SEEDS)} seeds, first {seed}")
    print(said)
    assert f"--families {family} --seed {seed}" in said  # the case again, from the shell
    if family != "basic":  # the bug is the family's: the basic family does not see it
        for seed in range(3):
            check_connector(config(planted), "basic", seed, steps=STEPS, directory=tmp_path)


def test_what_each_planted_bug_looks_like(tmp_path: Path) -> None:
    """What each family reports for its planted bug: vLLM's own exception where vLLM
    raises, the requests vLLM never drained and the verdicts of kvlife's log."""
    seen = {}
    for planted, family in CAUGHT_BY.items():
        runs = [run_one(config(planted), FAMILIES[family], s, STEPS, tmp_path) for s in SEEDS]
        failed = [r for r in runs if r.failed]
        seen[planted] = failed[0]
        print(f"{planted} / {family}: {len(failed)} of {len(runs)}: {failed[0].describe()}")
    assert "unreported" in seen["InheritsState"].verdicts and seen["InheritsState"].undrained
    assert "stray_report" in seen["RepeatsReport"].verdicts
    assert "stray_report" in seen["ReportsAborted"].verdicts
    assert "unreported" in seen["ForgetsPreempted"].verdicts
    assert seen["ForgetsPreempted"].undrained
    assert seen["LoadForAnother"].undrained or seen["LoadForAnother"].raised
    assert "event_mismatch" in seen["WrongTokens"].verdicts


def test_a_drain_that_moves_is_never_cut_short_and_one_that_stalls_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that decodes 600 tokens after the workload ends is drained however long
    that takes (a drain of a fixed number of steps called it undrained); a delayed free
    never reported ends the drain ``STALL_STEPS`` after the last request moved."""
    # a real worker's held outputs with nothing in them keep no drain going (they kept
    # kvlife's own connector's to the 5000-step backstop)
    own = run_one(KVLIFE, FAMILIES["resume"], 0, STEPS, tmp_path)
    assert not own.failed and own.drain_steps < 1000, (own.describe(), own.drain_steps)
    arrive = exercise_module._Workload.arrive

    def long_one(self: Any, scheduler: Any) -> None:
        if not self.arrived:
            self.arrived += 1
            params = SamplingParams(max_tokens=600, ignore_eos=True)
            tokens = list(range(100, 140))
            scheduler.add_request(
                Request(f"{self.tag}long", tokens, params, None, block_hasher=self.hasher)
            )
        arrive(self, scheduler)

    monkeypatch.setattr(exercise_module._Workload, "arrive", long_one)
    run = run_one(KVLIFE, FAMILIES["basic"], 0, 20, tmp_path)
    assert not run.failed, run.describe()
    assert run.drain_steps > 560  # the long request's tokens, one a step
    # no request held, the workers' reports still moving the drain: a lazy offload stores
    # blocks vLLM's prefix cache keeps, reported after 4-20 steps, for 200 steps after
    # the last request went (cut off at STALL_STEPS, its blocks in flight were a "leak")
    lazy = run_one(SIMPLE_LAZY, FAMILIES["hold"], 1, 120, tmp_path)
    assert not lazy.failed and lazy.drain_steps > exercise_module.STALL_STEPS, lazy.describe()
    stuck = run_one(config("ForgetsPreempted"), FAMILIES["preempt"], 0, STEPS, tmp_path)
    assert stuck.undrained
    assert exercise_module.STALL_STEPS <= stuck.drain_steps < 600
    assert f"after {stuck.drain_steps} drain steps" in stuck.describe()


@pytest.mark.parametrize("config", [NIXL, NIXL_PUSH], ids=["pull", "push"])
def test_nixl_loads_and_delays_frees_and_passes_every_family(
    config: dict[str, Any], tmp_path: Path
) -> None:
    """vLLM's NixlConnector (pull: decode requests load from the played prefill engine,
    prefill requests' frees wait for the played decode engine's read) and
    NixlPushConnector (push: decode requests' blocks registered with the played prefill
    engine and written by it, prefill requests' frees delayed until written to the played
    decode engine), in every family, under both runners."""
    _, run = exercised_clean(config, FAMILIES, tmp_path, kept="abort", steps=STEPS)
    kinds = copies_started(run.log)
    assert kinds["load"] > 0 and kinds["delayed_free"] > 0 and run.aborts > 0, kinds


def test_a_nixl_worker_that_never_reports_a_send_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exercise sees NIXL's delayed frees: a played worker that forgets the prefill
    requests of each batch never sends one, which leaves vLLM holding them, told as
    unreported."""

    def forgets_batches(play: NixlPlay) -> None:
        play.tracked.clear()

    run = run_with_step(monkeypatch, NixlPlay, NIXL, tmp_path, after=forgets_batches)
    assert run.undrained and "unreported" in run.verdicts, run.describe()


def test_a_nixl_push_worker_that_never_writes_a_finished_prefill_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never_writes(play: NixlPushPlay, out: Any) -> None:
        out.kv_connector_metadata.push_finished_blocks = {}

    run = run_with_step(monkeypatch, NixlPushPlay, NIXL_PUSH, tmp_path, before=never_writes)
    assert run.undrained and "unreported" in run.verdicts, run.describe()


def test_the_played_nixl_worker_refuses_an_abort_of_a_request_it_sends() -> None:
    """As NIXL's own worker asserts: an abort (``reqs_not_processed``) of a request whose
    send the worker waits for is a protocol error, told with the request id."""
    play = NixlPlay(None, 1)

    def meta(**fields: Any) -> Any:
        empty = {"reqs_to_recv": {}, "reqs_in_batch": set(), "reqs_not_processed": set()}
        return SimpleNamespace(kv_connector_metadata=SimpleNamespace(**{**empty, **fields}))

    play.step(meta(reqs_in_batch={"p"}, reqs_to_send={}), 0, lambda: 5)
    play.step(meta(reqs_to_send={"p": 30.0}), 1, lambda: 5)
    assert play.busy()
    with pytest.raises(NixlProtocolError, match="'p'"):
        play.step(meta(reqs_not_processed={"p"}, reqs_to_send={}), 2, lambda: 5)
    untracked = NixlPlay(None, 1)  # never in a batch: no send to wait for, none reported
    untracked.step(meta(reqs_to_send={"q": 30.0}), 0, lambda: 0)
    assert not untracked.busy()


def test_the_workload_gives_nixls_requests_their_roles_also_as_a_multiconnectors_child() -> None:
    multi = multi_config(NIXL, OFFLOADING)
    assert transfer_params_of(NIXL) is transfer_params_of(multi) is NixlPlay.transfer_params
    assert transfer_params_of(OFFLOADING) is None and transfer_params_of(KVLIFE) is None
    rng = random.Random(0)
    roles = [NixlPlay.transfer_params(rng, f"r{i}", 40, 2) for i in range(60)]
    decode = [params for params, _ in roles if params and params.get("do_remote_prefill")]
    prefill = [fixed for params, fixed in roles if params and params.get("do_remote_decode")]
    assert decode and prefill and any(params is None for params, _ in roles)
    assert all(params["remote_block_ids"] == [[0, 1, 2]] for params in decode)  # 40 tokens
    assert all(params["tp_size"] == 2 for params in decode) and set(prefill) == {1}


def test_a_multiconnector_of_nixl_and_offloading_fails_only_offloadings_reuse(
    tmp_path: Path,
) -> None:
    """NIXL's worker is not built in the exercise (it needs the NIXL library): as a
    MultiConnector's child it is played like alone; the pair fails ``reuse`` as vLLM's
    OffloadingConnector alone does."""
    families = ["basic", "reuse", "abort", "tp2"]
    reports, _ = exercise(multi_config(NIXL, OFFLOADING), families, range(2), STEPS, tmp_path)
    for report in reports:
        if report.family == "reuse":
            assert report.failed == report.runs
            assert any("offloading/scheduler.py" in where for where in report.raises)
        else:
            assert report.failed == 0 and report.copies > 0, report.lines()


def test_vllms_offloading_connector_fails_reuse_and_passes_fresh_ids(tmp_path: Path) -> None:
    reports, _ = exercise(OFFLOADING, ["basic", "reuse", "abort"], range(4), STEPS, tmp_path)
    for basic, reuse, abort in (reports[i :: len(RUNNERS)] for i in range(len(RUNNERS))):
        assert basic.failed == abort.failed == 0 and basic.copies > 0
        assert reuse.failed == reuse.runs and not reuse.clean_under  # under every runner
        assert any(where.startswith("KeyError at vllm/") for where in reuse.raises)
        assert {"inherited_state", "credited_elsewhere"} & set(reuse.verdicts)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["vllm", "exercise", *argv])
    return status, out.getvalue(), err.getvalue()


def test_the_command_exits_0_clean_1_failed_2_for_a_config_that_does_not_build(
    tmp_path: Path,
) -> None:
    common = ["--seeds", "2", "--steps", "40", "--out", str(tmp_path)]
    status, out, err = _cli(json.dumps(config("Planted")), "--families", "basic,tp2", *common)
    assert status == 0 and "basic, runner V1: 2 runs, 0 failed" in out
    assert "tp2, runner V2: 2 runs, 0 failed" in out
    # not a terminal: no redraws, a line each
    assert err == "".join(f"{f} ({r}): 2 runs\n" for f in ("basic", "tp2") for r in RUNNERS)
    status, out, _ = _cli(json.dumps(config("RepeatsReport")), "--families", "basic", *common)
    assert status == 1 and "verdict stray_report" in out and "kvlife audit why" in out
    (tmp_path / "c.json").write_text(json.dumps(config("RepeatsReport")))
    status, out, _ = _cli(f"@{tmp_path / 'c.json'}", "--families", "basic", "--json", *common)
    body = json.loads(out)
    assert status == 1 and body["connector"] == "RepeatsReport"
    assert all(run["failed"] for run in body["runs"]) and len(body["runs"]) == 6
    assert {run["runner"] for run in body["runs"]} == {"v1", "v2", "v2-async"}
    status, out, _ = _cli(json.dumps(config("Planted")), "--families", "basic", "--runners",
                          "v2", *common)  # fmt: skip
    assert status == 0 and "basic, runner V2: 2 runs" in out and "runner V1" not in out
    for bad, said in (
        ('{"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}', "does not build"),
        ("not json", "not readable JSON"),
        ('{"kv_role": "kv_both"}', "'kv_connector'"),
    ):
        status, out, err = _cli(bad, *common)
        assert status == 2 and out == "" and said in err and len(err.strip().splitlines()) == 1
    status, _, err = _cli(json.dumps(config("Planted")), "--families", "nope", *common)
    assert status == 2 and "unknown families ['nope']" in err
    status, _, err = _cli(json.dumps(config("Planted")), "--runners", "v3", *common)
    assert status == 2 and "unknown runners ['v3']" in err


def test_bad_config_text_raises_a_typed_error() -> None:
    with pytest.raises(ExerciseConfigError, match="JSON object"):
        parse_config("[1, 2]")
    with pytest.raises(ExerciseConfigError, match="not readable"):
        parse_config("@/no/such/file.json")
    with pytest.raises(ValueError, match="unknown families"):
        exercise_cases(["basic", "sometimes"])


# --- any connector: native panics, fixed ports, shutdown -----------------------------------


def _panics(hook: str) -> dict[str, Any]:
    return config("Panics") | {"kv_connector_extra_config": {"panic_in": hook}}


@pytest.mark.parametrize("hook", [h for h in PANIC_HOOKS if h != "__init__"])
def test_a_native_panic_in_any_hook_is_a_failed_run_with_its_seed_and_frame(
    hook: str, tmp_path: Path
) -> None:
    run = run_one(_panics(hook), FAMILIES["basic"], 3, 40, tmp_path)
    assert run.failed and run.seed == 3, run.describe()
    assert run.raised is not None and run.raised.startswith("NativePanic")
    assert f"{hook} contract violation" in run.raised
    assert run.raised_at is not None and "vllm_planted.py" in run.raised_at
    assert "in panic" in run.raised_at  # the innermost frame: where it was raised
    if hook == "shutdown":
        assert "at shutdown()" in run.raised
    elif hook != "get_finished":  # a scheduler-side call: the wrapper wrote it down
        assert "connector_raised" in run.verdicts, run.describe()


def test_a_panic_at_build_or_at_the_check_shutdown_exits_2_in_one_line(tmp_path: Path) -> None:
    common = ["--seeds", "1", "--steps", "20", "--out", str(tmp_path), "--families", "basic"]
    status, out, err = _cli(json.dumps(_panics("__init__")), *common)
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "does not build: NativePanic: panicked at src/leader.rs" in err
    status, out, err = _cli(json.dumps(_panics("shutdown")), *common)
    assert status == 2 and "Panics built, then its shutdown() raised NativePanic" in err


def test_a_connector_that_binds_a_fixed_port_is_shut_down_between_runs(tmp_path: Path) -> None:
    port = free_port()
    holds = config("HoldsPort") | {"kv_connector_extra_config": {"port": port}}
    try:
        reports, runs = exercise(holds, ["basic", "abort"], range(2), 30, tmp_path)
        assert [r.failed for r in reports] == [0] * 6 and len(runs) == 12  # each runner
        keeps = config("KeepsPort") | {"kv_connector_extra_config": {"port": free_port()}}
        with pytest.raises(ExerciseConfigError) as told:
            exercise(keeps, ["basic"], range(2), 30, tmp_path)
        said = str(told.value)
        assert said.startswith("KeepsPort built once and shut down, then did not build again")
        assert "Address already in use" in said and "release it in shutdown()" in said
    finally:
        for bound in HoldsPort.held:
            bound.close()
        HoldsPort.held.clear()


def test_a_multiconnector_of_kvlife_and_offloading_runs_each_child_as_alone(
    tmp_path: Path,
) -> None:
    """MultiConnector's own worker role with kvlife's worker and vLLM's OffloadingConnector
    played; its lens sees the OffloadingConnector child's stores. The families with fresh
    ids are clean; ``reuse`` fails as that child fails alone (vLLM's KeyError)."""
    families = ["basic", "hold", "tp2", "resume", "reuse"]
    reports, _ = exercise(multi_config(KVLIFE, OFFLOADING), families, range(2), STEPS, tmp_path)
    by = {(r.family, r.runner): r for r in reports}
    for family in families[:-1]:
        for runner in RUNNERS:
            report = by[family, runner]
            assert report.failed == 0, (family, runner, report)
            assert report.copies > 0  # the OffloadingConnector child's stores, through its lens
    assert by["resume", "v2"].resumes > 0
    for runner in RUNNERS:
        reuse = by["reuse", runner]
        assert reuse.failed == reuse.runs
        assert any("offloading/scheduler.py" in where for where in reuse.raises), reuse.raises
        assert "inherited_state" in reuse.verdicts


def test_a_multiconnector_with_a_child_that_runs_alone_only_is_refused(tmp_path: Path) -> None:
    lmcache = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}
    with pytest.raises(ExerciseConfigError, match="LMCacheMPConnector alone only"):
        exercise(multi_config(KVLIFE, lmcache), ["basic"], range(1), STEPS, tmp_path)
    with pytest.raises(ExerciseConfigError, match=r"needs kv_connector_extra_config\.connectors"):
        exercise({"kv_connector": "MultiConnector"}, ["basic"], range(1), STEPS, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing ran


class _FakeLens:
    def __init__(self, name: str, keeps: bool, owners: dict[str, Any]) -> None:
        self.name, self.keeps_every_request, self.owners = name, keeps, owners

    def issued(self, meta: Any) -> list[tuple[Any, str, Any]]:
        return [(job, "store", request) for job, request in meta]

    def completions(self, output: Any) -> list[tuple[Any, bool, Any]]:
        return [(job, True, None) for job in output.kv_connector_worker_meta]

    def owner(self, rid: str) -> Any:
        return self.owners.get(rid)

    def finishing(self, request: Any) -> bool:
        return request in self.owners.values()

    def flushes(self, request: Any) -> bool:
        return False


def test_the_multiconnector_lens_keys_each_childs_jobs_and_names_the_stale_owner() -> None:
    old, new = SimpleNamespace(arrival_time=1.0), SimpleNamespace(arrival_time=2.0)
    first = _FakeLens("A", keeps=True, owners={"r": new, "s": new})
    second = _FakeLens("B", keeps=False, owners={"r": old})
    lens = MultiLens([(0, first), (2, second)])
    assert lens.name == "MultiConnector(A, B)" and lens.keeps_every_request
    meta = SimpleNamespace(metadata=([(7, new)], None, [(7, old), ((9, "x"), old)]))
    assert list(lens.issued(meta)) == [
        ((7, 0), "store", new),
        ((7, 2), "store", old),
        ((9, "x", 2), "store", old),
    ]
    output = KVConnectorOutput(kv_connector_worker_meta=SimpleNamespace(metadata=([7], None, None)))
    assert list(lens.completions(output)) == [((7, 0), True, None)]
    assert lens.owner("r") is old  # two children disagree: the earlier arrival is stale
    assert lens.owner("s") is new  # the child that keeps no state for every request: passed
    assert lens.owner("t") is None  # the child that keeps every request holds none
    assert lens.finishing(old) and not lens.flushes(new)

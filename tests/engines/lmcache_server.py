"""A real ``lmcache server`` that a test or the exercise report starts itself: CPU memory
only (L1, 0.25 GB, LRU), chunks of one vLLM block (16 tokens), ``--supported-transfer-mode
auto`` (CPU workers take the engine-driven path), its request and HTTP ports free loopback
ports; stopped by its pid (SIGINT, then SIGKILL after 30 s)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.engines.vllm_server import free_port

CHUNK = 16  # the server's chunk size: one vLLM block of the tests


@dataclass(frozen=True)
class Server:
    port: int
    log: Path


@contextlib.contextmanager
def lmcache_server(log: Path) -> Iterator[Server]:
    """Start the server (its output in ``log``), yield it once it runs, stop it."""
    port, http = free_port(), free_port()
    command = [
        str(Path(sys.executable).with_name("lmcache")),
        "server",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--http-host", "127.0.0.1", "--http-port", str(http)),
        *("--chunk-size", str(CHUNK), "--l1-size-gb", "0.25", "--eviction-policy", "LRU"),
        *("--supported-transfer-mode", "auto", "--disable-observability"),
    ]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while "cache server is running" not in log.read_text(errors="replace"):
            assert process.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "lmcache server did not start in time"
            time.sleep(0.25)
        yield Server(port, log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def lmcache_config(server: Server) -> dict[str, Any]:
    """``LMCacheMPConnector`` talking to ``server``, the lookup status read in the step
    that asks (so that a paced clock decides what vLLM schedules)."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": server.port,
            "lmcache.mp.nonblocking_lookup_status": False,
        },
    }

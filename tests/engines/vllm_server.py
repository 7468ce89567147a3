"""vLLM OpenAI servers that a test starts itself: a free loopback port, waiting for
``/health``, and stopping the server's whole process group as an operator stops it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

SHUTDOWN_TIMEOUT = 10
"""vLLM's ``--shutdown-timeout`` for the servers whose audit log a test reads at the end:
with vLLM's default, 0, vLLM kills each engine core right after its signal, a race with
kvlife's signal handler that a loaded machine loses now and then (the log then reads as
cut short), so these servers give it 10 s, as docs/vllm.md advises."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(process: subprocess.Popen[bytes], url: str, log: Path, deadline: float) -> None:
    """Wait until the server at ``url`` answers ``/health`` (before ``deadline``, a
    ``time.monotonic()``); its log's tail in the failure when the process ended or did
    not answer in time."""
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/health", timeout=2) as response,
        ):
            if response.status == 200:
                return
        assert time.monotonic() < deadline, (
            f"{log.name}: the server did not answer /health in time; its log ends:\n"
            + log.read_text(errors="replace")[-3000:]
        )
        time.sleep(0.5)


def stop(process: subprocess.Popen[bytes]) -> bool:
    """SIGINT to the server's process group (what Ctrl-C does), SIGKILL after 90 s.
    Returns whether it stopped on the SIGINT (also when it had ended before)."""
    if process.poll() is not None:
        return True
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return False
    return True

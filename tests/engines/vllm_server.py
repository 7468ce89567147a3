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
    not answer in time, with what the last try got and which processes listen on the
    port (a server that started but never answered: is it the one that listens?)."""
    tries, last = 0, "nothing yet"
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        tries += 1
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except OSError as exc:  # refused, timed out, or an HTTP error status
            last = repr(exc)
        if time.monotonic() >= deadline:
            port = int(url.rsplit(":", 1)[1])
            raise AssertionError(
                f"{log.name}: the server (pid {process.pid}) did not answer /health in time "
                f"({tries} tries, the last: {last}; listening on port {port}: "
                f"{'; '.join(listeners(port)) or 'none'}); its log ends:\n"
                + log.read_text(errors="replace")[-3000:]
            )
        time.sleep(0.5)


def listeners(port: int) -> list[str]:
    """The processes with a TCP socket listening on ``port`` (Linux's ``/proc``), as
    ``pid command``; empty where ``/proc`` does not tell."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # LISTEN
                    inodes.add(f"socket:[{inode}]")
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
                pid = fd_dir.parent.name
                command = (fd_dir.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                found.append(f"{pid} {command.decode(errors='replace')[:120].strip()}")
    return found


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

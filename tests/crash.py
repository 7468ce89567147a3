"""Killing a writer process at a random point, for the crash tests."""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Callable


def kill_midway(writer: Callable[[int], None], wanted: int, delay_s: float) -> list[str]:
    """Fork a child that runs ``writer(report_fd)`` (it writes one line to the fd after
    each record whose write returned), wait for ``wanted`` lines, sleep ``delay_s`` so
    the kill lands anywhere (mid-write included), SIGKILL it, and return every line it
    finished reporting."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_fd)
        try:
            writer(write_fd)
        finally:
            os._exit(1)
    os.close(write_fd)
    got = b""
    while got.count(b"\n") < wanted and (chunk := os.read(read_fd, 4096)):
        got += chunk
    time.sleep(delay_s)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    while chunk := os.read(read_fd, 65536):
        got += chunk
    os.close(read_fd)
    return got.decode().split("\n")[:-1]

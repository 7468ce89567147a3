"""Push completion: a CUDA host function marks a copy done (``cudaLaunchHostFunc``).

An option, not the default (design §5): on an H200 a host function after each copy cut
back-to-back copy bandwidth from 55 to 41 GB/s in a measurement, where polling the events
did not. Use it when a scheduler would rather be told than ask.

What the host function does is the least it can: set the job's ``signalled`` flag (one
attribute store under the GIL). It never touches the registry, never calls CUDA (host
functions must not), and never allocates; the scheduler thread still delivers the ticket
in ``poll()``. The function runs on a CUDA driver thread and takes the GIL: PyTorch
releases the GIL while it waits for the GPU (``synchronize``, blocking copies), so the
stream is never stuck behind a Python thread that waits for that same stream.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvlife.offload.copy_engine import CopyJob

HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
"""The C type of a CUDA host function (``cudaHostFn_t``): ``void fn(void *data)``."""


class HostCallbackError(RuntimeError):
    """The CUDA runtime could not be found or refused a host function."""


@functools.cache
def cuda_runtime() -> ctypes.CDLL:
    """The CUDA runtime library PyTorch has loaded into this process (found once)."""
    torch.cuda.init()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if line.split() else ""
        if "libcudart" in Path(path).name:
            return ctypes.CDLL(path)
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise HostCallbackError("libcudart is not loaded and could not be found")


@functools.cache
def _launcher() -> Any:
    """``cudaLaunchHostFunc`` of that runtime, typed once."""
    launch = cuda_runtime().cudaLaunchHostFunc
    launch.argtypes = [ctypes.c_void_p, HOST_FN, ctypes.c_void_p]
    launch.restype = ctypes.c_int
    return launch


def launch_host_function(stream: torch.cuda.Stream, fn: Any, data: int | None = None) -> None:
    """Queue ``fn`` (a ``HOST_FN``; the caller keeps it alive until it ran) on ``stream``:
    CUDA calls ``fn(data)`` on a driver thread once the work queued before it is done,
    and the stream's later work waits until it returns.

    Raises:
        HostCallbackError: the CUDA runtime could not be found, or refused the function
            (nothing was queued).
    """
    status = _launcher()(ctypes.c_void_p(stream.cuda_stream), fn, ctypes.c_void_p(data))
    if status != 0:
        raise HostCallbackError(f"cudaLaunchHostFunc failed with CUDA error {status}")


class HostCallbacks:
    """Launch a host function after the work queued on a stream so far, per job."""

    def __init__(self) -> None:
        _launcher()  # no runtime: HostCallbackError now, not at the first copy
        self._jobs: dict[int, CopyJob] = {}  # key -> job waiting for its host function
        self._lock = threading.Lock()
        self._next = 1
        self._fn = HOST_FN(self._fire)  # kept alive as long as CUDA may call it
        self.fired = 0

    def _fire(self, key: Any) -> None:
        with self._lock:
            job = self._jobs.pop(int(key or 0), None)
        if job is not None:
            job.signalled = True
            self.fired += 1

    def after(self, stream: torch.cuda.Stream, job: CopyJob) -> None:
        """Mark ``job`` signalled once everything queued on ``stream`` so far is done.

        Raises:
            HostCallbackError: the runtime refused the host function (the job is then
                left to its event: ``signalled`` stays ``None``).
        """
        with self._lock:
            key = self._next
            self._next += 1
            self._jobs[key] = job
        job.signalled = False
        try:
            launch_host_function(stream, self._fn, key)
        except HostCallbackError:
            with self._lock:
                self._jobs.pop(key, None)
            job.signalled = None
            raise

    @property
    def waiting(self) -> int:
        """Host functions launched and not yet run."""
        return len(self._jobs)


class StreamGate:
    """A gate on a CUDA stream that its owner opens: work queued on ``stream`` after the
    gate waits until ``open()``, however long that takes (tests and the benchmark hold
    copies in flight with it instead of racing a timed sleep).

    A host function on ``stream`` that blocks (on a driver thread, without the GIL)
    until ``open()``; a context manager that opens it on exit, so a failing test never
    leaves the stream stuck. ``timeout_s`` bounds the wait if nobody opens it."""

    def __init__(self, stream: torch.cuda.Stream, timeout_s: float = 60.0) -> None:
        self._opened = threading.Event()
        self.timeout_s = timeout_s
        self.timed_out = False
        self.passed = threading.Event()  # set once the stream went through the gate
        self._fn = HOST_FN(self._wait)  # kept alive until the host function ran
        launch_host_function(stream, self._fn)

    def _wait(self, _data: object) -> None:
        self.timed_out = not self._opened.wait(self.timeout_s)
        self.passed.set()

    def open(self) -> None:
        """Let the stream go on."""
        self._opened.set()

    def __enter__(self) -> StreamGate:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.open()
        self.passed.wait(self.timeout_s)

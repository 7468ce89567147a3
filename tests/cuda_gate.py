"""A gate on a CUDA stream that the test opens: work queued on the stream after the gate
waits until ``open()``, however long the test takes, instead of racing a timed sleep."""

from __future__ import annotations

import threading
from types import TracebackType

import torch

from kvlife.offload.host_callback import HOST_FN, launch_host_function


class StreamGate:
    """A host function on ``stream`` that blocks (on a driver thread, without the GIL)
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

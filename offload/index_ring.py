"""Slot indices on their way to the device, without allocating and without waiting.

A CUDA copy needs its slot (or page) indices on the device. ``index.to("cuda")`` would
allocate device memory per copy (under memory pressure PyTorch's caching allocator then
frees cached blocks, and ``cudaFree`` synchronizes the device) and copy from pageable
memory (the CUDA runtime may synchronize with the stream to stage such a copy: behind a
long prefill, the scheduler thread waits). An [`IndexRing`][kvlife.offload.index_ring.IndexRing]
holds one pinned host buffer and one device buffer of the same size, made once; a launch
writes its indices into the next free stretch of the host buffer and queues an
asynchronous copy of that stretch into the device buffer on its own stream. A stretch is
reused once the event of the copy that read it has completed (asked with ``query()``,
which never blocks), in the order the stretches were taken.

When every stretch is still in flight (more indices queued than the ring holds) the
launch falls back to a plain ``to(device, non_blocking=True)`` and ``overflows`` counts it.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch


class Done(Protocol):
    """What a stretch waits for: a CUDA event (or anything with ``query()``)."""

    def query(self) -> bool: ...


class _Stretch:
    __slots__ = ("done", "end", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.done: Done | None = None  # None until sealed: never reused before


class IndexRing:
    """A ring of ``capacity`` int64 indices, pinned on the host and mirrored on ``device``.

    Args:
        capacity: indices the ring holds at once (over every copy in flight).
        device: where the indices go.
        pin: pin the host buffer (CUDA); pinned memory is what makes the copy asynchronous.

    Invariant: the stretches in ``_live`` are in the order they were taken and do not
    overlap; ``_head`` is where the next one starts (wrapping to 0 when it does not fit).
    """

    def __init__(self, capacity: int, device: torch.device, *, pin: bool) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.host = torch.empty(capacity, dtype=torch.long, pin_memory=pin)
        self.device_buffer = torch.empty(capacity, dtype=torch.long, device=device)
        self._live: deque[_Stretch] = deque()
        self._head = 0
        self._unsealed = 0  # stretches at the right end of _live not yet given their event
        self.overflows = 0

    @property
    def in_use(self) -> int:
        """Indices held by stretches not yet known to be read."""
        return sum(s.end - s.start for s in self._live)

    def _reclaim(self) -> None:
        live = self._live
        while live:
            done = live[0].done
            if done is None or not done.query():
                break
            live.popleft()
        if not live:
            self._head = 0

    def _reserve(self, n: int) -> int | None:
        """Where a stretch of ``n`` starts, or ``None`` when the ring has no room."""
        self._reclaim()
        if not self._live:
            return 0 if n <= self.capacity else None
        first = self._live[0].start
        head = self._head
        if head > first:  # free space is [head, capacity) and [0, first)
            if head + n <= self.capacity:
                return head
            return 0 if n <= first else None
        return head if head + n <= first else None  # wrapped: free space is [head, first)

    def put(self, values: torch.Tensor, stream: torch.cuda.Stream | None) -> torch.Tensor:
        """``values`` (a CPU int64 tensor) on the device, copied on ``stream`` (``None``:
        the current one). Work that reads the result must be queued on that stream, or
        after it, and the stretch must be given its event by ``seal`` before the ring can
        reuse it."""
        n = len(values)
        start = self._reserve(n)
        if start is None:
            self.overflows += 1
            return values.to(self.device_buffer.device, non_blocking=True)
        end = start + n
        self.host[start:end].copy_(values)
        target = self.device_buffer[start:end]
        if stream is None:
            target.copy_(self.host[start:end], non_blocking=True)
        else:
            with torch.cuda.stream(stream):
                target.copy_(self.host[start:end], non_blocking=True)
        self._live.append(_Stretch(start, end))
        self._unsealed += 1
        self._head = end
        return target

    def seal(self, done: Done) -> None:
        """The stretches put since the last ``seal`` are free once ``done.query()``."""
        for i in range(1, self._unsealed + 1):  # the newest, at the deque's right end
            self._live[-i].done = done
        self._unsealed = 0

    def abandon(self) -> None:
        """Give back the stretches put since the last ``seal`` (a launch that failed,
        after its streams were synchronized)."""
        for _ in range(self._unsealed):
            self._live.pop()
        self._unsealed = 0
        self._head = self._live[-1].end if self._live else 0

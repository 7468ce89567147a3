"""The completion pump (design §5): deliver each copy's ticket when its copy is over.

Copies on one stream complete in order, so the queue keeps one FIFO per stream and a poll
looks at each FIFO from its head, stopping at the first copy that is not done: a poll
costs O(completed + streams), not O(in flight). Each completion calls its callback, which
delivers the ticket (``ack``, or ``fail`` when the copy failed); refusals are counted and
audited by the registry, never raised into the loop.

Tensor parallelism: each rank copies its own shard, in the same order on every rank.
Given a ``torch.distributed`` process group, every poll all-reduces (MIN) the per-stream
counts of locally finished copies, and only the copies done on every rank are delivered.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvlife.fsm.hooks import FirstError
from kvlife.offload.copy_engine import CopyJob

Callback = Callable[[CopyJob], None]


class CompletionQueue:
    """Per-stream FIFOs of in-flight copies and their callbacks.

    Args:
        streams: number of streams (the copy engine's ``streams``).
        group: a ``torch.distributed`` process group for tensor-parallel agreement, or
            ``None`` for one rank. Every rank must push the same copies in the same order.
    """

    def __init__(self, streams: int = 1, *, group: Any = None) -> None:
        if streams <= 0:
            raise ValueError("streams must be positive")
        self._fifos: list[deque[tuple[CopyJob, Callback]]] = [deque() for _ in range(streams)]
        # per stream: how many entries from the head are known finished locally
        self._finished = [0] * streams
        self.group = group
        self.delivered = 0
        self.polls = 0
        if group is not None:
            self._counts = torch.zeros(streams, dtype=torch.int64)

    def push(self, job: CopyJob, callback: Callback) -> None:
        """Queue a launched copy (its event already recorded) with its callback."""
        if not 0 <= job.stream < len(self._fifos):
            raise ValueError(f"job stream {job.stream} outside 0..{len(self._fifos) - 1}")
        self._fifos[job.stream].append((job, callback))

    def __len__(self) -> int:
        return sum(len(fifo) for fifo in self._fifos)

    def poll(self) -> int:
        """Deliver every copy that is over (on every rank); return how many.

        If a callback raises (a release hook's error, through the registry), the other
        completed copies are still delivered in this poll; then the first exception is
        raised. The failed callback's copy counts as delivered: it is not offered again.
        """
        self.polls += 1
        fifos, finished = self._fifos, self._finished
        for s, fifo in enumerate(fifos):
            k = finished[s]
            # one pass from the first unknown entry (indexing a deque at k is O(k))
            for job, _ in itertools.islice(fifo, k, None) if k else fifo:
                if not job.query():
                    break
                k += 1
            finished[s] = k
        if self.group is not None:
            counts = self._counts
            for s, k in enumerate(finished):
                counts[s] = k
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=self.group)
            agreed = [int(c) for c in counts]
        else:
            agreed = finished
        delivered = 0
        first = FirstError()  # deliver the others first: they are done too
        for s, fifo in enumerate(fifos):
            for _ in range(agreed[s]):
                job, callback = fifo.popleft()
                finished[s] -= 1
                job.release_resources()
                delivered += 1
                with first:
                    callback(job)
        self.delivered += delivered
        first.reraise()
        return delivered

    def drain(self, *, timeout_s: float = 60.0) -> int:
        """Poll until nothing is in flight (see
        [`poll_until_idle()`][kvlife.offload.completion.poll_until_idle])."""
        return poll_until_idle(self.poll, self.__len__, timeout_s)


def poll_until_idle(
    poll: Callable[[], int], inflight: Callable[[], int], timeout_s: float = 60.0
) -> int:
    """Call ``poll`` until ``inflight()`` is 0, synchronizing CUDA between polls; return
    the sum of what the polls returned.

    Raises:
        TimeoutError: copies are still in flight after ``timeout_s`` seconds (the
            deliveries made until then stay made).
    """
    deadline = time.monotonic() + timeout_s
    delivered = 0
    while inflight():
        delivered += poll()
        if not inflight():
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{inflight()} copies still in flight after {timeout_s}s")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return delivered

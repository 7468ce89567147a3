"""The completion pump: per-stream FIFOs, oldest first, stop at the first copy not done."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import pytest
import torch

from kvlife.offload import CompletionQueue, CopyEngine, CopyJob, HostPagePool, KVLayout
from kvlife.offload.host_callback import StreamGate

LAYOUT = KVLayout(
    "per_layer", layers=1, slots=4096, heads=1, head_dim=2, dtype=torch.float32, page_size=1
)


def _engine(streams: int = 1, pages: int = 4096) -> CopyEngine:
    host = HostPagePool(LAYOUT, pages, pin_memory=False)
    return CopyEngine(LAYOUT, LAYOUT.allocate(), host, streams=streams, defer=True)


def _launch(engine: CopyEngine) -> CopyJob:
    pages = engine.host.alloc(1)
    assert pages is not None
    return engine.launch([0], pages)


class CountingJob(CopyJob):
    """A job that counts how often it is asked whether it is done."""

    __slots__ = ()
    queries = 0

    def query(self) -> bool:
        CountingJob.queries += 1
        return super().query()


def test_fifo_stops_at_the_first_copy_not_done() -> None:
    engine = _engine()
    queue = CompletionQueue()
    jobs = [_launch(engine) for _ in range(3)]
    done: list[int] = []
    for i, job in enumerate(jobs):
        queue.push(job, lambda job, i=i: done.append(i))
    jobs[1].run()
    jobs[2].run()
    assert queue.poll() == 0 and done == []  # copy 0 blocks its stream
    jobs[0].run()
    assert queue.poll() == 3 and done == [0, 1, 2]
    assert len(queue) == 0 and queue.delivered == 3


def test_streams_complete_independently() -> None:
    engine = _engine(streams=2)
    queue = CompletionQueue(streams=2)
    a, b = _launch(engine), _launch(engine)
    assert (a.stream, b.stream) == (0, 1)
    done: list[str] = []
    queue.push(a, lambda job: done.append("a"))
    queue.push(b, lambda job: done.append("b"))
    b.run()
    assert queue.poll() == 1 and done == ["b"]


def test_poll_cost_does_not_grow_with_copies_in_flight() -> None:
    engine = _engine(streams=2)
    queue = CompletionQueue(streams=2)
    for _ in range(4000):
        job = _launch(engine)
        job.__class__ = CountingJob
        queue.push(job, lambda job: None)
    CountingJob.queries = 0
    for _ in range(10):
        assert queue.poll() == 0
    assert CountingJob.queries == 10 * 2  # one look at each stream's head per poll


def test_a_job_whose_event_was_never_recorded_is_never_done() -> None:
    engine = _engine()
    job = _launch(engine)
    job._run = None  # as if launched but its event never recorded
    assert job.recorded is False and job.query() is False
    queue = CompletionQueue()
    queue.push(job, lambda job: pytest.fail("delivered an unrecorded copy"))
    assert queue.poll() == 0


def test_a_failed_copy_is_delivered_with_its_error() -> None:
    engine = _engine()
    job = _launch(engine)

    def boom() -> None:
        raise RuntimeError("copy failed")

    job._run = boom
    got: list[BaseException | None] = []
    queue = CompletionQueue()
    queue.push(job, lambda job: got.append(job.error))
    job.run()
    queue.poll()
    assert len(got) == 1 and isinstance(got[0], RuntimeError)


def test_drain_times_out_when_nothing_completes() -> None:
    queue = CompletionQueue()
    queue.push(_launch(_engine()), lambda job: None)
    with pytest.raises(TimeoutError, match="1 copies still in flight"):
        queue.drain(timeout_s=0.01)


def test_bad_streams() -> None:
    with pytest.raises(ValueError, match="positive"):
        CompletionQueue(streams=0)
    queue = CompletionQueue(streams=1)
    engine = _engine(streams=2)
    _launch(engine)
    on_stream_1 = _launch(engine)
    with pytest.raises(ValueError, match="stream 1"):
        queue.push(on_stream_1, lambda job: None)


# --- host-callback mode ------------------------------------------------------------------


def test_a_signalled_job_is_done_only_once_its_host_function_ran() -> None:
    job = _launch(_engine())
    job.run()
    job.signalled = False  # callback mode, host function not run yet
    assert not job.query()
    job.signalled = True
    assert job.query()


def test_host_callbacks_need_cuda() -> None:
    host = HostPagePool(LAYOUT, 1, pin_memory=False)
    with pytest.raises(ValueError, match="need CUDA"):
        CopyEngine(LAYOUT, LAYOUT.allocate(), host, completion="callback")
    with pytest.raises(ValueError, match="'poll' or 'callback'"):
        CopyEngine(LAYOUT, LAYOUT.allocate(), host, completion="push")  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_callbacks_signal_each_copy_after_it_ran() -> None:
    layout = KVLayout("per_layer", layers=1, slots=64, heads=1, head_dim=8, dtype=torch.float32,
                      page_size=1)  # fmt: skip
    host = HostPagePool(layout, 64, pin_memory=True)
    engine = CopyEngine(layout, [t.cuda() for t in layout.allocate()], host,
                        completion="callback")  # fmt: skip
    callbacks = engine.callbacks
    assert callbacks is not None
    queue = CompletionQueue()
    delivered: list[int] = []
    assert len(engine.copy_streams) == 1
    with StreamGate(engine.copy_streams[0]) as gate:  # every copy queues behind it
        for i in range(32):
            pages = host.alloc(1)
            assert pages is not None
            queue.push(engine.launch([i], pages), lambda job, i=i: delivered.append(i))
        assert queue.poll() == 0 and delivered == []  # no copy ran: no host function either
        assert callbacks.fired == 0 and callbacks.waiting == 32
        gate.open()
        torch.cuda.synchronize()
    assert not gate.timed_out
    deadline = time.monotonic() + 10  # the host functions run on a driver thread
    while len(delivered) < 32 and time.monotonic() < deadline:
        queue.poll()
    assert delivered == list(range(32))
    assert callbacks.fired == 32 and callbacks.waiting == 0


class _NoIndexing(deque):  # type: ignore[type-arg]
    """A FIFO that fails when indexed: indexing a deque at k costs O(k), so a poll that
    indexes its way through a backlog is quadratic."""

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("poll indexed the FIFO")


def test_a_backlog_is_delivered_in_one_pass_without_indexing() -> None:
    queue = CompletionQueue(streams=1)
    queue._fifos[0] = _NoIndexing()
    delivered: list[int] = []
    layout = KVLayout("per_layer", layers=1, slots=8, heads=1, head_dim=1, dtype=torch.float32,
                      page_size=1)  # fmt: skip
    host = HostPagePool(layout, 4, pin_memory=False)
    copier = CopyEngine(layout, layout.allocate(), host)
    for i in range(20_000):
        job = copier.launch([i % 8], host.alloc(1))  # type: ignore[arg-type]
        host.free(job.pages)
        queue.push(job, lambda job, i=i: delivered.append(i))
    assert queue.poll() == 20_000 and delivered == list(range(20_000))

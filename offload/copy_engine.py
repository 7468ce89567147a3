"""Copy a request's KV from the device pool into host pages.

CUDA path (design §5): the copy runs on side streams that first wait on the stream that
produced the KV (the current stream at launch). Each chunk of pages is gathered on the
device on a *gather* stream into a reused page-major staging buffer (whole aligned pages:
one ``index_select`` per component straight into page-major order; other slots: per token
into component-major staging, then one transpose) and copied to pinned host memory on a
*copy* stream; two staging buffers per stream alternate, so the gather of chunk i+1
overlaps the copy of chunk i. The job's completion event is recorded on the copy stream
after its last copy; only then does
[`CopyEngine.launch()`][kvlife.offload.copy_engine.CopyEngine.launch] return. A load runs
the other way through the same buffers.

No launch waits on the device and no copy allocates device memory: everything a copy
uses is made when the engine is built (staging, events, an
[`IndexRing`][kvlife.offload.index_ring.IndexRing] that carries slot indices to the device
from pinned memory), and every kernel the copy paths launch is launched once there, so
CUDA's lazy module loading (the default) never loads one behind queued device work.

CPU path: the same API; a copy runs synchronously at launch, or, with ``defer=True``,
when the caller runs it ([`CopyJob.run()`][kvlife.offload.copy_engine.CopyJob.run]) -- which is how
tests hold completions back
and release them in any order, and how they see a copy read device memory *late*, as a
real asynchronous copy does. When the slots come in whole aligned pages (page ``b`` of
the device pool is slots ``b*page_size ..``, as block-paged engines allocate them), each
component is gathered page by page straight into the host pages with one
``index_select(..., out=)`` over a run of host pages: one pass over the bytes, no staging
(about 75 % of a contiguous copy of the same bytes). Other slots (token-level
allocation, a partial last page) go through the staging buffer.

CUDA facts this relies on (``c10/cuda/CUDAEvent.h``, the stream docs):
``Event.query()`` returns True for an event that was never recorded, so a job counts as
done only if its event was recorded (``recorded``); ``Stream.wait_stream`` / ``wait_event``
return at once and only order *future* work on the stream.

Why one module: one engine owns the streams, staging buffers, events and index ring that
every path (stores and loads; whole pages, token slots, direct block runs) shares and
warms at build; the direct path's run listing is ``block_copy``'s, the DMA binding
``dma``'s, host pages ``host_pool``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from kvlife.offload.block_copy import BlockRuns, block_span
from kvlife.offload.host_callback import HostCallbacks
from kvlife.offload.host_pool import HostPagePool, HostPages, page_runs
from kvlife.offload.index_ring import IndexRing
from kvlife.offload.layout import KVLayout, LayoutError

_PENDING = RuntimeError("not launched")  # a slot in launch_many's results, filled before return


def _written_twice(device_pages: torch.Tensor) -> None:
    """Refuse a load that lists a device page (a block) twice (a CPU tensor): two host
    pages would race into it and the page the engine expects the other one in would keep
    what it held before, wrong KV served with no error. An engine never allocates one
    block twice to a request: the list is the caller's bug.

    Raises:
        ValueError: naming the first repeated page.
    """
    if len(device_pages) < 2:
        return
    ordered = np.sort(device_pages.numpy())
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated):
        raise ValueError(
            f"a load lists device page {int(repeated[0])} twice "
            f"({len(repeated)} repeat(s) in {len(device_pages)} pages)"
        )


def slot_index(slots: torch.Tensor | Sequence[int], device: str | None = None) -> torch.Tensor:
    """``slots`` as a ``long`` index tensor (on ``device`` when given).

    Raises:
        TypeError: the slots are not integers (floats or bools would be truncated into
            slots nobody named).
    """
    index = slots if isinstance(slots, torch.Tensor) else torch.as_tensor(slots)
    if not index.numel():
        return torch.empty(index.shape, dtype=torch.long, device=device)
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise TypeError(f"slots must be integers, got {index.dtype}")
    return index.to(dtype=torch.long, device=device)


class CopyError(RuntimeError):
    """A copy could not be launched or failed while running."""


class CopyJob:
    """One launched copy: some token slots into some host pages.

    ``query()`` is True once the copy is over (done or failed); ``error`` holds the
    exception of a failed copy. A job's ticket is delivered only after ``query()``.
    """

    __slots__ = (
        "_keep",
        "_run",
        "error",
        "event",
        "pages",
        "recorded",
        "signalled",
        "stream",
        "tokens",
    )

    def __init__(
        self,
        pages: HostPages,
        tokens: int,
        stream: int,
        event: torch.cuda.Event | None,
        run: Any = None,
        keep: tuple[Any, ...] = (),
    ) -> None:
        self.pages = pages
        self.tokens = tokens
        self.stream = stream
        self.event = event
        self.recorded = event is None and run is None  # CPU sync copies are done at launch
        self.error: BaseException | None = None
        # host-callback mode: False until the host function ran; None when polled
        self.signalled: bool | None = None
        self._run = run
        self._keep = keep  # device tensors the in-flight copy reads (kept alive until done)

    def query(self) -> bool:
        """Whether the copy is over. Never True for an event that was not recorded."""
        if not self.recorded:
            return False
        if self.signalled is not None:
            return self.signalled
        event = self.event
        return event is None or bool(event.query())

    @property
    def deferred(self) -> bool:
        """A CPU copy that has not run yet (``defer=True``)."""
        return self._run is not None

    def run(self) -> None:
        """Run a deferred CPU copy now. A copy that raises is recorded as failed."""
        if self._run is None:
            raise CopyError(f"{self!r} is not a deferred copy (or already ran)")
        run, self._run = self._run, None
        try:
            run()
        except Exception as exc:  # a failed copy is data: the fail path
            self.error = exc
        self.recorded = True
        self._keep = ()

    def release_resources(self) -> None:
        """Drop references to device tensors (after completion)."""
        self._keep = ()

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.query() else "in flight"
        return (
            f"<CopyJob {self.tokens} tokens -> {len(self.pages)} pages, "
            f"stream {self.stream}, {state}>"
        )


class CopyEngine:
    """Copies token slots of a device KV pool into host pages.

    Args:
        layout: the pool's layout.
        kv: the engine's KV tensors (see
            [`KVLayout.component_views()`][kvlife.offload.layout.KVLayout.component_views]).
        host: the host page pool.
        chunk_pages: pages per pipelined chunk (CUDA) and staging-buffer size.
        streams: side streams (CUDA) / completion streams (CPU); copies go round robin.
        defer: CPU only: a copy runs when [`CopyJob.run()`][kvlife.offload.copy_engine.CopyJob.run]
            is called.
        completion: ``"poll"`` (query each job's event) or ``"callback"`` (CUDA only: a
            host function marks each job done, see
            [`kvlife.offload.host_callback`][kvlife.offload.host_callback]).
        threads: CPU only: torch intra-op threads for kvlife's own copies (set around each
            copy and restored after it); ``None`` (the default) leaves the process's
            setting alone. On a small machine with other load, 1 avoids threads that wait
            on each other for small copies.
        direct: a ``"blocks"`` layout whose blocks of every component are one run of
            bytes each (a block-outermost cache: see
            [`block_span()`][kvlife.offload.block_copy.block_span]) is copied run by run
            with no kernel and no staging (``path`` ``"direct"``). ``None`` (the default):
            whenever the cache allows it; ``True``: required (``LayoutError`` otherwise);
            ``False``: never (the gather path).

    Raises:
        ValueError: a bad argument (nothing built).
        TypeError: ``host`` is not a ``HostPagePool`` (nothing built).
        LayoutError: the tensors do not match ``layout``, or ``direct=True`` on a cache
            whose blocks are not runs (the message says why).

    Attributes:
        before_cpu_copy: ``None``, or a function called (with no argument) right before
            each CPU copy runs; an exception it raises is that copy's failure, as a copy
            that fails while running (the fail path: for demos and tests that exercise it
            on purpose).
    """

    def __init__(
        self,
        layout: KVLayout,
        kv: Sequence[torch.Tensor],
        host: HostPagePool,
        *,
        chunk_pages: int = 64,
        streams: int = 1,
        defer: bool = False,
        completion: Literal["poll", "callback"] = "poll",
        threads: int | None = None,
        direct: bool | None = None,
    ) -> None:
        if not isinstance(host, HostPagePool):
            raise TypeError(f"host must be a HostPagePool, got {host!r}")
        if host.layout != layout:
            raise ValueError("the host pool was made for another layout")
        for name, value in (("chunk_pages", chunk_pages), ("streams", streams)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.layout = layout
        self.components = layout.component_views(kv)
        self.device = self.components[0].device
        self.host = host
        self.chunk_pages = chunk_pages
        self.streams = streams
        self.before_cpu_copy: Callable[[], None] | None = None
        self.cuda = self.device.type == "cuda"
        if defer and self.cuda:
            raise ValueError("defer is a CPU test facility; CUDA copies are asynchronous")
        self.defer = defer
        if completion not in ("poll", "callback"):
            raise ValueError(f"completion must be 'poll' or 'callback', got {completion!r}")
        if completion == "callback" and not self.cuda:
            raise ValueError("host callbacks need CUDA; on CPU completions are explicit")
        self.completion = completion
        if threads is not None and (not isinstance(threads, int) or threads <= 0):
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        if threads is not None and self.cuda:
            raise ValueError("threads applies to CPU copies only")
        self.threads = threads
        self._callbacks = HostCallbacks() if completion == "callback" else None
        self._next_stream = 0
        self._direct = self._direct_runs(direct)
        shape_cm = (layout.components, chunk_pages * layout.page_size, layout.elems)
        shape_pm = (chunk_pages, layout.components, layout.page_size, layout.elems)
        # CUDA: two staging buffers per stream, so that a store and a load on two
        # streams never wait on each other's buffers
        buffers = 2 * streams if self.cuda else 1
        # On the CPU, staging is needed only for slots that are not whole aligned pages:
        # made on first use; direct copies need none.
        staged = self.cuda and self._direct is None
        self._staging_cm = [
            torch.empty(shape_cm if staged else (0,), dtype=layout.dtype, device=self.device)
            for _ in range(buffers)
        ]
        self._staging_pm = [
            torch.empty(shape_pm if staged else (0,), dtype=layout.dtype, device=self.device)
            for _ in range(buffers)
        ]
        self._shapes = (shape_cm, shape_pm)
        page = layout.page_size
        pooled = layout.slots // page * page  # slots that form whole device pages
        self._page_shape = layout.page_shape
        # per component: its whole device pages, [pages, *page_shape] (a block layout's
        # tensors are that already, strided as the engine made them)
        self._paged = (
            list(self.components)
            if layout.kind == "blocks"
            else [c[:pooled].view(-1, page, layout.elems) for c in self.components]
        )
        self._page_offsets = torch.arange(page)
        if self.cuda and self._direct is not None:
            self._copy_streams = [torch.cuda.Stream(self.device) for _ in range(streams)]
            self._gather_streams = []
            self._warm_direct(self._direct)
        elif self.cuda:
            self._gather_streams = [torch.cuda.Stream(self.device) for _ in range(streams)]
            self._copy_streams = [torch.cuda.Stream(self.device) for _ in range(streams)]
            # staging buffer b is free again once the copy that read it is done, and
            # filled once the gather (store) or the host copy (load) that wrote it is
            self._staging_free = [torch.cuda.Event() for _ in range(buffers)]
            self._filled = [torch.cuda.Event() for _ in range(buffers)]
            self._turn = [0] * streams  # which of its two buffers a stream uses next
            # every copy in flight holds host pages: twice the pool's tokens and pages
            # is room for a store of each page and a load of each page at once, beside
            # what the warm-up sends
            self._warm_counts = sorted(
                {min(k, chunk_pages, len(self._paged[0])) for k in (1, 2, 17, chunk_pages)}
            )
            warm = buffers * sum(self._warm_counts) * (page + 1)
            capacity = warm + 2 * host.capacity * (page + 1)
            self._indices = IndexRing(capacity, self.device, pin=True)
            self._warm()

    def _direct_runs(self, direct: bool | None) -> BlockRuns | None:
        """The run-by-run copier of a block-outermost cache, or ``None`` (see ``direct``)."""
        if direct is False:
            return None
        span = block_span(self.components) if self.layout.kind == "blocks" else None
        if span is None:
            if direct:
                raise LayoutError(
                    "direct=True, but a block of every component is not one run of bytes in "
                    f"this {self.layout.kind} cache (a per-layer layout: each layer's blocks "
                    "in a region of its own)"
                )
            return None
        return BlockRuns(span, self.host.tensor)

    @property
    def path(self) -> Literal["direct", "gather"]:
        """How copies run: ``"direct"`` (whole blocks run by run, no kernel: on CUDA one
        ``cudaMemcpyBatchAsync`` per store or load) or ``"gather"`` (a gather or scatter on
        the device through staging buffers on CUDA; ``index_select`` and ``copy_`` per
        component on the CPU)."""
        return "gather" if self._direct is None else "direct"

    def describe(self) -> str:
        """The copy path in words, for a start-up log."""
        direct = self._direct
        if direct is None:
            if self.cuda:
                return "a gather kernel into staging, then one copy per run of host pages"
            return "a gather per component (index_select), a copy_ per page and component back"
        span = direct.span
        how = (
            "one cudaMemcpyBatchAsync per store or load (copy engines, no kernel)"
            if direct.batch
            else "one cudaMemcpyAsync per run (no kernel)"
            if self.cuda
            else "one copy_ per run"
        )
        merged = "consecutive blocks merge into one run" if span.packed else "one run per block"
        return f"direct: a block of every layer is one run of {span.size} bytes, {merged}; {how}"

    def _warm_direct(self, direct: BlockRuns) -> None:
        """Make the first batch call of the process here (the driver's set-up), both ways:
        device block 0 into a pinned scratch page and back, ordered after the current
        stream's work; the current stream waits for it."""
        compute = torch.cuda.current_stream(self.device)
        scratch = torch.empty((1, *self.host.tensor.shape[1:]), dtype=self.layout.dtype,
                              pin_memory=True)  # fmt: skip
        warm = BlockRuns(direct.span, scratch)
        first = torch.zeros(1, dtype=torch.long)
        kept = []
        for copy_stream in self._copy_streams:
            copy_stream.wait_stream(compute)
            kept.append(warm.copy_cuda(first, (0,), copy_stream, to_host=True))
            # the scratch page is written by the store just queued: read it in stream order
            kept.append(warm.copy_cuda(first, (0,), copy_stream, to_host=False, order="stream"))
            torch.cuda.Event().record(copy_stream)
            compute.wait_stream(copy_stream)
        self._warm_keep = scratch  # read by the copies above until they are done
        self._warm_listed = kept

    def _warm(self) -> None:
        """Launch, once, the kernels and copies the CUDA store and load paths use, on
        this engine's own tensors (same dtypes, strides and index types), for chunks of
        1, 2, 17 and ``chunk_pages`` pages (PyTorch picks other kernels for one page,
        and for more than 16 indices), and record every event they reuse, so that no
        later launch is the first of its kernel.

        CUDA loads a kernel at its first launch by default (``CUDA_MODULE_LOADING=LAZY``),
        and that load can wait for the work queued on the device: behind a long prefill,
        or a stream that waits on the host, the first offload would block the scheduler
        thread. Here, at build, such a wait is part of building. Device pages ``0..k-1``
        are read and written back with their own bytes; the current stream waits for
        that before its later work, so nothing races it.
        """
        page = self.layout.page_size
        compute = torch.cuda.current_stream(self.device)
        gather_stream = self._gather_streams[0]
        copy_stream = self._copy_streams[0]
        gather_stream.wait_stream(compute)
        copy_stream.wait_stream(compute)
        scratch = torch.empty((1, *self._staging_pm[0].shape[1:]), dtype=self.layout.dtype,
                              pin_memory=True)  # fmt: skip
        for buffer in range(len(self._staging_pm)):  # every stream's buffers, on stream 0
            for k in self._warm_counts:
                staged = self._staging_pm[buffer][:k]
                with torch.cuda.stream(gather_stream):
                    gather_stream.wait_event(self._staging_free[buffer])
                    if self.layout.kind != "blocks":  # token slots, a partial page too
                        tokens = self._on_device(torch.arange(k * page), gather_stream)
                        self._gather(tokens[:-1], k * page - 1, k, buffer)
                        self._gather(tokens, k * page, k, buffer)
                    device_pages = self._on_device(torch.arange(k), gather_stream)
                    self._gather_pages(device_pages, staged)
                    self._filled[buffer].record(gather_stream)
                with torch.cuda.stream(copy_stream):  # a store's copy, then a load's
                    copy_stream.wait_event(self._filled[buffer])
                    scratch.copy_(staged[:1], non_blocking=True)
                    staged[:1].copy_(scratch, non_blocking=True)
                    self._filled[buffer].record(copy_stream)
                with torch.cuda.stream(gather_stream):  # the pages get their own bytes back
                    gather_stream.wait_event(self._filled[buffer])
                    self._scatter_pages(device_pages, staged)
                    self._staging_free[buffer].record(gather_stream)
        done = torch.cuda.Event()
        done.record(gather_stream)
        self._indices.seal(done)
        for stream in (*self._gather_streams, *self._copy_streams):
            compute.wait_stream(stream)
        self._warm_keep = scratch  # read by the copies above until they are done

    @property
    def copy_streams(self) -> tuple[torch.cuda.Stream, ...]:
        """The side streams the device-to-host copies run on, one per ``streams`` (copies
        go to them in turn); empty on the CPU. Work queued on one before a copy is
        launched runs before that copy."""
        return tuple(self._copy_streams) if self.cuda else ()

    @property
    def callbacks(self) -> HostCallbacks | None:
        """The host functions that mark copies done, with ``completion="callback"``
        (``fired`` and ``waiting`` count them); ``None`` with polling."""
        return self._callbacks

    def launch(
        self, slots: torch.Tensor | Sequence[int], pages: HostPages, *, checked: bool = False
    ) -> CopyJob:
        """Copy the KV of ``slots`` (token order) into ``pages`` (filled in order).

        ``slots`` on the CPU (a list or CPU tensor) are range-checked; a CUDA tensor is
        not (that would synchronize with the compute stream).

        Returns the job once its completion event is recorded (CUDA), its copy ran (CPU),
        or it is deferred. A copy that raises while running is returned as a finished job
        with ``error`` set (the fail path). Raises ``ValueError`` for bad arguments, before
        anything is launched. ``checked``: ``slots`` is what ``check`` returned for these
        pages (not checked again).
        """
        if pages.pool is not self.host:
            raise ValueError("the pages belong to another pool")
        if checked and isinstance(slots, torch.Tensor):
            index = slots
        else:
            index = self.check(slots, len(pages))
        if self._direct is not None and self.cuda:
            if index.device.type != "cpu":
                raise ValueError(
                    "a direct block copy takes its blocks on the host (a list or a CPU tensor)"
                )
            return self._submit_direct([(index, pages)], load=False)[0]
        n = len(index)
        stream = self._next_stream
        self._next_stream = (stream + 1) % self.streams
        if self.cuda:
            try:
                return self._launch_cuda(index, pages, stream)
            except Exception as exc:  # e.g. a launch failure: the fail path
                # chunks launched before the failure may still write the host pages: wait
                # for them, so the fail path can free the pages safely.
                self._settle_failed(stream)
                failed = CopyJob(pages, n, stream, None)
                failed.error = exc
                return failed
        if self.defer:
            return CopyJob(pages, n, stream, None, run=lambda: self._copy_cpu(index, pages))
        job = CopyJob(pages, n, stream, None)
        try:
            self._copy_cpu(index, pages)
        except Exception as exc:  # a failed copy is data: the fail path
            job.error = exc
        return job

    def launch_many(
        self, items: Sequence[tuple[torch.Tensor | Sequence[int], HostPages]], *, load: bool = False
    ) -> list[CopyJob | BaseException]:
        """Launch several stores (or, with ``load``, loads of ``(slots, pages)`` back into
        their slots) at once: one job or the refusal per item, in order. On the direct CUDA
        path every accepted item goes into one ``cudaMemcpyBatchAsync`` with one completion
        event shared by their jobs (one submission per engine step, however many orders it
        holds); elsewhere each item is launched as ``launch`` or ``load`` would.

        A refused item (bad slots or pages) is returned as its exception and copies
        nothing; a batch the runtime refuses fails every item in it (each job's ``error``
        set), as a failed ``launch`` does.
        """
        direct = self._direct
        if direct is None or not self.cuda:
            out: list[CopyJob | BaseException] = []
            for slots, pages in items:
                try:
                    out.append(self.load(pages, slots) if load else self.launch(slots, pages))
                except (ValueError, LayoutError) as exc:
                    out.append(exc)
            return out
        results: list[CopyJob | BaseException] = []
        accepted: list[tuple[torch.Tensor, HostPages]] = []
        for slots, pages in items:
            try:
                blocks = self._check_direct(slots, pages)
                if load:
                    _written_twice(blocks)
                accepted.append((blocks, pages))
                results.append(_PENDING)
            except ValueError as exc:
                results.append(exc)
        jobs = iter(self._submit_direct(accepted, load=load))
        return [next(jobs) if made is _PENDING else made for made in results]

    def _submit_direct(
        self, items: Sequence[tuple[torch.Tensor, HostPages]], *, load: bool
    ) -> list[CopyJob]:
        """Checked ``(blocks, pages)`` copied by the copy engines in one submission on the
        next stream, after the work queued on the current stream (compute wrote what a
        store reads, and may still use the blocks a load writes): a job each, sharing the
        submission's event. A submission the runtime refuses queues nothing: every job is
        over and failed."""
        direct = self._direct
        assert direct is not None
        if not items:
            return []
        stream = self._next_stream
        self._next_stream = (stream + 1) % self.streams
        copy_stream = self._copy_streams[stream]
        blocks = items[0][0] if len(items) == 1 else torch.cat([b for b, _ in items])
        page_list = [p for _, pages in items for p in pages.indices]
        try:
            copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            listed = direct.copy_cuda(blocks, page_list, copy_stream, to_host=not load)
            done = torch.cuda.Event()
            done.record(copy_stream)
        except Exception as exc:  # refused by the runtime: nothing was queued
            failed = [CopyJob(pages, len(b), stream, None) for b, pages in items]
            for job in failed:
                job.error = exc
            return failed
        jobs = []
        for b, pages in items:
            job = CopyJob(pages, len(b), stream, done, keep=(listed,))
            if self._callbacks is not None and not load:
                self._callbacks.after(copy_stream, job)
            job.recorded = True
            jobs.append(job)
        return jobs

    def _check_direct(self, slots: torch.Tensor | Sequence[int], pages: HostPages) -> torch.Tensor:
        """A direct copy's blocks, checked on the host (see ``check`` and ``load``)."""
        if pages.pool is not self.host:
            raise ValueError("the pages belong to another pool")
        if isinstance(slots, torch.Tensor) and slots.device.type != "cpu":
            raise ValueError(
                "a direct block copy takes its blocks on the host (a list or a CPU tensor)"
            )
        return self.check(slots, len(pages))

    def check(self, slots: torch.Tensor | Sequence[int], pages: int) -> torch.Tensor:
        """``slots`` as the index tensor ``launch`` copies from, checked to fill
        ``pages`` pages (the last may be partial) with slots of this engine's caches (a
        CUDA tensor's range is not checked: see ``launch``). For a caller that must know a
        copy will be launched before it commits to it.

        Raises:
            ValueError: the slots do not fill the pages, are not one-dimensional, or are
                out of range.
            TypeError: the slots are not integers.
        """
        n = len(slots)
        page_size = self.layout.page_size
        if n == 0 or n > pages * page_size or n <= (pages - 1) * page_size:
            raise ValueError(f"{n} tokens do not fill {pages} pages of {page_size}")
        index = slot_index(slots)
        if index.dim() != 1:
            raise ValueError("slots must be one-dimensional")
        # Range-checking a device tensor would synchronize with the compute stream (a
        # pipeline stall per offload): indices already on the GPU are the caller's word.
        if index.device.type == "cpu" and (
            int(index.min()) < 0 or int(index.max()) >= self.layout.slots
        ):
            raise ValueError(f"slot indices out of range [0, {self.layout.slots})")
        return index

    def _chunks(self, n: int, pages: HostPages) -> list[tuple[int, int, tuple[int, ...]]]:
        """``(first token, tokens, page indices)`` per chunk of at most ``chunk_pages``."""
        page_size = self.layout.page_size
        out = []
        indices = pages.indices
        for first_page in range(0, len(indices), self.chunk_pages):
            chunk = indices[first_page : first_page + self.chunk_pages]
            first_token = first_page * page_size
            out.append((first_token, min(n - first_token, len(chunk) * page_size), chunk))
        return out

    def _gather(self, index: torch.Tensor, tokens: int, pages: int, buffer: int) -> torch.Tensor:
        """Gather ``tokens`` slots into page-major staging; returns ``[pages, C, ps, E]``."""
        cm = self._staging_cm[buffer]
        for c, component in enumerate(self.components):
            torch.index_select(component, 0, index, out=cm[c, :tokens])
        page_size = self.layout.page_size
        padded = pages * page_size
        if tokens < padded:  # a partial last page: its tail is never read, zero it anyway
            cm[:, tokens:padded].zero_()
        pm = self._staging_pm[buffer][:pages]
        pm.copy_(cm[:, :padded].view(-1, pages, page_size, self.layout.elems).transpose(0, 1))
        return pm

    def _copy_to_host(
        self, staged: torch.Tensor, chunk: tuple[int, ...], non_blocking: bool
    ) -> None:
        offset = 0
        for first, count in page_runs(chunk):
            self.host.page_view(first, count).copy_(
                staged[offset : offset + count], non_blocking=non_blocking
            )
            offset += count

    def _copy_cpu(self, index: torch.Tensor, pages: HostPages) -> None:
        if self.before_cpu_copy is not None:
            self.before_cpu_copy()
        if self.threads is None:
            return self._copy_cpu_pages(index, pages)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._copy_cpu_pages(index, pages)
        finally:
            torch.set_num_threads(previous)

    def _aligned_pages(self, index: torch.Tensor) -> torch.Tensor | None:
        """Device page numbers if ``index`` is whole aligned pages, else ``None``."""
        page = self.layout.page_size
        rows = index.view(-1, page)
        starts = rows[:, 0]
        if bool((starts % page).any()) or bool((starts >= len(self._paged[0]) * page).any()):
            return None
        if not torch.equal(rows - starts[:, None], self._page_offsets.expand_as(rows)):
            return None
        return starts // page

    def _copy_cpu_pages(self, index: torch.Tensor, pages: HostPages) -> None:
        if self._direct is not None:
            self._direct.copy_cpu(index, pages.indices, to_host=True)
            return
        page = self.layout.page_size
        whole = len(index) // page
        if self.layout.kind == "blocks":  # a block is a page: always whole and aligned
            device_pages: torch.Tensor | None = index
        else:
            device_pages = self._aligned_pages(index[: whole * page]) if whole else None
        if device_pages is None:
            self._copy_cpu_staged(index, pages, 0)
            return
        offset = 0
        for first, count in page_runs(pages.indices[:whole]):
            self._gather_pages(
                device_pages[offset : offset + count], self.host.page_view(first, count)
            )
            offset += count
        if whole < len(pages):  # the partial last page
            self._copy_cpu_staged(index, pages, whole)

    def _ensure_staging(self) -> None:
        if self._staging_cm[0].numel() == 0:  # CPU staging is made on first use
            shape_cm, shape_pm = self._shapes
            self._staging_cm[0] = torch.empty(shape_cm, dtype=self.layout.dtype)
            self._staging_pm[0] = torch.empty(shape_pm, dtype=self.layout.dtype)

    def _gather_pages(self, device_pages: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Gather whole aligned device pages into page-major ``out`` (``[pages, C, ps,
        E]``: host pages on the CPU, staging on CUDA), one ``index_select`` per component
        and no transpose pass; returns ``out``."""
        shape = self._page_shape
        for c, paged in enumerate(self._paged):
            torch.index_select(paged, 0, device_pages, out=out[:, c].view(-1, *shape))
        return out

    def _copy_cpu_staged(self, index: torch.Tensor, pages: HostPages, first_page: int) -> None:
        """Gather through staging, from host page ``first_page`` of ``pages`` on."""
        self._ensure_staging()
        skip = first_page * self.layout.page_size
        rest = pages.tail(first_page)
        for first_token, tokens, chunk in self._chunks(len(index) - skip, rest):
            start = skip + first_token
            staged = self._gather(index[start : start + tokens], tokens, len(chunk), 0)
            self._copy_to_host(staged, chunk, non_blocking=False)

    def _on_device(self, values: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
        """CPU indices on the device through the index ring, copied on ``stream`` (no
        allocation, no wait); device indices as they are."""
        if values.device.type != "cpu":
            return values
        return self._indices.put(values, stream)

    def _settle_failed(self, stream: int) -> None:
        """After a launch failed part way: wait for what it queued, give its indices back."""
        self._copy_streams[stream].synchronize()
        if self._direct is None:  # direct copies queue nothing once refused, use no ring
            self._gather_streams[stream].synchronize()
            self._indices.abandon()

    def _next_buffer(self, stream: int) -> int:
        turn = self._turn[stream]
        self._turn[stream] = turn ^ 1
        return 2 * stream + turn

    def _launch_cuda(self, index: torch.Tensor, pages: HostPages, stream: int) -> CopyJob:
        page = self.layout.page_size
        whole = len(index) // page
        compute = torch.cuda.current_stream(self.device)
        gather_stream = self._gather_streams[stream]
        copy_stream = self._copy_streams[stream]
        gather_stream.wait_stream(compute)  # the KV (and a device index) were made on compute
        device_pages = None
        if self.layout.kind == "blocks":
            device_pages = index  # a block layout's slots are its pages
        elif whole and index.device.type == "cpu":  # checked on the host: no device sync
            device_pages = self._aligned_pages(index[: whole * page])
        # the token index is read only for token-level slots and a partial last page
        if device_pages is not None:
            device_pages = self._on_device(device_pages, gather_stream)
        if device_pages is None or whole * page != len(index):
            index = self._on_device(index, gather_stream)
        for first_token, tokens, chunk in self._chunks(len(index), pages):
            buffer = self._next_buffer(stream)
            with torch.cuda.stream(gather_stream):
                gather_stream.wait_event(self._staging_free[buffer])
                if device_pages is not None and tokens == len(chunk) * page:
                    first_page = first_token // page
                    staged = self._gather_pages(
                        device_pages[first_page : first_page + len(chunk)],
                        self._staging_pm[buffer][: len(chunk)],
                    )
                else:  # token-level slots, or the partial last page
                    staged = self._gather(
                        index[first_token : first_token + tokens], tokens, len(chunk), buffer
                    )
                self._filled[buffer].record(gather_stream)
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(self._filled[buffer])
                self._copy_to_host(staged, chunk, non_blocking=True)
                self._staging_free[buffer].record(copy_stream)
        done = torch.cuda.Event()
        done.record(copy_stream)
        self._indices.seal(done)
        job = CopyJob(pages, len(index), stream, done, keep=(index, device_pages))
        if self._callbacks is not None:
            self._callbacks.after(copy_stream, job)
        job.recorded = True  # only now may the job be queried, and its ticket issued
        return job

    def load(self, pages: HostPages, slots: torch.Tensor | Sequence[int]) -> CopyJob:
        """Copy host ``pages`` back into the device pool at ``slots`` (token order; whole
        aligned device pages, as block-paged engines allocate them), byte for byte: the
        inverse of [`launch()`][kvlife.offload.copy_engine.CopyEngine.launch].

        CPU: the copy runs at once and the job is done when this returns. CUDA: the host
        pages go to the device a chunk at a time into a staging buffer on a copy stream
        and are scattered into the pool on a gather stream (both wait first for the work
        queued on the current stream); the job's event marks the end, and work on the
        current stream that reads the slots must wait for it
        (``torch.cuda.current_stream().wait_event(job.event)``). Pass ``slots`` as a list
        or a CPU tensor: they are checked on the host (a CUDA tensor is copied to the
        host first, which waits for the device).

        Raises ``ValueError`` (before anything is copied) for slots that are not whole
        aligned pages, out of range, not as many pages as ``pages``, or that list one
        device page twice (two host pages would race into it), and
        ``TypeError`` for slots that are not integers. A copy that
        fails while running is returned as a finished job with ``error`` set; device
        pages it had not reached are unchanged, the others may be partly written.
        """
        page = self.layout.page_size
        if pages.pool is not self.host:
            raise ValueError("the pages belong to another pool")
        index = slot_index(slots, "cpu")
        if index.dim() != 1 or len(index) != len(pages) * page:
            raise ValueError(f"{len(index)} slots are not {len(pages)} whole pages of {page}")
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.layout.slots):
            raise ValueError(f"slot indices out of range [0, {self.layout.slots})")
        if self.layout.kind == "blocks" or not len(index):
            device_pages: torch.Tensor | None = index
        else:
            device_pages = self._aligned_pages(index)
        if device_pages is None:
            raise ValueError("a load writes whole aligned device pages only")
        _written_twice(device_pages)
        if self._direct is not None and self.cuda:
            return self._submit_direct([(device_pages, pages)], load=True)[0]
        stream = self._next_stream
        self._next_stream = (stream + 1) % self.streams
        job = CopyJob(pages, len(index), stream, None)
        if self.cuda:
            job.recorded = False
        try:
            if self._direct is not None:
                self._direct.copy_cpu(device_pages, pages.indices, to_host=False)
            elif self.cuda:
                self._load_cuda(pages, device_pages, stream, job)
            else:
                offset = 0
                for first, count in pages.runs():
                    self._scatter_pages(
                        device_pages[offset : offset + count], self.host.page_view(first, count)
                    )
                    offset += count
        except Exception as exc:  # a failed copy is data: the fail path
            if self.cuda:
                self._settle_failed(stream)
            job.error = exc
            job.event = None
            job.recorded = True
        return job

    def _load_cuda(
        self, pages: HostPages, device_pages: torch.Tensor, stream: int, job: CopyJob
    ) -> None:
        """Host pages to the device a chunk at a time, through the same two staging
        buffers as stores (no allocation): the host copy of chunk i+1 on the copy stream
        overlaps the scatter of chunk i on the gather stream."""
        compute = torch.cuda.current_stream(self.device)
        copy_stream = self._copy_streams[stream]
        gather_stream = self._gather_streams[stream]
        # the slots may still be read (or written) by work queued on compute
        copy_stream.wait_stream(compute)
        gather_stream.wait_stream(compute)
        targets = self._on_device(device_pages, gather_stream)
        indices = pages.indices
        for first in range(0, len(indices), self.chunk_pages):
            chunk = indices[first : first + self.chunk_pages]
            buffer = self._next_buffer(stream)
            staged = self._staging_pm[buffer][: len(chunk)]
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(self._staging_free[buffer])
                self._from_host(chunk, staged)
                self._filled[buffer].record(copy_stream)
            with torch.cuda.stream(gather_stream):
                gather_stream.wait_event(self._filled[buffer])
                self._scatter_pages(targets[first : first + len(chunk)], staged)
                self._staging_free[buffer].record(gather_stream)
        done = torch.cuda.Event()
        done.record(gather_stream)
        self._indices.seal(done)
        job.event = done
        job._keep = (targets,)
        job.recorded = True

    def _from_host(self, chunk: tuple[int, ...], staged: torch.Tensor) -> None:
        offset = 0
        for first, count in page_runs(chunk):
            staged[offset : offset + count].copy_(
                self.host.page_view(first, count), non_blocking=True
            )
            offset += count

    def _scatter_pages(self, device_pages: torch.Tensor, src: torch.Tensor) -> None:
        """Write page-major ``src`` (``[pages, C, page_size, elems]``) into the device
        pages ``device_pages``: one ``index_copy_`` per component on CUDA; on the CPU one
        ``copy_`` per page and component, which measured about 1.8x faster there than
        ``index_copy_`` for whole blocks (``make bench-vllm``'s copy-speed line)."""
        shape = self._page_shape
        if self.cuda:
            for c, paged in enumerate(self._paged):
                paged.index_copy_(0, device_pages, src[:, c].reshape(-1, *shape))
            return
        targets = device_pages.tolist()
        for c, paged in enumerate(self._paged):
            pages = src[:, c].reshape(-1, *shape)
            for i, target in enumerate(targets):
                paged[target].copy_(pages[i])

"""Copies of whole blocks with no kernel: a block of every component as one run of bytes.

When an engine lays its KV cache out block-outermost (vLLM's ``BLNHC``, ``BLHNC`` and
``BHLNC`` layouts: a block of every layer side by side in memory), one block of every
component is one contiguous run of bytes, and consecutive blocks are consecutive runs. A
host page then holds that run as the device holds it (the device's byte order, whatever
it is inside the block), and a store or a load is a list of ``(destination, source,
bytes)`` with one entry per run of blocks contiguous on both sides: on CUDA one
``cudaMemcpyBatchAsync`` (the copy engines move it; no staging buffer, no gather, no SM),
on the CPU one ``copy_`` per run.

[`block_span()`][kvlife.offload.block_copy.block_span] finds whether an engine's block
views form such runs (from their strides and addresses, whatever the layout is called);
[`BlockRuns`][kvlife.offload.block_copy.BlockRuns] lists the runs of an order with numpy
(never a Python loop per block) and copies them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvlife.offload.dma import AccessOrder, batch_available, memcpy_async, memcpy_batch


@dataclass(frozen=True)
class BlockSpan:
    """Where one block of every component lies in device memory.

    Attributes:
        raw: the device bytes as ``[blocks, size]`` (``uint8``), block ``b``'s row being
            its run; rows are ``stride`` bytes apart.
        size: bytes of one block of every component (a host page's size).
        stride: bytes from one block's run to the next; ``stride == size`` when blocks
            are packed (consecutive blocks are one run).
    """

    raw: torch.Tensor
    size: int
    stride: int

    @property
    def packed(self) -> bool:
        """Whether consecutive blocks are one run of bytes (runs of blocks merge)."""
        return self.stride == self.size


def block_span(views: Sequence[torch.Tensor]) -> BlockSpan | None:
    """The run of bytes a block of every component takes, or ``None`` when the views'
    blocks are not one run (a per-layer layout: each layer's blocks in a region of its
    own).

    ``views``: one ``[blocks, *block]`` view per component (see
    [`block_views()`][kvlife.offload.layout.block_views]), any strides. They form a span
    when they share one allocation, dtype and block stride, and the elements of block 0
    of every component exactly tile one interval (no gap, no overlap): then block ``b``
    of every component is that interval moved by ``b`` block strides. Only strides and
    addresses are read (the check builds a small host tensor of the block's size once).
    """
    if not views:
        return None
    first = views[0]
    blocks, step, dtype = first.shape[0], first.stride(0), first.dtype
    storage = first.untyped_storage().data_ptr()
    item = first.element_size()
    for view in views:
        if (
            view.dtype != dtype
            or view.device != first.device
            or view.shape[0] != blocks
            or view.stride(0) != step
            or view.untyped_storage().data_ptr() != storage
            or any(s <= 0 for s, n in zip(view.stride(), view.shape, strict=True) if n > 1)
        ):
            return None
    starts = [view.data_ptr() for view in views]
    base = min(starts)
    if any((s - base) % item for s in starts):
        return None
    offsets = [(s - base) // item for s in starts]
    inner = [view[0] for view in views]
    elems = sum(block.numel() for block in inner)
    ends = [
        offset + sum((n - 1) * s for n, s in zip(block.shape, block.stride(), strict=True)) + 1
        for offset, block in zip(offsets, inner, strict=True)
    ]
    if blocks == 0 or elems == 0 or max(ends) != elems or (blocks > 1 and step < elems):
        return None
    cover = torch.zeros(elems, dtype=torch.int32)
    for offset, block in zip(offsets, inner, strict=True):
        cover.as_strided(block.shape, block.stride(), offset).add_(1)
    if not bool((cover == 1).all()):
        return None
    size, stride = elems * item, step * item
    raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        first.untyped_storage(),
        base - first.untyped_storage().data_ptr(),
        (blocks, size),
        (stride, 1),
    )
    return BlockSpan(raw, size, stride)


def runs(
    blocks: np.ndarray, pages: np.ndarray, packed: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first block, first page, count)`` of each run of an order: consecutive blocks
    into consecutive pages (only when ``packed``; else one entry per block), as int64
    arrays."""
    n = len(blocks)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    if packed:
        breaks = np.flatnonzero((np.diff(blocks) != 1) | (np.diff(pages) != 1)) + 1
    else:
        breaks = np.arange(1, n)
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.append(starts, n))
    return blocks[starts], pages[starts], counts


class BlockRuns:
    """Stores and loads of whole blocks between a [`BlockSpan`][kvlife.offload.block_copy.BlockSpan]
    and host pages of the span's size, run by run.

    Args:
        span: the device blocks.
        host: the host pool's tensor (contiguous; each page ``span.size`` bytes).

    Raises:
        ValueError: the host tensor is not contiguous or its pages are not the span's size.
    """

    def __init__(self, span: BlockSpan, host: torch.Tensor) -> None:
        page_bytes = math.prod(host.shape[1:]) * host.element_size()
        if not host.is_contiguous() or page_bytes != span.size:
            raise ValueError(
                f"host pages of {page_bytes} bytes (contiguous: {host.is_contiguous()}) do "
                f"not hold blocks of {span.size} bytes"
            )
        self.span = span
        self.host = host.view(-1).view(torch.uint8).view(len(host), span.size)
        self.batch = span.raw.is_cuda and batch_available()
        # the CPU copies move 8-byte words where the runs allow it (about 10 % faster than
        # bytes through torch's copy kernels, measured here)
        self._words = (span.raw, self.host)
        if span.size % 8 == 0 and span.stride % 8 == 0:
            with contextlib.suppress(RuntimeError):  # an address not 8-byte aligned: bytes
                self._words = (span.raw.view(torch.int64), self.host.view(torch.int64))

    def runs(
        self, blocks: torch.Tensor, pages: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs of copying device ``blocks`` (a CPU tensor) to or from ``pages``."""
        return runs(
            blocks.numpy().astype(np.int64, copy=False),
            np.asarray(pages, dtype=np.int64),
            self.span.packed,
        )

    def copy_cpu(self, blocks: torch.Tensor, pages: Sequence[int], *, to_host: bool) -> int:
        """Copy on the CPU; returns the number of calls. A store writes each run of
        consecutive host pages with one call: ``copy_`` where its blocks are one run too,
        else one ``index_select`` over its blocks (one multi-threaded pass, where a
        ``copy_`` per block measured about 10 % slower here); a load writes each run of
        blocks with one ``copy_`` (``index_copy_`` of whole blocks measured at a seventh of
        that)."""
        device, host = self._words
        if not to_host:
            firsts, page_firsts, counts = self.runs(blocks, pages)
            for b, p, k in zip(firsts.tolist(), page_firsts.tolist(), counts.tolist(), strict=True):
                device[b : b + k].copy_(host[p : p + k])
            return len(counts)
        page_array = np.asarray(pages, dtype=np.int64)
        if not len(page_array):
            return 0
        block_array = blocks.numpy().astype(np.int64, copy=False)
        step = np.diff(block_array) == 1
        starts = (np.flatnonzero(np.diff(page_array) != 1) + 1).tolist()
        bounds = [0, *starts, len(page_array)]
        for i, j in itertools.pairwise(bounds):
            p, b, k = int(page_array[i]), int(block_array[i]), j - i
            if k == 1 or (self.span.packed and bool(step[i : j - 1].all())):
                host[p : p + k].copy_(device[b : b + k])
            else:
                torch.index_select(device, 0, blocks[i:j], out=host[p : p + k])
        return len(bounds) - 1

    def descriptors(
        self, blocks: torch.Tensor, pages: Sequence[int], *, to_host: bool
    ) -> np.ndarray:
        """``[3, runs]`` uint64: destination addresses, source addresses, byte counts."""
        firsts, page_firsts, counts = self.runs(blocks, pages)
        device = self.span.raw.data_ptr() + firsts * self.span.stride
        host = self.host.data_ptr() + page_firsts * self.span.size
        out = np.empty((3, len(counts)), dtype=np.uint64)
        out[0] = host if to_host else device
        out[1] = device if to_host else host
        out[2] = counts * self.span.size
        return out

    def copy_cuda(
        self,
        blocks: torch.Tensor,
        pages: Sequence[int],
        stream: torch.cuda.Stream,
        *,
        to_host: bool,
        order: AccessOrder | None = None,
    ) -> np.ndarray:
        """Queue the copy on ``stream``: one ``cudaMemcpyBatchAsync``, or one
        ``cudaMemcpyAsync`` per run where the runtime has no batch call. Returns the
        descriptors (keep them until the copy is over).

        ``order``: how the source is read. By default stores read in stream order (compute
        queued before them writes the KV) and loads in any order: the driver may read a
        load's host pages before the stream's earlier work is done, which is safe only
        because nothing on the device writes a page a load reads (the planner loads only
        pages whose store is over, and pins them); pass ``"stream"`` for a load whose
        pages earlier work on the stream writes.

        Raises:
            DMAError: the runtime refused the copy.
        """
        listed = self.descriptors(blocks, pages, to_host=to_host)
        count = listed.shape[1]
        if count == 0:
            return listed
        if self.batch:
            memcpy_batch(
                listed[0].ctypes.data,
                listed[1].ctypes.data,
                listed[2].ctypes.data,
                count,
                stream,
                to_host=to_host,
                order=order or ("stream" if to_host else "any"),
            )
        else:
            for dst, src, size in listed.T.tolist():
                memcpy_async(dst, src, size, stream)
        return listed

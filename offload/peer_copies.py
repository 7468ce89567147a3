"""The ways other engines copy KV blocks to and from host memory, for side-by-side figures.

kvlife gathers a chunk of pages on the device into a page-major staging buffer and copies
it in one transfer per run of host pages. vLLM's CPU offload (OffloadingConnector,
SimpleCPUOffloadConnector) instead copies each block of each layer on its own: a flat
list of ``(source, destination, bytes)``, one ``cudaMemcpyAsync`` per entry where the
runtime is older than CUDA 12.8, one ``cudaMemcpyBatchAsync`` of the whole list where it
is not. Both use no SM (the DMA engines copy), where kvlife's gather is a kernel.

This module builds that list over kvlife's own tensors (device blocks and host pages,
the same bytes kvlife copies) and runs it both ways through the CUDA runtime by ctypes,
so that ``kvlife bench offload`` can measure them in the same process. On the CPU the
per-block way is one ``memmove`` per entry (the batch needs CUDA). Nothing here is on
kvlife's own copy path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvlife.offload.dma import (
    DMAError,
    batch_available,
    memcpy_async,
    memcpy_batch,
)

PeerCopyError = DMAError
"""The CUDA runtime refused a copy (its error code in the message), or lacks the call."""
batch_copy_available = batch_available


class CopyList(NamedTuple):
    """One entry per block and component: int64 CPU tensors of addresses and sizes."""

    sources: torch.Tensor
    destinations: torch.Tensor
    sizes: torch.Tensor

    def __len__(self) -> int:
        return len(self.sizes)


def block_copy_list(
    device: Sequence[torch.Tensor],
    host: torch.Tensor,
    blocks: torch.Tensor,
    pages: torch.Tensor,
    *,
    to_host: bool,
) -> CopyList:
    """The copies that move device block ``blocks[i]`` of every component into host page
    ``pages[i]`` (``to_host``) or back, one entry per block and component.

    ``device``: one ``[blocks, *block]`` tensor per component whose blocks are each one
    contiguous run of bytes (vLLM's per-layer caches are); ``host``: kvlife's host pool
    tensor ``[pages, components, ...]``, where component ``c`` of page ``p`` holds the
    same bytes as one device block.

    Raises:
        ValueError: a block id or page is out of range, or a component's blocks are not
            contiguous or not the size of a host page's component.
    """
    per_page = host[0, 0].numel() * host.element_size()
    page_stride = host.stride(0) * host.element_size()
    component_stride = host.stride(1) * host.element_size()
    blocks = blocks.to(torch.long)
    pages = pages.to(torch.long)
    # raw addresses: an index out of range would copy past the tensors, not raise
    if len(blocks) and (int(blocks.min()) < 0 or int(blocks.max()) >= len(device[0])):
        raise ValueError(f"block ids out of range [0, {len(device[0])})")
    if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= len(host)):
        raise ValueError(f"host pages out of range [0, {len(host)})")
    dev_ptrs = []
    host_ptrs = []
    for c, tensor in enumerate(device):
        block = tensor[0]
        if not block.is_contiguous() or block.numel() * block.element_size() != per_page:
            raise ValueError(
                f"component {c}: a block of {tuple(block.shape)} strides {block.stride()} is "
                f"not {per_page} contiguous bytes"
            )
        dev_ptrs.append(tensor.data_ptr() + blocks * (tensor.stride(0) * tensor.element_size()))
        host_ptrs.append(host.data_ptr() + pages * page_stride + c * component_stride)
    dev = torch.stack(dev_ptrs, 1).reshape(-1)  # block-major, as vLLM lists them
    hst = torch.stack(host_ptrs, 1).reshape(-1)
    sizes = torch.full_like(dev, per_page)
    return CopyList(dev, hst, sizes) if to_host else CopyList(hst, dev, sizes)


def copy_per_block(copies: CopyList, stream: torch.cuda.Stream | None) -> None:
    """One ``cudaMemcpyAsync`` per entry on ``stream`` (CUDA), or one ``memmove`` per
    entry (``stream`` ``None``: CPU tensors)."""
    sources = copies.sources.tolist()
    destinations = copies.destinations.tolist()
    sizes = copies.sizes.tolist()
    if stream is None:
        for dst, src, size in zip(destinations, sources, sizes, strict=True):
            ctypes.memmove(dst, src, size)
        return
    for dst, src, size in zip(destinations, sources, sizes, strict=True):
        memcpy_async(dst, src, size, stream)


def copy_batch(copies: CopyList, stream: torch.cuda.Stream, *, to_host: bool) -> None:
    """The whole list as one ``cudaMemcpyBatchAsync`` on ``stream``, in stream order.

    Raises:
        PeerCopyError: the runtime lacks the call or refused the batch.
    """
    memcpy_batch(
        copies.destinations.data_ptr(),
        copies.sources.data_ptr(),
        copies.sizes.data_ptr(),
        len(copies),
        stream,
        to_host=to_host,
    )

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
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvlife.offload.host_callback import cuda_runtime

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_LOCATION_HOST = 2  # cudaMemLocationTypeHost


class PeerCopyError(RuntimeError):
    """The CUDA runtime refused a copy (its error code in the message), or lacks the call."""


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


@functools.cache
def runtime_version() -> int:
    """The CUDA runtime's version, as ``cudaRuntimeGetVersion`` gives it (12080 = 12.8)."""
    version = ctypes.c_int()
    status = cuda_runtime().cudaRuntimeGetVersion(ctypes.byref(version))
    if status != 0:
        raise PeerCopyError(f"cudaRuntimeGetVersion failed with CUDA error {status}")
    return version.value


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
    memcpy = _memcpy_async()
    handle = ctypes.c_void_p(stream.cuda_stream)
    for dst, src, size in zip(destinations, sources, sizes, strict=True):
        status = memcpy(dst, src, size, _MEMCPY_DEFAULT, handle)
        if status != 0:
            raise PeerCopyError(f"cudaMemcpyAsync failed with CUDA error {status}")


@functools.cache
def _memcpy_async() -> Any:
    memcpy = cuda_runtime().cudaMemcpyAsync
    memcpy.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    memcpy.restype = ctypes.c_int
    return memcpy


class _Location(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _Attributes(ctypes.Structure):
    _fields_ = (
        ("src_access_order", ctypes.c_int),
        ("src_location", _Location),
        ("dst_location", _Location),
        ("flags", ctypes.c_uint),
    )


def batch_copy_available() -> bool:
    """Whether the runtime has ``cudaMemcpyBatchAsync`` (CUDA 12.8 and later)."""
    if not torch.cuda.is_available():
        return False
    try:
        return runtime_version() >= 12080 and hasattr(cuda_runtime(), "cudaMemcpyBatchAsync")
    except (PeerCopyError, OSError):
        return False


def copy_batch(copies: CopyList, stream: torch.cuda.Stream, *, to_host: bool) -> None:
    """The whole list as one ``cudaMemcpyBatchAsync`` on ``stream``, in stream order.

    Raises:
        PeerCopyError: the runtime lacks the call or refused the batch.
    """
    if not batch_copy_available():
        raise PeerCopyError("cudaMemcpyBatchAsync needs CUDA 12.8 or later")
    device = torch.cuda.current_device()
    here = _Location(_LOCATION_DEVICE, device)
    there = _Location(_LOCATION_HOST, 0)
    attrs = _Attributes(_ORDER_STREAM, here if to_host else there, there if to_host else here, 0)
    index = ctypes.c_size_t(0)
    args: list[Any] = [
        ctypes.c_void_p(copies.destinations.data_ptr()),
        ctypes.c_void_p(copies.sources.data_ptr()),
        ctypes.c_void_p(copies.sizes.data_ptr()),
        ctypes.c_size_t(len(copies)),
        ctypes.byref(attrs),
        ctypes.byref(index),
        ctypes.c_size_t(1),
    ]
    failed = ctypes.c_size_t(0)
    if runtime_version() < 13000:  # CUDA 12.8 and 12.9 report the failed copy's index
        args.append(ctypes.byref(failed))
    args.append(ctypes.c_void_p(stream.cuda_stream))
    status = cuda_runtime().cudaMemcpyBatchAsync(*args)
    if status != 0:
        raise PeerCopyError(
            f"cudaMemcpyBatchAsync of {len(copies)} copies failed with CUDA error {status}"
        )

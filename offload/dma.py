"""Copies by the GPU's copy engines, through the CUDA runtime PyTorch loaded (by ctypes).

Two calls, both asynchronous on a stream and neither using an SM:

* [`memcpy_batch()`][kvlife.offload.dma.memcpy_batch]: ``cudaMemcpyBatchAsync`` (CUDA 12.8
  and later), a list of ``(destination, source, bytes)`` submitted in one call. The
  driver spends host time per descriptor (about 0.5 µs, measured by others) and never
  merges adjacent ones, so callers hand it few, large descriptors;
* [`memcpy_async()`][kvlife.offload.dma.memcpy_async]: one ``cudaMemcpyAsync``, the
  fallback where the runtime has no batch call.

Source access order: ``"stream"`` reads the source in stream order (a store must: the
KV it reads is written by compute queued before it; vLLM served garbled output with no
error when stores read in any order); ``"any"`` lets the copy engines read as they like,
which is safe only for a source nothing on the device writes (a load from pinned host
memory). CUDA 13 renamed the batch call (it takes no failure index): both are handled.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Literal

import torch

from kvlife.offload.host_callback import cuda_runtime

MEMCPY_DEFAULT = 4
"""``cudaMemcpyDefault``: the direction from the pointers (unified addressing)."""
_ORDER = {"stream": 1, "any": 3}  # cudaMemcpySrcAccessOrderStream, ...Any
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_LOCATION_HOST = 2  # cudaMemLocationTypeHost

AccessOrder = Literal["stream", "any"]


class DMAError(RuntimeError):
    """The CUDA runtime refused a copy (its error code in the message), or lacks the call.
    Nothing was queued by the refused call."""


@functools.cache
def runtime_version() -> int:
    """The CUDA runtime's version, as ``cudaRuntimeGetVersion`` gives it (12080 = 12.8).

    Raises:
        DMAError: the runtime could not tell.
    """
    version = ctypes.c_int()
    status = cuda_runtime().cudaRuntimeGetVersion(ctypes.byref(version))
    if status != 0:
        raise DMAError(f"cudaRuntimeGetVersion failed with CUDA error {status}")
    return version.value


def batch_available() -> bool:
    """Whether the runtime has ``cudaMemcpyBatchAsync`` (CUDA 12.8 and later)."""
    if not torch.cuda.is_available():
        return False
    try:
        return runtime_version() >= 12080 and hasattr(cuda_runtime(), "cudaMemcpyBatchAsync")
    except (DMAError, OSError):
        return False


class _Location(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _Attributes(ctypes.Structure):
    _fields_ = (
        ("src_access_order", ctypes.c_int),
        ("src_location", _Location),
        ("dst_location", _Location),
        ("flags", ctypes.c_uint),
    )


@functools.cache
def _attributes(device: int, to_host: bool, order: AccessOrder) -> _Attributes:
    """One attribute set for a whole batch (made once per kind: no allocation per call)."""
    here = _Location(_LOCATION_DEVICE, device)
    there = _Location(_LOCATION_HOST, 0)
    if to_host:
        return _Attributes(_ORDER[order], here, there, 0)
    return _Attributes(_ORDER[order], there, here, 0)


def memcpy_batch(
    destinations: int,
    sources: int,
    sizes: int,
    count: int,
    stream: torch.cuda.Stream,
    *,
    to_host: bool,
    order: AccessOrder = "stream",
) -> None:
    """Queue ``count`` copies on ``stream`` as one ``cudaMemcpyBatchAsync``.

    ``destinations``, ``sources`` and ``sizes`` are the addresses of three host arrays of
    ``count`` 64-bit integers (pointers and byte counts); the caller keeps them alive
    until the call returns. ``to_host``: device to host (else host to device).

    Raises:
        DMAError: the runtime lacks the call or refused the batch (nothing queued).
        ValueError: ``order`` is not ``"stream"`` or ``"any"``, or ``"any"`` on a store
            (it would read KV that compute has not finished writing).
    """
    if order not in _ORDER:
        raise ValueError(f"order must be 'stream' or 'any', got {order!r}")
    if order == "any" and to_host:
        raise ValueError("a device-to-host copy reads in stream order (order='stream')")
    if not batch_available():
        raise DMAError("cudaMemcpyBatchAsync needs CUDA 12.8 or later")
    attrs = _attributes(stream.device.index or 0, to_host, order)
    index = ctypes.c_size_t(0)
    args: list[Any] = [
        ctypes.c_void_p(destinations),
        ctypes.c_void_p(sources),
        ctypes.c_void_p(sizes),
        ctypes.c_size_t(count),
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
        raise DMAError(f"cudaMemcpyBatchAsync of {count} copies failed with CUDA error {status}")


@functools.cache
def _memcpy() -> Any:
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


def memcpy_async(destination: int, source: int, size: int, stream: torch.cuda.Stream) -> None:
    """Queue one ``cudaMemcpyAsync`` of ``size`` bytes on ``stream``.

    Raises:
        DMAError: the runtime refused it (nothing queued).
    """
    status = _memcpy()(
        destination, source, size, MEMCPY_DEFAULT, ctypes.c_void_p(stream.cuda_stream)
    )
    if status != 0:
        raise DMAError(f"cudaMemcpyAsync failed with CUDA error {status}")

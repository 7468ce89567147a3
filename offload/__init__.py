"""kvlife.offload: real KV offload to (pinned) host memory on torch.

[`KVLayout`][kvlife.offload.layout.KVLayout] describes the engine's device KV pool;
[`HostPagePool`][kvlife.offload.host_pool.HostPagePool] holds host pages shaped after it
(its accounting alone, for a scheduler, is a
[`PageAllocator`][kvlife.offload.host_pool.PageAllocator]);
[`HostPrefixCache`][kvlife.offload.prefix_cache.HostPrefixCache] keeps finished requests'
pages by content, with pins and LRU eviction;
[`CopyEngine`][kvlife.offload.copy_engine.CopyEngine] gathers token slots on the device and
copies them into host pages (side streams and CUDA events on a GPU, synchronous on CPU);
[`CompletionQueue`][kvlife.offload.completion.CompletionQueue] delivers each copy's ticket
when its event is done (agreed over ``torch.distributed`` under tensor parallelism);
[`OffloadManager`][kvlife.offload.manager.OffloadManager] is what a scheduler calls.
"""

from __future__ import annotations

from kvlife.offload.completion import CompletionQueue
from kvlife.offload.copy_engine import CopyEngine, CopyError, CopyJob
from kvlife.offload.host_callback import HostCallbackError, HostCallbacks
from kvlife.offload.host_pool import (
    DoubleFreeError,
    ForeignPageError,
    HostPageError,
    HostPagePool,
    HostPages,
    PageAllocator,
)
from kvlife.offload.layout import KVLayout, LayoutError
from kvlife.offload.manager import (
    Blake2bPageHasher,
    HostCopy,
    KVSource,
    OffloadManager,
    OffloadResult,
    OffloadStats,
    PageHash,
    PageHasher,
)
from kvlife.offload.prefix_cache import HostPrefixCache, PrefixCacheError, PrefixCacheStats

__all__ = [
    "Blake2bPageHasher",
    "CompletionQueue",
    "CopyEngine",
    "CopyError",
    "CopyJob",
    "DoubleFreeError",
    "ForeignPageError",
    "HostCallbackError",
    "HostCallbacks",
    "HostCopy",
    "HostPageError",
    "HostPagePool",
    "HostPages",
    "HostPrefixCache",
    "KVLayout",
    "KVSource",
    "LayoutError",
    "OffloadManager",
    "OffloadResult",
    "OffloadStats",
    "PageAllocator",
    "PageHash",
    "PageHasher",
    "PrefixCacheError",
    "PrefixCacheStats",
]

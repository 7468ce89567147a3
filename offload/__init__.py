"""kvlife.offload: real KV offload to (pinned) host memory on torch.

[`KVLayout`][kvlife.offload.layout.KVLayout] describes the engine's device KV pool;
[`HostPagePool`][kvlife.offload.host_pool.HostPagePool] holds host pages shaped after it
(its accounting alone, for a scheduler, is a
[`PageAllocator`][kvlife.offload.pages.PageAllocator]);
[`HostPrefixCache`][kvlife.offload.prefix_cache.HostPrefixCache] keeps finished requests'
pages by content, with pins and LRU eviction;
[`CopyEngine`][kvlife.offload.copy_engine.CopyEngine] gathers token slots on the device and
copies them into host pages (side streams and CUDA events on a GPU, synchronous on CPU);
[`CompletionQueue`][kvlife.offload.completion.CompletionQueue] delivers each copy's ticket
when its event is done (agreed over ``torch.distributed`` under tensor parallelism);
[`OffloadManager`][kvlife.offload.manager.OffloadManager] is what a scheduler calls.

Where an engine runs its scheduler and its copies in different processes, the core comes
in two halves: [`OffloadPlanner`][kvlife.offload.planner.OffloadPlanner] (the scheduler
half: no torch) and [`OffloadWorker`][kvlife.offload.worker.OffloadWorker] (the worker
half). The names below are imported when first used, so ``import kvlife.offload.planner``
loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlife.fsm._lazy import lazy_names

if TYPE_CHECKING:
    from kvlife.offload.completion import (
        CompletionQueue,
    )
    from kvlife.offload.copy_engine import (
        CopyEngine,
        CopyError,
        CopyJob,
    )
    from kvlife.offload.host_callback import (
        HostCallbackError,
        HostCallbacks,
    )
    from kvlife.offload.host_pool import HostPagePool, HostPages
    from kvlife.offload.layout import (
        KVLayout,
        LayoutError,
        block_views,
    )
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
    from kvlife.offload.pages import (
        DoubleFreeError,
        ForeignPageError,
        HostPageError,
        PageAllocator,
    )
    from kvlife.offload.planner import (
        LoadOrder,
        OffloadPlanner,
        PageAccount,
        ReportCountError,
        StoreOrder,
        UnknownOrderError,
    )
    from kvlife.offload.prefix_cache import (
        HostPrefixCache,
        PrefixCacheError,
        PrefixCacheStats,
    )
    from kvlife.offload.worker import (
        OffloadWorker,
    )

_HOME = {
    "CompletionQueue": "completion",
    "CopyEngine": "copy_engine",
    "CopyError": "copy_engine",
    "CopyJob": "copy_engine",
    "HostCallbackError": "host_callback",
    "HostCallbacks": "host_callback",
    "DoubleFreeError": "pages",
    "ForeignPageError": "pages",
    "HostPageError": "pages",
    "HostPagePool": "host_pool",
    "HostPages": "host_pool",
    "PageAllocator": "pages",
    "KVLayout": "layout",
    "LayoutError": "layout",
    "block_views": "layout",
    "Blake2bPageHasher": "manager",
    "HostCopy": "manager",
    "KVSource": "manager",
    "OffloadManager": "manager",
    "OffloadResult": "manager",
    "OffloadStats": "manager",
    "PageHash": "manager",
    "PageHasher": "manager",
    "LoadOrder": "planner",
    "OffloadPlanner": "planner",
    "PageAccount": "planner",
    "ReportCountError": "planner",
    "StoreOrder": "planner",
    "UnknownOrderError": "planner",
    "HostPrefixCache": "prefix_cache",
    "PrefixCacheError": "prefix_cache",
    "PrefixCacheStats": "prefix_cache",
    "OffloadWorker": "worker",
}

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
    "LoadOrder",
    "OffloadManager",
    "OffloadPlanner",
    "OffloadResult",
    "OffloadStats",
    "OffloadWorker",
    "PageAccount",
    "PageAllocator",
    "PageHash",
    "PageHasher",
    "PrefixCacheError",
    "PrefixCacheStats",
    "ReportCountError",
    "StoreOrder",
    "UnknownOrderError",
    "block_views",
]


_load = lazy_names(globals(), {name: f"kvlife.offload.{home}" for name, home in _HOME.items()})


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first use (PEP 562)."""
    return _load(name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

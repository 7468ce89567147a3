"""SGLang 0.5.23's hierarchical cache (``UnifiedRadixCache`` with its
``HybridCacheController``) built on the CPU: what ``kvlife sglang exercise`` drives, and
what kvlife's own tests of the lens run on.

What stands in for CUDA, and only in a cache built here:

* the host pool's pinning: SGLang's allocator table has no CPU entry (it falls back to
  ``cudaHostRegister``), so ``"cpu"`` gets a plain allocation;
* ``transfer_kv_direct`` (an ``sgl_kernel`` kernel SGLang imports only on CUDA): the same
  copy written with torch indexing, for ``hicache_io_backend="direct"`` and the
  ``layer_first`` layout, the one combination used here. On a machine where SGLang
  imported the kernel, it is left alone;
* the host pool's ``pin_memory`` flag is off (the pages the storage backend's reads make
  for themselves would ask for pinned memory).

With ``storage_dir``, the cache has an L3 tier: SGLang's ``HiCacheFile`` backend writing
page files there (backups after each write to host, prefetches into host memory).

Everything else is SGLang's: the pools, the allocator, the cache and both tree cores
(``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``: ``python``, and ``rust``, the default, from
the extension bundled in the wheel), the controller, its ack queues and the CPU events.
Each token's device K holds the token id (exact in fp16 below 2048), so a load-back's
bytes can be compared with the tokens it should bring back.
"""

from __future__ import annotations

import atexit
from array import array
from dataclasses import dataclass
from typing import Any

import torch

PAGE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
CORES = ("python", "rust")
POLICIES = ("write_through", "write_back")


def _host_alloc(dims: Any, dtype: torch.dtype, device: str, *_: Any, **__: Any) -> torch.Tensor:
    return torch.empty(dims, dtype=dtype, device="cpu")


def _transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices].to(dst.dtype)


def use_cpu_standins() -> None:
    """Give SGLang's host pool a CPU allocation and a CPU copy where it has none."""
    from sglang.srt.mem_cache.pool_host import common, mha  # noqa: PLC0415

    common.ALLOC_MEMORY_FUNCS["cpu"] = _host_alloc
    if not hasattr(mha, "transfer_kv_direct"):
        mha.transfer_kv_direct = _transfer_kv_direct


@dataclass
class CpuCache:
    """One cache on the CPU, its device pool and allocator, and the calls a scheduler
    makes on it, in tokens."""

    cache: Any
    allocator: Any
    kv: Any
    core: str
    policy: str
    device_tokens_total: int

    @staticmethod
    def key(tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: PLC0415

        return RadixKey(array("q", tokens))

    def insert(self, tokens: list[int]) -> Any:
        """Insert ``tokens`` with fresh device slots whose keys hold the token ids (what
        a load-back must bring back); ``None`` when the device had no room (the cache
        is asked to evict instead). The cache takes every slot: it frees itself the ones
        where it already held the tokens."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: PLC0415

        value = self.allocator.alloc(len(tokens))
        if value is None:
            self.evict(len(tokens))
            return None
        self.kv.k_buffer[0][value] = torch.tensor(tokens, dtype=torch.float16)[:, None, None]
        return self.cache.insert(InsertParams(key=self.key(tokens), value=value))

    def match(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: PLC0415

        return self.cache.match_prefix(MatchPrefixParams(key=self.key(tokens)))

    def evict(self, tokens: int) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: PLC0415

        return int(self.cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted)

    def evict_host(self, tokens: int) -> int:
        return int(self.cache.evict_host(tokens))

    def load_back(self, tokens: list[int]) -> bool:
        """Match ``tokens`` and load back what is only on host; ``True`` when a load was
        started."""
        m = self.match(tokens)
        if not m.host_hit_length:
            return False
        return bool(self.cache.load_back(m.best_match_node))

    def poll(self) -> None:
        """One scheduler step's poll: submit queued loads, then the cache's own check."""
        self.cache.ready_to_load_host_cache()
        self.cache.check_hicache_events()

    def device_tokens(self, tokens: list[int]) -> list[int]:
        """The token ids the device keys of ``tokens``' cached prefix hold."""
        m = self.match(tokens)
        indices = self.cache.path_device_indices(m.last_device_node)
        keys = self.kv.k_buffer[0][indices][:, 0, 0]
        return [int(k) for k in keys.tolist()]

    def host_pool(self) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: PLC0415

        return self.cache.host_pool_group.get_entry(PoolName.KV).host_pool


def build(
    core: str = "python",
    policy: str = "write_through",
    *,
    device_tokens: int = 128,
    host_ratio: float = 2.0,
    tp_group: Any = None,
    storage_dir: str | None = None,
) -> CpuCache:
    """A ``UnifiedRadixCache`` with HiCache on the CPU (``init_hicache`` run; writes go
    through on the first insert, any host hit loads back); ``tp_group``: the process
    group of its TP ranks (the cache all-reduces its ack counts over it).

    Raises:
        ValueError: an unknown tree core or write policy; nothing is built.
    """
    if core not in CORES or policy not in POLICIES:
        raise ValueError(
            f"kvlife: a CPU HiCache needs a core of {CORES} and a policy of {POLICIES}, "
            f"got {core!r}, {policy!r}"
        )
    from sglang.srt.environ import envs  # noqa: PLC0415
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: PLC0415
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: PLC0415
    from sglang.srt.mem_cache.memory_pool import (  # noqa: PLC0415
        MHATokenToKVPool,
        ReqToTokenPool,
    )
    from sglang.srt.mem_cache.unified_cache.components.base import (  # noqa: PLC0415
        ComponentType,
    )
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: PLC0415
    from sglang.srt.server_args import (  # noqa: PLC0415
        ServerArgs,
        set_global_server_args_for_scheduler,
    )

    use_cpu_standins()
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PAGE))
    req_pool = ReqToTokenPool(size=8, max_context_len=512, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=device_tokens,
        page_size=PAGE,
        dtype=torch.float16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(
        size=device_tokens, dtype=torch.float16, device="cpu", kvcache=kv, need_sort=False
    )
    params = CacheInitParams(
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        disable=False,
        tree_components=(ComponentType.FULL,),
        tp_cache_group=tp_group,
    )
    with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(core):
        cache = UnifiedRadixCache(params=params)
    args = ServerArgs(
        model_path="dummy",
        page_size=PAGE,
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        hicache_write_policy=policy,
        hicache_ratio=host_ratio,
        **(
            {}
            if storage_dir is None
            else {"hicache_storage_backend": "file", "file_storage_path": storage_dir}
        ),
    )
    set_global_server_args_for_scheduler(args)
    if storage_dir is None:
        cache.init_hicache(args, params)
    else:  # the storage backend asks for this process's place in its TP group
        from sglang.srt.runtime_context import get_parallel  # noqa: PLC0415

        ranks = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1}
        if tp_group is not None:
            ranks["tp_rank"] = torch.distributed.get_rank(tp_group)
            ranks["tp_size"] = torch.distributed.get_world_size(tp_group)
        # SGLang's HiCacheFile takes its directory from this variable before the config
        # (another cache of the process may have set it): this cache's is the one given
        directory = envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(storage_dir)
        with get_parallel().override(**ranks), directory:
            cache.init_hicache(args, params)
    atexit.unregister(cache.shutdown)  # the caller releases it (a test builds hundreds)
    from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: PLC0415

    # nothing is pinned on a CPU: pages the storage path makes for itself are not either
    cache.host_pool_group.get_entry(PoolName.KV).host_pool.pin_memory = False
    cache.write_through_threshold = 1
    cache.load_back_threshold = 0
    return CpuCache(cache, allocator, kv, core, policy, device_tokens)


__all__ = ["CORES", "PAGE", "POLICIES", "CpuCache", "build", "use_cpu_standins"]

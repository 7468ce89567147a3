"""SGLang 0.5.23's hierarchical cache (``UnifiedRadixCache`` with its
``HybridCacheController``) built on the CPU, for the HiCache lens's tests and benchmark.

Runs in ``.venv-sglang``. What stands in for CUDA, and only here:

* ``torchvision``: the stand-in module of ``standins/`` (put first on ``sys.path`` by
  ``sglang_harness``, imported first).
* the host pool's pinning: SGLang's allocator table has no CPU entry (it falls back to
  ``cudaHostRegister``), so ``"cpu"`` gets a plain allocation;
* ``transfer_kv_direct`` (an ``sgl_kernel`` kernel imported only on CUDA): the same copy
  written with torch indexing, for ``hicache_io_backend="direct"`` and the
  ``layer_first`` layout, the one combination used here.

Everything else is SGLang's: the pools, the allocator, the cache and both tree cores
(``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``: ``python``, and ``rust``, the default, from
the extension bundled in the wheel), the controller, its ack queues and the CPU "events".
"""

from __future__ import annotations

# ruff: noqa: I001  (the stand-in torchvision must be on sys.path before SGLang loads)

import random
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

import tests.engines.sglang_harness  # noqa: F401  (first: the torchvision stand-in)
from sglang.srt.environ import envs
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.pool_host import common as pool_host_common
from sglang.srt.mem_cache.pool_host import mha as pool_host_mha
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

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


pool_host_common.ALLOC_MEMORY_FUNCS["cpu"] = _host_alloc
pool_host_mha.transfer_kv_direct = _transfer_kv_direct


@dataclass
class HiCache:
    """One cache on the CPU, its device pool and allocator."""

    cache: Any
    allocator: Any
    kv: Any
    core: str
    policy: str

    def insert(self, tokens: list[int]) -> Any:
        """Insert ``tokens`` with fresh device slots whose keys hold the token ids (what
        a load-back must bring back). The cache takes every slot: it frees itself the
        ones where it already held the tokens."""
        value = self.allocator.alloc(len(tokens))
        if value is None:
            self.evict(len(tokens))
            return None
        self.kv.k_buffer[0][value] = torch.tensor(tokens, dtype=torch.float16)[:, None, None]
        return self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))

    def match(self, tokens: list[int]) -> Any:
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))

    def evict(self, tokens: int) -> int:
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


def build(
    core: str = "python",
    policy: str = "write_through",
    *,
    device_tokens: int = 128,
    host_ratio: float = 2.0,
    tp_group: Any = None,
) -> HiCache:
    """A ``UnifiedRadixCache`` with HiCache on the CPU (``init_hicache`` run; writes go
    through on the first insert); ``tp_group``: the process group of its TP ranks (the
    cache all-reduces its ack counts over it)."""
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
    )
    set_global_server_args_for_scheduler(args)
    cache.init_hicache(args, params)
    import atexit  # noqa: PLC0415

    atexit.unregister(cache.shutdown)
    cache.write_through_threshold = 1
    cache.load_back_threshold = 0
    return HiCache(cache, allocator, kv, core, policy)


@dataclass
class Workload:
    """What a seeded random workload did, and what the cache answered (to compare a run
    with the lens to one without)."""

    answers: list[Any] = field(default_factory=list)
    loads: int = 0
    host_evictions: int = 0


def run_workload(hc: HiCache, seed: int, steps: int = 120, *, check_bytes: bool = True) -> Workload:
    """Seeded random work on ``hc``: inserts of prefixes that share and split (a few
    families of token sequences, and branches off them: a branch inserted while the
    family's write is pending splits its node mid-write), matches, device eviction to
    host, load-backs with their bytes checked, host eviction; a poll after most steps
    (three in four), so that copies are sometimes still pending at the next step."""
    rng = random.Random(seed)
    done = Workload()
    families = [[100 * f + i for i in range(PAGE * 6)] for f in range(1, 6)]  # exact in fp16
    for _ in range(steps):
        op = rng.random()
        family = rng.choice(families)
        cut = PAGE * rng.randint(1, 6)
        tokens = family[:cut]
        if rng.random() < 0.25:  # a branch: the family's first pages, then its own
            tokens = family[: PAGE * rng.randint(1, 3)] + [t + 50 for t in family[: PAGE * 2]]
        if op < 0.35:
            result = hc.insert(tokens)
            done.answers.append(("insert", None if result is None else result.prefix_len))
        elif op < 0.5:
            m = hc.match(tokens)
            done.answers.append(("match", m.device_prefix_len, m.host_hit_length))
        elif op < 0.7:
            done.answers.append(("evict", hc.evict(PAGE * rng.randint(1, 8))))
        elif op < 0.85:
            started = hc.load_back(tokens)
            done.loads += started
            done.answers.append(("load_back", started))
        else:
            freed = hc.evict_host(PAGE * rng.randint(1, 4))
            done.host_evictions += bool(freed)
            done.answers.append(("evict_host", freed))
        if rng.random() >= 0.75:
            continue  # loads not submitted yet: their device pages hold nothing to check
        hc.poll()
        m = hc.match(tokens)
        if check_bytes and m.device_prefix_len:  # what the device holds for it is its own tokens
            got = hc.device_tokens(tokens)
            assert got == tokens[: len(got)], (seed, tokens[: len(got)], got)
    hc.poll()
    return done


@contextmanager
def held_acks(hc: HiCache, queue: str = "load") -> Iterator[list[Any]]:
    """Take the acks off ``queue`` (``write`` or ``load``) while inside: a lost ack."""
    cc = hc.cache.cache_controller
    q = cc.ack_write_queue if queue == "write" else cc.ack_load_queue
    held = list(q)
    q.clear()
    yield held

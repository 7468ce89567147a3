"""kvlife as SGLang's decode-side KV offload manager (SGLang 0.5.23, the ``sglang`` extra).

A drop-in for ``sglang.srt.disaggregation.decode_kvcache_offload_manager.
DecodeKVCacheOffloadManager``: same constructor, same scheduler-facing methods, so the one
change is the assignment::

    from kvlife.offload.engines.sglang import KVLifeDecodeOffloadManager

    scheduler.decode_offload_manager = KVLifeDecodeOffloadManager(
        req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
        tp_group=scheduler.dp_tp_cpu_group,
        tree_cache=scheduler.tree_cache,
    )

What it does the same way as SGLang's manager: a running request's KV past the prefill
node's page-aligned prompt is copied to host memory in chunks of the offload stride
(``SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE``, default one page); each completed chunk is backed
up to the HiCache storage backend (``--hicache-storage-backend``) under SGLang's own page
hash chain (``get_hash_str`` from the request's namespace seed, continuing the prompt's
pages), in SGLang's host page layout (``--hicache-mem-layout``), so prefill nodes reading
that storage find the pages; host memory is freed when its backup is done; a finished
request's device slots are released with SGLang's own calls once no copy reads them.

What is different: every ``Req`` *object* has a kvlife lifecycle (identity, never rid or
``==``), so a late completion of an old request changes nothing of a new one with the same
rid, whatever ``Req.__eq__`` says; completions are polled (an event query), never waited
on in the scheduler loop; tensor-parallel ranks agree on *completed copies* (kvlife's
completion queue all-reduces the count of finished copies, MIN), not on queue lengths;
every transition, refusal and late completion is in kvlife's audit log when the registry
has a sink; and the lifecycle diagram is kvlife's.

SGLang 0.5.18 (the last release whose own manager keys its state by rid): its scheduler
passes ``server_args`` to the manager, and so it does to this one; the request's row is on
the ``Req``, the release makes 0.5.18's calls, and storage hashes start from no namespace
seed, as 0.5.18's do.

Why one module: it is one drop-in for SGLang's decode offload manager, each method
SGLang's call translated into the offload core's (``OffloadManager``), for both releases
it supports; the HiCache lens is a watcher (``kvlife.offload.watch.sglang``).
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.environ import envs
from sglang.srt.layers.dp_attention import is_dp_attention_enabled
from sglang.srt.managers.schedule_batch import FINISH_ABORT, ReqKvInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import get_memory, get_parallel, get_schedule, get_serving

from kvlife.fsm import JsonLinesSink, Lifecycle, LifecycleRegistry, UnknownRequestError
from kvlife.fsm import __version__ as KVLIFE_VERSION
from kvlife.fsm.audit.sinks import SERVER_LOCK_WAIT_S
from kvlife.fsm.table import Trigger
from kvlife.offload.copy_engine import CopyEngine
from kvlife.offload.engines.sglang_plugin import PluginSettings, audit_log_path, rank_name
from kvlife.offload.host_pool import HostPagePool, HostPages
from kvlife.offload.layout import KVLayout, LayoutError
from kvlife.offload.manager import HostCopy, OffloadManager, OffloadResult, PageHash

logger = logging.getLogger(__name__)

try:
    from sglang.srt.mem_cache.utils import storage_namespace_seed
except ImportError:  # SGLang <= 0.5.18: storage chains start from no seed
    storage_namespace_seed = None

#: SGLang >= 0.5.19 keeps a request's ``req_to_token`` row on ``req.kv``; before, on ``req``.
ROW_ON_KV = "req_pool_idx" in getattr(ReqKvInfo, "__dataclass_fields__", {})


def request_row(req: Any) -> int | None:
    """The request's ``req_to_token`` row (``None`` or -1: it holds none)."""
    row: int | None = req.kv.req_pool_idx if ROW_ON_KV else req.req_pool_idx
    return row


#: SGLang's host page layouts whose pages kvlife writes to storage byte for byte.
PAGE_FORMATS = ("layer_first", "page_first")

#: Storage backends that read pages from SGLang's own registered host pool (zero copy);
#: kvlife's host pages are its own, so these are refused.
ZERO_COPY_BACKENDS = frozenset(
    {"hf3fs", "mooncake", "npu_memcache", "eic", "nixl", "simm", "mori", "tensorcast", "seaweedfs"}
)


def kv_layout(kv_pool: Any, page_size: int) -> tuple[KVLayout, list[torch.Tensor]]:
    """kvlife's [`KVLayout`][kvlife.offload.layout.KVLayout] of an SGLang device KV pool,
    and the tensors to hand to a ``CopyEngine``.

    ``MHATokenToKVPool`` (``k_buffer``/``v_buffer``: one ``[slots, heads, head_dim]``
    tensor per layer) is a ``"per_layer"`` layout; ``MLATokenToKVPool`` (``kv_buffer``: one
    ``[slots, 1, kv_cache_dim]`` per layer) an ``"mla"`` one. Slots include SGLang's padded
    first page.

    Raises:
        LayoutError: any other pool class (subclasses too: their buffers differ, e.g. FP4
            scales or DSA indexers), or buffers that are not alike and contiguous.
    """
    kind = type(kv_pool)
    if kind is MHATokenToKVPool:
        k_bufs, v_bufs = list(kv_pool.k_buffer), list(kv_pool.v_buffer)
        tensors = [t for pair in zip(k_bufs, v_bufs, strict=True) for t in pair]
        first = k_bufs[0]
        if first.dim() != 3:
            raise LayoutError(
                f"expected [slots, heads, head_dim] buffers, got {tuple(first.shape)}"
            )
        slots, heads, head_dim = first.shape
        layout = KVLayout("per_layer", len(k_bufs), slots, heads, head_dim, first.dtype, page_size)
    elif kind is MLATokenToKVPool:
        bufs = list(kv_pool.kv_buffer)
        first = bufs[0]
        if first.dim() != 3 or first.shape[1] != 1:
            raise LayoutError(
                f"expected [slots, 1, kv_cache_dim] buffers, got {tuple(first.shape)}"
            )
        slots, _, dim = first.shape
        if not all(t.is_contiguous() for t in bufs):  # a reshape would copy: refuse
            raise LayoutError("the MLA kv_buffer tensors are not contiguous")
        tensors = [t.view(slots, dim) for t in bufs]
        layout = KVLayout.mla(len(bufs), slots, dim, first.dtype, page_size)
    else:
        raise LayoutError(
            f"kvlife cannot copy a {kind.__name__}: it copies SGLang's MHATokenToKVPool and "
            "MLATokenToKVPool (not their subclasses); leave SGLang's own offload manager on"
        )
    layout.component_views(tensors)  # shape, dtype, device and contiguity, or LayoutError
    return layout, tensors


def storage_page(layout: KVLayout, host: HostPagePool, page: int, page_format: str) -> torch.Tensor:
    """One host page as the flat tensor SGLang's host pool of ``page_format`` would hand its
    storage backend for the same tokens (``get_data_page(..., flat=True)``).

    Raises:
        LayoutError: ``page_format`` is not one of ``PAGE_FORMATS``.
    """
    data = host.tensor[page]  # [components, page_size, elems]
    ps = layout.page_size
    if layout.kind == "mla":
        # SGLang: layer_first [layers, ps, 1, dim], page_first [ps, layers, 1, dim]
        if page_format == "layer_first":
            return data.flatten()
        if page_format == "page_first":
            return data.permute(1, 0, 2).flatten()
    else:  # kvlife: k0, v0, k1, v1, ...; SGLang: [2, layers, ps, ...] or [2, ps, layers, ...]
        kv = data.view(layout.layers, 2, ps, layout.heads, layout.head_dim)
        if page_format == "layer_first":
            return kv.permute(1, 0, 2, 3, 4).flatten()
        if page_format == "page_first":
            return kv.permute(1, 2, 0, 3, 4).flatten()
    raise LayoutError(
        f"kvlife writes SGLang storage pages in {' or '.join(PAGE_FORMATS)} layout, "
        f"not {page_format!r} (--hicache-mem-layout)"
    )


class SGLangPageHasher:
    """SGLang's storage page hash chain (``get_hash_str``), from the request's namespace
    seed (``storage_namespace_seed(req.extra_key, req.cache_salt)``)."""

    def seed(self, req: Any) -> PageHash | None:
        """``None`` (no prior) unless the request has an extra key or a cache salt (and
        always ``None`` on SGLang <= 0.5.18, which had no namespaces)."""
        if storage_namespace_seed is None:
            return None
        seed: str | None = storage_namespace_seed(req.extra_key, req.cache_salt)
        return seed

    def page(self, prior: PageHash | None, token_ids: Sequence[int]) -> PageHash:
        """``get_hash_str(token_ids, prior)``: a hex string (``prior`` is this hasher's)."""
        digest: str = get_hash_str(list(token_ids), prior or None)
        return digest


class SGLangKVSource:
    """kvlife's [`KVSource`][kvlife.offload.manager.KVSource] over SGLang's pools.

    A request's tokens are ``origin_input_ids + output_ids[:-1]`` (the last sampled
    token's KV is not computed yet), its slots its row of ``req_to_token``;
    ``release_slots`` makes the release calls of the installed SGLang's own manager, once.
    """

    def __init__(
        self, req_to_token_pool: Any, tree_cache: Any, allocator: Any = None, page_size: int = 1
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.tree_cache = tree_cache
        self.allocator = allocator  # SGLang <= 0.5.18 frees through it
        self.page_size = page_size

    def committed(self, req: Any) -> int:
        """Prompt tokens plus every output token but the last."""
        return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)

    def token_ids(self, req: Any, start: int, end: int) -> Sequence[int]:
        """Token ids in ``[start, end)`` (the prompt, then the outputs)."""
        prompt = req.origin_input_ids
        n = len(prompt)
        if end <= n:
            return array("q", prompt[start:end])
        ids = array("q", prompt[start:]) if start < n else array("q")
        ids.extend(req.output_ids[max(start - n, 0) : end - n])
        return ids

    def slots(self, req: Any, start: int, end: int) -> torch.Tensor:
        """Device slots of tokens ``[start, end)``: the request's ``req_to_token`` row."""
        row = request_row(req)
        if row is None or row < 0:
            raise ValueError(f"request {req.rid!r} holds no req_to_token row")
        slots: torch.Tensor = self.req_to_token_pool.req_to_token[row, start:end]
        return slots.to(torch.int64)

    def release_slots(self, req: Any, lifecycle: Lifecycle) -> None:
        """SGLang's release of a finished request. 0.5.23: the request's own KV range back
        to the allocator (``free_kv_row``), its tree lock, its ``req_to_token`` row, then
        ``mark_kv_released``. 0.5.18: the prompt's pages, the decoded range and any
        over-allocation back to the allocator, the row, ``req.kv = None`` and the tree's
        protected size. A request that holds no row (already released) is left alone."""
        row = request_row(req)
        if row is None or row == -1:
            return
        if ROW_ON_KV:
            kv = req.kv
            self.tree_cache.free_kv_row(kv, [(kv.cache_protected_len, kv.kv_allocated_len)])
            self.tree_cache.unlock(req.lock)
            req.lock = None
            self.req_to_token_pool.free(req)
            kv.mark_kv_released()
        else:
            self._release_before_0_5_19(req, row)

    def _release_before_0_5_19(self, req: Any, row: int) -> None:
        tokens = self.req_to_token_pool.req_to_token[row]
        prompt = len(req.origin_input_ids) // self.page_size * self.page_size
        committed = req.effective_kv_committed_len()
        if prompt > 0:
            self.allocator.free(tokens[:prompt])
        self.allocator.free(tokens[prompt:committed])
        tail = -(-committed // self.page_size) * self.page_size
        if tail < req.kv.kv_allocated_len:  # over-allocation (speculative decoding)
            self.allocator.free(tokens[tail : req.kv.kv_allocated_len])
        self.req_to_token_pool.free(req)
        req.kv = None
        self.tree_cache.protected_size_ -= len(req.prefix_indices)


@dataclass
class BackupStats:
    """Counters of the storage backups."""

    submitted: int = 0
    pages_stored: int = 0
    failed: int = 0
    skipped: int = 0  # not this rank's to write (MLA: one writer)


class KVLifeDecodeOffloadManager:
    """SGLang's decode-side KV offload manager, on kvlife lifecycles.

    Attributes:
        sweep_every: ``check_offload_progress`` calls between two
            [`sweep()`][kvlife.offload.engines.sglang.KVLifeDecodeOffloadManager.sweep]s.

    Args:
        req_to_token_pool: SGLang's ``ReqToTokenPool`` (as for its own manager).
        token_to_kv_pool_allocator: SGLang's allocator; its ``get_kvcache()`` is the
            device pool copied from.
        tp_group: the scheduler's TP CPU group (``dp_tp_cpu_group``); ranks agree on
            completed copies over it.
        tree_cache: the scheduler's tree cache; releases go through it.
        server_args: SGLang <= 0.5.18 passes its ``ServerArgs`` (the HiCache settings are
            read from it); from 0.5.19 on the settings are SGLang's published ones.
        registry: the kvlife registry (give it an audit sink to get the audit log); a new
            one, without a sink, if ``None``. It must be owned by the scheduler thread.
        storage: the storage backend (anything with SGLang's ``batch_set(keys, values)``);
            built from the server args' ``hicache_storage_backend`` if ``None``.
        host_pages: host pages (of ``page_size`` tokens of every layer); if ``None``, the
            server args' ``hicache_size`` (GB) or ``hicache_ratio`` times the device pool.
        defer: CPU tests: copies run when their job is ``run()`` (see ``CopyEngine``).

    Raises:
        LayoutError: the device pool or the page layout is one kvlife cannot copy.
        ValueError: the storage backend is missing, zero-copy, or its config is not JSON;
            decode context parallelism; a host pool of no pages.

    Whatever it raises, nothing was allocated or registered: no host memory, no hook on
    ``registry``, no thread.
    """

    sweep_every = 256

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tp_group: Any,
        tree_cache: Any,
        server_args: Any = None,
        *,
        registry: LifecycleRegistry | None = None,
        storage: Any = None,
        host_pages: int | None = None,
        defer: bool = False,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.tp_group = tp_group
        self.page_size = page_size = int(get_schedule().page_size)
        stride = envs.SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE.get()
        if stride is None or stride <= 0:
            self.offload_stride = page_size
        else:
            self.offload_stride = max(page_size, stride // page_size * page_size)
        self.tp_world_size = dist.get_world_size(group=tp_group) if tp_group is not None else 1
        self.kv_cache = token_to_kv_pool_allocator.get_kvcache()
        self.layout, tensors = kv_layout(self.kv_cache, page_size)
        memory = server_args if server_args is not None else get_memory()
        self._model_name = (
            server_args.served_model_name
            if server_args is not None
            else get_serving().served_model_name
        )
        self.page_format = str(memory.hicache_mem_layout)
        if self.page_format not in PAGE_FORMATS:
            raise LayoutError(
                f"kvlife writes storage pages in {' or '.join(PAGE_FORMATS)} layout, not "
                f"--hicache-mem-layout {self.page_format!r}"
            )
        if host_pages is None:
            host_pages = self._host_pages_from_args(memory)
        self._writer = True
        # the storage first: a refused backend leaves nothing behind (no hook on `registry`)
        self.storage = storage if storage is not None else self._storage_from_args(memory)
        self.host = HostPagePool(self.layout, host_pages)
        self.copier = CopyEngine(self.layout, tensors, self.host, defer=defer)
        self.source = SGLangKVSource(
            req_to_token_pool, tree_cache, token_to_kv_pool_allocator, page_size
        )
        group = tp_group if self.tp_world_size > 1 else None
        # kvlife's offload manager (``req.kv`` is SGLang's own per-request KV object)
        self.kvlife = OffloadManager(
            self.source,
            self.copier,
            stride_pages=self.offload_stride // page_size,
            registry=registry,
            group=group,
            page_hash=SGLangPageHasher(),
            whole_strides=True,
        )
        self.registry = self.kvlife.registry
        self.backups = BackupStats()
        self._backup_thread = ThreadPoolExecutor(1, thread_name_prefix="kvlife-backup")
        self._pending_backups: list[tuple[Future[bool], HostPages, str]] = []
        self.kvlife.on_copy(self._back_up)
        self.kvlife.on_release(self._free_kept)
        # what SGLang's scheduler counts (len) when it checks for idleness
        self.ongoing_offload: Mapping[int, Any] = self.kvlife.inflight_requests
        self._closed = False
        self._polls = 0
        logger.info("kvlife decode KV offload: %s, %d host pages", self.layout, host_pages)

    # ------------------------------------------------------------------ SGLang's methods

    def offload_kv_cache(self, req: Any) -> bool:
        """Offload ``req``'s newly committed KV in whole strides; ``True`` when a copy was
        launched. For a finished request that launched its last copy, the lifecycle is
        finished here and released when the copies completed (SGLang's scheduler then
        does not call ``finalize_release_on_finish``). No host memory: ``False``, nothing
        changed, the chunk is tried again (bigger) at the next call.

        Raises:
            RidConflictError: the first call for a request whose rid is held by another
                request that has not finished (two live requests with one rid). Nothing
                registered; the other request is untouched.
        """
        row = request_row(req)
        if row is None or row == -1 or not req.output_ids:
            return False
        lc = self._lifecycle(req)
        if lc.outcome is not None:  # already finishing: nothing more is copied
            return False
        ticket = self.kvlife.step(req)
        if ticket is None:
            return False
        if req.finished():
            self._finish(req)
        return True

    def finalize_release_on_finish(self, req: Any) -> None:
        """Finish (or, for an abort, abort) ``req``'s lifecycle: its slots are released now
        if no copy reads them, else when the last one completes. A request already
        released is refused and audited (no second release)."""
        row = request_row(req)
        if row is None or row == -1:
            try:  # a repeat or a request that never held KV: audited as a refused finish
                self.registry.lifecycle(req, audit_as=Trigger.FINISH)
            except UnknownRequestError:
                return
        lc = self._lifecycle(req)
        if lc.outcome is None:
            self._finish(req)

    def check_offload_progress(self) -> None:
        """Deliver the copies that completed on every TP rank (their chunks go to storage
        and finished requests release), and free the host pages of the backups that were
        done when the call began (as SGLang's manager counts its backup acks first).
        Never waits."""
        done = self._backups_done()
        try:
            self.kvlife.poll()
        finally:
            self._reap_backups(done)
        self._polls += 1
        if self._polls % self.sweep_every == 0:
            self.sweep()

    def sweep(self) -> int:
        """Abort the lifecycles of requests that ended without this manager being told,
        and return how many: a request retracted (SGLang freed its KV itself, after
        ``drain_before_retraction``) and then aborted while it waited holds no row, has
        no copy in flight and is finished. Its lifecycle is aborted (audited) and
        released, and the registry lets go of the request. A retracted request that still
        waits is left alone. ``check_offload_progress`` calls this every ``sweep_every``
        calls."""
        swept = 0
        for lc in self.registry.lifecycles():
            if lc.outcome is not None or lc.inflight:
                continue
            req = lc.req
            row = request_row(req)
            if (row is None or row == -1) and req.finished():
                self.kvlife.abort(req)
                swept += 1
        return swept

    def drain_before_retraction(self) -> None:
        """Deliver what completed; refuse (``RuntimeError``, on every rank) while any rank
        still has a copy reading device KV -- retraction frees that KV."""
        self.check_offload_progress()
        pending = torch.tensor([int(self.kvlife.inflight > 0)], dtype=torch.int)
        if self.tp_world_size > 1:
            dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=self.tp_group)
        if pending.item():
            raise RuntimeError(
                "Decode KV offload copies are still pending on some rank; refusing to "
                f"retract (local: {self.kvlife.inflight} copies in flight)."
            )

    def has_inflight_device_transfer(self) -> bool:
        """Whether a device-to-host copy may still read device KV."""
        return self.kvlife.inflight > 0

    def release_host_resources(self) -> None:
        """Shutdown: wait for the backups started, free their pages, stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._backup_thread.shutdown(wait=True)
        self._reap_backups(len(self._pending_backups))

    # ------------------------------------------------------------------ internals

    def _lifecycle(self, req: Any) -> Lifecycle:
        if req in self.registry:
            return self.registry.lifecycle(req)
        start = len(req.origin_input_ids) // self.page_size * self.page_size
        return self.kvlife.register(req, req.rid, start=start)

    def _finish(self, req: Any) -> None:
        if isinstance(req.finished_reason, FINISH_ABORT):
            self.kvlife.abort(req)
        else:
            self.kvlife.finish(req, flush=False)

    def _back_up(self, req: Any, lc: Lifecycle, copy: HostCopy) -> bool:
        """A completed copy: its full pages go to storage on the backup thread; a copy
        this rank does not write (MLA: one writer) or with a partial page is freed."""
        keys = [h for h in copy.hashes if isinstance(h, str)]
        if not self._writer or len(keys) != len(copy.pages):
            self.backups.skipped += 1
            self.host.free(copy.pages)
            return True
        future = self._backup_thread.submit(self._store, keys, copy.pages.indices)
        self._pending_backups.append((future, copy.pages, lc.rid))
        self.backups.submitted += 1
        return True

    def _free_kept(self, req: Any, result: OffloadResult) -> None:
        """Pages a finished request's copies still hold (a copy hook that failed): freed."""
        for pages in result.pages:
            self.host.free(pages)

    def _store(self, keys: list[str], pages: Sequence[int]) -> bool:
        values = [storage_page(self.layout, self.host, p, self.page_format) for p in pages]
        return bool(self.storage.batch_set(keys, values))

    def _backups_done(self) -> int:
        """How many backups, from the oldest, are done."""
        done = 0
        for future, _, _ in self._pending_backups:
            if not future.done():
                break
            done += 1
        return done

    def _reap_backups(self, done: int) -> None:
        """Free the pages of the ``done`` oldest backups (all done) and count them."""
        pending = self._pending_backups
        for future, pages, rid in pending[:done]:
            self.host.free(pages)
            error = future.exception()
            if error is None and future.result():
                self.backups.pages_stored += len(pages)
            else:
                self.backups.failed += 1
                logger.warning(
                    "kvlife: storage backup of %d pages of %r failed: %s", len(pages), rid, error
                )
        del pending[:done]

    def _host_pages_from_args(self, memory: Any) -> int:
        per_page = self.layout.bytes_per_page
        size_gb = float(getattr(memory, "hicache_size", 0) or 0)
        if size_gb > 0:
            pages = int(size_gb * 1e9) // per_page
        else:
            ratio = float(getattr(memory, "hicache_ratio", None) or 2.0)
            pages = int(self.layout.slots * ratio) // self.page_size
        if pages <= 0:
            raise ValueError(f"the host pool would hold {pages} pages; set hicache_size")
        return pages

    def _storage_from_args(self, memory: Any) -> Any:
        from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: PLC0415

        name = memory.hicache_storage_backend
        if not name:
            raise ValueError(
                "the decode offload manager backs pages up to HiCache storage: set "
                "--hicache-storage-backend (or pass storage=...)"
            )
        if name in ZERO_COPY_BACKENDS:
            raise ValueError(
                f"storage backend {name!r} reads pages from SGLang's own registered host "
                "pool (zero copy); kvlife's host pages are its own: use 'file' or a backend "
                "with batch_set(keys, values)"
            )
        try:
            extra = json.loads(memory.hicache_storage_backend_extra_config or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"Invalid hicache storage backend extra config JSON: {exc}") from exc
        parallel = get_parallel()
        if getattr(parallel, "attn_dcp_size", 1) > 1:
            raise ValueError(
                "kvlife's decode offload does not shard storage pages for decode context "
                "parallelism (attn_dcp_size > 1); leave SGLang's own manager on"
            )
        if is_dp_attention_enabled():  # storage keys are per attention-TP rank, as SGLang's
            tp_rank, tp_size, dp_rank = (
                parallel.attn_tp_rank,
                parallel.attn_tp_size,
                parallel.attn_dp_rank,
            )
        else:
            tp_rank, tp_size, dp_rank = parallel.tp_rank, parallel.tp_size, 0
        fields: dict[str, Any] = {
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "pp_rank": parallel.pp_rank,
            "pp_size": parallel.pp_size,
            "attn_cp_rank": 0,
            "attn_cp_size": 1,
            "is_mla_model": self.layout.kind == "mla",
            "enable_storage_metrics": False,
            "is_page_first_layout": self.page_format == "page_first",
            "model_name": self._model_name,
            "extra_config": extra,
        }
        if "dp_rank" in getattr(HiCacheStorageConfig, "__dataclass_fields__", {}):
            fields["dp_rank"] = dp_rank  # SGLang >= 0.5.19
        config = HiCacheStorageConfig(**fields)
        self._writer = bool(getattr(config, "is_storage_writer", True))
        return StorageBackendFactory.create_backend(name, config, None)


class ServerDecodeOffloadManager(KVLifeDecodeOffloadManager):
    """The drop-in as a launched SGLang server builds it, through kvlife's SGLang plugin
    ([`kvlife.offload.engines.sglang_plugin`][kvlife.offload.engines.sglang_plugin]): SGLang's
    scheduler constructs it with the arguments it passes its own manager, and it writes
    this scheduler process's audit log.

    The log is ``KVLIFE_AUDIT_DIR/sglang-RANK.jsonl`` (``RANK`` from SGLang's published
    ranks: ``tp0``, ``pp1-tp0``, ``dp2-tp1``; see
    [`rank_name`][kvlife.offload.engines.sglang_plugin.rank_name]). Every scheduler-facing
    call writes its records to the file when it returns (no fsync: a scheduler killed
    between calls loses none), a thread fsyncs every ``KVLIFE_AUDIT_FLUSH_S`` seconds, and
    SGLang's graceful shutdown (``release_host_resources``) closes the log. While the log
    is open, ``PATH.open`` exists; a log whose process was killed keeps it, and the next
    server to open the same path records the unclean stop. Logs of earlier runs are
    appended to, never truncated.

    Raises what the drop-in's constructor raises, and ``OSError`` when the log cannot be
    opened; either way no log file is created or left open and no thread keeps running.
    """

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tp_group: Any,
        tree_cache: Any,
        server_args: Any = None,
    ) -> None:
        settings = PluginSettings.from_env()
        parallel = get_parallel()
        rank = rank_name(
            parallel.tp_rank, parallel.pp_rank, parallel.pp_size, getattr(parallel, "dp_rank", None)
        )
        super().__init__(
            req_to_token_pool,
            token_to_kv_pool_allocator,
            tp_group,
            tree_cache,
            server_args,
            registry=LifecycleRegistry(),
        )
        path = audit_log_path(settings, rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.sink = JsonLinesSink(
                path,
                flush_interval_s=settings.flush_interval_s,
                open_marker=True,
                lock_wait_s=SERVER_LOCK_WAIT_S,
            )
        except BaseException:
            self._backup_thread.shutdown(wait=True)
            raise
        self.registry.attach(self.sink)
        self.audit_log = path
        self.rank = rank
        self._write_failing = False
        import sglang.version  # noqa: PLC0415

        logger.info(
            "kvlife %s is SGLang %s's decode KV offload manager on rank %s: audit log %s "
            "(written at every call, fsynced every %.1f s), %d host pages of %d bytes",
            KVLIFE_VERSION,
            sglang.version.__version__,
            rank,
            path.resolve(),
            settings.flush_interval_s,
            self.host.capacity,
            self.layout.bytes_per_page,
        )

    def offload_kv_cache(self, req: Any) -> bool:
        """As the drop-in's; its records are in the file when it returns."""
        try:
            return super().offload_kv_cache(req)
        finally:
            self._written()

    def finalize_release_on_finish(self, req: Any) -> None:
        """As the drop-in's; its records are in the file when it returns."""
        try:
            super().finalize_release_on_finish(req)
        finally:
            self._written()

    def check_offload_progress(self) -> None:
        """As the drop-in's; its records are in the file when it returns."""
        try:
            super().check_offload_progress()
        finally:
            self._written()

    def release_host_resources(self) -> None:
        """SGLang's graceful shutdown: as the drop-in's, then every record is written and
        the audit log closed (its ``.open`` marker removed)."""
        if self._closed:
            return
        try:
            super().release_host_resources()
        finally:
            self.registry.flush()
            self.sink.close()

    def _written(self) -> None:
        try:
            self.sink.write_out()
        except OSError as exc:  # the records stay buffered; the next call or flush retries
            if not self._write_failing:
                logger.warning("kvlife: writing the audit log %s failed: %s", self.audit_log, exc)
            self._write_failing = True
        else:
            self._write_failing = False

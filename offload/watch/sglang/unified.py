"""The HiCache lens on SGLang 0.5.23's ``UnifiedRadixCache`` with its
``HybridCacheController`` (what ``--enable-hierarchical-cache`` builds there), on either
tree core (Rust or Python): what it reads, and where.

The lens wraps, on the cache *instance* (SGLang's classes are not touched, and a cache
built without the lens is not affected):

* the controller's ``write`` (the host pages a device-to-host copy got, or ``None``) and
  ``load`` (a host-to-device copy's pages); the tree core's ``commit_backup``;
* ``_track_write_through_node`` (a write is pending under its node id: the write ticket),
  ``_replace_pending_write_through_node`` (a split moved a pending write's fragments);
* the cache's ``ongoing_write_through`` and ``ongoing_load_back`` dictionaries, replaced by
  dictionaries that tell the lens each entry an ack pops (and each id popped that is not
  there: SGLang raises ``KeyError`` on it), whichever call acks it: the poll's
  ``writing_check`` / ``loading_check`` or a write-back's blocking wait; ``reset``
  (the dictionaries are made again); ``_drain_storage_control_queues_impl`` (the storage
  backup acks it drains);
* the cache's ``ongoing_prefetch`` dictionary, likewise: a prefetch from the storage
  backend registered for a request, inserted into the tree (``del``), or given up
  (``pop``: the request aborted, nothing found, the deadline passed);
* ``write_backup_storage`` and the controller's ``write_storage`` (a backup to the storage
  backend and its operation id);
* the host KV pool's ``free`` (host pages handed back);
* ``inc_lock_ref`` / ``dec_lock_ref`` and their host twins (lock receipts);
* ``check_hicache_events`` (one poll: an exception written down, overdue copies, records
  written out), and ``release_host_resources`` / ``shutdown`` (the log is closed).

Everything else the cache does, it does as without the lens. In ``refuse`` mode the one
change is that an ack's node ids that no pending copy explains are taken out of the
``HiCacheAck`` (its other ids and its place in the queue kept, so TP ranks still count
the same acks) before the poll's ``writing_check`` / ``loading_check`` pop them.

A poll with nothing to ack passes through one wrapper (``check_hicache_events``): the acks
are seen where they are popped, so the poll's inner calls are not wrapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from time import monotonic
from typing import Any

from kvlife.offload.watch.sglang.lens import AckQueue, HiCacheLens

#: The cache class this module reads (module, name).
WRAPS = ("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache")

#: What the lens reads, by owner: a release where one is missing gets no lens.
READS: dict[str, tuple[str, ...]] = {
    "cache": (
        "cache_controller",
        "tree_core",
        "host_pool_group",
        "ongoing_write_through",
        "ongoing_load_back",
        "ongoing_prefetch",
        "is_write_back",
        "_track_write_through_node",
        "_replace_pending_write_through_node",
        "reset",
        "_drain_storage_control_queues_impl",
        "write_backup_storage",
        "inc_lock_ref",
        "dec_lock_ref",
        "inc_host_lock_ref",
        "dec_host_lock_ref",
        "check_hicache_events",
        "release_host_resources",
        "shutdown",
    ),
    "controller": (
        "write",
        "load",
        "write_storage",
        "ack_write_queue",
        "ack_load_queue",
        "ack_backup_queue",
    ),
    "tree_core": ("commit_backup",),
}


def missing(cache: Any) -> list[str]:
    """The names this module reads that ``cache`` does not have (empty: it can be lensed)."""
    owners = {
        "cache": cache,
        "controller": getattr(cache, "cache_controller", None),
        "tree_core": getattr(cache, "tree_core", None),
    }
    gone = []
    for owner, names in READS.items():
        target = owners[owner]
        for name in names:
            if target is None or not hasattr(target, name):
                gone.append(f"{owner}.{name}")
    return gone


class _Acked(dict[Hashable, Any]):
    """A cache's dictionary of pending copies (node id -> what the ack releases) that tells
    the lens each entry popped (the copy was acked) and each id popped that it does not
    hold (a stray ack; the ``KeyError`` is raised as the dictionary's own)."""

    __slots__ = ("lens", "queue")

    def __init__(self, entries: dict[Hashable, Any], lens: HiCacheLens, queue: AckQueue) -> None:
        super().__init__(entries)
        self.lens, self.queue = lens, queue

    def pop(self, key: Hashable, *default: Any) -> Any:
        if key in self:
            value = dict.pop(self, key)
            self.lens.acked(self.queue, (key,))
            return value
        if not default:
            self.lens.stray(self.queue, key, refused=False)
        return dict.pop(self, key, *default)


class _Prefetches(dict[Any, Any]):
    """The cache's dictionary of pending prefetches (request handle -> its state) that
    tells the lens each prefetch registered, each one inserted (``del``) and each one given
    up (``pop``)."""

    __slots__ = ("lens",)

    def __init__(self, entries: dict[Any, Any], lens: HiCacheLens) -> None:
        super().__init__(entries)
        self.lens = lens

    def __setitem__(self, request: Any, value: Any) -> None:
        dict.__setitem__(self, request, value)
        rid = str(getattr(request, "rid", request))
        attempt = getattr(request, "attempt_id", 0)
        tokens = len(getattr(value, "prefetch_key", ()))
        self.lens.prefetch_started(request, f"{rid}@{attempt}" if attempt else rid, tokens)

    def __delitem__(self, request: Any) -> None:
        if request not in self:
            self.lens.prefetch_ended(request, done=True)  # a stray: written down, then raised
        dict.__delitem__(self, request)
        self.lens.prefetch_ended(request, done=True)

    def pop(self, request: Any, *default: Any) -> Any:
        if request in self:
            value = dict.pop(self, request)
            self.lens.prefetch_ended(request, done=False)
            return value
        if not default:
            self.lens.prefetch_ended(request, done=False)  # a stray: written down, then raised
        return dict.pop(self, request, *default)


def _pages(indices: Any, page: int) -> list[int]:
    """The host pages a tensor of host slot indices covers, as Python ints: SGLang's host
    pool hands out and takes back whole pages of ``page`` slots (tokens), page-aligned, so
    the lens follows pages, not tokens (a copy of a 4k-token node with 64-token pages is
    64 entries, not 4,096)."""
    if indices is None:
        return []
    slots: list[int] = indices.tolist()
    if page == 1:
        return slots
    return [slot // page for slot in slots[::page]]  # each page's first slot


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    wrapped = make(original)
    functools.update_wrapper(wrapped, original)
    wrapped.__kvlife_lens__ = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


def install(cache: Any, lens: HiCacheLens) -> None:
    """Put ``lens`` on ``cache`` (its controller and host pool built: after
    ``init_hicache``).

    Raises:
        ValueError: ``cache`` already has a lens, or has no controller (HiCache is off);
            nothing was wrapped.
    """
    if getattr(cache.check_hicache_events, "__kvlife_lens__", False):
        raise ValueError("kvlife: this cache already has a HiCache lens")
    cc = cache.cache_controller
    if cc is None:
        raise ValueError("kvlife: the cache has no HiCache controller (init_hicache not run)")
    from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: PLC0415

    host_pool = cache.host_pool_group.get_entry(PoolName.KV).host_pool
    page = int(getattr(host_pool, "page_size", 1) or 1)
    refuse = lens.mode == "refuse"
    storage_node: list[int] = []  # the node write_backup_storage is backing up now

    def write(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            node = kwargs.get("node_id", -1)
            if node != -1:
                lens.write_submitted(node, None if result is None else _pages(result, page))
            return result

        return call

    def load(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            node = kwargs.get("node_id", -1)
            if result is not None and node != -1:
                host = kwargs.get("host_indices", args[0] if args else None)
                lens.copy_started("load_back", node, node, _pages(host, page), tokens=len(result))
            return result

        return call

    def commit_backup(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(node_id: int, *args: Any, **kwargs: Any) -> Any:
            lens.backup_committed(node_id)
            return original(node_id, *args, **kwargs)

        return call

    def track(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(node_id: int, *args: Any, **kwargs: Any) -> Any:
            result = original(node_id, *args, **kwargs)
            if cache.is_write_back:
                lens.copy_started("write_back", node_id, node_id)
            else:
                lens.copy_started("write_through", node_id, node_id)
            return result

        return call

    def replace(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(ack_id: int, old_node_id: int, new_node_ids: list[int]) -> Any:
            result = original(ack_id, old_node_id, new_node_ids)
            lens.split(ack_id, old_node_id, list(new_node_ids))
            return result

        return call

    def refused(queue: list[Any], name: AckQueue) -> None:
        """Take the node ids no pending copy explains out of the acks (refuse mode)."""
        want: dict[Hashable, int] = {}
        for i, ack in enumerate(queue):
            keep = []
            for ack_id in ack.node_ids:
                used = want.get(ack_id, 0)
                if used < lens.pending_under(name, ack_id):
                    want[ack_id] = used + 1
                    keep.append(ack_id)
                else:
                    lens.stray(name, ack_id, refused=True)
            if len(keep) != len(ack.node_ids):
                queue[i] = ack._replace(node_ids=keep)

    def watch() -> None:
        """Put the watching dictionaries in place of the cache's pending-copy ones."""
        watched: tuple[tuple[str, AckQueue], ...] = (
            ("ongoing_write_through", "write"),
            ("ongoing_load_back", "load"),
        )
        for name, queue in watched:
            current = getattr(cache, name)
            if type(current) is not _Acked:
                setattr(cache, name, _Acked(current, lens, queue))
        if type(cache.ongoing_prefetch) is not _Prefetches:
            cache.ongoing_prefetch = _Prefetches(cache.ongoing_prefetch, lens)

    def poll(original: Callable[[], Any]) -> Callable[[], Any]:
        """``check_hicache_events`` (it takes no argument in this release): the common
        poll, nothing due and nothing to refuse, costs one call and a clock read."""

        def call() -> Any:
            if refuse:
                refused(cc.ack_write_queue, "write")
                refused(cc.ack_load_queue, "load")
            try:
                return original()
            except Exception as exc:
                lens.raised("check_hicache_events", exc)
                raise
            finally:
                if monotonic() >= lens.step_due:  # most polls: nothing due, no call
                    lens.step()

        return call

    def drain_storage(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            n = kwargs.get("n_backup")
            waiting = list(cc.ack_backup_queue.queue)
            ops = [op.id for op in (waiting if n is None else waiting[:n])]
            result = original(*args, **kwargs)
            lens.acked("storage", ops)
            return result

        return call

    def backup_storage(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(node_id: int, *args: Any, **kwargs: Any) -> Any:
            storage_node.append(node_id)
            try:
                return original(node_id, *args, **kwargs)
            finally:
                storage_node.pop()

        return call

    def write_storage(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(host_indices: Any, *args: Any, **kwargs: Any) -> Any:
            op = original(host_indices, *args, **kwargs)
            node = storage_node[-1] if storage_node else -1
            lens.copy_started("storage_backup", node, op, _pages(host_indices, page))
            return op

        return call

    def free(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(indices: Any, *args: Any, **kwargs: Any) -> Any:
            lens.host_freed(_pages(indices, page))
            return original(indices, *args, **kwargs)

        return call

    def lock(where: str, up: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(node_id: int, *args: Any, **kwargs: Any) -> Any:
                if not up:  # (node_id, params, ...): the params are the receipt
                    lens.unlocked(where, node_id, args[0] if args else kwargs.get("params"))
                result = original(node_id, *args, **kwargs)
                if up:
                    lens.locked(where, node_id)
                return result

            return call

        return make

    def then(action: Callable[[], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A wrapper that runs ``action`` after the call, whether it returned or raised."""

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                try:
                    return original(*args, **kwargs)
                finally:
                    action()

            return call

        return make

    _wrap(cc, "write", write)
    _wrap(cc, "load", load)
    _wrap(cc, "write_storage", write_storage)
    _wrap(cache.tree_core, "commit_backup", commit_backup)
    _wrap(host_pool, "free", free)
    _wrap(cache, "_track_write_through_node", track)
    _wrap(cache, "_replace_pending_write_through_node", replace)
    watch()
    _wrap(cache, "reset", then(watch))
    _wrap(cache, "_drain_storage_control_queues_impl", drain_storage)
    _wrap(cache, "write_backup_storage", backup_storage)
    _wrap(cache, "inc_lock_ref", lock("device", True))
    _wrap(cache, "dec_lock_ref", lock("device", False))
    _wrap(cache, "inc_host_lock_ref", lock("host", True))
    _wrap(cache, "dec_host_lock_ref", lock("host", False))
    _wrap(cache, "check_hicache_events", poll)
    _wrap(cache, "release_host_resources", then(lens.close))
    _wrap(cache, "shutdown", then(lens.close))
    cache.kvlife_lens = lens

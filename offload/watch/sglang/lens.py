"""The lens's bookkeeping, in a hierarchical cache's words and free of any engine: host
copies as lifecycles, each copy a ticket the lens mints, acks matched to tickets, host
frees matched to the copies that still use those pages, lock receipts.

A generation module (``kvlife.offload.watch.sglang.unified``, ...) knows where a
cache release keeps its pending copies and acks; it calls the methods here with plain
node ids, host page slots and ack lists, so the verdicts are the same whatever the cache
looks like inside.

What is a lifecycle: one per node whose KV the cache copies (its rid is ``node<ID>``),
registered at the first copy that names the node. Its tickets are the copies SGLang starts
for it: ``write_through`` or ``write_back`` (device to host), ``load_back`` (host to
device), ``storage_backup`` (host to the storage backend). The lifecycle finishes when
the last host page it was written to is freed (``host_eviction``), or when the cache shuts
down, and is released when no copy of it is in flight.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic
from typing import Literal

from kvlife.fsm import (
    JsonLinesSink,
    Lifecycle,
    LifecycleError,
    LifecycleRegistry,
    OverdueWatch,
    Ticket,
    Trigger,
)
from kvlife.fsm.audit.records import DetailValue
from kvlife.fsm.audit.sinks import SERVER_LOCK_WAIT_S
from kvlife.fsm.errors import Reason

logger = logging.getLogger("sglang.kvlife")

Mode = Literal["observe", "refuse"]
MODES: tuple[Mode, ...] = ("observe", "refuse")
"""``observe``: write verdicts down, change nothing. ``refuse``: also take out of an ack
the node ids no pending copy explains, before the cache pops them (it raises ``KeyError``
on such an id and the scheduler dies)."""

CopyKind = Literal["write_through", "write_back", "load_back", "storage_backup"]
AckQueue = Literal["write", "load", "storage", "prefetch"]

_OVERDUE_EVERY_S = 0.05  # a poll looks for overdue copies and writes out at most this often
_SPENT = 4096  # spent lock receipts remembered (a receipt spent twice is a verdict)

_ACKED_BY: dict[str, AckQueue] = {
    "write_through": "write",
    "write_back": "write",
    "load_back": "load",
    "storage_backup": "storage",
}


class NodeCopy:
    """The object a node's lifecycle is registered under (identity, never the node id:
    a node id SGLang hands out again after the node is gone gets a new lifecycle)."""

    __slots__ = ("node", "rid", "slots")

    def __init__(self, node: int) -> None:
        self.node = node
        self.rid = f"node{node}"
        self.slots = 0  # host pages written for it and not freed yet

    def __repr__(self) -> str:
        return f"NodeCopy({self.node}, slots={self.slots})"


class PrefetchCopy:
    """The object a request's prefetch from the storage backend is registered under: one
    lifecycle per prefetch, its rid the request's (``rid@attempt`` after a retry)."""

    __slots__ = ("rid",)

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def __repr__(self) -> str:
        return f"PrefetchCopy({self.rid!r})"


@dataclass
class _Copy:
    ticket: Ticket
    kind: CopyKind
    node: int
    slots: frozenset[int]
    told_freed: bool = False


@dataclass
class LensCounts:
    """What the lens saw, for a test, a benchmark or a metric."""

    copies: dict[str, int] = field(default_factory=dict)
    acks: int = 0
    splits: int = 0
    host_frees: int = 0
    writes_without_pages: int = 0
    prefetches: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    refused_ids: int = 0


class HiCacheLens:
    """Per-node lifecycles of one cache's host copies, and the verdicts on it.

    Args:
        path: the audit log (JSON lines; ``None``: in memory only, for a test).
        witness: what is watched, in the log's header (``kvlife audit check`` counts the
            tickets still open at its end as ``unreported``).
        mode: ``observe`` or ``refuse`` (see [`MODES`][kvlife.offload.watch.sglang.lens.MODES]).
        overdue_s: a copy open longer than this is written down as ``overdue``.
        flush_interval_s: seconds between fsyncs of the log.
        sinks: more sinks (a test's ``MemorySink``).

    Raises:
        ValueError: an unknown ``mode`` or a ``overdue_s`` that is not positive; nothing
            is opened.
    """

    def __init__(
        self,
        path: str | Path | None,
        witness: str,
        *,
        mode: str = "observe",
        overdue_s: float = 120.0,
        flush_interval_s: float = 1.0,
        sinks: Sequence[object] = (),
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"kvlife: HiCache lens mode must be one of {MODES}, got {mode!r}")
        if not overdue_s > 0:
            raise ValueError(f"kvlife: overdue_s must be a positive number, got {overdue_s!r}")
        self.mode: Mode = "refuse" if mode == "refuse" else "observe"
        self.sink: JsonLinesSink | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.sink = JsonLinesSink(
                str(path),
                flush_interval_s=flush_interval_s,
                open_marker=True,
                witness=witness,
                lock_wait_s=SERVER_LOCK_WAIT_S,
            )
        all_sinks = [*sinks] + ([self.sink] if self.sink is not None else [])
        self.registry = LifecycleRegistry(sinks=all_sinks)
        self.overdue = OverdueWatch(self.registry, overdue_s)
        self.witness = witness
        self.counts = LensCounts()
        self.closed = False
        #: ``monotonic()`` time from which the next poll's ``step()`` has work to do
        self.step_due = 0.0
        self._nodes: dict[int, NodeCopy] = {}  # node id -> its live lifecycle's key
        # per ack queue, per node id: the copies an ack naming it would complete, oldest first
        self._pending: dict[AckQueue, dict[Hashable, deque[_Copy]]] = {
            "write": {},
            "load": {},
            "storage": {},
        }
        self._owner: dict[int, NodeCopy] = {}  # host slot -> the lifecycle written there
        self._reading: dict[int, list[_Copy]] = {}  # host slot -> copies in flight on it
        self._written: dict[int, tuple[int, ...] | None] = {}  # node -> last write's slots
        self._locks: dict[tuple[str, int], int] = {}  # (device|host, node) -> receipts held
        self._spent: OrderedDict[int, object] = OrderedDict()  # receipts spent lately
        self._split: dict[Hashable, str] = {}  # pending write's ack id -> the nodes it spans
        self._prefetching: dict[Hashable, tuple[PrefetchCopy, Ticket]] = {}  # by request

    # ------------------------------------------------------------------ lifecycles

    def _node(self, node: int) -> NodeCopy:
        key = self._nodes.get(node)
        if key is None:
            key = NodeCopy(node)
            self.registry.register(key, rid=key.rid)
            self._nodes[node] = key
        return key

    def _lifecycle(self, node: int) -> Lifecycle | None:
        key = self._nodes.get(node)
        return None if key is None else self.registry.lifecycle(key)

    def _end(self, key: NodeCopy, why: str) -> None:
        if self._nodes.get(key.node) is key:
            del self._nodes[key.node]
        with contextlib.suppress(LifecycleError):  # finished before: audited
            self.registry.finish(key, by=why)

    def verdict(
        self,
        reason: Reason,
        trigger: Trigger,
        message: str,
        node: int | None,
        op: int | None = None,
        **detail: DetailValue,
    ) -> None:
        """Write down a verdict on the cache (on the node's lifecycle when it has one,
        else on its rid), count it and warn."""
        lc = None if node is None else self._lifecycle(node)
        rid = None if node is None else f"node{node}"
        self.registry.record_violation(
            reason, trigger, message, lifecycle=lc, rid=rid, op=op, serial=None, **detail
        )
        self.counts.verdicts[reason] = self.counts.verdicts.get(reason, 0) + 1
        logger.warning("kvlife: %s: %s", self.witness, message)
        if self.sink is not None:
            self.sink.write_out()

    # ------------------------------------------------------------------ copies

    def write_submitted(self, node: int, slots: Iterable[int] | None) -> None:
        """The cache asked for a device-to-host copy of ``node``: the host pages it got, or
        ``None`` when the write failed (no host memory)."""
        self._written[node] = None if slots is None else tuple(slots)
        if slots is None:
            self.counts.writes_without_pages += 1

    def backup_committed(self, node: int) -> None:
        """The cache recorded ``node`` as backed on host."""
        if node in self._written and self._written[node] is None:
            self.verdict(
                "failed_write_backed",
                Trigger.START_OFFLOAD,
                f"node {node} was committed as backed on host, but the write that should "
                "have backed it failed (no host pages): a later hit loads pages never written",
                node,
            )

    def copy_started(
        self,
        kind: CopyKind,
        node: int,
        ack_id: Hashable,
        slots: Iterable[int] = (),
        **detail: DetailValue,
    ) -> Ticket | None:
        """A copy the cache will ack under ``ack_id`` is pending: a ticket for it on
        ``node``'s lifecycle. A second pending copy under the same ack id of the same
        queue is ``pending_overwritten`` (the cache keeps one entry per id)."""
        queue = _ACKED_BY[kind]
        pending = self._pending[queue].get(ack_id)
        if pending:
            self.verdict(
                "pending_overwritten",
                Trigger.START_OFFLOAD,
                f"a {kind} of node {node} was registered under ack id {ack_id!r} while the "
                f"{pending[0].kind} registered under it (copy {pending[0].ticket.op}) was still "
                "in flight: the cache's entry for it is overwritten",
                node,
                entry=kind,
                earlier=pending[0].ticket.op,
            )
        if kind in ("write_through", "write_back"):
            written = self._written.pop(node, None)
            slots = written or ()
        key = self._node(node)  # never a finished one: _end forgets a key as it finishes it
        ticket = self.registry.start_offload(key, kind=kind, **detail)
        copy = _Copy(ticket, kind, node, frozenset(slots))
        self._pending[queue].setdefault(ack_id, deque()).append(copy)
        for slot in copy.slots:
            self._reading.setdefault(slot, []).append(copy)
        if kind in ("write_through", "write_back"):
            for slot in copy.slots:
                previous = self._owner.get(slot)
                if previous is not None and previous is not key:
                    previous.slots -= 1
                self._owner[slot] = key
            key.slots += len(copy.slots)
        self.overdue.opened(ticket, kind)
        self.counts.copies[kind] = self.counts.copies.get(kind, 0) + 1
        return ticket

    def pending_under(self, queue: AckQueue, ack_id: Hashable) -> int:
        """Copies pending under ``ack_id`` on ``queue``."""
        return len(self._pending[queue].get(ack_id, ()))

    def raised(self, call: str, error: BaseException) -> None:
        """The cache raised in ``call`` (SGLang's scheduler dies on it): written down
        before it goes on."""
        self.verdict(
            "connector_raised",
            Trigger.ACK,
            f"the cache raised in {call}: {type(error).__name__}: {error}",
            None,
            call=call,
            error=f"{type(error).__name__}: {error}"[:200],
        )

    def stray(self, queue: AckQueue, ack_id: Hashable, refused: bool) -> None:
        """An ack no pending copy explains (repeated, or for an id never written)."""
        node = ack_id if isinstance(ack_id, int) else None
        told = {
            "write": "the cache pops ongoing_write_through[id] and raises KeyError",
            "load": "the cache pops ongoing_load_back[id] and raises KeyError",
            "storage": "the cache drops it silently",
            "prefetch": "the cache removes ongoing_prefetch[request] and raises KeyError",
        }[queue]
        action = "taken out of the ack before the cache saw it" if refused else told
        self.verdict(
            "stray_report",
            Trigger.ACK,
            f"a {queue} ack names {ack_id!r}, which has no copy in flight ({action})",
            node,
            report=f"{queue}_ack",
            ack_id=str(ack_id),
            refused=refused,
        )
        if refused:
            self.counts.refused_ids += 1

    def acked(self, queue: AckQueue, ack_ids: Iterable[Hashable], ok: bool = True) -> None:
        """The cache consumed an ack naming ``ack_ids``: each completes the oldest copy
        pending under it; one that completes none is a stray report."""
        for ack_id in ack_ids:
            self.counts.acks += 1
            pending = self._pending[queue].get(ack_id)
            if not pending:
                self.stray(queue, ack_id, refused=False)
                continue
            copy = pending.popleft()
            if not pending:
                del self._pending[queue][ack_id]
            split = self._split.pop(ack_id, None) if queue == "write" else None
            if split is None:
                self._settle(copy, ok)
            else:
                self._settle(copy, ok, split_into=split)

    def _settle(self, copy: _Copy, ok: bool, **detail: DetailValue) -> None:
        for slot in copy.slots:
            on = self._reading.get(slot)
            if on is not None:
                on.remove(copy)
                if not on:
                    del self._reading[slot]
        lc = copy.ticket.lifecycle
        self.registry.complete(copy.ticket, ok=ok, **detail)
        key = lc.req
        if (
            isinstance(key, NodeCopy)
            and key.slots <= 0
            and lc.inflight == 0
            and not lc.released
            and copy.kind in ("load_back", "storage_backup")
            and self._nodes.get(key.node) is key
        ):
            self._end(key, "no_host_pages")  # a load of a node the lens saw no write of

    def split(self, ack_id: Hashable, old: int, new: Sequence[int]) -> None:
        """A node with a pending write was split: the ack still names ``ack_id``, and the
        host pages the write fills stay with its lifecycle (legal: no verdict). The ack's
        record says which nodes the write came to span (``split_into``)."""
        self.counts.splits += 1
        self._split[ack_id] = ",".join(f"node{n}" for n in new)

    # ------------------------------------------------------------------ prefetches

    def prefetch_started(self, request: Hashable, rid: str, tokens: int) -> None:
        """The cache registered a prefetch of ``tokens`` from the storage backend for
        ``request`` (its pending entry): a lifecycle with one ``storage_prefetch`` ticket.
        A later write of the same entry (the cache records the host pages it got) is an
        update, not a new prefetch."""
        if request in self._prefetching:
            return
        key = PrefetchCopy(rid)
        self.registry.register(key, rid=rid)
        ticket = self.registry.start_offload(key, kind="storage_prefetch", tokens=tokens)
        self.overdue.opened(ticket, "storage_prefetch")
        self._prefetching[request] = (key, ticket)
        self.counts.prefetches += 1

    def prefetch_ended(self, request: Hashable, done: bool) -> None:
        """The cache removed ``request``'s pending prefetch: ``done`` when its pages went
        into the tree, else it was given up (the request aborted, nothing found, the
        deadline passed). The ticket completes (or fails) and the lifecycle finishes. A
        removal of an entry the lens never saw registered is a stray report."""
        found = self._prefetching.pop(request, None)
        if found is None:
            self.stray("prefetch", str(request), refused=False)
            return
        key, ticket = found
        self.registry.complete(ticket, ok=done, report="inserted" if done else "given_up")
        with contextlib.suppress(LifecycleError):  # finished before: audited
            self.registry.finish(key, by="prefetch_done" if done else "prefetch_given_up")

    # ------------------------------------------------------------------ host memory

    def host_freed(self, slots: Sequence[int]) -> None:
        """Host pages handed back to the pool: a copy still in flight on one of them is
        ``host_freed_in_flight``; a lifecycle whose last page this was finishes."""
        self.counts.host_frees += 1
        reading = self._reading
        owner = self._owner
        hit: dict[int, tuple[_Copy, int]] = {}  # id(copy) -> (copy, its pages freed)
        ending: list[NodeCopy] = []
        for slot in slots:
            for copy in reading.get(slot, ()):
                _, n = hit.get(id(copy), (copy, 0))
                hit[id(copy)] = (copy, n + 1)
            key = owner.pop(slot, None)
            if key is not None:
                key.slots -= 1
                if key.slots <= 0:
                    ending.append(key)
        for copy, n in hit.values():
            if copy.told_freed:
                continue
            copy.told_freed = True
            self.verdict(
                "host_freed_in_flight",
                Trigger.FINISH,
                f"{n} host page(s) of node {copy.node} were freed while its "
                f"{copy.kind} (copy {copy.ticket.op}) was still in flight on them",
                copy.node,
                op=copy.ticket.op,
                copy=copy.kind,
                slots=n,
            )
        for key in ending:
            self._end(key, "host_eviction")

    # ------------------------------------------------------------------ locks

    def locked(self, where: str, node: int) -> None:
        """A lock increment on ``node`` (``where``: ``device`` or ``host``): a receipt."""
        self._locks[where, node] = self._locks.get((where, node), 0) + 1

    def unlocked(self, where: str, node: int, receipt: object = None) -> None:
        """A lock decrement on ``node``: it spends a receipt (``receipt``: the object the
        cache decrements with, when it has one). None held on the node, or a receipt
        already spent, is ``unbalanced_lock``."""
        held = self._locks.get((where, node), 0)
        spent = self._spent
        twice = receipt is not None and id(receipt) in spent and spent[id(receipt)] is receipt
        if receipt is not None and not twice:
            spent[id(receipt)] = receipt  # held: its id is not reused while remembered
            if len(spent) > _SPENT:
                spent.popitem(last=False)
        if held <= 0 or twice:
            self.verdict(
                "unbalanced_lock",
                Trigger.FINISH,
                f"a {where} lock on node {node} was released "
                + (
                    "with a receipt already spent (another holder's count is taken)"
                    if twice
                    else "but no lock increment on it is outstanding"
                )
                + " ('pool memory leak detected')",
                node,
                lock=where,
            )
            return
        if held == 1:
            del self._locks[where, node]
        else:
            self._locks[where, node] = held - 1

    def locks_held(self) -> int:
        """Lock receipts outstanding now."""
        return sum(self._locks.values())

    # ------------------------------------------------------------------ the log

    def step(self) -> None:
        """The end of a cache poll (``check_hicache_events``): at most every
        ``_OVERDUE_EVERY_S`` (50 ms), write down the copies that crossed the overdue limit
        and write the records out (a verdict is written out at once, and so is
        everything when the cache raises or closes)."""
        now = monotonic()
        if now < self.step_due:
            return
        self.step_due = now + _OVERDUE_EVERY_S
        self._step_overdue()
        sink = self.sink
        if sink is not None and sink.waiting:
            sink.write_out()

    def _step_overdue(self) -> None:
        if self.overdue.check():
            logger.warning(
                "kvlife: %s: %d cop(ies) open longer than %g s, the oldest %.1f s "
                "(kvlife audit check %s)",
                self.witness,
                self.overdue.open_overdue(),
                self.overdue.limit_s,
                self.overdue.oldest_age(),
                "" if self.sink is None else self.sink.path,
            )

    def pending(self) -> int:
        """Copies in flight now."""
        copies = sum(len(q) for queue in self._pending.values() for q in queue.values())
        return copies + len(self._prefetching)

    def close(self) -> None:
        """The cache shuts down: every live lifecycle finishes (its host memory goes with
        the cache), copies still in flight stay open (``unreported`` in the check), and
        the log is closed. Calling it again does nothing."""
        if self.closed:
            return
        self.closed = True
        for key in list(self._nodes.values()):
            self._end(key, "shutdown")
        if self.sink is not None:
            self.sink.close()

"""The scheduler half of kvlife's offload core: it plans copies and takes their reports.

An engine that runs its scheduler and its copies in different processes (vLLM: an engine
core and one worker per rank) splits kvlife's offload core along the same line. This half
runs beside the scheduler and imports no torch. It holds:

- the [`LifecycleRegistry`][kvlife.fsm.registry.LifecycleRegistry] (one lifecycle per
  request object, one ticket per copy);
- the host pages' account: a [`PageAllocator`][kvlife.offload.pages.PageAllocator] (the
  pages the workers hold, by number) and a
  [`HostPrefixCache`][kvlife.offload.prefix_cache.HostPrefixCache] of stored blocks named by
  their hashes;
- each lifecycle's progress (the device blocks its request holds, how many of them are on
  the host or being copied there, its copies in flight);
- the orders in flight and how many workers reported each (a copy is over when every
  worker reported it, as tensor parallelism needs);
- the fences: device blocks of finished requests that a store still reads.

A *slot* is the device block of one block of a request: an ``int``, or, for an engine that
keeps several KV cache groups (a hybrid model: full-attention and sliding-window layers),
a *row*, a tuple of each group's block (``None`` where a group holds none for that block,
as a sliding window's blocks behind the window). The planner does not look inside a slot
except to fence its blocks: a row's blocks are fenced while a store reads them, whether
its request finished or not (a sliding-window group gives blocks back while the request
runs).

It plans copies as orders ([`StoreOrder`][kvlife.offload.planner.StoreOrder],
[`LoadOrder`][kvlife.offload.planner.LoadOrder]) that name the lifecycle's copy number (its
ticket's ``op``), device blocks and host pages; the worker half copies them and reports
each order's copy number back; [`report()`][kvlife.offload.planner.OffloadPlanner.report]
delivers the ticket when every worker's report is in.

*Owner mode* (``hand_over`` given; what
[`OffloadManager`][kvlife.offload.manager.OffloadManager] composes): there is no host
cache. Each lifecycle keeps the pages of its completed stores, every block is copied (the
last one may be partial), and at release the lifecycle's pages are handed over: the
longest run of consecutive stores from its first block, before any failed store, to
``hand_over(lc, req, orders)``, which owns their pages from then on; the planner frees
the rest. An order's ``slots`` are empty then: the owner reads the device slots from its
engine as it launches the copy.

In cache mode (the default), a store copies only blocks the host cache does not hold: a
block whose hash is cached is refreshed in the eviction order instead, and one that
another order is storing right now is left to that order. A completed store's pages join
the host cache at once (a block's hash names its content, whichever request computed it
and however it ended); a failed store's pages are freed. Every page is in exactly one
place of the account (free, cached, pinned by loads, written by stores in flight, or kept
by a live lifecycle in owner mode), so
[`account()`][kvlife.offload.planner.OffloadPlanner.account] sums to the capacity, less
the pages handed over in owner mode.

Why one module: the scheduler half keeps one account (every host page in exactly one
place) that stores, loads, fences, the host cache, evictions and every worker's reports
all change; each of them is a few methods over that account, and the test of the account
is that they stay together. Host page numbers are ``pages``', the cache's index
``prefix_cache``'s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from threading import get_ident
from types import MappingProxyType
from typing import Any, NamedTuple

from kvlife.fsm.overdue import OverdueWatch
from kvlife.fsm.registry import Lifecycle, LifecycleRegistry, Ticket
from kvlife.fsm.table import LIFECYCLE, State, Trigger
from kvlife.offload.errors import ReportCountError, UnknownOrderError
from kvlife.offload.pages import PageAllocator, page_runs
from kvlife.offload.prefix_cache import HostPrefixCache

Slot = int | tuple[int | None, ...]
"""One block of a request on the device: a block number, or a row of each KV cache group's
block number (``None``: the group holds none)."""


def block_ids(slots: Iterable[Slot]) -> Iterator[int]:
    """The device block numbers in ``slots`` (a row's, ``None`` left out)."""
    for slot in slots:
        if type(slot) is tuple:
            for block in slot:
                if block is not None:
                    yield block
        else:
            yield slot  # type: ignore[misc]  # an int


# Read once: reading an enum member off its class costs about 70 ns in CPython 3.11.
_FINISHED_PENDING = State.FINISHED_PENDING
_START_OFFLOAD = Trigger.START_OFFLOAD
_ACK = Trigger.ACK
_FAIL = Trigger.FAIL
_NO_REPORTS: Mapping[int, int] = MappingProxyType({})
# The states the table lets a copy start in, for a check by identity (LIFECYCLE.permits
# looks the row up through the enum's hash: about 280 ns a call).
_STORABLE = tuple(state for state in State if LIFECYCLE.permits(state, Trigger.START_OFFLOAD))

MAX_REMEMBERED_ORDERS = 65536
"""Orders over that are remembered (copy number, lifecycle serial and rid; no ticket), so
that a late or repeated report of one is refused, counted and audited by the registry
(``LifecycleRegistry.refuse_spent``) rather than raised as unknown."""


class CacheEvent(NamedTuple):
    """A change of what the host cache holds, for those who route by it (KV events).

    ``kind`` is ``"stored"`` (``keys`` joined the cache: the blocks ``first ..`` of the
    request ``req``, consecutive) or ``"removed"`` (``keys`` left it: evicted or reset;
    ``req`` is ``None`` and ``first`` 0)."""

    kind: str
    keys: tuple[Hashable, ...]
    req: Any
    first: int


class StoreOrder(NamedTuple):
    """Copy device blocks into host pages: ``slots[i]`` into ``pages[i]``.

    ``op`` is the copy number of the store's ticket (what the workers report back);
    ``first`` is the index, among the request's blocks, of ``slots[0]`` (the order's
    blocks are consecutive blocks of the request). Immutable and picklable (it crosses
    process lines).
    """

    op: int
    slots: tuple[Slot, ...]
    pages: tuple[int, ...]
    first: int


class LoadOrder(NamedTuple):
    """Copy host pages into device blocks: ``pages[i]`` into ``slots[i]``; ``op`` and
    ``first`` as for [`StoreOrder`][kvlife.offload.planner.StoreOrder]."""

    op: int
    slots: tuple[Slot, ...]
    pages: tuple[int, ...]
    first: int


_new_order = tuple.__new__
"""Makes a ``StoreOrder`` or ``LoadOrder`` from a tuple of its fields, in C: calling the
class runs the ``__new__`` that ``NamedTuple`` writes in Python (compiled, the slowest
part of making an order)."""


@dataclass(frozen=True)
class PageAccount:
    """Where every host page is now. ``free + cached + pinned + storing + kept ==
    capacity`` (in owner mode, less the pages handed over).

    Attributes:
        capacity: host pages in all.
        free: pages no one holds.
        cached: pages of the host cache that no load reads (evictable).
        pinned: pages of the host cache that loads read now.
        storing: pages that stores in flight write.
        kept: pages of completed stores that live lifecycles keep (owner mode; 0 in
            cache mode).
    """

    capacity: int
    free: int
    cached: int
    pinned: int
    storing: int
    kept: int = 0

    @property
    def balanced(self) -> bool:
        """Whether the five places hold every page exactly once (in owner mode: whether
        no page is handed over now)."""
        return self.free + self.cached + self.pinned + self.storing + self.kept == self.capacity


COUNTERS = (
    "stores",
    "stored_blocks",
    "store_failures",
    "skipped_stores",
    "held_blocks",
    "loads",
    "loaded_blocks",
    "load_failures",
    "hit_blocks",
    "evictions",
    "refusals",
)
"""The planner's counters since start, as
[`counters()`][kvlife.offload.planner.OffloadPlanner.counters] names them: stores and loads
over (and their blocks), failed ones, stores skipped for want of host pages, blocks a store
did not copy because the host cache held them or another store was copying them, blocks
offered to the engine from the host cache, cached pages evicted, and calls the registry
refused (late or repeated reports, stale instances)."""


class Order:
    """An order the planner made, as it keeps it. Read it, never change it.

    Attributes:
        ticket: The ticket of its copy (``ticket.op`` is its copy number).
        slots: The device blocks it reads or writes (empty in owner mode).
        pages: The host pages it writes or reads.
        hashes: A store's block hashes, one per page (``None`` for a partial block);
            empty for loads.
        load: Whether it is a load.
        first: The index of its first block among the request's.
        progress: Its lifecycle's progress.
        reported: Workers that reported it done so far.
        failed: Workers that reported it failed so far.
        keep: A store's pages join the cache when it is done (``False``: ordered before
            a reset).
    """

    # A plain class rather than a dataclass: compiled, its constructor is C (a dataclass's
    # generated __init__ would run as Python, once per order).
    __slots__ = (
        "failed",
        "first",
        "hashes",
        "keep",
        "load",
        "pages",
        "progress",
        "reported",
        "slots",
        "ticket",
    )

    def __init__(
        self,
        ticket: Ticket,
        slots: tuple[Slot, ...],
        pages: tuple[int, ...],
        hashes: tuple[Hashable, ...],
        load: bool,
        first: int,
        progress: Progress,
    ) -> None:
        self.ticket = ticket
        self.slots = slots
        self.pages = pages
        self.hashes = hashes
        self.load = load
        self.first = first
        self.progress = progress
        self.reported = 0
        self.failed = 0
        self.keep = True

    def __repr__(self) -> str:
        kind = "load" if self.load else "store"
        return (
            f"<Order op={self.ticket.op} {kind} first={self.first} pages={self.pages} "
            f"reported={self.reported} failed={self.failed}>"
        )


@dataclass(slots=True)
class Progress:
    """What the planner knows of one lifecycle's request. Read it, never change it: the
    planner's methods do (an adapter may keep it beside the lifecycle to ask, without a
    call, whether a store is due: ``full - covered >= stride``)."""

    #: The request object (``None`` once its lifecycle is released: nothing holds it then).
    req: Any
    #: The device blocks the request holds, as the engine told (slots: blocks or rows).
    slots: list[Slot] = field(default_factory=list)
    #: Its first blocks that are on the host, or being copied there, or passed over.
    covered: int = 0
    #: The copy numbers of its orders in flight.
    ops: set[int] = field(default_factory=set)
    #: The last lookup's (first block, pages), until a load takes it.
    hit: tuple[int, list[int]] | None = None
    #: The first block this planner stores for it (``admit(covered=...)``).
    start: int = 0
    #: Owner mode: its completed stores whose pages it keeps.
    kept: list[Order] = field(default_factory=list)
    #: Owner mode: the first block of its earliest failed store.
    failed_at: int | None = None
    #: Whatever the planner's owner keeps with the lifecycle (the manager: its page-hash
    #: chain); the planner never reads it.
    note: Any = None


HandOver = Callable[[Lifecycle, Any, list[Order]], None]

_PLANNED = -1
"""What ``_storing`` holds for a block planned for a store whose ticket is not started yet
(the copy number replaces it when the order is made)."""

# One run of a planned store: (progress, first block, pages, the keys, the run's offset in
# them), ordered once its ticket is started.
_Run = tuple["Progress", int, tuple[int, ...], Sequence[Hashable], int]
"""Owner mode's release hook: ``hand_over(lc, req, orders)`` (see the module's docstring)."""


class OffloadPlanner:
    """The scheduler half: plans stores and loads, takes the workers' reports.

    Args:
        pages: host pages the workers hold (one block of every layer each), or the
            [`PageAllocator`][kvlife.offload.pages.PageAllocator] of a pool that holds
            them (so that pages freed through the pool and through the planner are one
            account).
        registry: the lifecycle registry (a new one if ``None``); the planner adds a
            release hook to it.
        reporters: workers that must report each order before it is over (the tensor
            parallel world size).
        events: keep a [`CacheEvent`][kvlife.offload.planner.CacheEvent] for every
            change of what the host cache holds, for ``take_events`` (off: none kept).
        hand_over: owner mode (see the module's docstring): no host cache; each released
            lifecycle's kept stores go to ``hand_over(lc, req, orders)``.
        overdue: an [`OverdueWatch`][kvlife.fsm.overdue.OverdueWatch] over ``registry``
            that every store and load ticket is handed to (its owner calls ``check``).

    Raises:
        ValueError: ``pages`` or ``reporters`` is not a positive int, or ``overdue``
            watches another registry.
        TypeError: ``hand_over`` is not callable.
    """

    def __init__(
        self,
        pages: int | PageAllocator,
        *,
        registry: LifecycleRegistry | None = None,
        reporters: int = 1,
        events: bool = False,
        hand_over: HandOver | None = None,
        overdue: OverdueWatch | None = None,
    ) -> None:
        if not isinstance(reporters, int) or isinstance(reporters, bool) or reporters <= 0:
            raise ValueError(f"reporters must be a positive int, got {reporters!r}")
        if hand_over is not None and not callable(hand_over):
            raise TypeError(f"hand_over needs a callable, got {hand_over!r}")
        self.allocator = pages if isinstance(pages, PageAllocator) else PageAllocator(pages)
        self._hand_over = hand_over
        self._kept_pages = 0
        self.cache = HostPrefixCache()
        self.registry = registry if registry is not None else LifecycleRegistry()
        if overdue is not None and overdue.registry is not self.registry:
            raise ValueError("the overdue watch must watch the planner's registry")
        self.overdue = overdue
        self.reporters = reporters
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._progress: dict[int, Progress] = {}  # by lifecycle serial
        self._orders: dict[int, Order] = {}  # in flight, by copy number
        # Invariant: a hash is in _storing while exactly that order writes its page.
        self._storing: dict[Hashable, int] = {}
        self._storing_pages = 0
        # the orders over, newest last: copy number -> its lifecycle's serial and rid (two
        # dicts of ints and strs: remembering one keeps no object alive, and adds none the
        # garbage collector tracks)
        self._over: OrderedDict[int, int] = OrderedDict()
        self._over_rids: dict[int, str] = {}
        # device block of a finished request -> the stores in flight that read it
        self._fences: dict[int, set[int]] = {}
        self.registry.on_release(self._released)
        self._events: list[CacheEvent] | None = [] if events else None
        if events:
            self.cache.evicted = []

    # ------------------------------------------------------------------ requests

    def admit(self, req: object, rid: str | None = None, *, covered: int = 0) -> Lifecycle:
        """Register ``req`` (see
        [`LifecycleRegistry.register()`][kvlife.fsm.registry.LifecycleRegistry.register]);
        its errors leave nothing registered. ``covered``: its first blocks that are
        stored elsewhere already (not stored by this planner).

        Raises:
            ValueError: ``covered`` is not a non-negative int. Nothing registered.
        """
        if not isinstance(covered, int) or isinstance(covered, bool) or covered < 0:
            raise ValueError(f"covered must be a non-negative int, got {covered!r}")
        lc = self.registry.register(req, rid)
        self._progress[lc.serial] = Progress(req, covered=covered, start=covered)
        return lc

    def progress(self, lc: Lifecycle) -> Progress:
        """``lc``'s [`Progress`][kvlife.offload.planner.Progress] (the same object for the
        lifecycle's whole life).

        Raises:
            KeyError: ``lc`` is not a live lifecycle of this planner.
        """
        return self._progress[lc.serial]

    def find(self, req: object) -> Lifecycle | None:
        """``req``'s live lifecycle here, or ``None`` (nothing counted or audited)."""
        if req not in self.registry:
            return None
        return self.registry.lifecycle(req)

    def slots(self, lc: Lifecycle) -> list[Slot]:
        """The device blocks (or rows) ``lc``'s request holds, as the engine told (a copy).

        Raises:
            KeyError: ``lc`` is not a live lifecycle of this planner.
        """
        return list(self._progress[lc.serial].slots)

    def add_slots(self, lc: Lifecycle, slots: Iterable[Slot], *, fresh: bool = False) -> set[int]:
        """The engine gave ``lc``'s request the device blocks ``slots`` (after those it
        holds; ``fresh``: instead of them, as after a preemption). Returns the stores in
        flight that still read any of those blocks for a finished request: the workers
        must finish them before the blocks are written. Those blocks' fences are lifted.

        Raises:
            KeyError: ``lc`` is not a live lifecycle of this planner. Nothing changed.
        """
        progress = self._progress[lc.serial]
        slots = list(slots)
        if fresh:
            progress.slots = slots
        else:
            progress.slots += slots
        return self.reused(slots)

    def reused(self, slots: Iterable[Slot]) -> set[int]:
        """The engine hands ``slots`` to a request: the stores in flight that read any of
        their blocks for a finished request, or a row's blocks for any request (the
        workers finish them first); their fences go."""
        fences = self._fences
        if not fences:
            return set()
        wait: set[int] = set()
        for slot in block_ids(slots):
            ops = fences.pop(slot, None)
            if ops:
                wait |= ops
        return wait

    def preempted(self, lc: Lifecycle) -> set[int]:
        """``lc``'s request was preempted: the engine takes its device blocks back. Returns
        its copies in flight (they read or write those blocks: the workers finish them
        first); it holds no blocks until it resumes (``add_slots(..., fresh=True)``).

        Raises:
            KeyError: ``lc`` is not a live lifecycle of this planner. Nothing changed.
        """
        progress = self._progress[lc.serial]
        progress.slots = []
        return set(progress.ops)

    def end(self, lc: Lifecycle, *, aborted: bool = False) -> Lifecycle:
        """``lc``'s request finished (or was aborted); the engine takes its device blocks
        back now. Blocks that stores in flight still read are fenced (see ``add_slots``);
        the lifecycle is released when its last copy is over.

        Raises:
            KeyError: ``lc`` is not a live lifecycle of this planner. Nothing changed.
            InvalidTransitionError: ``lc`` already finished or was aborted (the
                registry's refusal, counted and audited). Nothing else changed.
        """
        progress = self._progress[lc.serial]
        if aborted:
            self.registry.abort(lc)
        else:
            self.registry.finish(lc)
        progress.hit = None
        if lc.state is _FINISHED_PENDING:
            for op in progress.ops:
                order = self._orders[op]
                if not order.load:
                    for slot in block_ids(order.slots):
                        self._fences.setdefault(slot, set()).add(op)
        return lc

    # ------------------------------------------------------------------ stores

    def store(
        self,
        lc: Lifecycle,
        full: int,
        hashes: Sequence[Hashable],
        *,
        stride: int = 1,
        retry: bool = True,
    ) -> list[StoreOrder]:
        """Plan the stores of ``lc``'s first ``full`` blocks (those whose KV is final once
        the step ran) that are not on the host or being copied there, once ``stride`` of
        them wait. ``hashes[i]`` names block ``i``'s content (a block without a hash yet
        waits). A block the host cache holds is not copied (it becomes the most recently
        used instead), nor one another order stores now. Returns one order per run of
        consecutive blocks to copy; none when nothing waits, when the state refuses a
        store, or when the host pages (free and evictable) are too few: then nothing
        changed (but the held blocks' recency) and the blocks are tried again at the next
        call, or, with ``retry=False``, passed over (for slots that may not hold the
        block's KV later: a sliding window's).

        Raises:
            KeyError: ``lc`` is not a live lifecycle of this planner. Nothing changed.
            ValueError: ``stride`` is below 1. Nothing changed.
        """
        if stride < 1:
            raise ValueError(f"stride must be a positive int, got {stride!r}")
        runs = self._plan_store(lc, full, hashes, stride, retry, hold=False)
        return [
            self._order_store(lc, progress, start, pages, keys, offset)
            for progress, start, pages, keys, offset in runs
        ]

    def store_many(
        self,
        items: Sequence[tuple[Lifecycle, int, Sequence[Hashable]]],
        *,
        stride: int = 1,
        retry: bool = True,
    ) -> list[StoreOrder]:
        """``store`` for each ``(lc, full, hashes)`` of ``items`` (a scheduler step's), with
        every ticket started in one registry batch
        ([`apply()`][kvlife.fsm.registry.LifecycleRegistry.apply]): the same orders, pages,
        records and counters as one ``store`` after another, in that order.

        Raises:
            KeyError: a lifecycle is not a live lifecycle of this planner. The items
                before it were planned and started, none after it.
            WrongThreadError: called from a thread other than the registry's owner.
                Nothing changed.
            ValueError: ``stride`` is below 1. Nothing changed.
        """
        if stride < 1:
            raise ValueError(f"stride must be a positive int, got {stride!r}")
        registry = self.registry
        if get_ident() != registry.owner_thread:
            registry.apply(())  # raises WrongThreadError before any page is taken
        planned: list[tuple[Lifecycle, _Run]] = []
        try:
            for lc, full, hashes in items:
                for run in self._plan_store(lc, full, hashes, stride, retry, hold=True):
                    planned.append((lc, run))
        finally:
            orders = self._order_stores(planned)
        return orders

    def _order_stores(self, planned: list[tuple[Lifecycle, _Run]]) -> list[StoreOrder]:
        """The orders of ``planned`` runs, their tickets started in one batch."""
        if not planned:
            return []
        if len(planned) == 1:  # a batch of one costs more than the single call
            lc, (progress, start, pages, keys, offset) = planned[0]
            return [self._order_store(lc, progress, start, pages, keys, offset)]
        details = (
            [{"kind": "store", "blocks": len(run[2]), "first_block": run[1]} for _, run in planned]
            if self.registry.audited
            else None
        )
        targets = [lc for lc, _ in planned]
        group = (_START_OFFLOAD, targets) if details is None else (_START_OFFLOAD, targets, details)
        tickets = self.registry.apply([group])
        orders = []
        for i, ticket in enumerate(tickets):  # one per planned run (the group's targets)
            progress, start, taken, keys, offset = planned[i][1]
            if type(ticket) is not Ticket:  # pragma: no cover - the state was checked
                for key in keys[offset : offset + len(taken)]:
                    if self._storing.get(key) == _PLANNED:
                        del self._storing[key]
                self.allocator.free(taken)
                raise ticket  # type: ignore[misc]
            orders.append(self._make_order(ticket, progress, start, taken, keys, offset))
        return orders

    def _plan_store(
        self,
        lc: Lifecycle,
        full: int,
        hashes: Sequence[Hashable],
        stride: int,
        retry: bool,
        *,
        hold: bool,
    ) -> list[_Run]:
        """``store``'s planning: the runs of blocks to copy and their pages (taken, and the
        progress covered past them); the orders are made by the caller. ``hold``: mark the
        blocks as being stored now (``_PLANNED``), for plans of the same batch made before
        the orders (a single store makes its order at once, which marks them)."""
        progress = self._progress[lc.serial]
        first = progress.covered
        if full - first < stride:  # the common case, decided before anything is counted
            return []
        # two arguments each: compiled, min() of two is a comparison, of three a call
        full = min(full, len(progress.slots))
        full = min(full, len(hashes))
        if full - first < stride or lc.state not in _STORABLE:
            return []
        cache, storing = self.cache, self._storing
        keys = hashes[first:full]
        # not cached, not being copied by another order now, each content once
        absent, held = cache.missing(keys, storing)
        count = len(absent)
        if held:  # needed again: the most recently used, before anything is evicted
            cache.touch(held)
        pages = cache.take(self.allocator, count) if count else ()
        if pages is None:
            self._counts["skipped_stores"] += 1
            if not retry:
                progress.covered = full
            return []
        self._counts["held_blocks"] += full - first - count
        progress.covered = full
        if not count:
            return []
        if absent[-1] - absent[0] == count - 1:  # one run: the common case
            runs = [(progress, first + absent[0], pages, keys, absent[0])]
        else:
            runs = []
            used = 0
            for start, run in page_runs(absent):
                runs.append((progress, first + start, pages[used : used + run], keys, start))
                used += run
        if hold and self._hand_over is None:  # a later plan of the batch leaves them
            for _, _, taken, _, offset in runs:
                for key in keys[offset : offset + len(taken)]:
                    storing[key] = _PLANNED
        return runs

    def store_owned(
        self,
        lc: Lifecycle,
        full: int,
        hashes: Sequence[Hashable | None],
        *,
        detail: Mapping[str, int | float | str | bool | None] | None = None,
    ) -> StoreOrder | None:
        """Owner mode: plan the store of ``lc``'s blocks from the first not stored yet
        up to ``full`` (the last may be partial: no more are stored after it), named by
        ``hashes`` (one per block, ``None`` for a partial one). Every block is copied
        (there is no host cache to hold one). ``detail`` is the audit detail of the
        store's record (``kind``, ``blocks`` and ``first_block`` if ``None``: see
        [`TICKET_DETAIL`][kvlife.fsm.audit.records.TICKET_DETAIL]). Returns ``None``
        when nothing waits, or when the host pages are too few: then nothing changed
        (counted as a skipped store) and the blocks are tried again at the next call.

        Raises:
            RuntimeError: the planner is not in owner mode. Nothing changed.
            ValueError: ``hashes`` does not name each block once. Nothing changed.
            KeyError: ``lc`` is not a live lifecycle of this planner. Nothing changed.
            InvalidTransitionError: the state refuses a copy (the registry's refusal,
                counted and audited). Nothing else changed.
        """
        if self._hand_over is None:
            raise RuntimeError("store_owned needs an owner-mode planner (hand_over)")
        progress = self._progress[lc.serial]
        first = progress.covered
        count = full - first
        if len(hashes) != max(count, 0):
            raise ValueError(
                f"{len(hashes)} hashes for blocks {first}..{full - 1} of {lc!r}: one each"
            )
        if count <= 0:
            return None
        if not LIFECYCLE.permits(lc.state, _START_OFFLOAD):
            self.registry.require(lc, _START_OFFLOAD)  # refused: counted, audited, raised
        pages = self.allocator.alloc(count)
        if pages is None:
            self._counts["skipped_stores"] += 1
            return None
        try:
            order = self._order_store(lc, progress, first, pages, hashes, 0, detail)
        except BaseException:  # the registry refused (another thread): nothing changes
            self.allocator.free(pages)
            raise
        progress.covered = full
        return order

    def _order_store(
        self,
        lc: Lifecycle,
        progress: Progress,
        start: int,
        pages: tuple[int, ...],
        keys: Sequence[Hashable],
        offset: int,
        detail: Mapping[str, int | float | str | bool | None] | None = None,
    ) -> StoreOrder:
        """One store of blocks ``start ..`` (``len(pages)`` of them) whose hashes are
        ``keys[offset ..]``, its ticket started alone."""
        count = len(pages)
        if not self.registry.audited:  # no record is built: no detail to build and check
            ticket = self.registry.start_offload(lc)
        elif detail is None:
            ticket = self.registry.start_offload(lc, kind="store", blocks=count, first_block=start)
        else:
            ticket = self.registry.start_offload(lc, **detail)
        return self._make_order(ticket, progress, start, pages, keys, offset)

    def _make_order(
        self,
        ticket: Ticket,
        progress: Progress,
        start: int,
        pages: tuple[int, ...],
        keys: Sequence[Hashable],
        offset: int,
    ) -> StoreOrder:
        """The order of a store whose ticket was started."""
        count = len(pages)
        slots = tuple(progress.slots[start : start + count])
        names = tuple(keys[offset : offset + count])
        op = ticket.op
        if self.overdue is not None:
            self.overdue.opened(ticket, "store")
        self._orders[op] = Order(ticket, slots, pages, names, False, start, progress)
        progress.ops.add(op)
        if slots and type(slots[0]) is tuple:  # rows: fenced while read, request running or not
            fences = self._fences
            for block in block_ids(slots):
                fences.setdefault(block, set()).add(op)
        if self._hand_over is None:  # owner mode: no cache, nothing to store only once
            storing = self._storing
            for key in names:
                storing[key] = op
        self._storing_pages += count
        return _new_order(StoreOrder, (op, slots, pages, start))

    # ------------------------------------------------------------------ loads

    def lookup(self, lc: Lifecycle, first: int, hashes: Sequence[Hashable]) -> int:
        """Blocks of ``lc``'s request from block ``first`` on that the host cache holds
        (the longest cached run of ``hashes``); noted for ``load``. Counted as hit blocks.

        Raises:
            KeyError: ``lc`` is not a live lifecycle of this planner. Nothing changed.
            ValueError: ``first`` is negative. Nothing changed.
        """
        progress = self._progress[lc.serial]
        if first < 0:
            raise ValueError(f"a lookup from block {first} of {lc!r}: blocks count from 0")
        pages = self.cache.lookup(hashes) if hashes else []
        progress.hit = (first, pages)
        self._counts["hit_blocks"] += len(pages)
        return len(pages)

    def load(self, lc: Lifecycle, count: int, blocks: Sequence[Slot]) -> LoadOrder | None:
        """The engine took the first ``count`` blocks of the last ``lookup`` and allocated
        device blocks for them: plan the load of their host pages into them (the pages
        are pinned until it is over). ``blocks`` are all of the request's device blocks
        from its first (those the engine's own prefix cache supplied included), so the
        load writes ``blocks[first:first + count]``, ``first`` being the lookup's. ``None``
        when ``count`` is 0 (the lookup's note is dropped then too).

        Raises:
            ValueError: ``count`` is negative or exceeds the lookup's blocks, or ``blocks``
                ends before them. Nothing changed.
            InvalidTransitionError: the state refuses a copy (the registry's refusal,
                counted and audited). Nothing else changed.
        """
        progress = self._progress[lc.serial]
        first, pages = progress.hit or (0, [])
        slots = tuple(blocks[first : first + count])
        if count < 0 or count > len(pages) or len(slots) < count:
            raise ValueError(
                f"a load of {count} blocks from block {first} for {lc!r}: the lookup found "
                f"{len(pages)}, the request has {len(blocks)} device blocks"
            )
        if count == 0:
            progress.hit = None
            return None
        taken = tuple(pages[:count])
        ticket = self.registry.start_offload(lc, kind="load", blocks=count, first_block=first)
        progress.hit = None
        self.cache.pin(taken)
        op = ticket.op
        if self.overdue is not None:
            self.overdue.opened(ticket, "load")
        self._orders[op] = Order(ticket, slots, taken, (), True, first, progress)
        progress.ops.add(op)
        progress.covered = max(progress.covered, first + count)  # already on the host
        return _new_order(LoadOrder, (op, slots, taken, first))

    # ------------------------------------------------------------------ reports

    def report(self, op: int, ok: bool = True, count: int = 1, *, taken: bool = False) -> bool:
        """``count`` workers reported order ``op`` over (``ok``) or failed. When every
        worker reported it, its ticket is delivered (failed if any worker failed) and the
        order's pages go where they belong. Returns whether the order ended now. A report
        for an order already over is delivered again: the registry refuses, counts and
        audits it, and nothing else changes. So is the rest of a ``count`` larger than the
        workers the order still waits for (a worker that reported twice), after the order
        ended with the reports it waited for.

        ``taken`` (owner mode): the caller took the pages of the store that ends now
        (a copy hook that backs them up); the lifecycle does not keep them.

        Raises:
            UnknownOrderError: no order ``op`` was made (or it was forgotten). Nothing
                changed.
            ReportCountError: ``count`` is not a positive int. Nothing changed.
        """
        if type(count) is not int or count <= 0:
            raise ReportCountError(op, count)
        delivery = self._take_report(op, ok, count, taken)
        if delivery is None:
            return False
        ticket, delivered_ok, excess = delivery
        if self.registry.audited:
            self.registry.deliver(ticket, delivered_ok, job=op)
        else:
            self.registry.deliver(ticket, delivered_ok)
        if excess:
            self._refuse_over(op, ok)
        return True

    def report_many(
        self, done: Mapping[int, int], failed: Mapping[int, int] = _NO_REPORTS
    ) -> list[UnknownOrderError | ReportCountError]:
        """A step's reports at once: ``done`` and ``failed`` map copy numbers to how many
        workers reported them so (vLLM's worker metadata), taken in that order as
        ``report`` takes each, with every ticket they end delivered in one registry batch
        ([`apply()`][kvlife.fsm.registry.LifecycleRegistry.apply]): the same records and
        refusals as one ``report`` after another. Never raises for a report: returns an
        [`UnknownOrderError`][kvlife.offload.planner.UnknownOrderError] per copy number
        this planner never ordered and a
        [`ReportCountError`][kvlife.offload.planner.ReportCountError] per count that is
        not a positive int (neither report changed anything; the others were taken)."""
        problems: list[UnknownOrderError | ReportCountError] = []
        deliveries: list[tuple[Ticket, bool, int]] = []
        orders = self._orders
        pairs: tuple[tuple[Mapping[Any, object], bool], ...] = ((done, True), (failed, False))
        for reports, ok in pairs:
            for op, count in reports.items():
                # checked here, not by the call's types: a bad one is returned, never
                # raised between a batch's reports
                if type(count) is not int or count <= 0:
                    problems.append(ReportCountError(op, count))
                    continue
                if type(op) is not int:
                    problems.append(UnknownOrderError(op))
                    continue
                if deliveries and op not in orders:  # refused after the deliveries before it
                    self._deliver(deliveries)
                    deliveries = []
                try:
                    delivery = self._take_report(op, ok, count, False)
                except UnknownOrderError as exc:
                    problems.append(exc)
                    continue
                if delivery is not None:
                    deliveries.append((delivery[0], delivery[1], op))
                    if delivery[2]:  # more reports than workers: refused after the delivery
                        self._deliver(deliveries)
                        deliveries = []
                        self._refuse_over(op, ok)
        if deliveries:
            self._deliver(deliveries)
        return problems

    def _deliver(self, deliveries: list[tuple[Ticket, bool, int]]) -> None:
        """Deliver ``(ticket, ok, op)`` in one registry batch, in order."""
        registry, audited = self.registry, self.registry.audited
        if len(deliveries) == 1:  # a batch of one costs more than the single call
            ticket, ok, op = deliveries[0]
            if audited:
                registry.deliver(ticket, ok, job=op)
            else:
                registry.deliver(ticket, ok)
            return
        groups: list[tuple[Trigger, list[Ticket], list[dict[str, int] | None]]] = []
        for ticket, ok, op in deliveries:
            trigger = _ACK if ok else _FAIL
            if not groups or groups[-1][0] is not trigger:
                groups.append((trigger, [], []))
            groups[-1][1].append(ticket)
            groups[-1][2].append({"job": op} if audited else None)
        registry.apply(groups)  # refusals are counted and audited there

    def _take_report(
        self, op: int, ok: bool, count: int, taken: bool
    ) -> tuple[Ticket, bool, bool] | None:
        """``report``'s bookkeeping (``count`` is a positive int): returns the ticket to
        deliver, whether as done, and whether more workers reported than the order
        waited for (``None``: the order waits for more reports, or it was over: that
        report is refused here, see ``_refuse_over``)."""
        order = self._orders.get(op)
        if order is None:
            self._refuse_over(op, ok)
            return None
        waited = self.reporters - order.reported - order.failed
        if count < waited:
            if ok:
                order.reported += count
            else:
                order.failed += count
            return None
        if ok:
            order.reported += waited
        else:
            order.failed += waited
        del self._orders[op]
        ticket = order.ticket
        over = self._over
        over[op] = ticket.serial
        self._over_rids[op] = ticket.rid
        if len(over) > MAX_REMEMBERED_ORDERS:
            del self._over_rids[over.popitem(last=False)[0]]
        self._ended(op, order, taken)
        return ticket, order.failed == 0, count > waited

    def _refuse_over(self, op: int, ok: bool) -> None:
        """A report for order ``op``, which is over: delivered again, the registry refuses,
        counts and audits it (``duplicate_ack`` while its lifecycle lives,
        ``stale_instance`` after).

        Raises:
            UnknownOrderError: no order ``op`` was made, or it was forgotten.
        """
        serial = self._over.get(op)
        if serial is None:
            raise UnknownOrderError(op)
        self.registry.refuse_spent(self._over_rids[op], serial, op, ok)

    def order(self, op: int) -> Order:
        """The order ``op`` in flight (read it, never change it).

        Raises:
            KeyError: no order ``op`` is in flight.
        """
        return self._orders[op]

    def ops(self) -> list[int]:
        """The copy numbers of the orders in flight, oldest first."""
        return list(self._orders)

    def _ended(self, op: int, order: Order, taken: bool = False) -> None:
        order.progress.ops.discard(op)
        counts, failed = self._counts, order.failed > 0
        if order.load:
            self.cache.unpin(order.pages)  # no longer read
            if failed:
                counts["load_failures"] += 1
            else:
                counts["loads"] += 1
                counts["loaded_blocks"] += len(order.pages)
        else:
            if self._fences:
                self._lift_fences(op, block_ids(order.slots))
            self._storing_pages -= len(order.pages)
            owner = self._hand_over is not None
            if not owner:
                storing = self._storing
                for key in order.hashes:
                    if storing.get(key) == op:
                        del storing[key]
            if failed:  # the host copy is incomplete: its pages back
                counts["store_failures"] += 1
                self.allocator.free(order.pages)
                if owner:
                    progress = order.progress
                    if progress.failed_at is None or order.first < progress.failed_at:
                        progress.failed_at = order.first
            else:
                counts["stores"] += 1
                counts["stored_blocks"] += len(order.pages)
                if owner:
                    if not taken:  # the lifecycle keeps them until it is released
                        order.progress.kept.append(order)
                        self._kept_pages += len(order.pages)
                else:
                    if order.keep:
                        spare = self.cache.insert_all(order.hashes, order.pages)
                        if self._events is not None:
                            self._stored(order, spare)
                    else:  # ordered before a reset: the cache does not take it
                        spare = list(order.pages)
                    if spare:  # the same content was cached meanwhile
                        self.allocator.free(spare)

    def _lift_fences(self, op: int, slots: Iterable[int]) -> None:
        fences = self._fences
        for slot in slots:
            ops = fences.get(slot)
            if ops is not None:
                ops.discard(op)
                if not ops:
                    del fences[slot]

    def _released(self, lc: Lifecycle, req: Any) -> None:
        progress = self._progress.pop(lc.serial, None)
        if progress is None:
            return
        try:
            if self._hand_over is not None:
                self._hand(lc, req, progress, self._hand_over)
        finally:
            # Released means released: each kept Order points back at its Progress, a
            # cycle that would hold the request until the cyclic collector ran.
            progress.kept = []
            progress.req = None

    def _hand(self, lc: Lifecycle, req: Any, progress: Progress, hand_over: HandOver) -> None:
        kept = sorted(progress.kept, key=lambda order: order.first)
        self._kept_pages -= sum(len(order.pages) for order in kept)
        run: list[Order] = []
        if lc.outcome == "finished":  # the consecutive stores from its first block
            expected, failed_at = progress.start, progress.failed_at
            for order in kept:
                if order.first != expected or (failed_at is not None and order.first > failed_at):
                    break
                run.append(order)
                expected += len(order.pages)
        for order in kept[len(run) :]:
            self.allocator.free(order.pages)
        hand_over(lc, req, run)

    # ------------------------------------------------------------------ events

    def _stored(self, order: Order, spare: list[int]) -> None:
        events = self._events
        assert events is not None
        self._removed()  # what left the cache before these joined it comes first
        req = order.ticket.lifecycle.req
        if not spare:
            events.append(CacheEvent("stored", order.hashes, req, order.first))
            return
        # pages not taken: their content was cached already (no change to tell); the
        # others are told as runs of consecutive blocks
        left = set(spare)
        kept = [i for i, page in enumerate(order.pages) if page not in left]
        for start, count in page_runs(kept):
            keys = order.hashes[start : start + count]
            events.append(CacheEvent("stored", keys, req, order.first + start))

    def _removed(self) -> None:
        evicted, events = self.cache.evicted, self._events
        if evicted and events is not None:
            events.append(CacheEvent("removed", tuple(evicted), None, 0))
            evicted.clear()

    def take_events(self) -> list[CacheEvent]:
        """The changes of what the host cache holds since the last call, in order (empty
        when the planner was made without ``events``)."""
        if self._events is None:
            return []
        self._removed()
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ reset

    def reset(self) -> bool:
        """Empty the host cache of every page no copy reads: cached pages are freed, and
        stores in flight free their pages when they are over instead of caching them
        (their blocks may be stored again by any request meanwhile). Pages that loads
        read stay cached until the loads are over. Returns whether the cache is empty
        now (``False`` while loads or stores were in flight). Lifecycles, tickets and
        progress are untouched: blocks a request already covered are not stored again
        for it.
        """
        cache = self.cache
        if cache.evictable:
            victims = cache.evict(cache.evictable)
            assert victims is not None
            self.allocator.free(victims)
        stores = 0
        for order in self._orders.values():
            if not order.load:
                order.keep = False
                stores += 1
        self._storing.clear()
        return not stores and not len(cache)

    # ------------------------------------------------------------------ introspection

    @property
    def inflight(self) -> int:
        """Orders not yet reported by every worker."""
        return len(self._orders)

    def inflight_of(self, lc: Lifecycle) -> frozenset[int]:
        """The copy numbers of ``lc``'s orders in flight (empty once released)."""
        progress = self._progress.get(lc.serial)
        return frozenset(progress.ops) if progress is not None else frozenset()

    @property
    def fenced(self) -> frozenset[int]:
        """Device blocks of finished requests that stores in flight still read."""
        return frozenset(self._fences)

    def account(self) -> PageAccount:
        """Where every host page is now (free, cached, pinned by loads, written by stores
        in flight); the four sum to the capacity."""
        pinned = len(self.cache.pinned)
        return PageAccount(
            capacity=self.allocator.capacity,
            free=self.allocator.available,
            cached=len(self.cache) - pinned,
            pinned=pinned,
            storing=self._storing_pages,
            kept=self._kept_pages,
        )

    def counters(self) -> dict[str, int]:
        """Every counter since start (the keys of
        [`COUNTERS`][kvlife.offload.planner.COUNTERS])."""
        counts = dict(self._counts)
        counts["evictions"] = self.cache.stats.evictions
        refusals = self.registry.refusals
        counts["refusals"] = sum(refusals.values()) - refusals["overdue"]  # not a refusal
        return counts

    def __repr__(self) -> str:
        a = self.account()
        return (
            f"<OffloadPlanner {len(self._progress)} lifecycles, {len(self._orders)} orders "
            f"in flight, pages free={a.free} cached={a.cached} pinned={a.pinned} "
            f"storing={a.storing}>"
        )


__all__ = [
    "COUNTERS",
    "MAX_REMEMBERED_ORDERS",
    "CacheEvent",
    "LoadOrder",
    "OffloadPlanner",
    "Order",
    "PageAccount",
    "Progress",
    "ReportCountError",
    "StoreOrder",
    "UnknownOrderError",
    "block_ids",
]

"""The scheduler-facing API: offload running requests' KV as they decode.

Wiring, per scheduler step::

    manager.register(req)                 # when the request is admitted
    manager.step(req)                     # after each decode step, for running requests
    manager.poll()                        # once per step: deliver finished copies
    manager.finish(req) / manager.abort(req)

The engine answers four questions about a request through
[`KVSource`][kvlife.offload.manager.KVSource]: how many tokens have final KV, their token
ids, their device slots, and -- called *by kvlife* -- "you may hand this request's device
slots back now". kvlife calls ``release_slots`` only when no copy that reads them is in
flight (design §7.1).

Host pages: each copy gets its pages before it is launched; a copy that fails frees its
pages; an aborted request's pages are freed on release; a finished request's pages pass to
the ``on_release`` hooks in an [`OffloadResult`][kvlife.offload.manager.OffloadResult] (the hook
owns them and returns them
to the pool, ``manager.host.free(...)``, when done with them, e.g. after a backup). A
copy hook ([`on_copy()`][kvlife.offload.manager.OffloadManager.on_copy]) may instead take
each copy's pages as it completes (a backup that starts at once, as SGLang's does).

The manager is kvlife's two offload halves in one process: an
[`OffloadPlanner`][kvlife.offload.planner.OffloadPlanner] in owner mode (the registry, each
lifecycle's progress and kept copies, the host pages' account, the copies in flight) and
an [`OffloadWorker`][kvlife.offload.worker.OffloadWorker] over the copy engine (the
launches and, under tensor parallelism, the agreement of every rank on what is over).
What the manager adds is the engine's side: tokens and pages (a partial last page at
finish), page hashes, device slots and the hooks.

Page hashes: each full page offloaded gets a prefix hash, ``H(previous page's hash, its
token ids)``, so equal prefixes have equal hashes whichever request computed them. The
hash function is pluggable ([`PageHasher`][kvlife.offload.manager.PageHasher]): an engine
whose storage is keyed by its own hash chain (SGLang's HiCache) passes its own.
"""

from __future__ import annotations

import hashlib
import operator
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, cast

import torch

from kvlife.fsm.hooks import FirstError, run_all
from kvlife.fsm.registry import Lifecycle, LifecycleRegistry, Ticket
from kvlife.fsm.table import State, Trigger
from kvlife.offload.completion import poll_until_idle
from kvlife.offload.copy_engine import CopyEngine
from kvlife.offload.host_pool import HostPages
from kvlife.offload.planner import OffloadPlanner, Order, PageAccount, Progress
from kvlife.offload.worker import OffloadWorker


class KVSource(Protocol):
    """What kvlife needs to know from the engine about a request."""

    def committed(self, req: Any) -> int:
        """Tokens of ``req`` whose KV is final (will not be rewritten)."""
        ...

    def token_ids(self, req: Any, start: int, end: int) -> Sequence[int] | torch.Tensor:
        """Token ids of ``req`` in ``[start, end)``: ``end - start`` integers."""
        ...

    def slots(self, req: Any, start: int, end: int) -> Sequence[int] | torch.Tensor:
        """Device slot indices holding the KV of tokens ``[start, end)``: ``end - start``
        integers (a list, or an integer tensor), each in the pool's range."""
        ...

    def release_slots(self, req: Any, lifecycle: Lifecycle) -> None:
        """No copy reads the device slots ``req`` held under ``lifecycle`` any more: the
        engine may reuse them. (A re-admitted request has a newer lifecycle with slots of
        its own, which this call does not cover.)"""
        ...


PageHash: TypeAlias = bytes | str
"""A page's prefix hash: bytes for kvlife's own hasher, str (hex) for SGLang's."""


class PageHasher(Protocol):
    """How page hashes are chained (see the module's docstring)."""

    def seed(self, req: Any) -> PageHash | None:
        """The hash the request's first page chains from (``None``: no prior hash)."""
        ...

    def page(self, prior: PageHash | None, token_ids: Sequence[int]) -> PageHash:
        """The hash of a full page of ``token_ids`` that follows a page hashed ``prior``."""
        ...


class Blake2bPageHasher:
    """kvlife's default page hash: BLAKE2b-128 over the prior hash and the token ids as
    64-bit integers; the chain starts from ``b""``."""

    def seed(self, req: Any) -> bytes:
        """Every chain starts from the empty hash."""
        return b""

    def page(self, prior: PageHash | None, token_ids: Sequence[int]) -> bytes:
        """``blake2b(prior || int64 token ids, digest_size=16)``."""
        if isinstance(prior, str):
            prior = prior.encode()
        h = hashlib.blake2b(prior or b"", digest_size=16)
        h.update(array("q", token_ids).tobytes())
        return h.digest()


@dataclass(frozen=True)
class HostCopy:
    """One completed (acked) copy: ``tokens`` tokens from ``first_token`` in ``pages``.

    ``hashes`` holds one prefix hash per page: ``H(previous page's hash, token ids)`` for
    a full page, ``None`` for a partial last page.
    """

    first_token: int
    tokens: int
    pages: HostPages
    hashes: tuple[PageHash | None, ...]


@dataclass(frozen=True)
class OffloadResult:
    """What a release hook receives.

    For a finished request, ``copies`` are its host copies in token order (the longest
    run without a failed copy from its first offloaded token: 0, or ``start`` of
    ``register``) and the hook owns their pages. For an aborted request,
    ``copies`` is empty: kvlife already freed the pages.
    """

    rid: str
    serial: int
    outcome: str
    tokens: int
    copies: tuple[HostCopy, ...]

    @property
    def pages(self) -> list[HostPages]:
        """Every copy's pages, in token order."""
        return [c.pages for c in self.copies]


@dataclass
class OffloadStats:
    """Counters of one manager."""

    copies_launched: int = 0
    copies_acked: int = 0
    copies_failed: int = 0
    tokens_offloaded: int = 0
    bytes_offloaded: int = 0
    skipped_no_host_memory: int = 0
    refused_deliveries: int = 0
    copies_taken: int = 0


class _Chain:
    """What the manager keeps with a lifecycle's planner progress (``Progress.note``)."""

    __slots__ = ("end", "prev")

    def __init__(self, prev: PageHash | None) -> None:
        self.prev = prev  # the hash the next page chains from
        self.end = 0  # tokens flushed at finish (the partial last page's end), else 0


ReleaseHook = Callable[[Any, OffloadResult], None]
CopyHook = Callable[[Any, Lifecycle, HostCopy], bool]


_SOURCE_METHODS = ("committed", "token_ids", "slots", "release_slots")
"""What a ``KVSource`` must have."""


class OffloadManager:
    """Offloads requests' KV into host pages and drives their lifecycles.

    Args:
        source: the engine's [`KVSource`][kvlife.offload.manager.KVSource].
        copier: the [`CopyEngine`][kvlife.offload.copy_engine.CopyEngine] (device KV -> host pool).
        stride_pages: offload once this many full pages are waiting (and at finish).
        registry: the lifecycle registry to use (a new one if ``None``).
        group: a ``torch.distributed`` group for tensor-parallel agreement.
        page_hash: the [`PageHasher`][kvlife.offload.manager.PageHasher] (kvlife's
            [`Blake2bPageHasher`][kvlife.offload.manager.Blake2bPageHasher] if ``None``).
        whole_strides: offload only whole multiples of ``stride_pages`` pages at a step
            (SGLang's decode offload chunks this way); by default every waiting full page
            goes once ``stride_pages`` are waiting.

    Raises:
        ValueError: ``stride_pages`` is not a positive int.
        TypeError: ``source`` lacks one of ``KVSource``'s methods, ``copier`` is not a
            ``CopyEngine``, or ``page_hash`` lacks ``seed`` or ``page``. Nothing built.
    """

    def __init__(
        self,
        source: KVSource,
        copier: CopyEngine,
        *,
        stride_pages: int = 4,
        registry: LifecycleRegistry | None = None,
        group: Any = None,
        page_hash: PageHasher | None = None,
        whole_strides: bool = False,
    ) -> None:
        if not isinstance(stride_pages, int) or stride_pages <= 0:
            raise ValueError(f"stride_pages must be a positive int, got {stride_pages!r}")
        hasher = Blake2bPageHasher() if page_hash is None else page_hash
        if not callable(getattr(hasher, "page", None)) or not callable(
            getattr(hasher, "seed", None)
        ):
            raise TypeError(f"page_hash needs .seed(req) and .page(prior, ids), got {hasher!r}")
        lacking = [m for m in _SOURCE_METHODS if not callable(getattr(source, m, None))]
        if lacking:
            raise TypeError(
                f"source must be a KVSource (with {', '.join(_SOURCE_METHODS)}); "
                f"{source!r} lacks {', '.join(lacking)}"
            )
        if not isinstance(copier, CopyEngine):
            raise TypeError(f"copier must be a CopyEngine, got {copier!r}")
        self.page_hash: PageHasher = hasher
        self.whole_strides = bool(whole_strides)
        self.source = source
        self.copier = copier
        self.host = copier.host
        self.page_size = copier.layout.page_size
        self.stride_pages = stride_pages
        #: The scheduler half (owner mode, over the host pool's own page accounting).
        self.planner = OffloadPlanner(
            self.host.allocator, registry=registry, hand_over=self._released
        )
        self.registry = self.planner.registry
        #: The worker half (the copies, and every rank's agreement under ``group``).
        self.worker = OffloadWorker.over(copier, group=group)
        self.stats = OffloadStats()
        self._hooks: list[ReleaseHook] = []
        self._copy_hooks: list[CopyHook] = []

    def on_release(self, hook: ReleaseHook) -> ReleaseHook:
        """Call ``hook(req, result)`` when a request's lifecycle is released (after kvlife
        handed its device slots back). Usable as a decorator.

        Every hook runs even when an earlier one (or ``release_slots``) raised: a hook
        that frees host pages must never be skipped. After all ran, the first exception
        is raised from the call that released the lifecycle (``poll``, ``finish``,
        ``abort``); ``poll`` delivers every other completed copy first. The release
        itself stays applied and audited.
        """
        if not callable(hook):
            raise TypeError(f"on_release needs a callable, got {hook!r}")
        self._hooks.append(hook)
        return hook

    def on_copy(self, hook: CopyHook) -> CopyHook:
        """Call ``hook(req, lifecycle, copy)`` as each copy completes without error, before
        its ticket is delivered. A hook that returns ``True`` *takes* the copy: it owns
        ``copy.pages`` from then on (and frees them with ``manager.host.free``), and the
        copy is not part of the request's
        [`OffloadResult`][kvlife.offload.manager.OffloadResult]. At most one hook should
        take a copy; hooks after the one that took it still see it. Usable as a decorator.

        A hook that raises has not taken the copy: the manager keeps the pages, the other
        hooks run, the ticket is delivered, and the first exception is raised from
        ``poll`` after the other completed copies were delivered.
        """
        if not callable(hook):
            raise TypeError(f"on_copy needs a callable, got {hook!r}")
        self._copy_hooks.append(hook)
        return hook

    # ------------------------------------------------------------------ scheduler calls

    def register(self, req: Any, rid: str | None = None, *, start: int = 0) -> Lifecycle:
        """Register an admitted request (see
        [`LifecycleRegistry.register()`][kvlife.fsm.registry.LifecycleRegistry.register]).

        ``start``: tokens before it are not offloaded by this manager (a prefill node
        stored them already); it must be a whole number of pages, and those pages are
        hashed (not copied) so that the hash chain of what is offloaded continues theirs.

        Raises:
            ValueError: ``start`` is negative or not a multiple of the page size, or the
                engine gave the wrong number of token ids for it. Nothing registered.
            DuplicateRegistrationError: ``req``'s lifecycle has not finished. This and
                the other errors of ``LifecycleRegistry.register`` (``TypeError``,
                ``RidConflictError``, ``WrongThreadError``) leave nothing registered.
        """
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"start must be a non-negative int, got {start!r}")
        if start % self.page_size:
            raise ValueError(
                f"start={start} is not a whole number of pages of {self.page_size} tokens"
            )
        prev = self.page_hash.seed(req)
        if start:
            ids = self.source.token_ids(req, 0, start)
            if len(ids) != start:
                raise ValueError(f"token_ids gave {len(ids)} ids for {start} tokens")
            _, prev = self._hash_pages(prev, ids)
        lc = self.planner.admit(req, rid, covered=start // self.page_size)
        self.planner.progress(lc).note = _Chain(prev)
        return lc

    def step(self, req: Any) -> Ticket | None:
        """Offload ``req``'s newly committed full pages once ``stride_pages`` are waiting.

        Returns the copy's ticket, or ``None`` when nothing was offloaded (too few pages,
        or host memory exhausted: then nothing changed and the pages are tried again at
        the next step).

        Raises:
            UnknownRequestError: ``req`` has no live lifecycle here (counted and audited
                as a refused ``start_offload``).
            InvalidTransitionError: ``req``'s lifecycle already finished or aborted.
            ValueError: the engine's answers (slots, token ids) do not fit the copy
                (as many of each as tokens, slots in range), or ``committed`` is
                negative. Nothing changed.
            TypeError: the engine's slots, token ids or ``committed`` are not
                integers. Nothing changed.
        """
        lc = self.registry.lifecycle(req, audit_as=Trigger.START_OFFLOAD)
        if lc.outcome is not None:  # finished or aborted: refused, audited, nothing changes
            self.registry.require(lc, Trigger.START_OFFLOAD)
        progress = self.planner.progress(lc)
        full = self._committed(req) // self.page_size
        waiting = full - progress.covered
        if waiting < self.stride_pages:
            return None
        if self.whole_strides:
            full = progress.covered + waiting // self.stride_pages * self.stride_pages
        return self._offload(lc, progress, full * self.page_size)

    def finish(self, req: Any, *, flush: bool = True) -> Lifecycle:
        """Flush the rest of ``req``'s committed tokens (a partial last page included),
        then finish. The lifecycle releases when every copy resolved; then kvlife calls
        ``release_slots`` and the hooks. If host memory is exhausted the flush is skipped
        (counted) and the request finishes with what was offloaded. With
        ``flush=False`` nothing more is copied (what was not offloaded is dropped).

        Raises:
            UnknownRequestError: ``req`` has no live lifecycle here (counted and audited
                as a refused ``finish``).
            InvalidTransitionError: ``req``'s lifecycle already finished or aborted.
            ValueError: the engine's answers do not fit the flush, or ``committed``
                is negative. Nothing changed.
            TypeError: the engine's slots, token ids or ``committed`` are not
                integers. Nothing changed.
        """
        lc = self.registry.lifecycle(req, audit_as=Trigger.FINISH)
        self.registry.require(lc, Trigger.FINISH)
        if flush:
            progress = self.planner.progress(lc)
            committed = self._committed(req)
            if committed > progress.covered * self.page_size:
                self._offload(lc, progress, committed)
        return self.registry.finish(lc)

    def abort(self, req: Any) -> Lifecycle:
        """Abort ``req``: no flush; its host pages are freed on release.

        Raises:
            UnknownRequestError: ``req`` has no live lifecycle here (counted and audited
                as a refused ``abort``).
            InvalidTransitionError: ``req``'s lifecycle already finished or aborted.
        """
        return self.registry.abort(self.registry.lifecycle(req, audit_as=Trigger.ABORT))

    def poll(self) -> int:
        """Deliver every finished copy (agreed by all ranks under TP); return how many.
        With a process group, every rank must call ``poll`` the same number of times."""
        first = FirstError()  # deliver the others first: they are done too
        reports = self.worker.reports()
        for op, ok in reports:
            with first:
                self._completed(op, ok)
        first.reraise()
        return len(reports)

    def drain(self, timeout_s: float = 60.0) -> int:
        """Poll until no copy is in flight.

        Raises:
            TimeoutError: copies are still in flight after ``timeout_s`` seconds.
        """
        return poll_until_idle(self.poll, lambda: self.planner.inflight, timeout_s)

    @property
    def inflight(self) -> int:
        """Copies launched and not yet delivered."""
        return self.planner.inflight

    @property
    def inflight_requests(self) -> Mapping[int, Any]:
        """The copies in flight: copy number -> request (a read-only live view of the
        planner's orders)."""
        return _InflightRequests(self.planner)

    # ------------------------------------------------------------------ internals

    def _committed(self, req: Any) -> int:
        """The engine's ``committed(req)`` as an int (a numpy or torch integer taken as
        its value), refused otherwise: a float or a string would reach the page
        arithmetic and the copy's bounds."""
        given = self.source.committed(req)
        try:
            committed = operator.index(given)
        except TypeError:
            raise TypeError(
                f"committed() must give an integer count of tokens, got {given!r} "
                f"({type(given).__name__})"
            ) from None
        if committed < 0:
            raise ValueError(f"committed() gave {committed} tokens")
        return committed

    def _offload(self, lc: Lifecycle, progress: Progress, end: int) -> Ticket | None:
        # step and finish let only a lifecycle that may start a copy get here (the
        # planner's store refuses any other, audited)
        chain: _Chain = progress.note
        size = self.page_size
        first_page = progress.covered
        start = first_page * size
        tokens = end - start
        n_pages = -(-tokens // size)
        req = progress.req
        # everything the copy needs, read and checked before it is ordered: a bad answer
        # from the engine raises here and changes nothing
        given = self.source.slots(req, start, end)
        if len(given) != tokens:  # check() takes any count that fills the pages
            raise ValueError(f"slots gave {len(given)} slots for {tokens} tokens")
        slots = self.copier.check(given, n_pages)
        ids = self.source.token_ids(req, start, end)
        if len(ids) != tokens:
            raise ValueError(f"token_ids gave {len(ids)} ids for {tokens} tokens")
        hashes, prev_hash = self._hash_pages(chain.prev, ids)
        detail: dict[str, int | str] | None = None
        if self.registry.audited:
            detail = {
                "kind": "store",
                "tokens": tokens,
                "blocks": n_pages,
                "first_block": first_page,
            }
        order = self.planner.store_owned(lc, first_page + n_pages, hashes, detail=detail)
        if order is None:  # no host memory: nothing changed, tried again later
            self.stats.skipped_no_host_memory += 1
            return None
        chain.prev = prev_hash
        if tokens % size:
            chain.end = end
        self.stats.copies_launched += 1
        ticket = self.planner.order(order.op).ticket
        # the worker copies the checked token slots into the order's pages
        self.worker.store([order._replace(slots=slots)], checked=True)  # type: ignore[arg-type]
        return ticket

    def _hash_pages(
        self, prev: PageHash | None, ids: Sequence[int] | torch.Tensor
    ) -> tuple[tuple[PageHash | None, ...], PageHash | None]:
        hashes: list[PageHash | None] = []
        size = self.page_size
        page_hash = self.page_hash.page
        if isinstance(ids, torch.Tensor):  # engines often keep token ids in a tensor
            ids = ids.tolist()
        for first in range(0, len(ids), size):
            page = ids[first : first + size]
            if len(page) < size:
                hashes.append(None)  # a partial page is not content-addressable yet
                break
            prev = page_hash(prev, page)
            hashes.append(prev)
        return tuple(hashes), prev

    def _tokens(self, order: Order) -> int:
        """The tokens a store copies (its last page may be the flush's partial one)."""
        if order.hashes[-1] is None:  # the flush's partial last page
            return int(order.progress.note.end) - order.first * self.page_size
        return len(order.pages) * self.page_size

    def _copy(self, order: Order) -> HostCopy:
        """The host copy a completed store made."""
        hashes = cast("tuple[PageHash | None, ...]", order.hashes)
        pages = self.host.pages(order.pages)
        return HostCopy(order.first * self.page_size, self._tokens(order), pages, hashes)

    def _completed(self, op: int, ok: bool) -> None:
        try:
            order = self.planner.order(op)
        except KeyError:  # pragma: no cover - a worker reports each copy once
            self.stats.refused_deliveries += 1
            return
        taken = False
        first = FirstError()  # the other hooks and the delivery still run
        if ok:
            if self._copy_hooks:  # the host copy is built for the hooks only
                copy = self._copy(order)
                req, lc = order.progress.req, order.ticket.lifecycle
                for hook in list(self._copy_hooks):
                    with first:
                        taken = bool(hook(req, lc, copy)) or taken
            if taken:
                self.stats.copies_taken += 1
            tokens = self._tokens(order)
            self.stats.copies_acked += 1
            self.stats.tokens_offloaded += tokens
            self.stats.bytes_offloaded += tokens * self.copier.layout.bytes_per_token
        else:
            self.stats.copies_failed += 1
        with first:  # delivers the ticket; a release runs the release hooks from here
            self.planner.report(op, ok, taken=taken)
        first.reraise()

    def _released(self, lc: Lifecycle, req: Any, kept: list[Order]) -> None:
        """The planner's hand-over: ``lc`` released, ``kept`` its run of stores (ours)."""
        copies = tuple(self._copy(order) for order in kept)
        result = OffloadResult(
            lc.rid, lc.serial, lc.outcome or "", sum(c.tokens for c in copies), copies
        )
        first = FirstError()  # the next hook may be the one that frees pages
        with first:
            # no copy of this lifecycle is in flight any more: the device slots may go back
            self.source.release_slots(req, lc)
        with first:
            run_all(self._hooks, req, result)
        first.reraise()

    def lifecycle_state(self, req: Any) -> State:
        """The state of ``req``'s current lifecycle."""
        return self.registry.lifecycle(req).state

    def account(self) -> PageAccount:
        """Where the host pages are (see
        [`OffloadPlanner.account()`][kvlife.offload.planner.OffloadPlanner.account]):
        free, written by copies in flight, kept by live requests; the rest were handed to
        the hooks."""
        return self.planner.account()


class _InflightRequests(Mapping[int, Any]):
    """[`OffloadManager.inflight_requests`][kvlife.offload.manager.OffloadManager.inflight_requests]:
    read from the planner's orders, nothing kept twice."""

    def __init__(self, planner: OffloadPlanner) -> None:
        self._planner = planner

    def __len__(self) -> int:
        return self._planner.inflight

    def __iter__(self) -> Iterator[int]:
        return iter(self._planner.ops())

    def __getitem__(self, op: int) -> Any:
        return self._planner.order(op).progress.req

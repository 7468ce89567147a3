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

Page hashes: each full page offloaded gets a prefix hash, ``H(previous page's hash, its
token ids)``, so equal prefixes have equal hashes whichever request computed them. The
hash function is pluggable ([`PageHasher`][kvlife.offload.manager.PageHasher]): an engine
whose storage is keyed by its own hash chain (SGLang's HiCache) passes its own.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import torch

from kvlife.fsm.hooks import FirstError, run_all
from kvlife.fsm.registry import Lifecycle, LifecycleRegistry, Ticket
from kvlife.fsm.table import State, Trigger
from kvlife.offload.completion import CompletionQueue
from kvlife.offload.copy_engine import CopyEngine, CopyJob
from kvlife.offload.host_pool import HostPages


class KVSource(Protocol):
    """What kvlife needs to know from the engine about a request."""

    def committed(self, req: Any) -> int:
        """Tokens of ``req`` whose KV is final (will not be rewritten)."""
        ...

    def token_ids(self, req: Any, start: int, end: int) -> Sequence[int] | torch.Tensor:
        """Token ids of ``req`` in ``[start, end)``."""
        ...

    def slots(self, req: Any, start: int, end: int) -> Sequence[int] | torch.Tensor:
        """Device slot indices holding the KV of tokens ``[start, end)``."""
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


@dataclass
class _Progress:
    """The manager's bookkeeping of one lifecycle (keyed by its serial, never its rid)."""

    req: Any
    start: int = 0  # tokens before it were stored elsewhere (register(start=...))
    launched: int = 0  # tokens whose copy was launched (acked, failed or in flight)
    prev_hash: PageHash | None = b""
    inflight: dict[int, HostCopy] = field(default_factory=dict)  # op -> copy
    acked: list[HostCopy] = field(default_factory=list)
    failed_at: int | None = None  # first token of the earliest failed copy


ReleaseHook = Callable[[Any, OffloadResult], None]
CopyHook = Callable[[Any, Lifecycle, HostCopy], bool]


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
        self.page_hash: PageHasher = hasher
        self.whole_strides = bool(whole_strides)
        self.source = source
        self.copier = copier
        self.host = copier.host
        self.page_size = copier.layout.page_size
        self.stride_pages = stride_pages
        self.registry = registry if registry is not None else LifecycleRegistry()
        self.queue = CompletionQueue(copier.streams, group=group)
        self.stats = OffloadStats()
        self._progress: dict[int, _Progress] = {}
        self._hooks: list[ReleaseHook] = []
        self._copy_hooks: list[CopyHook] = []
        self.registry.on_release(self._released)

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
        lc = self.registry.register(req, rid)
        self._progress[lc.serial] = _Progress(req, start=start, launched=start, prev_hash=prev)
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
        """
        lc = self.registry.lifecycle(req, audit_as=Trigger.START_OFFLOAD)
        if lc.outcome is not None:  # finished or aborted: refused, audited, nothing changes
            self.registry.require(lc, Trigger.START_OFFLOAD)
        progress = self._progress[lc.serial]
        full_end = self.source.committed(req) // self.page_size * self.page_size
        waiting = (full_end - progress.launched) // self.page_size
        if waiting < self.stride_pages:
            return None
        if self.whole_strides:
            full_end = progress.launched + (
                waiting // self.stride_pages * self.stride_pages * self.page_size
            )
        return self._offload(lc, progress, full_end)

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
        """
        lc = self.registry.lifecycle(req, audit_as=Trigger.FINISH)
        self.registry.require(lc, Trigger.FINISH)
        if flush:
            progress = self._progress[lc.serial]
            committed = self.source.committed(req)
            if committed > progress.launched:
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
        return self.queue.poll()

    def drain(self, timeout_s: float = 60.0) -> int:
        """Poll until no copy is in flight."""
        return self.queue.drain(timeout_s=timeout_s)

    @property
    def inflight(self) -> int:
        """Copies launched and not yet delivered."""
        return len(self.queue)

    @property
    def inflight_requests(self) -> Mapping[int, Any]:
        """The copies in flight: copy number -> request (a read-only live view; its length
        is ``inflight``, a lookup scans the live lifecycles)."""
        return _InflightRequests(self)

    # ------------------------------------------------------------------ internals

    def _offload(self, lc: Lifecycle, progress: _Progress, end: int) -> Ticket | None:
        self.registry.require(lc, Trigger.START_OFFLOAD)
        start = progress.launched
        tokens = end - start
        n_pages = -(-tokens // self.page_size)
        pages = self.host.alloc(n_pages)
        if pages is None:
            self.stats.skipped_no_host_memory += 1
            return None
        req = progress.req
        try:
            slots = self.source.slots(req, start, end)
            ids = self.source.token_ids(req, start, end)
            if len(ids) != tokens:
                raise ValueError(f"token_ids gave {len(ids)} ids for {tokens} tokens")
            hashes, prev_hash = self._hash_pages(progress.prev_hash, ids)
            job = self.copier.launch(slots, pages)
        except BaseException:
            self.host.free(pages)  # nothing was launched: nothing changes
            raise
        # the copy's event is recorded (or the copy ran): only now issue its ticket
        if self.registry.audited:
            ticket = self.registry.start_offload(lc, tokens=tokens, pages=n_pages, first=start)
        else:  # no record is built: no detail to build and check either
            ticket = self.registry.start_offload(lc)
        progress.launched = end
        progress.prev_hash = prev_hash
        progress.inflight[ticket.op] = HostCopy(start, tokens, pages, hashes)
        self.stats.copies_launched += 1
        self.queue.push(job, lambda job: self._completed(ticket, job))
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

    def _completed(self, ticket: Ticket, job: CopyJob) -> None:
        lc = ticket.lifecycle
        progress = self._progress.get(lc.serial)
        copy = progress.inflight.pop(ticket.op, None) if progress is not None else None
        if progress is None or copy is None:  # pragma: no cover - a queue delivers once
            self.stats.refused_deliveries += 1
            return
        ok = job.error is None
        first = FirstError()  # the other hooks and the delivery still run
        if ok:
            taken = False
            for hook in list(self._copy_hooks):
                with first:
                    taken = bool(hook(progress.req, lc, copy)) or taken
            if taken:
                self.stats.copies_taken += 1
            else:
                progress.acked.append(copy)
            self.stats.copies_acked += 1
            self.stats.tokens_offloaded += copy.tokens
            self.stats.bytes_offloaded += copy.tokens * self.copier.layout.bytes_per_token
        else:
            self.host.free(copy.pages)
            self.stats.copies_failed += 1
            if progress.failed_at is None or copy.first_token < progress.failed_at:
                progress.failed_at = copy.first_token
        reason = self.registry.deliver(ticket, ok=ok)
        if reason is not None:  # pragma: no cover - only if the registry was driven behind our back
            self.stats.refused_deliveries += 1
        first.reraise()

    def _released(self, lc: Lifecycle, req: Any) -> None:
        progress = self._progress.pop(lc.serial, None)
        if progress is None:  # a lifecycle this manager did not register
            return
        acked = sorted(progress.acked, key=lambda c: c.first_token)
        kept: list[HostCopy] = []
        if lc.outcome == "finished":
            expected = progress.start
            for copy in acked:
                if copy.first_token != expected or (
                    progress.failed_at is not None and copy.first_token > progress.failed_at
                ):
                    break
                kept.append(copy)
                expected += copy.tokens
        for copy in acked[len(kept) :]:
            self.host.free(copy.pages)
        result = OffloadResult(
            lc.rid,
            lc.serial,
            lc.outcome or "",
            sum(c.tokens for c in kept),
            tuple(kept),
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


class _InflightRequests(Mapping[int, Any]):
    """[`OffloadManager.inflight_requests`][kvlife.offload.manager.OffloadManager.inflight_requests]:
    read from the manager's own bookkeeping, nothing kept twice."""

    def __init__(self, manager: OffloadManager) -> None:
        self._manager = manager

    def __len__(self) -> int:
        return self._manager.inflight

    def __iter__(self) -> Iterator[int]:
        for progress in list(self._manager._progress.values()):
            yield from list(progress.inflight)

    def __getitem__(self, op: int) -> Any:
        for progress in self._manager._progress.values():
            if op in progress.inflight:
                return progress.req
        raise KeyError(op)

"""A fake serving engine for offload tests: real torch KV tensors, a slot allocator, and
assertions that kvlife never hands device slots back while a copy that reads them is in
flight."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlife.fsm import Lifecycle, State
from kvlife.offload import CopyEngine, CopyJob, HostPagePool, HostPages, KVLayout, OffloadManager


class EngineInvariantError(AssertionError):
    """The fake engine caught kvlife breaking a promise (design §7.1)."""


@dataclass
class Admission:
    """One admission of a request: its lifecycle, tokens and device slots."""

    lifecycle: Lifecycle
    seed: int
    token_ids: list[int] = field(default_factory=list)
    slot_ids: list[int] = field(default_factory=list)
    written: list[torch.Tensor] = field(default_factory=list)  # [C, E] per token


class FakeEngine:
    """Implements :class:`kvlife.offload.KVSource` over real CPU tensors."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        host_pages: int = 256,
        chunk_pages: int = 4,
        streams: int = 1,
        defer: bool = False,
        stride_pages: int = 2,
        group: Any = None,
        registry: Any = None,
        device: str = "cpu",
    ) -> None:
        self.layout = layout
        self.kv = layout.allocate(device)
        self.views = layout.component_views(self.kv)
        self.free_slots: list[int] = list(range(layout.slots - 1, -1, -1))
        self.current: dict[int, Admission] = {}  # id(req) -> current admission
        self.admissions: dict[int, Admission] = {}  # serial -> admission, kept for checks
        self.released_serials: list[int] = []
        self.host = HostPagePool(layout, host_pages, pin_memory=device != "cpu")
        self.copier = CopyEngine(
            layout, self.kv, self.host, chunk_pages=chunk_pages, streams=streams, defer=defer
        )
        self.jobs: list[tuple[CopyJob, list[int]]] = []
        launch = self.copier.launch

        def recording_launch(slots: Any, pages: HostPages, **how: Any) -> CopyJob:
            job = launch(slots, pages, **how)
            self.jobs.append((job, [int(s) for s in slots]))
            return job

        self.copier.launch = recording_launch  # type: ignore[method-assign]
        self.manager = OffloadManager(
            self, self.copier, stride_pages=stride_pages, group=group, registry=registry
        )
        self.results: list[tuple[Any, Any]] = []
        self.manager.on_release(lambda req, result: self.results.append((req, result)))
        self._seeds = 0

    # --- engine side ------------------------------------------------------------------

    def admit(self, req: Any) -> Lifecycle:
        lc = self.manager.register(req)
        self._seeds += 1
        admission = Admission(lc, self._seeds)
        self.current[id(req)] = admission
        self.admissions[lc.serial] = admission
        return lc

    def decode(self, req: Any, n: int = 1) -> None:
        """Commit ``n`` tokens: take slots, write their KV."""
        admission = self.current[id(req)]
        gen = torch.Generator().manual_seed(admission.seed * 100_003 + len(admission.token_ids))
        for _ in range(n):
            if not self.free_slots:
                raise RuntimeError("device KV pool exhausted")
            slot = self.free_slots.pop()
            shape = (self.layout.components, self.layout.elems)
            # kept on the CPU: the bytes the host pages must end up holding
            values = torch.randn(shape, generator=gen).to(self.layout.dtype)
            for c, view in enumerate(self.views):
                view[slot] = values[c].to(view.device)
            admission.token_ids.append(admission.seed * 1000 + len(admission.token_ids))
            admission.slot_ids.append(slot)
            admission.written.append(values)

    def inflight_slots(self) -> set[int]:
        """Slots read by copies that have not finished."""
        # a deferred copy has not read its slots yet, whatever query() says
        return {s for job, slots in self.jobs if job.deferred or not job.query() for s in slots}

    # --- KVSource ----------------------------------------------------------------------

    def committed(self, req: Any) -> int:
        return len(self.current[id(req)].token_ids)

    def token_ids(self, req: Any, start: int, end: int) -> Sequence[int]:
        return self.current[id(req)].token_ids[start:end]

    def slots(self, req: Any, start: int, end: int) -> Sequence[int]:
        return self.current[id(req)].slot_ids[start:end]

    def release_slots(self, req: Any, lifecycle: Lifecycle) -> None:
        admission = self.admissions[lifecycle.serial]
        if lifecycle.serial in self.released_serials:
            raise EngineInvariantError(f"slots of {lifecycle!r} handed back twice")
        if lifecycle.state is not State.RELEASED or lifecycle.inflight:
            raise EngineInvariantError(f"slots handed back while {lifecycle!r} is not released")
        busy = self.inflight_slots() & set(admission.slot_ids)
        if busy:
            raise EngineInvariantError(f"slots {sorted(busy)} handed back while a copy reads them")
        for slot in admission.slot_ids:  # scribble: a late reader would copy garbage
            for view in self.views:
                view[slot] = float("nan") if view.dtype.is_floating_point else -1
        self.free_slots.extend(admission.slot_ids)
        self.released_serials.append(lifecycle.serial)

    # --- checks ------------------------------------------------------------------------

    def run_all(self) -> None:
        """Run every deferred copy (in launch order)."""
        for job, _ in self.jobs:
            if job.deferred:
                job.run()


def host_matches(engine: FakeEngine, result: Any, admission: Admission) -> bool:
    """Whether the host pages of ``result`` hold exactly the KV written for its tokens."""
    for copy in result.copies:
        got = engine.host.read_tokens(copy.pages, copy.tokens)
        want = torch.stack(admission.written[copy.first_token : copy.first_token + copy.tokens], 1)
        if not torch.equal(got, want):
            return False
    return True

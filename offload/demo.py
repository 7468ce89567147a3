"""The main job: a realistic decode workload offloading KV through kvlife.

A scheduler admits requests with random prompt and output lengths into a device KV pool of
real torch tensors, decodes one token per running request per step, offloads committed pages
through an [`OffloadManager`][kvlife.offload.manager.OffloadManager], aborts some requests,
and reuses request ids at once. On CPU, copies are held back and released in random order
over four streams (on CUDA they complete asynchronously on their own). A small, labelled
share of faults is injected: copies that fail, and a buggy component that re-delivers old
tickets. Everything is audited; the result is a summary and an audit log.

Run it through ``kvlife demo`` (which also draws the diagrams) or `run_workload()`.
"""

from __future__ import annotations

import random
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from kvlife.fsm.audit import JsonLinesSink, MemorySink
from kvlife.fsm.registry import Lifecycle, LifecycleRegistry, Ticket
from kvlife.fsm.table import State
from kvlife.offload.copy_engine import CopyEngine, CopyJob
from kvlife.offload.host_pool import HostPagePool, HostPages
from kvlife.offload.layout import KVLayout
from kvlife.offload.manager import OffloadManager, OffloadResult


class SlotReuseError(AssertionError):
    """The engine was told to reuse device slots that an in-flight copy still reads."""


@dataclass
class DemoRequest:
    """An engine request. Equality is by rid, as in many engines: kvlife must not care."""

    rid: str
    prompt: int
    output: int
    token_base: int  # its token ids derive from it (the admission number)
    generated: int = 0
    abort_at: int | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DemoRequest) and other.rid == self.rid

    def __hash__(self) -> int:
        return hash(self.rid)


class DemoEngine:
    """A serving engine's KV side: a slot allocator over real tensors, and the
    [`KVSource`][kvlife.offload.manager.KVSource] answers kvlife needs. It checks kvlife's promise:
    slots handed back are read by no copy in flight."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self.kv = layout.allocate(device)
        self.views = layout.component_views(self.kv)
        self.device = device
        self.free: list[int] = list(range(layout.slots - 1, -1, -1))
        self.slots_of: dict[int, list[int]] = {}  # lifecycle serial -> its slots
        self.current: dict[int, int] = {}  # id(req) -> serial of its current admission
        self.reading: dict[int, list[int]] = {}  # id(job) -> slots it reads, while in flight
        self.jobs: dict[int, CopyJob] = {}

    def admit(self, req: Any, lc: Lifecycle) -> None:
        self.current[id(req)] = lc.serial
        self.slots_of[lc.serial] = []

    def commit(self, req: Any, n: int, gen: torch.Generator) -> None:
        """Write the KV of ``n`` new tokens into free slots (prefill or decode)."""
        if n > len(self.free):
            raise RuntimeError("device KV pool exhausted")
        slots = [self.free.pop() for _ in range(n)]
        self.slots_of[self.current[id(req)]].extend(slots)
        index = torch.tensor(slots, device=self.device)
        values = torch.randn((n, self.layout.elems), generator=gen).to(self.layout.dtype)
        values = values.to(self.device)
        for view in self.views:
            view.index_copy_(0, index, values)

    def watch(self, copier: CopyEngine) -> None:
        """Record which slots each copy reads until it finishes."""
        launch = copier.launch

        def watched(
            slots: Sequence[int] | torch.Tensor, pages: HostPages, *, checked: bool = False
        ) -> CopyJob:
            job = launch(slots, pages, checked=checked)
            self.jobs[id(job)] = job
            self.reading[id(job)] = [int(s) for s in slots]
            return job

        copier.launch = watched  # type: ignore[method-assign]

    def untrack_finished(self) -> None:
        for key in [k for k, job in self.jobs.items() if job.query()]:
            del self.jobs[key], self.reading[key]

    # KVSource
    def committed(self, req: Any) -> int:
        return len(self.slots_of[self.current[id(req)]])

    def token_ids(self, req: Any, start: int, end: int) -> Sequence[int]:
        return [(req.token_base * 7919 + i) % 50_000 for i in range(start, end)]

    def slots(self, req: Any, start: int, end: int) -> Sequence[int]:
        return self.slots_of[self.current[id(req)]][start:end]

    def release_slots(self, req: Any, lifecycle: Lifecycle) -> None:
        slots = self.slots_of.pop(lifecycle.serial)
        self.untrack_finished()
        busy = {s for read in self.reading.values() for s in read} & set(slots)
        if busy or lifecycle.state is not State.RELEASED:
            raise SlotReuseError(f"{lifecycle!r}: slots {sorted(busy)[:8]} still being read")
        self.free.extend(slots)


@dataclass
class DemoConfig:
    """Knobs of the workload."""

    requests: int = 300
    seed: int = 0
    device: str = "cpu"
    rids: int = 24  # distinct rids: reuse is constant
    max_running: int = 12
    prompt: tuple[int, int] = (16, 192)
    output: tuple[int, int] = (8, 96)
    abort_rate: float = 0.12
    fail_rate: float = 0.02  # injected: copies that fail
    redeliver_rate: float = 0.01  # injected: a buggy component re-delivers an old ticket
    stride_pages: int = 2
    host_pages: int = 140  # tight enough that host memory sometimes runs out
    backup_steps: int = 6  # steps a finished request's host pages are kept before freeing


@dataclass
class DemoSummary:
    """What the workload did."""

    config: DemoConfig
    steps: int = 0
    wall_s: float = 0.0
    lifecycles: int = 0
    released: int = 0
    live_at_end: int = 0
    finished: int = 0
    aborted: int = 0
    rid_reuses_in_flight: int = 0
    #: The first rids registered again while a copy of their old lifecycle was in flight.
    reused_rids: list[str] = field(default_factory=list)
    #: Completions of old tickets the demo delivered again on purpose (each one refused).
    redelivered: int = 0
    transitions: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    copies: int = 0
    copies_failed: int = 0
    skipped_no_host_memory: int = 0
    bytes_offloaded: int = 0
    audit_records: int = 0
    device: str = "cpu"

    def table(self) -> str:
        """The summary as an aligned two-column table."""
        mib = self.bytes_offloaded / 2**20
        rate = self.bytes_offloaded / self.wall_s / 2**20 if self.wall_s else 0.0
        rows = [
            ("device", self.device),
            ("scheduler steps", f"{self.steps}"),
            (
                "lifecycles (registered / released / live)",
                f"{self.lifecycles} / {self.released} / {self.live_at_end}",
            ),
            ("outcomes (finished / aborted)", f"{self.finished} / {self.aborted}"),
            ("rid reused while its old copy was in flight", f"{self.rid_reuses_in_flight}"),
            ("accepted transitions", f"{self.transitions}"),
        ]
        rows.append(("completions re-delivered on purpose", f"{self.redelivered}"))
        for reason, n in sorted(self.refusals.items()):
            rows.append((f"refused: {reason}", f"{n}"))
        rows += [
            ("copies (acked+failed / failed, injected)", f"{self.copies} / {self.copies_failed}"),
            ("offloads skipped: host memory exhausted", f"{self.skipped_no_host_memory}"),
            ("KV offloaded", f"{mib:.1f} MiB"),
            (
                "throughput (whole run)",
                f"{rate:.1f} MiB/s, {self.transitions / self.wall_s:.0f} transitions/s"
                if self.wall_s
                else "-",
            ),
            ("audit records", f"{self.audit_records}"),
            ("wall time", f"{self.wall_s:.2f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def explanation(self, audit_log: str, out: str) -> str:
        """What the figures mean and what to run next on the demo's audit log."""
        refused = sum(self.refusals.values())
        which = (
            f"All {refused} refusals come"
            if refused == self.redelivered
            else f"{self.redelivered} of the {refused} refusals come"
        )
        paragraphs = [
            f"{which} from completions the demo delivers again on purpose after they were "
            "delivered (a late or repeated CUDA event, the bug class kvlife exists for): "
            "kvlife refused each one (duplicate_ack while the lifecycle was live, "
            "stale_instance after its release), changed nothing and audited it.",
            f"{self.rid_reuses_in_flight} times a finished request's rid was given to a new "
            "request while a copy of the old one was still in flight: a rid-keyed "
            "bookkeeping would have applied that copy's completion to the new request.",
        ]
        lines = [textwrap.fill(p, 92) for p in paragraphs]
        if self.reused_rids:
            shown = ", ".join(self.reused_rids)
            first = self.reused_rids[0]
            lines += [
                f"Rids reused that way (first {len(self.reused_rids)}): {shown}. Next:",
                f"  kvlife audit why {audit_log} --rid {first} -o {out}/story-{first}.svg",
                f"  kvlife audit timeline {audit_log} -o {out}/timeline-{first}.png --rid {first}",
                f"  kvlife audit report {audit_log} -o {out}/report.html",
            ]
        else:
            lines.append(f"Next: kvlife audit report {audit_log} -o {out}/report.html")
        return "\n".join(lines)


def demo_layout(device: torch.device) -> KVLayout:
    """4 layers, K+V, 4 heads, dim 64, bf16 (4 KiB per token), 16-token pages."""
    return KVLayout(
        "per_layer", layers=4, slots=8192, heads=4, head_dim=64, dtype=torch.bfloat16, page_size=16
    )


def run_workload(
    config: DemoConfig,
    *,
    sinks: Sequence[Any] = (),
    progress: Callable[[int, int], None] | None = None,
) -> DemoSummary:
    """Run the workload; every record goes to ``sinks``. Deterministic for a seed on CPU."""
    rng = random.Random(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    device = torch.device(config.device)
    layout = demo_layout(device)
    engine = DemoEngine(layout, device)
    host = HostPagePool(layout, config.host_pages, pin_memory=device.type == "cuda")
    cpu = device.type == "cpu"
    copier = CopyEngine(layout, engine.kv, host, chunk_pages=8, streams=4, defer=cpu)
    engine.watch(copier)
    _inject_failures(copier, engine, rng, config.fail_rate)
    registry = LifecycleRegistry(sinks=list(sinks))
    counter = MemorySink(capacity=1)  # only to count records cheaply
    registry.attach(counter)
    manager = OffloadManager(engine, copier, stride_pages=config.stride_pages, registry=registry)
    summary = DemoSummary(config, device=str(device))
    backups: list[tuple[int, list[HostPages]]] = []  # (free at step, pages)

    def released(req: Any, result: OffloadResult) -> None:
        if result.outcome == "finished":
            summary.finished += 1
            backups.append((summary.steps + config.backup_steps, result.pages))
        else:
            summary.aborted += 1

    manager.on_release(released)
    pending_rids = list(range(config.rids))
    running: list[DemoRequest] = []
    old_tickets: list[Ticket] = []
    admitted = 0
    start = time.perf_counter()
    while admitted < config.requests or running or manager.inflight:
        summary.steps += 1
        # admit: a finished request's rid is free again at once
        while admitted < config.requests and len(running) < config.max_running and pending_rids:
            rid = f"req-{pending_rids.pop(rng.randrange(len(pending_rids)))}"
            req = DemoRequest(
                rid, rng.randint(*config.prompt), rng.randint(*config.output), token_base=admitted
            )
            if rng.random() < config.abort_rate:
                req.abort_at = rng.randint(0, req.output)
            holder = registry.live(rid)
            if holder is not None and holder.inflight:
                summary.rid_reuses_in_flight += 1
                if len(summary.reused_rids) < 5 and rid not in summary.reused_rids:
                    summary.reused_rids.append(rid)
            lc = manager.register(req)
            engine.admit(req, lc)
            engine.commit(req, req.prompt, gen)  # prefill
            running.append(req)
            admitted += 1
        # decode one token per running request, offload what is committed
        for req in list(running):
            if req.abort_at is not None and req.generated >= req.abort_at:
                manager.abort(req)
            elif req.generated >= req.output:
                manager.finish(req)
            else:
                engine.commit(req, 1, gen)
                req.generated += 1
                ticket = manager.step(req)
                if ticket is not None:
                    old_tickets.append(ticket)
                continue
            running.remove(req)
            pending_rids.append(int(req.rid.split("-")[1]))
        if cpu:  # completions held back, released in random order
            for job in [j for j in engine.jobs.values() if j.deferred]:
                if rng.random() < 0.5:
                    job.run()
        if old_tickets and rng.random() < config.redeliver_rate * len(running):
            registry.deliver(rng.choice(old_tickets))  # injected bug: refused, audited
            summary.redelivered += 1
        manager.poll()
        while backups and backups[0][0] <= summary.steps:
            for pages in backups.pop(0)[1]:
                host.free(pages)
        if progress is not None:
            progress(admitted, config.requests)
        if device.type == "cuda" and not running and manager.inflight:
            torch.cuda.synchronize(device)
    for _, pages_list in backups:
        for pages in pages_list:
            host.free(pages)
    summary.wall_s = time.perf_counter() - start
    stats = registry.statistics()
    summary.lifecycles = stats.registered
    summary.released = stats.released
    summary.live_at_end = len(registry)
    summary.transitions = stats.transitions
    summary.refusals = {k: v for k, v in stats.refusals.items() if v}
    summary.copies = manager.stats.copies_acked + manager.stats.copies_failed
    summary.copies_failed = manager.stats.copies_failed
    summary.skipped_no_host_memory = manager.stats.skipped_no_host_memory
    summary.bytes_offloaded = manager.stats.bytes_offloaded
    last = counter.records()
    summary.audit_records = last[-1].seq + 1 if last else 0
    registry.flush()
    return summary


def _inject_failures(
    copier: CopyEngine, engine: DemoEngine, rng: random.Random, rate: float
) -> None:
    """Make a share of CPU copies raise when they run (the fail path, on purpose)."""
    if rate <= 0 or copier.cuda:
        return

    def sometimes_failing() -> None:
        if rng.random() < rate:
            raise RuntimeError("injected copy failure")

    copier.before_cpu_copy = sometimes_failing


def text_progress(stream: TextIO = sys.stderr) -> Callable[[int, int], None]:
    """A progress bar on ``stream`` (redrawn in place on a terminal, sparse otherwise)."""
    tty = stream.isatty()
    last = [-1]

    def show(done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if pct == last[0] or (not tty and pct % 25 and pct != 100):
            return
        last[0] = pct
        bar = "#" * (pct // 4) + "." * (25 - pct // 4)
        lead = "\r" if tty else ""
        stream.write(f"{lead}[{bar}] {pct:3d}% {done}/{total} requests admitted")
        if not tty or pct == 100:
            stream.write("\n")
        stream.flush()

    return show


def open_audit(path: str) -> JsonLinesSink:
    """A fresh JSON-lines audit file for the demo."""
    return JsonLinesSink(path, fsync="batch")

"""``kvlife sglang exercise``: a conformance run of SGLang's hierarchical cache, for
SGLang's developers before a release and for operators before an upgrade.

It builds SGLang's real ``UnifiedRadixCache`` with its ``HybridCacheController`` on the CPU
([`cpu`][kvlife.offload.watch.sglang.cpu]: SGLang's pools, tree cores and controller;
a CPU allocation and a torch copy stand in for the host pinning and the transfer kernel),
puts kvlife's HiCache lens on it, and drives seeded workloads through *families* of
schedules that break caches: prefixes shared and split while their write is in flight,
eviction pressure on device and host, acks held back, requests aborted while their
load-back is in flight, the write-back policy. Each run checks what a serving engine needs
of its cache:

* no exception from the cache (the exception and its innermost frame);
* every copy acked: after the workload every request ends and the exercise polls until
  the cache has no write or load pending (a lost ack keeps its node pending and locked
  for ever);
* no lock left: the cache's protected size is 0 once every request has ended;
* every device and host page back: after evicting everything, the device allocator and
  the host pool are as large as when built (a leak is a page count);
* a load-back brings back its own tokens (each token's device K holds its id);
* kvlife's audit log of the run checks clean (each verdict with the node it names and the
  ``kvlife audit why`` command that tells its story).

Each family runs on both tree cores (``python`` and ``rust``); ``storage`` adds an L3 tier
(SGLang's ``HiCacheFile`` backend in a directory of its own per run), waiting for each
backup and each prefetch to end (SGLang's ``wait_complete`` prefetch policy) so that a run
is the same run to run. What it does not cover:
tensor parallelism (see ``kvlife audit ranks``), a GPU (the CUDA kernels and the pinned
host pool), storage backends other than the file one.

Why one module: it is one run of SGLang's cache (families, the workload, one run's
checks, the report and the command), as ``kvlife.offload.watch.vllm.exercise`` is for
vLLM; the cache built on the CPU is ``cpu``'s, the lens ``lens``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import sys
import time
import traceback
import warnings
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlife.offload.watch.exercise_cli import (
    add_run_options,
    listed,
    print_reports,
    progress_line,
    run_counts_error,
)
from kvlife.offload.watch.sglang.cpu import CORES, PAGE, CpuCache, build

#: polls after the workload for every copy to be acked
DRAIN_POLLS = 64


@dataclass(frozen=True)
class Family:
    """One kind of schedule that breaks caches: what the workload does."""

    name: str
    #: what the family does, for the report
    what: str
    policy: str = "write_through"
    device_tokens: int = 128
    host_ratio: float = 2.0
    #: the share of prompts that branch off another prompt's first pages
    branch: float = 0.0
    #: per step, the chance that the step ends without a poll (copies stay pending)
    skip_poll: float = 0.0
    #: each ack held back this many polls (a range), delivered in order
    hold: tuple[int, int] = (0, 0)
    #: per step, the chance that one live request is aborted, wherever it is
    abort: float = 0.0
    #: an L3 tier (SGLang's ``HiCacheFile`` backend): backups after each write to host,
    #: and a request whose prompt is not all on device or host prefetches the rest
    storage: bool = False


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("basic", "requests, matches, device eviction to host, load-backs, host evictions"),
        Family(
            "prefix",
            "prompts branch off others' first pages, inserted while the shared node's write "
            "is pending: nodes split mid-write",
            branch=0.6,
            skip_poll=0.4,
        ),
        Family(
            "pressure",
            "a device pool of 48 tokens and a host pool as large: evictions to host and host "
            "evictions on most steps",
            device_tokens=48,
            host_ratio=1.0,
        ),
        Family(
            "hold",
            "every ack held back 1-6 polls, delivered in order (a slow copy stream)",
            hold=(1, 6),
        ),
        Family(
            "abort",
            "one request in three steps aborted wherever it is: before its load-back is "
            "submitted, while it is in flight, after its ack",
            abort=0.35,
            hold=(0, 3),
        ),
        Family(
            "write_back",
            "the write-back policy: a node is written to host when it is evicted",
            policy="write_back",
            skip_poll=0.3,
        ),
        Family(
            "storage",
            "an L3 tier (HiCacheFile): every write to host backed up to storage, requests "
            "prefetch what is only there, one prefetch in three aborted while in flight",
            device_tokens=48,
            host_ratio=1.0,
            abort=0.35,
            storage=True,
        ),
    )
}


class ExerciseError(ValueError):
    """A bad family, core or count: nothing ran."""


# -- one run --------------------------------------------------------------------------------


class _HeldEvent:
    """An ack's event that reports ready only from poll ``due`` on (a slow copy); a
    blocking wait on it completes it."""

    def __init__(self, event: Any, clock: list[int], due: int) -> None:
        self.event, self.clock, self.due = event, clock, due

    def query(self) -> bool:
        return self.clock[0] >= self.due and bool(self.event.query())

    def synchronize(self) -> None:
        self.due = 0
        self.event.synchronize()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.event, name)


@dataclass
class _Request:
    tokens: list[int]
    lock: Any
    ends: int  # the step it finishes at (unless aborted first)


#: seconds a storage backup or prefetch may take before the run says it never ended
STORAGE_WAIT_S = 5.0


@dataclass(kw_only=True)
class Did:
    """What runs did, for the report (a run's, or a family's summed by
    [`count()`][kvlife.offload.watch.sglang.exercise.Did.count])."""

    requests: int = 0
    aborts: int = 0
    #: copies started, by ticket kind
    copies: dict[str, int] = field(default_factory=dict)
    splits: int = 0
    host_frees: int = 0
    writes_without_pages: int = 0
    prefetches: int = 0
    #: tokens prefetches brought from storage into host memory
    prefetched: int = 0

    def count(self, other: Did) -> None:
        """Add what ``other`` did."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for kind, n in other.copies.items():
            self.copies[kind] = self.copies.get(kind, 0) + n


_SUMMED = tuple(f.name for f in dataclasses.fields(Did) if f.name != "copies")


@dataclass
class RunResult(Did):
    """One run: what it did and what went wrong (``failed`` when anything did)."""

    family: str
    core: str
    seed: int
    log: str
    #: ``Type: message`` of an exception, and its innermost frame
    raised: str = ""
    raised_at: str = ""
    #: node ids still pending after the drain
    undrained: list[int] = field(default_factory=list)
    #: tokens still locked after every request ended
    locked: int = 0
    #: device and host pages not back after everything was evicted
    leaked_device: int = 0
    leaked_host: int = 0
    #: tokens whose load-back brought back other tokens
    wrong_bytes: list[int] = field(default_factory=list)
    #: verdict kind -> the rids it names
    verdicts: dict[str, list[str]] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(
            self.raised
            or self.undrained
            or self.locked
            or self.leaked_device
            or self.leaked_host
            or self.wrong_bytes
            or self.verdicts
        )


def why_command(log: str, rid: str) -> str:
    """The command that tells ``rid``'s story in ``log``."""
    return f"kvlife audit why {log} --rid {rid}"


def _innermost(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f"{Path(last.filename).name}:{last.lineno} in {last.name}"


class _Run:
    """The workload of one run on one cache."""

    def __init__(self, hc: CpuCache, family: Family, seed: int, result: RunResult) -> None:
        self.hc, self.family, self.result = hc, family, result
        self.rng = random.Random(seed)
        self.clock = [0]  # polls so far
        self.live: list[_Request] = []
        self.step = 0
        self.prompts = [[100 * f + i for i in range(PAGE * 6)] for f in range(1, 6)]

    def tokens(self) -> list[int]:
        rng = self.rng
        prompt = rng.choice(self.prompts)
        if rng.random() < self.family.branch:  # its first pages, then its own
            return prompt[: PAGE * rng.randint(1, 3)] + [t + 50 for t in prompt[: PAGE * 2]]
        return prompt[: PAGE * rng.randint(1, 6)]

    def poll(self) -> None:
        """One poll; with an L3 tier, polled again until the backups it started are acked
        (the backend's thread writes them: waiting keeps a run the same run to run)."""
        self._poll()
        cache = self.hc.cache
        if not self.family.storage:
            return
        deadline = time.monotonic() + STORAGE_WAIT_S
        while cache.ongoing_backup and time.monotonic() < deadline:
            time.sleep(0.001)
            cache.check_hicache_events()

    def _poll(self) -> None:
        hc, cc = self.hc, self.hc.cache.cache_controller
        hc.cache.ready_to_load_host_cache()
        cc.start_writing()  # what the poll would submit first: its acks are held too
        low, high = self.family.hold
        if high:
            for queue in (cc.ack_write_queue, cc.ack_load_queue):
                for i, ack in enumerate(queue):
                    if not isinstance(ack.finish_event, _HeldEvent):
                        due = self.clock[0] + self.rng.randint(low, high)
                        queue[i] = ack._replace(
                            finish_event=_HeldEvent(ack.finish_event, self.clock, due)
                        )
        hc.cache.check_hicache_events()
        self.clock[0] += 1

    def prefetch(self, tokens: list[int]) -> bool:
        """What the scheduler does for a request whose prompt is not all on device or
        host: prefetch the rest from storage, then wait for it (here, until it is done, so
        that a run is the same run to run); or abort the request while its prefetch is in
        flight. ``False``: the request was aborted."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: PLC0415

        cache = self.hc.cache
        m = self.hc.match(tokens)
        matched = m.device_prefix_len + m.host_hit_length
        anchor = m.last_host_node
        if matched >= len(tokens) or not (cache.is_backuped(anchor) or cache.is_root(anchor)):
            return True
        handle = CacheRequestHandle(f"req{self.result.requests}", 0)
        cache.prefetch_from_storage(
            handle,
            anchor,
            array("q", tokens[matched:]),
            cache.get_last_hash_value(anchor),
            None,
            matched_prefix_tokens=array("q", tokens[:matched]),
        )
        if handle not in cache.ongoing_prefetch:
            return True  # nothing to fetch (too short, or storage has none of it)
        self.result.prefetches += 1
        if self.rng.random() < self.family.abort:
            cache.release_aborted_request(handle)
            self.result.aborts += 1
            self.result.requests += 1
            return False
        deadline = time.monotonic() + STORAGE_WAIT_S
        while not cache.check_prefetch_progress(handle):  # wait_complete: until all is in
            if time.monotonic() > deadline:
                raise TimeoutError(f"a prefetch from storage did not end in {STORAGE_WAIT_S} s")
            self.poll()
            time.sleep(0.001)
        self.result.prefetched += int(cache.pop_prefetch_loaded_tokens(handle))
        return True

    def begin(self) -> None:
        """A request: prefetch from storage what is only there, match its prompt, load
        back what is on host only, lock its prefix."""
        hc = self.hc
        tokens = self.tokens()
        if self.family.storage and not self.prefetch(tokens):
            return
        m = hc.match(tokens)
        if m.host_hit_length:
            hc.cache.load_back(m.best_match_node)
            m = hc.match(tokens)
        lock = hc.cache.lock(m.last_device_node)
        self.live.append(_Request(tokens, lock, self.step + self.rng.randint(0, 4)))
        self.result.requests += 1

    def end(self, request: _Request, abort: bool) -> None:
        """A request ends: finished, its KV is cached (inserted); aborted, it is not."""
        self.live.remove(request)
        if not abort:
            self.hc.insert(request.tokens)
        else:
            self.result.aborts += 1
        self.hc.cache.unlock(request.lock)

    def run(self, steps: int) -> None:
        rng, hc, family = self.rng, self.hc, self.family
        for self.step in range(steps):
            op = rng.random()
            if op < 0.4:
                self.begin()
            elif op < 0.55:
                hc.match(self.tokens())
            elif op < 0.75:
                hc.evict(PAGE * rng.randint(1, 8))
            elif op < 0.85:
                hc.load_back(self.tokens())
            else:
                hc.evict_host(PAGE * rng.randint(1, 4))
            for request in [r for r in self.live if r.ends <= self.step]:
                self.end(request, abort=False)
            if self.live and not family.storage and rng.random() < family.abort:
                self.end(rng.choice(self.live), abort=True)
            if rng.random() < family.skip_poll:
                continue
            self.poll()
            self.check_bytes()

    def check_bytes(self) -> None:
        """The device pages of a live request's prefix hold its own tokens (loads are
        submitted by the poll: their copies are done)."""
        for request in self.live:
            if self.hc.match(request.tokens).device_prefix_len:
                got = self.hc.device_tokens(request.tokens)
                if got != request.tokens[: len(got)] and not self.result.wrong_bytes:
                    self.result.wrong_bytes = request.tokens[: len(got)]

    def drain(self) -> None:
        """Every request ends, every held ack is let go, polls until nothing is pending;
        then what is still locked, pending, or not back in the pools."""
        hc, result = self.hc, self.result
        for request in list(self.live):
            self.end(request, abort=False)
        self.family = dataclasses.replace(self.family, hold=(0, 0))
        self.clock[0] += 1_000_000  # every held ack is due
        cache = hc.cache
        for _ in range(DRAIN_POLLS):
            if not cache.ongoing_write_through and not cache.ongoing_load_back:
                break
            self.poll()
        result.undrained = sorted({*cache.ongoing_write_through, *cache.ongoing_load_back})
        result.locked = int(cache.protected_size())
        if result.undrained or result.locked:
            return  # pages of a pending copy or a locked node cannot come back
        hc.evict(hc.device_tokens_total)
        result.leaked_device = hc.device_tokens_total - int(hc.allocator.available_size())
        host = hc.host_pool()
        hc.evict_host(int(host.size))
        result.leaked_host = int(host.size) - int(host.available_size())


def run_one(
    family: Family,
    core: str,
    seed: int,
    steps: int,
    directory: Path,
    tamper: Callable[[CpuCache], None] | None = None,
) -> RunResult:
    """One run of ``family`` on the ``core`` tree core: the cache built, the lens on it
    (its log in ``directory``), the workload, the drain and the checks. ``tamper`` (for
    kvlife's own tests) is given the cache, lens on, before the workload."""
    from kvlife.fsm.audit.checker import check_audit  # noqa: PLC0415
    from kvlife.fsm.audit.reader import read_audit  # noqa: PLC0415
    from kvlife.offload.watch.sglang import HiCacheLens, attach  # noqa: PLC0415

    log = directory / f"{family.name}-{core}-{seed}.jsonl"
    result = RunResult(family.name, core, seed, str(log))
    storage = directory / f"l3-{family.name}-{core}-{seed}" if family.storage else None
    if storage is not None:
        shutil.rmtree(storage, ignore_errors=True)  # a run starts with storage empty
        storage.mkdir(parents=True)
    hc = build(
        core,
        family.policy,
        device_tokens=family.device_tokens,
        host_ratio=family.host_ratio,
        storage_dir=None if storage is None else str(storage),
    )
    hc.cache.prefetch_threshold = PAGE
    hc.cache.prefetch_stop_policy = "wait_complete"  # a prefetch brings all it finds
    witness = f"SGLang UnifiedRadixCache ({family.name}, {core} core, seed {seed})"
    lens = attach(hc.cache, HiCacheLens(log, witness))
    run = _Run(hc, family, seed, result)
    try:
        if tamper is not None:
            tamper(hc)
        run.run(steps)
        run.drain()
    except Exception as exc:  # the report says what and where, the next run goes on
        result.raised = f"{type(exc).__name__}: {exc}"[:300]
        result.raised_at = _innermost(exc)
    finally:
        hc.cache.release_host_resources()  # closes the lens's log
        if storage is not None:
            shutil.rmtree(storage, ignore_errors=True)
    result.copies = dict(lens.counts.copies)
    result.splits = lens.counts.splits
    result.host_frees = lens.counts.host_frees
    result.writes_without_pages = lens.counts.writes_without_pages
    for violation in check_audit(read_audit(log)).violations:
        result.verdicts.setdefault(violation.kind, []).append(str(violation.rid))
    return result


# -- many runs, the report ----------------------------------------------------------------


@dataclass
class FamilyReport(Did):
    """A family's runs on one tree core, summed up: each kind of failure with how often
    and the first seed that shows it."""

    family: str
    core: str
    what: str
    runs: int = 0
    failed: int = 0
    #: what went wrong -> (runs, the first seed, what it said)
    failures: dict[str, tuple[int, int, str]] = field(default_factory=dict)

    def add(self, run: RunResult) -> None:
        self.runs += 1
        self.count(run)
        if not run.failed:
            return
        self.failed += 1
        found: list[tuple[str, str]] = []
        if run.raised:
            found.append((f"raised {run.raised.split(':', 1)[0]} at {run.raised_at}", run.raised))
        if run.undrained:
            found.append(("never acked", f"nodes {run.undrained} still pending after the drain"))
        if run.locked:
            found.append(("lock left", f"{run.locked} tokens still locked after every request"))
        if run.leaked_device or run.leaked_host:
            found.append(
                (
                    "pages leaked",
                    f"{run.leaked_device} device, {run.leaked_host} host token(s) not back",
                )
            )
        if run.wrong_bytes:
            found.append(("wrong bytes", f"a load-back of {run.wrong_bytes[:8]}... brought others"))
        for kind, rids in run.verdicts.items():
            found.append((f"verdict {kind}", f"{rids[0]}: {why_command(run.log, rids[0])}"))
        for key, said in found:
            count, seed, text = self.failures.get(key, (0, run.seed, said))
            self.failures[key] = (count + 1, seed, text)

    def lines(self) -> list[str]:
        copies = ", ".join(
            f"{n} {kind.replace('_', ' ')}" for kind, n in sorted(self.copies.items())
        )
        lines = [
            f"{self.family} ({self.core} core): {self.runs} runs, {self.failed} failed "
            f"({self.what})",
            f"  did: {self.requests} requests, {self.aborts} aborted; copies: {copies or 'none'}; "
            f"{self.splits} nodes split mid-write, {self.host_frees} host frees, "
            f"{self.writes_without_pages} writes that found no host pages",
        ]
        if self.prefetches:
            lines.append(
                f"  storage: {self.prefetches} prefetches, {self.prefetched} tokens brought "
                "into host memory"
            )
        for key, (count, seed, text) in self.failures.items():
            lines.append(f"  {key} in {count} run(s), first seed {seed}: {text}")
        return lines


def exercise(
    families: Sequence[str],
    cores: Sequence[str],
    seeds: Sequence[int],
    steps: int,
    directory: Path,
    progress: Callable[[str, int, int], None] | None = None,
    tamper: Callable[[CpuCache], None] | None = None,
) -> tuple[list[FamilyReport], list[RunResult]]:
    """Every family on every core over every seed: the reports and every run. A failing
    run's log stays in ``directory``; a clean run's is removed.

    Raises:
        ExerciseError: an unknown family or core; nothing ran.
    """
    unknown = [f for f in families if f not in FAMILIES] + [c for c in cores if c not in CORES]
    if unknown:
        raise ExerciseError(
            f"unknown {unknown}: families are {', '.join(FAMILIES)}; cores {', '.join(CORES)}"
        )
    directory.mkdir(parents=True, exist_ok=True)
    reports, runs = [], []
    for name in families:
        for core in cores:
            report = FamilyReport(name, core, FAMILIES[name].what)
            for i, seed in enumerate(seeds):
                run = run_one(FAMILIES[name], core, seed, steps, directory, tamper)
                report.add(run)
                runs.append(run)
                if not run.failed:
                    Path(run.log).unlink(missing_ok=True)
                if progress is not None:
                    progress(f"{name} ({core})", i + 1, len(seeds))
            reports.append(report)
    return reports, runs


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlife sglang exercise [--families ...] [--cores ...] [--seeds N] [--seed S]
    [--steps N] [--out DIR] [--json]``: exit 0 when every run is clean, 1 when one failed,
    2 for bad arguments (one line)."""
    parser = argparse.ArgumentParser(
        prog="kvlife sglang exercise",
        description="Drive SGLang's hierarchical cache (UnifiedRadixCache with HiCache, on "
        "the CPU) through the schedules that break caches, with kvlife's lens on it, and "
        "check what a serving engine needs of it.",
    )
    add_run_options(parser, FAMILIES)
    parser.add_argument("--cores", default=",".join(CORES), help="tree cores (default: both)")
    args = parser.parse_args(argv)
    error = run_counts_error(args, "kvlife sglang exercise")
    if error:
        print(error, file=sys.stderr)
        return 2
    families, cores, out = listed(args.families), listed(args.cores), Path(args.out)
    progress = progress_line()

    with warnings.catch_warnings():  # SGLang's imports warn of quantizations needing CUDA
        warnings.simplefilter("ignore")
        import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401, PLC0415

    try:
        reports, runs = exercise(
            families, cores, range(args.seed, args.seed + args.seeds), args.steps, out, progress
        )
    except ExerciseError as exc:
        print(f"kvlife sglang exercise: {exc}", file=sys.stderr)
        return 2
    title = f"kvlife sglang exercise: SGLang's HiCache on the CPU, {args.steps} steps a run"
    return print_reports(reports, runs, title, as_json=args.json, out=out)


__all__ = [
    "FAMILIES",
    "Did",
    "ExerciseError",
    "Family",
    "FamilyReport",
    "RunResult",
    "exercise",
    "main",
    "run_one",
    "why_command",
]

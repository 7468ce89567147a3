"""The HiCache lens's cost on the cache's hot calls, side by side in one process: SGLang
0.5.23's ``UnifiedRadixCache`` on the CPU alone, and the same with the lens (writing its
log to a temporary file), in alternating rounds after one that is not kept. Prints, per
call and tree core, the median time per call of each and their ratio.

    make bench-sglang      (or: .venv-sglang/bin/python -m tests.engines.hicache_bench)

The calls: ``match_prefix`` (a prefix on device), ``insert`` (of a prefix already cached:
the tree's answer, no new copy), ``check_hicache_events`` with nothing to ack (one
scheduler step's poll), and a whole step of a seeded workload (inserts with write-through,
evictions, load-backs, host evictions, each with its poll)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from tests.engines import hicache_harness as H

from kvlife.fsm.native import describe
from kvlife.offload.watch.sglang import HiCacheLens, attach

TOKENS = list(range(100, 124))


def _per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _caches(core: str, tmp: Path) -> tuple[H.HiCache, H.HiCache]:
    alone, lensed = H.build(core), H.build(core)
    attach(lensed.cache, HiCacheLens(tmp / f"bench-{core}.jsonl", "bench"))
    for hc in (alone, lensed):
        hc.insert(TOKENS)
        hc.poll()
    return alone, lensed


def turns(rounds: int) -> Iterator[tuple[int, bool]]:
    """``(round, lens on)`` in the order the runs go: round -1 first, whose runs are not
    kept (the first runs of a process are slower), then each round's two runs, the one
    with the lens first every other round."""
    for r in range(-1, rounds):
        yield from ((r, True), (r, False)) if r % 2 else ((r, False), (r, True))


def measure(core: str, rounds: int, calls: int, tmp: Path) -> dict[str, tuple[float, float]]:
    """Per call name: (median us alone, median us with the lens)."""
    alone, lensed = _caches(core, tmp)
    calls_of = {
        "match_prefix": lambda hc: lambda: hc.match(TOKENS),
        "insert (cached)": lambda hc: lambda: hc.insert(TOKENS),
        "check_hicache_events": lambda hc: hc.cache.check_hicache_events,
    }
    out: dict[str, tuple[float, float]] = {}
    for name, make in calls_of.items():
        each = (make(alone), make(lensed))
        times: tuple[list[float], list[float]] = ([], [])
        for r, lens_on in turns(rounds):
            took = _per_call(each[lens_on], calls)
            if r >= 0:
                times[lens_on].append(took)
        out[name] = (statistics.median(times[0]), statistics.median(times[1]))
    steps: tuple[list[float], list[float]] = ([], [])
    for r, lens_on in turns(rounds):
        hc = H.build(core)
        if lens_on:
            attach(hc.cache, HiCacheLens(tmp / f"bench-{core}-{r}.jsonl", "bench"))
        start = time.perf_counter()
        H.run_workload(hc, seed=max(r, 0), steps=60, check_bytes=False)
        if r >= 0:
            steps[lens_on].append((time.perf_counter() - start) / 61 * 1e6)
        hc.cache.release_host_resources()
    out["workload step"] = (statistics.median(steps[0]), statistics.median(steps[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    print(
        f"HiCache lens cost, SGLang 0.5.23 on CPU, medians of {args.rounds} alternating "
        f"rounds; kvlife {describe()}"
    )
    print(f"{'core':6} {'call':22} {'alone us':>9} {'lens us':>9} {'ratio':>6}")
    worst = {"hot": 0.0, "step": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        for core in H.CORES:
            for name, (a, b) in measure(core, args.rounds, args.calls, Path(tmp)).items():
                ratio = b / a
                kind = "step" if name == "workload step" else "hot"
                worst[kind] = max(worst[kind], ratio)
                print(f"{core:6} {name:22} {a:9.1f} {b:9.1f} {ratio:6.3f}")
    print(
        f"worst ratio on the hot calls {worst['hot']:.3f} (the target: at most 1.05); "
        f"on a workload step {worst['step']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

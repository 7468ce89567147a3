"""Scheduler-loop time of kvlife's drop-in against SGLang 0.5.23's own decode offload
manager: the same seeded decode workload through each, side by side in one process, timing
every manager call the scheduler makes in a step (``offload_kv_cache``,
``finalize_release_on_finish``, ``check_offload_progress``). ``make bench-sglang``.

On CPU both managers' copies run inside the call that launches them and SGLang's
``finish_event.synchronize()`` returns at once, so this measures the bookkeeping each adds
to a step, not the GPU wait SGLang's manager has and kvlife's does not.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

from kvlife.fsm.native import describe
from tests.engines.sglang_harness import (
    PAGE,
    close,
    kvlife_manager,
    make_pools,
    run_workload,
    sglang_manager,
    sglang_on_cpu,
)


def measure(*, seed: int, steps: int, rounds: int) -> dict[str, float]:
    """Median per-step manager time of each (over the steps of ``rounds`` runs each,
    alternating), in microseconds, and their ratio."""
    logging.disable(logging.WARNING)  # SGLang logs every refused host allocation
    try:
        return _measure(seed=seed, steps=steps, rounds=rounds)
    finally:
        logging.disable(logging.NOTSET)


def _measure(*, seed: int, steps: int, rounds: int) -> dict[str, float]:
    theirs: list[float] = []
    ours: list[float] = []
    args = {"layout": "page_first", "stride": 8, "hicache_size_gb": 512 * 192 / 1e9}
    with tempfile.TemporaryDirectory(prefix="kvlife-sglang-bench-") as tmp:
        for r in range(rounds):
            pools = make_pools(seed=seed + r, rows=64, slots=8192, context=512)
            with sglang_on_cpu():
                manager = sglang_manager(pools, Path(tmp) / f"sglang{r}", **args)
                host_pages = manager.decode_host_mem_pool.available_size() // PAGE
                theirs += run_workload(pools, manager, seed=seed + r, steps=steps).manager_s
            close(manager)
            pools = make_pools(seed=seed + r, rows=64, slots=8192, context=512)
            ours_manager = kvlife_manager(
                pools, Path(tmp) / f"kvlife{r}", host_pages=host_pages, **args
            )
            ours += run_workload(pools, ours_manager, seed=seed + r, steps=steps).manager_s
            close(ours_manager)
    theirs_us = statistics.median(theirs) * 1e6
    ours_us = statistics.median(ours) * 1e6
    return {
        "steps": float(len(ours)),
        "sglang_steps": float(len(theirs)),
        "sglang_us": theirs_us,
        "kvlife_us": ours_us,
        "ratio": ours_us / theirs_us,
        "sglang_p99_us": statistics.quantiles(theirs, n=100)[98] * 1e6,
        "kvlife_p99_us": statistics.quantiles(ours, n=100)[98] * 1e6,
        "sglang_max_ms": max(theirs) * 1e3,
        "kvlife_max_ms": max(ours) * 1e3,
        "sglang_total_ms": sum(theirs) * 1e3,
        "kvlife_total_ms": sum(ours) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    got = measure(seed=args.seed, steps=args.steps, rounds=args.rounds)
    print(
        f"scheduler-loop time in the offload manager, per step ({got['steps']:.0f} steps each); "
        f"kvlife {describe()}"
    )
    print(f"  SGLang 0.5.23 DecodeKVCacheOffloadManager  {got['sglang_us']:8.1f} us  1.00")
    ours, ratio = got["kvlife_us"], got["ratio"]
    print(f"  kvlife KVLifeDecodeOffloadManager           {ours:8.1f} us  {ratio:.2f}")
    print(
        f"  p99 {got['sglang_p99_us']:.1f} vs {got['kvlife_p99_us']:.1f} us; slowest step "
        f"{got['sglang_max_ms']:.2f} vs {got['kvlife_max_ms']:.2f} ms; whole runs "
        f"{got['sglang_total_ms']:.1f} vs {got['kvlife_total_ms']:.1f} ms (CPU copies: see the "
        "module doc)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

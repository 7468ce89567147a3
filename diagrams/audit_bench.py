"""Benchmark of ``kvlife audit check`` on big logs: time and peak memory against a floor.

Run: ``kvlife bench audit`` (or ``python -m kvlife.diagrams.audit_bench``). For each size it
writes (once, then reuses) a log of a decode-like workload -- rid reuse, two copies per
lifecycle, stale deliveries -- and runs, each in a fresh process so that peak RSS is that
run's own:

* ``json.loads floor``: the standard library reading every line (no checking at all);
* ``kvlife audit check``: this kvlife's streaming checker, ``--expect-released``;
* with ``--old-tree DIR``, the same command from another kvlife on ``PYTHONPATH`` (e.g.
  an older release unpacked there), for before/after figures.

The table gives seconds, peak RSS and the time ratio to the floor of the same size.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvlife.fsm.audit.sinks import JsonLinesSink
from kvlife.fsm.cli_args import BenchParser, positive_ints
from kvlife.fsm.registry import LifecycleRegistry

RECORDS_PER_LIFECYCLE = 6
"""Records per lifecycle in the generated workload (without the occasional refusal)."""

# Peak RSS is read from /proc/self/status (VmHWM) at exit: the high-water mark of the
# process image itself. (wait4's ru_maxrss would also count the benchmark process that
# forked it, since Linux keeps the maximum across exec.)
_PEAK = (
    "import atexit, sys\n"
    "def _peak():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            open(sys.argv[2], 'w').write(line.split()[1])\n"
    "atexit.register(_peak)\n"
)
_FLOOR = "import json, sys\nfor line in open(sys.argv[1], 'rb'):\n    json.loads(line)\n"
_CHECK = (
    "import sys\nfrom kvlife.diagrams.cli import main\n"
    "raise SystemExit(main(['audit', 'check', '--expect-released', sys.argv[1]]))\n"
)


class _Request:
    __slots__ = ("rid",)

    def __init__(self, rid: str) -> None:
        self.rid = rid


def write_workload(path: Path, records: int) -> int:
    """Write a log of about ``records`` records; return how many it holds."""
    path.unlink(missing_ok=True)
    sink = JsonLinesSink(path, fsync="never", batch_records=8192)
    registry = LifecycleRegistry(sinks=[sink])
    written = 0
    held: list[tuple[_Request, object]] = []  # finished, one copy still in flight
    i = 0
    while written < records:
        req = _Request(f"req-{i % 61}")  # fewer rids than held lifecycles: reuse
        registry.register(req)
        first = registry.start_offload(req, tokens=256, pages=16)
        second = registry.start_offload(req, tokens=256, pages=16)
        registry.complete(first)
        registry.finish(req)
        held.append((req, second))
        written += 5
        if len(held) > 64:  # complete late, after the rid may have been reused
            _, ticket = held.pop(0)
            registry.complete(ticket)  # type: ignore[arg-type]
            written += 1
            if i % 50 == 0:
                registry.deliver(ticket)  # type: ignore[arg-type]  # a stale re-delivery
                written += 1
        i += 1
    for _, ticket in held:
        registry.complete(ticket)  # type: ignore[arg-type]
        written += 1
    sink.close()
    return written


@dataclass
class Run:
    """One measured run."""

    records: int
    setup: str
    seconds: float
    peak_rss_mib: float
    status: int


def run_measured(
    code: str, log: Path, env: dict[str, str] | None = None
) -> tuple[float, float, int]:
    """Run ``python -c code log`` in a fresh process; (seconds, peak RSS MiB, status)."""
    with tempfile.TemporaryDirectory(prefix="kvlife-bench-") as tmp:
        peak_file = Path(tmp) / "peak"
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", _PEAK + code, str(log), str(peak_file)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            check=False,
        )
        seconds = time.perf_counter() - t0
        peak_kib = int(peak_file.read_text()) if peak_file.exists() else 0
    return seconds, peak_kib / 1024, done.returncode


def measure(sizes: Sequence[int], directory: Path, old_tree: Path | None = None) -> list[Run]:
    """Write (or reuse) a log per size and time every setup on it."""
    directory.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    for size in sizes:
        log = directory / f"audit-{size}.jsonl"
        count = directory / f"audit-{size}.count"
        if not (log.exists() and count.exists()):
            print(f"writing a {size:,}-record log ...", file=sys.stderr)
            count.write_text(str(write_workload(log, size)))
        records = int(count.read_text())
        setups: list[tuple[str, str, dict[str, str] | None]] = [
            ("json.loads floor", _FLOOR, None),
            ("kvlife audit check", _CHECK, None),
        ]
        if old_tree is not None:
            old_env = {**os.environ, "PYTHONPATH": str(old_tree)}
            setups.append((f"audit check from {old_tree}", _CHECK, old_env))
        for name, code, env in setups:
            print(f"{size:,} records: {name} ...", file=sys.stderr)
            seconds, rss, status = run_measured(code, log, env)
            runs.append(Run(records, name, seconds, rss, status))
    return runs


def format_table(runs: Sequence[Run]) -> str:
    """The benchmark's printed table."""
    width = max(len(r.setup) for r in runs)
    lines = [
        f"{'records':>10}  {'setup':<{width}}  {'seconds':>8}  {'peak RSS MiB':>12}  "
        f"{'x floor':>7}  exit"
    ]
    floors = {r.records: r.seconds for r in runs if r.setup == "json.loads floor"}
    for r in runs:
        ratio = r.seconds / floors[r.records] if r.records in floors else float("nan")
        lines.append(
            f"{r.records:>10,}  {r.setup:<{width}}  {r.seconds:>8.2f}  {r.peak_rss_mib:>12.1f}  "
            f"{ratio:>7.2f}  {r.status}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: print the table."""
    parser = BenchParser(
        prog="kvlife bench audit",
        description="Benchmark of 'kvlife audit check' on big logs: time and peak memory "
        "against a floor (the standard library reading every line).",
    )
    parser.add_argument(
        "--records",
        type=positive_ints,
        default=[500_000, 1_000_000, 2_000_000, 4_000_000],
        help="comma-separated log sizes (default 500000,1000000,2000000,4000000)",
    )
    parser.add_argument(
        "--dir", default="out/audit-bench", help="where the logs are kept (default out/audit-bench)"
    )
    parser.add_argument(
        "--old-tree",
        metavar="DIR",
        help="also run 'kvlife audit check' from another kvlife unpacked in DIR (put on "
        "PYTHONPATH), for before/after figures",
    )
    args = parser.parse_args(argv)
    runs = measure(args.records, Path(args.dir), Path(args.old_tree) if args.old_tree else None)
    print(format_table(runs))
    return 0 if all(r.status == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

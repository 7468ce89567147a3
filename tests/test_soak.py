"""The soak (``make soak``, not CI): a million lifecycles over a thousand reused rids with
the JSON-lines sink; resident memory stays flat, the registry ends empty, the log checks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlife.fsm import JsonLinesSink, LifecycleRegistry
from tests.strategies import Req

LIFECYCLES = 1_000_000
RIDS = 1_000
WARM_UP = 50_000


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")  # pragma: no cover - Linux only


@pytest.mark.slow
def test_soak_a_million_lifecycles(tmp_path: Path) -> None:
    path = tmp_path / "soak.jsonl"
    rids = [f"rid-{i}" for i in range(RIDS)]
    late: dict[str, object] = {}  # rid -> a ticket delivered after its rid was reused
    warm_rss = 0.0
    start = time.perf_counter()
    with JsonLinesSink(path, fsync="batch") as sink:
        registry = LifecycleRegistry(sinks=[sink])
        for i in range(LIFECYCLES):
            if i == WARM_UP:
                warm_rss = _rss_mib()
            rid = rids[i % RIDS]
            req = Req(rid)
            registry.register(req)  # the rid's previous lifecycle may still be pending
            old = late.pop(rid, None)
            first = registry.start_offload(req, tokens=16)
            registry.complete(first)
            second = registry.start_offload(req, tokens=16)
            if old is not None:
                registry.complete(old)  # type: ignore[arg-type]  # the late ack: old instance only
            registry.finish(req)  # with a copy in flight: finished_pending
            if i % 3:
                registry.complete(second)
            else:
                late[rid] = second
        for ticket in late.values():
            registry.complete(ticket)  # type: ignore[arg-type]
        end_rss = _rss_mib()
        assert len(registry) == 0
    elapsed = time.perf_counter() - start
    records = registry.statistics()
    size = path.stat().st_size
    print(f"\nsoak: {LIFECYCLES:,} lifecycles over {RIDS} rids in {elapsed:.1f} s "
          f"({LIFECYCLES / elapsed:,.0f} lifecycles/s, {records.transitions / elapsed:,.0f} "
          f"transitions/s); log {size / 2**20:.0f} MiB; RSS {warm_rss:.1f} MiB after warm-up, "
          f"{end_rss:.1f} MiB at the end (+{end_rss - warm_rss:.1f} MiB)")  # fmt: skip
    assert end_rss - warm_rss <= 20, (warm_rss, end_rss)
    check_start = time.perf_counter()
    result = subprocess.run(
        [str(Path(sys.executable).parent / "kvlife"), "audit", "check", str(path),
         "--expect-released"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    took = time.perf_counter() - check_start
    print(f"kvlife audit check: exit {result.returncode} in {took:.0f} s: "
          f"{result.stdout.strip().splitlines()[0]}")  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

"""The GPU check's last word: one table of what held, from the CUDA tests' JUnit report and
the benchmark's JSON in the folder named on the command line. Exit 0 when everything held.

Run by ``tests/gpu/check.sh``; runs anywhere (standard library only)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def test_rows(report: Path) -> list[tuple[str, str, bool | None]]:
    """``(what, figure, held)`` per CUDA test: passed, failed (with the message's first
    line) or skipped (``None``)."""
    if not report.exists():
        return [("CUDA tests", "no report (the run died or timed out)", False)]
    rows: list[tuple[str, str, bool | None]] = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            message = (failure.get("message") or "failed").splitlines()[0][:60]
            rows.append((name, message, False))
        elif case.find("skipped") is not None:
            rows.append((name, "skipped", None))
        else:
            rows.append((name, f"passed in {float(case.get('time', 0)):.1f} s", True))
    return rows or [("CUDA tests", "none ran", False)]


def bench_rows(path: Path) -> list[tuple[str, str, bool | None]]:
    """``(what, figure, held)`` per benchmark verdict (its target in the figure)."""
    if not path.exists():
        return [("offload benchmark", "no JSON (the run died or timed out)", False)]
    data = json.loads(path.read_text())
    rows: list[tuple[str, str, bool | None]] = [
        (v["what"], f"{v['figure']} (target {v['target']})", v["held"])
        for v in data.get("verdicts", [])
    ]
    parts = data.get("parts", {})
    cpu = data.get("environment", {}).get("device") == "CPU"  # no CUDA-only parts there
    finished = (
        bool(rows)
        and {"poll", "outermost"} <= set(parts)
        and (cpu or {"completion", "concurrent_outermost"} <= set(parts))
    )
    if not finished:
        rows.append(("offload benchmark", "did not finish every part", False))
    return rows


def main(folder: str) -> int:
    out = Path(folder)
    rows = test_rows(out / "cuda-tests.xml") + bench_rows(out / "bench.json")
    width = max(len(what) for what, _, _ in rows)
    for what, figure, held in rows:
        verdict = {True: "held", False: "NOT HELD", None: "n/a"}[held]
        print(f"{what:<{width}}  {verdict:<8}  {figure}")
    missed = sum(held is False for _, _, held in rows)
    print(f"{len(rows)} checks, {missed} not held")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))

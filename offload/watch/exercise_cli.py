"""What ``kvlife vllm exercise`` and ``kvlife sglang exercise`` share on their command
line: the run options (families, seeds, steps, where failing runs' logs stay, JSON) and
the progress line on stderr. Imports no engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol


def add_run_options(parser: argparse.ArgumentParser, families: Iterable[str]) -> None:
    """``--families``, ``--seeds``, ``--seed``, ``--steps``, ``--out`` and ``--json``."""
    names = ", ".join(families)
    parser.add_argument(
        "--families",
        default=names.replace(", ", ","),
        help=f"comma-separated, of {names} (default: all)",
    )
    parser.add_argument("--seeds", type=int, default=20, help="runs per family (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--steps", type=int, default=120, help="workload steps a run (default 120)")
    parser.add_argument("--out", default="kvlife-exercise", help="where failing runs' logs stay")
    parser.add_argument("--json", action="store_true", help="the reports and runs as JSON")


def run_counts_error(args: argparse.Namespace, prog: str) -> str | None:
    """The one-line error for ``--seeds`` or ``--steps`` below 1, else ``None``."""
    if args.seeds < 1 or args.steps < 1:
        return f"{prog}: --seeds and --steps must be at least 1"
    return None


def listed(text: str) -> list[str]:
    """A comma-separated option's items, blanks dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def progress_line(redraw: bool | None = None) -> Callable[[str, int, int], None]:
    """A progress callback ``(family, done, total)`` on stderr: redrawn in place on a
    terminal; elsewhere (a log file) one line a family when it is done, never a ``\\r``."""
    if redraw is None:
        redraw = sys.stderr.isatty()

    def progress(family: str, done: int, total: int) -> None:
        if redraw:
            print(f"\r{family}: {done}/{total} runs", end="", file=sys.stderr, flush=True)
            if done == total:
                print(file=sys.stderr)
        elif done == total:
            print(f"{family}: {total} runs", file=sys.stderr, flush=True)

    return progress


class _Report(Protocol):
    def lines(self) -> list[str]: ...


class _Run(Protocol):
    @property
    def failed(self) -> bool: ...


def print_reports(
    reports: Sequence[_Report],
    runs: Sequence[_Run],
    title: str,
    *,
    as_json: bool,
    head: dict[str, Any] | None = None,
    out: Path | None = None,
) -> int:
    """Print the families' reports (``title`` first, then each family's lines, then where
    the failing runs' logs are when ``out`` is given), or with ``as_json`` one JSON
    object (``head``'s keys, ``families``, ``runs`` with their ``failed``); both are
    dataclasses. Returns the exit status: 1 when a run failed, else 0."""
    failed = any(r.failed for r in runs)
    if as_json:
        body = {
            **(head or {}),
            "families": [dataclasses.asdict(r) for r in reports],  # type: ignore[call-overload]
            "runs": [dataclasses.asdict(r) | {"failed": r.failed} for r in runs],  # type: ignore[call-overload]
        }
        print(json.dumps(body, indent=1))
    else:
        print(title)
        for report in reports:
            print("\n".join(report.lines()))
        if failed and out is not None:
            print(f"the failing runs' logs are in {out}")
    return 1 if failed else 0


__all__ = ["add_run_options", "listed", "print_reports", "progress_line", "run_counts_error"]

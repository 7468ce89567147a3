"""What the ``kvlife`` command's subcommands share (see
``kvlife.diagrams.cli``): the one-line usage error, reading a log and
its rotated backups with a progress bar for big ones, running the checker over it and
stating its verdict, writing an output file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from kvlife.fsm.audit import (
    AuditChecker,
    AuditFormatError,
    AuditReader,
    AuditReport,
    Verdict,
    audit_files,
    ending_lines,
)


class UsageError(Exception):
    """A bad command line: reported in one line, exit status 2."""


def _checker(args: argparse.Namespace) -> AuditChecker:
    """The checker ``audit check`` would run with these options."""
    return AuditChecker(
        expect_released=getattr(args, "expect_released", False),
        accept_tables=getattr(args, "accept_table", ()),
        overdue_fails=getattr(args, "overdue_fails", False),
    )


def _verdict(args: argparse.Namespace, report: AuditReport, reader: AuditReader) -> Verdict:
    return Verdict.of(report, reader.problem_count, allow_lost=getattr(args, "allow_lost", False))


def _count(n: int, noun: str) -> str:
    """``1 violation``, ``2 violations``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _write_file(path: str, data: bytes) -> None:
    """Write an output file; a path that cannot be written is a usage error."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"kvlife: {path} is a directory; give a file name")
    try:
        target.write_bytes(data)
    except OSError as exc:
        raise UsageError(f"kvlife: cannot write {path}: {exc.strerror or exc}") from None


_PROGRESS_MIN_BYTES = 16 << 20


def _progress_bar(label: str) -> Callable[[int, int], None]:
    """A one-line progress bar on stderr (a terminal only)."""
    shown = [-1]

    def show(done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        if percent != shown[0]:
            shown[0] = percent
            end = "\n" if done >= total else ""
            print(f"\r{label}: {percent:3d}% of {total / 2**20:.0f} MiB", end=end, file=sys.stderr)

    return show


_LOG_HELP = (
    "an audit log (with its rotated files), several, or a directory of them: one per "
    "writer (each engine core under data parallelism), each checked as its own sequence"
)


def _label(logs: Sequence[str]) -> str:
    """How messages name the logs given."""
    return logs[0] if len(logs) == 1 else f"{logs[0]} (and {len(logs) - 1} more)"


def log_files(logs: Sequence[str]) -> list[Path]:
    """The files of the logs given, in reading order: each log's rotated files oldest
    first; a directory stands for every ``*.jsonl`` log in it (by name). Each writer's
    log begins with its own header, so the reader sees it as a segment of its own.

    Raises:
        UsageError: a path is empty, names no audit log, or is a directory without one.
    """
    files: list[Path] = []
    for path in logs:
        if not path:
            raise UsageError("kvlife: the audit log path is empty")
        base = Path(path)
        if base.is_dir():
            writers = sorted(p for p in base.iterdir() if p.name.endswith(".jsonl") and p.is_file())
            if not writers:
                raise UsageError(f"kvlife: {path} is a directory with no audit log (*.jsonl)")
            for writer in writers:
                files += audit_files(writer)
            continue
        found = audit_files(base)
        if not found[-1].exists():
            raise UsageError(f"kvlife: no such audit log: {path}")
        files += found
    return files


def _reader(logs: str | Sequence[str]) -> AuditReader:
    """A streaming reader of the logs given (see ``log_files``); usage errors for bad
    paths."""
    paths = [logs] if isinstance(logs, str) else list(logs)
    reader = AuditReader(log_files(paths))
    if sys.stderr.isatty() and reader.total_bytes() >= _PROGRESS_MIN_BYTES:
        reader.progress = _progress_bar(f"reading {Path(paths[0]).name}")
    return reader


_T = TypeVar("_T")


def _reading(path: str, work: Callable[[], _T], writes: str | None = None) -> _T:
    """Run ``work`` (which reads the log, and may write the file ``writes``); unreadable
    input, or an output that cannot be written, becomes a usage error (one line, exit 2)."""
    try:
        return work()
    except AuditFormatError as exc:
        raise UsageError(f"kvlife: {exc}") from None
    except OSError as exc:
        name = exc.filename or path
        if writes is not None and str(name) == str(writes):
            raise UsageError(f"kvlife: cannot write {name}: {exc.strerror or exc}") from None
        raise UsageError(f"kvlife: cannot read {name}: {exc.strerror}") from None


def _check(path: str, reader: AuditReader, checker: AuditChecker) -> AuditReport:
    def run() -> AuditReport:
        feed = checker.feed
        for event in reader:
            feed(event)
        return checker.finish()

    return _reading(path, run)


def _problems_line(path: str, reader: AuditReader) -> str:
    first = reader.problems[0]
    return (
        f"kvlife: {reader.problem_count} unreadable line(s) in {path}; first: "
        f"{Path(first.file).name}:{first.line}: {first.message}"
    )


def _say_verdict(
    args: argparse.Namespace, path: str, report: AuditReport, reader: AuditReader
) -> int:
    """Tell ``audit check``'s verdict on stderr (with the first unreadable line, if any)
    and return its exit status."""
    verdict = _verdict(args, report, reader)
    for line in ending_lines(report):
        print(f"{path}: {line}", file=sys.stderr)
    print(f"{path}: {verdict}", file=sys.stderr)
    if reader.problem_count:
        print(_problems_line(path, reader), file=sys.stderr)
    return verdict.exit_status

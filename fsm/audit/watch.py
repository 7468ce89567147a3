"""Checking audit logs while they are written: ``kvlife audit watch``.

``kvlife audit check`` judges logs after the fact. Some verdicts exist only across logs:
a prefill/decode hand-over's ``freed_before_read`` (the prefill server freed the blocks
before the decode server began to read them) and ``handover_mismatch`` need the prefill
server's log and the decode server's together, so neither engine can count them itself.
[`AuditWatch`][kvlife.fsm.audit.watch.AuditWatch] follows any number of logs as their
writers append to them and rotate them (a directory: every ``*.jsonl`` log in it, those
that appear later too), checks each with the same
[`AuditChecker`][kvlife.fsm.audit.checker.AuditChecker] ``audit check`` runs, joins the
hand-overs of all of them in one [`HandoverJoin`][kvlife.fsm.audit.handover.HandoverJoin],
and counts every verdict by log and kind;
[`WatchCollector`][kvlife.fsm.audit.watch.WatchCollector] serves the counts to Prometheus
(``kvlife metrics rules --for watch`` pages on them).

What it counts, and when:

* a violation a record shows (a state the table does not allow, a gap in ``seq``, a
  protocol verdict the writer recorded, ...): when the record is read, as ``audit check``
  finds it;
* a violation found at a segment's end (a ticket never reported, an overdue ticket never
  completed): when the writer's next segment begins (a restarted engine); the engine's
  own overdue gauges tell those live;
* a hand-over verdict: once it has held for ``settle_s`` (2 s by default), so that a side
  read before the other log's earlier records were flushed cannot make a verdict the
  whole logs would not give. Times on the two sides are compared as ``audit check`` does
  (the wall clock each log's header anchors: exact on one host).

A log already written when the watch starts is read from its oldest rotated file on; what
it held is counted then (Prometheus sees those counters start there: they do not page).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Final

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

from kvlife.fsm.audit.checker import VIOLATION_MEANINGS, AuditChecker
from kvlife.fsm.audit.handover import HandoverJoin
from kvlife.fsm.audit.reader import AuditFormatError, AuditReader, audit_files

SETTLE_S: Final = 2.0
"""How long a hand-over verdict must hold before it is counted, seconds."""

HANDOVER_KINDS: Final = ("freed_before_read", "handover_mismatch")
"""The verdicts only a join of two servers' logs can give."""

_BACKUP: Final = re.compile(r"\.[1-9][0-9]*$")


@dataclass(frozen=True)
class Found:
    """A verdict the watch counted: the log it is about, its kind, the rid it names and
    what ``audit check`` says of it."""

    log: str
    kind: str
    rid: str | None
    message: str

    def line(self) -> str:
        """``VIOLATION kind in LOG rid='...': message``."""
        return f"VIOLATION {self.kind} in {self.log} rid={self.rid!r}: {self.message}"


def _first_line(file: BinaryIO) -> bytes:
    """A file's first line (its header), as far as it is written (at most 64 KiB)."""
    head = os.pread(file.fileno(), 1 << 16, 0)
    end = head.find(b"\n")
    return head if end < 0 else head[: end + 1]


def _always_alive(_pid: int) -> bool:
    return True  # a followed log is being written: never judged cut short


class FollowedLog:
    """One log (``PATH`` and its rotated backups) followed as its writer appends to it
    and rotates it. ``poll()`` reads what was written since the last poll.

    After a poll: ``failed`` says why the log cannot be followed (it is not a kvlife
    audit log, was written with another transition table, or cannot be read: a
    directory at its path, a file the watch may not read, an I/O error), else ``None``;
    ``checker.report`` holds the counts so far; ``reader`` the unreadable lines;
    [`incomplete()`][kvlife.fsm.audit.watch.FollowedLog.incomplete] what the log lacks
    that was read since it was last asked.
    """

    def __init__(
        self,
        path: Path,
        join: HandoverJoin,
        *,
        overdue_fails: bool = False,
        accept_tables: Iterable[str] = (),
    ) -> None:
        self.path = path
        self.label = str(path)
        self.reader = AuditReader([path], rotated=False)
        self.checker = AuditChecker(
            overdue_fails=overdue_fails,
            accept_tables=accept_tables,
            alive=_always_alive,
            join=join,
        )
        self.failed: str | None = None
        self._file: BinaryIO | None = None  # PATH, open between polls
        self._inode: int | None = None
        self._head = b""  # PATH's first line when it was opened or last cut short
        self._name = path
        self._position = (0, 0)
        self._started = False
        self._closed = False
        self._told = 0  # violations of the report already returned
        self._read: set[bytes] = set()  # the header lines of the backups read through
        self._problems_told = (0, 0)  # (reader.problems shown, reader.problem_count told)
        self._lost_told = 0  # lost markers of the report already told

    def _feed(self, file: BinaryIO, name: Path, *, follow: bool) -> None:
        line, offset = self._position
        file.seek(offset)
        feed = self.checker.feed
        for event in self.reader.read_lines(file, name, line=line, offset=offset, follow=follow):
            feed(event)
        self._position = self.reader.position

    def _catch_up(self) -> None:
        """Read through every rotated backup not read yet, oldest first (each is
        complete). A file is known by its header line, which no other file of the log
        shares (the header names the segment and the file's part of it)."""
        opened: list[tuple[Path, BinaryIO, bytes]] = []
        current = _first_line(self._file) if self._file is not None else None
        present: set[bytes] = set()
        try:
            for name in audit_files(self.path):
                if name == self.path:
                    continue
                try:
                    file: BinaryIO = open(name, "rb")  # noqa: SIM115 - closed below
                except FileNotFoundError:
                    continue  # rotated away meanwhile (the oldest backup is dropped)
                header = _first_line(file)
                present.add(header)
                if header in self._read or header == current:
                    file.close()
                    continue
                opened.append((name, file, header))
            for name, file, header in opened:
                self._position = (0, 0)
                self._feed(file, name, follow=False)
                self._read.add(header)
        finally:
            for _, file, _ in opened:
                file.close()
        self._read &= present  # a backup dropped is never seen again

    def _open_current(self) -> BinaryIO | None:
        """Open ``PATH`` (``None`` while it does not exist) and follow it from its start."""
        try:
            file: BinaryIO = open(self.path, "rb")  # noqa: SIM115 - kept open between polls
        except FileNotFoundError:
            return None
        self._file, self._inode = file, os.fstat(file.fileno()).st_ino
        self._name, self._position = self.path, (0, 0)
        self._head = _first_line(file)
        return file

    def _cut_short(self, file: BinaryIO) -> bool:
        """Whether ``PATH`` was cut short in place since it was read (logrotate's
        ``copytruncate``): it is shorter than what was read, or begins otherwise."""
        offset = self._position[1]
        if not offset:
            return False
        if os.fstat(file.fileno()).st_size < offset:
            return True
        head = _first_line(file)
        known = min(len(head), len(self._head))  # either may be written only in part
        return head[:known] != self._head[:known]

    def _after_cut(self, file: BinaryIO) -> None:
        """Read the rest of what ``PATH`` held from its copy (the backup that begins
        with the same line), then ``PATH`` again from its start (kvlife's sink goes on in
        it as the segment's next part)."""
        for name in audit_files(self.path):
            if name == self.path:
                continue
            try:
                copy: BinaryIO = open(name, "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                continue
            with copy:
                if _first_line(copy) == self._head:
                    self._feed(copy, name, follow=False)
                    break
        self._read.add(self._head)
        self._name, self._position = self.path, (0, 0)
        self._head = _first_line(file)

    def _replaced(self) -> bool:
        """Whether ``PATH`` is another file than the one open (the writer rotated it)."""
        try:
            return os.stat(self.path).st_ino != self._inode
        except FileNotFoundError:
            return True  # renamed, its successor not created yet

    def poll(self) -> list[Found]:
        """Read what was written since the last poll; the violations it showed."""
        if self.failed is not None or self._closed:
            return []
        try:
            if not self._started:
                self._started = True
                self._open_current()  # first: a rotation from here on is seen as one
                self._catch_up()
                self._position = (0, 0)
            file = self._file if self._file is not None else self._open_current()
            if file is None:
                return self._found()
            if self._cut_short(file):
                self._after_cut(file)
            self._feed(file, self._name, follow=True)
            if not self._head.endswith(b"\n"):  # opened (or cut) before it was written
                self._head = _first_line(file)
            while self._replaced():  # the writer rotated it: its last lines, the backups
                self._feed(file, self._name, follow=False)  # written since, then PATH
                self._read.add(_first_line(file))
                file.close()
                self._file = None
                self._catch_up()
                successor = self._open_current()
                if successor is None:
                    break
                file = successor
                self._feed(file, self._name, follow=True)
        except AuditFormatError as exc:
            self.failed = str(exc)
            self.close()
        except OSError as exc:  # a directory, a file it may not read, an I/O error
            self.failed = f"{exc.filename or self.path} cannot be read: {exc.strerror or exc}"
            self.close()
        return self._found()

    def incomplete(self) -> list[str]:
        """What the log lacks that was read since the last call, one line each, as
        ``audit check`` says it: each line that is not a record (the first
        [`MAX_PROBLEMS`][kvlife.fsm.audit.reader.MAX_PROBLEMS] by place, then how many
        more) and each range of records a failing sink reported lost. ``audit check``
        fails a log for either (the watch's ``unreadable_lines_total`` and
        ``records_lost_total`` count them: ``KvlifeWatchIncomplete`` pages)."""
        reader = self.reader
        shown, told = self._problems_told
        lines = [
            f"{self.label}: unreadable line {Path(p.file).name}:{p.line}: {p.message}"
            for p in reader.problems[shown:]
        ]
        more = reader.problem_count - told - len(lines)
        if more > 0:
            lines.append(f"{self.label}: {more} more unreadable line(s)")
        self._problems_told = (len(reader.problems), reader.problem_count)
        lost = self.checker.report.lost
        lines += [
            f"{self.label}: records lost (sink error): seq {m.first_seq}-{m.last_seq} "
            f"({m.kvlife_lost} records): {m.error}"
            for m in lost[self._lost_told :]
        ]
        self._lost_told = len(lost)
        return lines

    def _found(self) -> list[Found]:
        kept = self.checker.report.violations
        new = kept[self._told :]
        self._told = len(kept)
        return [Found(self.label, v.kind, v.rid, v.message) for v in new]

    def close(self) -> None:
        """Close the file followed and stop following (a poll after it reads nothing)."""
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None


VerdictKey = tuple[str, str, int, int]  # kind, the decode side's file, segment, serial


class AuditWatch:
    """Follows audit logs (files, or directories of ``*.jsonl`` logs, those that appear
    later included) and counts their verdicts while they are written; see the module.

    Args:
        paths: log files (each with its rotated backups) and directories.
        overdue_fails: count every ``overdue`` record as a violation, as ``audit check
            --overdue-fails`` does.
        accept_tables: table digests to replay as this kvlife's table.
        settle_s: how long a hand-over verdict must hold before it is counted.
        clock: monotonic seconds (a test's clock).

    Raises:
        ValueError: no path given, or ``settle_s`` negative.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        *,
        overdue_fails: bool = False,
        accept_tables: Iterable[str] = (),
        settle_s: float = SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not paths:
            raise ValueError("kvlife audit watch: no log given")
        if not settle_s >= 0:
            raise ValueError(f"kvlife audit watch: settle_s must be >= 0, got {settle_s!r}")
        self.paths = [Path(p) for p in paths]
        self.overdue_fails = overdue_fails
        self.accept_tables = tuple(accept_tables)
        self.settle_s = settle_s
        self.clock = clock
        self.join = HandoverJoin(track_changes=True)
        self.logs: dict[Path, FollowedLog] = {}
        #: Hand-over verdicts counted, by log.
        self.handover_counts: dict[tuple[str, str], int] = {}
        self._pending: dict[VerdictKey, tuple[float, tuple[str, str]]] = {}
        self._counted: set[VerdictKey] = set()
        self.polls = 0
        self.last_poll = 0.0  # wall-clock seconds of the last poll's end
        self._dirs: set[Path] = set()  # the paths that were directories when first seen

    def _discover(self) -> None:
        for path in self.paths:
            if path in self._dirs or path.is_dir():
                self._dirs.add(path)
                try:
                    found = [p for p in path.iterdir() if p.name.endswith(".jsonl") and p.is_file()]
                except FileNotFoundError:  # removed: the logs followed so far stay
                    continue
            else:
                found = [path]
            for log in sorted(found):
                if log not in self.logs:
                    self.logs[log] = FollowedLog(
                        log,
                        self.join,
                        overdue_fails=self.overdue_fails,
                        accept_tables=self.accept_tables,
                    )

    def _label(self, file: str) -> str:
        """The log a file belongs to, as its ``FollowedLog`` names it."""
        base = Path(_BACKUP.sub("", file))
        log = self.logs.get(base)
        return log.label if log is not None else str(base)

    def poll(self) -> list[Found]:
        """Read every log's new records; the verdicts counted by this poll."""
        self._discover()
        found: list[Found] = []
        for log in self.logs.values():
            found += log.poll()
        found += self._judge()
        self.polls += 1
        self.last_poll = time.time()
        return found

    def _judge(self) -> list[Found]:
        now = self.clock()
        keys = self.join.changed() | {identity for _, identity in self._pending.values()}
        holding: set[VerdictKey] = set()
        found: list[Found] = []
        for handover in self.join.finish(keys):
            for kind, side, message in handover.verdicts:
                key: VerdictKey = (kind, side.file, side.segment, side.serial)
                if key in self._counted:
                    continue
                holding.add(key)
                since, _ = self._pending.setdefault(key, (now, (handover.engine, handover.rid)))
                if now - since >= self.settle_s:
                    self._counted.add(key)
                    del self._pending[key]
                    label = self._label(side.file)
                    count = (label, kind)
                    self.handover_counts[count] = self.handover_counts.get(count, 0) + 1
                    found.append(Found(label, kind, side.rid, message))
        for key in [k for k in self._pending if k not in holding]:
            del self._pending[key]  # the logs read since no longer give it
        return found

    def violations(self) -> dict[tuple[str, str], int]:
        """Every verdict counted so far, by (log, kind)."""
        counts = dict(self.handover_counts)
        for log in self.logs.values():
            for kind, n in log.checker.report.violation_kinds.items():
                if kind not in HANDOVER_KINDS:  # those are counted here once settled
                    counts[(log.label, kind)] = counts.get((log.label, kind), 0) + n
        return counts

    def close(self) -> None:
        """Close every file followed."""
        for log in self.logs.values():
            log.close()


HELP: Final = {
    "violations": "kvlife audit watch: verdicts found in the log, by kind",
    "records": "kvlife audit watch: records read from the log",
    "unreadable": "kvlife audit watch: lines of the log that are not records",
    "lost": "kvlife audit watch: records the log's writer reported lost",
    "failed": "kvlife audit watch: 1 when the log cannot be followed",
    "logs": "kvlife audit watch: logs followed",
    "handovers": "kvlife audit watch: prefill/decode hand-overs joined",
    "poll": "kvlife audit watch: when the logs were last read (unix seconds)",
}


class WatchCollector:
    """A Prometheus collector of an [`AuditWatch`][kvlife.fsm.audit.watch.AuditWatch]'s
    counts (register it on a ``prometheus_client`` registry; the names start with
    ``NAMESPACE_watch_``):

    * ``violations_total{log, kind}``: every kind of verdict, 0 until one is found;
    * ``records_total{log}``, ``unreadable_lines_total{log}``, ``records_lost_total{log}``;
    * ``log_failed{log}``: 1 when a log cannot be followed (not a kvlife audit log,
      another transition table, or it cannot be read);
    * ``logs``, ``handovers`` (hand-over identities joined), ``last_poll_timestamp_seconds``.

    A scrape reads a snapshot the watch's thread publishes after each poll (``publish()``).
    """

    def __init__(self, watch: AuditWatch, namespace: str = "kvlife") -> None:
        self.watch = watch
        self.prefix = f"{namespace}_watch_"
        self._snapshot: list[tuple[str, str, str, dict[str, str], float]] = []

    def publish(self) -> None:
        """Take the watch's counts now (call it after each poll, in the poll's thread)."""
        p = self.prefix
        rows: list[tuple[str, str, str, dict[str, str], float]] = []
        counts = self.watch.violations()
        for log in self.watch.logs.values():
            for kind in VIOLATION_MEANINGS:
                labels = {"log": log.label, "kind": kind}
                n = counts.pop((log.label, kind), 0)
                rows.append((f"{p}violations", "counter", HELP["violations"], labels, n))
            report, reader = log.checker.report, log.reader
            at = {"log": log.label}
            failed = float(log.failed is not None)
            rows += [
                (f"{p}records", "counter", HELP["records"], at, report.records),
                (f"{p}unreadable_lines", "counter", HELP["unreadable"], at, reader.problem_count),
                (f"{p}records_lost", "counter", HELP["lost"], at, report.lost_records),
                (f"{p}log_failed", "gauge", HELP["failed"], at, failed),
            ]
        for (label, kind), n in counts.items():  # a kind not in the table of meanings
            labels = {"log": label, "kind": kind}
            rows.append((f"{p}violations", "counter", HELP["violations"], labels, n))
        join = self.watch.join
        rows += [
            (f"{p}logs", "gauge", HELP["logs"], {}, len(self.watch.logs)),
            (
                f"{p}handovers",
                "gauge",
                HELP["handovers"],
                {},
                len(join.prefill.keys() | join.decode.keys()),
            ),
            (f"{p}last_poll_timestamp_seconds", "gauge", HELP["poll"], {}, self.watch.last_poll),
        ]
        self._snapshot = rows

    def collect(self) -> Iterator[Metric]:
        """The metric families of the last snapshot (``prometheus_client`` calls it)."""
        # the optional metrics extra: only a watch that serves metrics needs it
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for name, kind, doc, labels, value in self._snapshot:
            family = families.get(name)
            if family is None:
                make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = families[name] = make(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
        yield from families.values()


__all__ = ["HANDOVER_KINDS", "SETTLE_S", "AuditWatch", "FollowedLog", "Found", "WatchCollector"]

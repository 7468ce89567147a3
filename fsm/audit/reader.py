"""Reading audit logs: one streaming reader under everything that reads a log.

[`AuditReader`][kvlife.fsm.audit.reader.AuditReader] walks a log (a file, or a rotated set
``PATH.N ... PATH.1 PATH``) line by line and yields what each line is -- a
[`Segment`][kvlife.fsm.audit.reader.Segment] when a writer's segment begins, an
[`AuditRecord`][kvlife.fsm.audit.records.AuditRecord], or a
[`LostRecords`][kvlife.fsm.audit.records.LostRecords] marker -- decoding records with msgspec's
typed decoder. Memory does not grow with the log: only the current line is held, plus at
most [`MAX_PROBLEMS`][kvlife.fsm.audit.reader.MAX_PROBLEMS] problem reports.

Crash tolerance: a torn last line (a crash mid-write) is skipped and its size reported in
``torn_tail``; a complete line in the middle that is not a valid record is reported in
``problems`` (never joined with a neighbour) and skipped. A file whose first line is not
a kvlife header is refused with
[`AuditFormatError`][kvlife.fsm.audit.reader.AuditFormatError]: it is not an audit log.

[`read_audit()`][kvlife.fsm.audit.reader.read_audit] reads a whole log into an
[`AuditLog`][kvlife.fsm.audit.reader.AuditLog] in memory, for small logs and tests; tools that may
meet big logs iterate an [`AuditReader`][kvlife.fsm.audit.reader.AuditReader] instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final

import msgspec

from kvlife.fsm.audit.records import (
    SCHEMA_VERSION,
    AuditHeader,
    AuditRecord,
    AuditSchemaError,
    ClosingRecord,
    LostRecords,
    check_record,
)
from kvlife.fsm.audit.sinks import rotated_name

MAX_PROBLEMS: Final = 100
"""Problems kept in detail per reader (all are counted in ``problem_count``)."""

_RECORD: Final = msgspec.json.Decoder(AuditRecord)
_LOST: Final = msgspec.json.Decoder(LostRecords)
_HEADER: Final = msgspec.json.Decoder(AuditHeader)
_CLOSING: Final = msgspec.json.Decoder(ClosingRecord)
_ANY: Final = msgspec.json.Decoder()


class AuditFormatError(ValueError):
    """The input is not a kvlife audit log (no header first), or it is unreadable.

    Also raised by [`read_audit()`][kvlife.fsm.audit.reader.read_audit] in strict mode for the first
    problem found.
    """


@dataclass(frozen=True)
class AuditProblem:
    """Something the reader could not take as a record: where, and why."""

    line: int  # 1-based line number in its file
    offset: int  # byte offset of the line's start in its file
    message: str
    file: str = ""


@dataclass(frozen=True)
class Segment:
    """A writer's segment begins: its index in the log (0, 1, ...) and its header.

    Each segment is its own serial and ``seq`` space. A size-rotated segment continues
    across files without a new [`Segment`][kvlife.fsm.audit.reader.Segment].
    """

    index: int
    header: AuditHeader
    file: str


Event = Segment | AuditRecord | LostRecords | ClosingRecord
"""What a reader yields: a segment begins, a record, a lost-records marker, or a closing
record (the segment's writer closed it; see
[`ClosingRecord`][kvlife.fsm.audit.records.ClosingRecord])."""


def segment_records(events: Iterable[Event]) -> Iterator[tuple[int, AuditRecord]]:
    """The records of a stream of events, each with the index of its segment (a
    segment is its own serial space); headers and lost markers are skipped."""
    segment = 0
    for event in events:
        if type(event) is AuditRecord:
            yield segment, event
        elif type(event) is Segment:
            segment = event.index


Progress = Callable[[int, int], None]

_BYTE: Final = re.compile(r"\s*\(byte (\d+)\)$")


def _json_error(exc: Exception) -> str:
    """msgspec's message with its 0-based byte offset in the line as a 1-based column:
    ``JSON is malformed: invalid character at column 1``."""
    text = str(exc)
    match = _BYTE.search(text)
    if match is None:
        return text
    return f"{text[: match.start()]} at column {int(match.group(1)) + 1}"


def audit_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of a possibly rotated log, oldest first: ``PATH.N ... PATH.1 PATH``.

    Backups are the existing ``PATH.<number>`` siblings; ``PATH`` itself is last (and
    left out when it does not exist, e.g. after a crash during rotation).
    """
    base = Path(path)
    pattern = re.compile(re.escape(base.name) + r"\.([1-9][0-9]*)")
    numbers: list[int] = []
    if base.parent.is_dir():
        for entry in os.scandir(base.parent):
            match = pattern.fullmatch(entry.name)
            if match and entry.is_file():
                numbers.append(int(match.group(1)))
    files = [rotated_name(base, n) for n in sorted(numbers, reverse=True)]
    if base.exists() or not files:
        files.append(base)
    return files


class AuditReader:
    """Stream the events of an audit log. Iterate it once.

    Args:
        source: a path (with ``rotated=True``, its rotated set, see
            [`audit_files()`][kvlife.fsm.audit.reader.audit_files]) or a sequence of paths read in
            the given order.
        rotated: take ``PATH``'s rotated backups too (only for a single path).
        strict: raise [`AuditFormatError`][kvlife.fsm.audit.reader.AuditFormatError] at the
            first problem instead of reporting it (torn tails are not problems).
        progress: called as ``progress(bytes_read, total_bytes)`` about every 4 MiB.

    After (or during) iteration: ``torn_tail`` (bytes skipped after the last newline of each
    file, summed), ``problems`` (the first
    [`MAX_PROBLEMS`][kvlife.fsm.audit.reader.MAX_PROBLEMS]), ``problem_count``, ``records``,
    ``segments``, ``files``.

    Raises (while iterating):
        FileNotFoundError, IsADirectoryError, PermissionError: a file cannot be opened.
        AuditFormatError: a file does not start with a kvlife header, a header has an
            unsupported schema version, or ``strict`` and a problem was found.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        rotated: bool = True,
        strict: bool = False,
        progress: Progress | None = None,
    ) -> None:
        if isinstance(source, (str, os.PathLike)):
            self.files = audit_files(source) if rotated else [Path(source)]
        else:
            self.files = [Path(p) for p in source]
            if not self.files:
                raise ValueError("no audit log files given")
        self.strict = strict
        self.progress = progress
        self.torn_tail = 0
        self.problems: list[AuditProblem] = []
        self.problem_count = 0
        self.records = 0
        self.lost_markers = 0
        self.closings = 0
        self.segments = 0
        self._started = False
        self._header: AuditHeader | None = None
        #: (lines, bytes) of the file last read that were complete: see ``read_lines``
        self.position = (0, 0)
        self._torn_here = 0

    def total_bytes(self) -> int:
        """The size of every file of the log together."""
        return sum(p.stat().st_size for p in self.files)

    def _problem(self, file: Path, line: int, offset: int, message: str) -> None:
        if self.strict:
            raise AuditFormatError(f"{file}:{line}: {message}")
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(AuditProblem(line, offset, message, str(file)))

    def __iter__(self) -> Iterator[Event]:
        if self._started:
            raise RuntimeError("an AuditReader can be iterated once")
        self._started = True
        total = self.total_bytes() if self.progress is not None else 0
        done = 0
        for position, file in enumerate(self.files):
            with open(file, "rb", buffering=1 << 20) as f:
                yield from self.read_lines(f, file, done=done, total=total)
            complete, offset = self.position
            # A later file of a rotated set may be empty or hold a torn header: the writer
            # was killed while rotating. The first file must hold at least a header.
            if complete == 0 and position == 0:
                raise AuditFormatError(
                    f"{file} has no complete line: not a kvlife audit log (no header)"
                )
            done += offset + self._torn_here
            if self.progress is not None:
                self.progress(done, total)

    def read_lines(
        self,
        f: BinaryIO,
        file: Path,
        *,
        line: int = 0,
        offset: int = 0,
        follow: bool = False,
        done: int = 0,
        total: int = 0,
    ) -> Iterator[Event]:
        """The events of ``f``'s complete lines from where it stands (line ``line`` and
        byte ``offset`` of ``file`` read before). A last line without its newline is a
        torn tail (counted in ``torn_tail``), or with ``follow`` a line still being
        written (left unread). Afterwards ``position`` is (the last complete line's number,
        the byte after it): where to go on from.

        Raises:
            AuditFormatError: as iterating the reader does.
        """
        name = str(file)
        decode_record = _RECORD.decode
        complete, end = line, offset
        self._torn_here = 0
        try:
            for number, text in enumerate(f, start=line + 1):
                start = end
                if text[-1:] != b"\n":
                    if not follow:
                        self.torn_tail += len(text)  # only the last line can lack it
                        self._torn_here = len(text)
                    break
                end += len(text)
                complete = number
                try:
                    record = decode_record(text)
                except (msgspec.DecodeError, RecursionError):
                    event = self._other_line(file, number, start, text)
                    if type(event) is AuditHeader:
                        continued = event.continues(self._header)
                        self._header = event
                        if not continued:
                            self.segments += 1
                            yield Segment(self.segments - 1, event, name)
                    elif type(event) is LostRecords:
                        self.lost_markers += 1
                        yield event
                    elif type(event) is ClosingRecord:
                        self.closings += 1
                        yield event
                    continue
                if number == 1:
                    raise self._not_a_log(file)
                try:
                    check_record(record)  # the one rule types cannot say
                except AuditSchemaError as exc:
                    self._problem(file, number, start, str(exc))
                    continue
                self.records += 1
                yield record
                if self.progress is not None and not number & 0x7FFF:
                    self.progress(done + end, total)
        finally:
            self.position = (complete, end)

    @staticmethod
    def _not_a_log(file: Path) -> AuditFormatError:
        return AuditFormatError(
            f"{file} is not a kvlife audit log: its first line is not a kvlife header"
        )

    def open_markers(self) -> dict[str, str]:
        """What the ``PATH.open`` marker beside each log read says (a writer keeps one
        while its log is open: its pid and when it opened), by log path; logs without
        one are left out."""
        markers: dict[str, str] = {}
        for file in self.files:
            base = str(file)
            if base in markers or re.search(r"\.[1-9][0-9]*$", file.name):
                continue  # a rotated backup: its log's marker is beside the newest file
            text = open_marker(file)
            if text is not None:
                markers[base] = text
        return markers

    def _other_line(
        self, file: Path, number: int, start: int, line: bytes
    ) -> AuditHeader | LostRecords | ClosingRecord | None:
        """A line that is not a record: a header, a lost marker, or a problem. A file's
        first line must be a header of this schema version."""
        try:
            obj = _ANY.decode(line)
        except (msgspec.DecodeError, RecursionError) as exc:
            # RecursionError: JSON nested deeper than the decoder goes (no record is)
            if number == 1:
                raise self._not_a_log(file) from None
            why = "nested too deep" if isinstance(exc, RecursionError) else _json_error(exc)
            self._problem(file, number, start, f"not JSON: {why}")
            return None
        if isinstance(obj, dict) and "kvlife_audit" in obj:
            version = obj["kvlife_audit"]
            if version != SCHEMA_VERSION or isinstance(version, bool):
                message = (
                    f"unsupported audit schema version {version!r} "
                    f"(this kvlife reads version {SCHEMA_VERSION})"
                )
                if number == 1:
                    raise AuditFormatError(f"{file}: {message}")
                self._problem(file, number, start, message)
                return None
            try:
                header = _HEADER.decode(line)
            except msgspec.DecodeError as exc:
                if number == 1:
                    raise AuditFormatError(f"{file}: bad kvlife header: {exc}") from None
                self._problem(file, number, start, f"bad header: {exc}")
                return None
            return header
        if number == 1:
            raise self._not_a_log(file)
        if isinstance(obj, dict) and "kvlife_lost" in obj:
            try:
                marker = _LOST.decode(line)
            except msgspec.DecodeError as exc:
                self._problem(file, number, start, f"bad lost-records marker: {exc}")
                return None
            return marker
        if isinstance(obj, dict) and "kvlife_closed" in obj:
            try:
                return _CLOSING.decode(line)
            except msgspec.DecodeError as exc:
                self._problem(file, number, start, f"bad closing record: {exc}")
                return None
        try:
            _RECORD.decode(line)
        except msgspec.DecodeError as exc:
            self._problem(file, number, start, f"not a schema-1 record: {exc}")
        return None


def open_marker(path: str | os.PathLike[str]) -> str | None:
    """What ``PATH.open`` says (``pid N, opened TIME``), or ``None`` when there is none."""
    marker = Path(f"{path}.open")
    try:
        return marker.read_text(errors="replace").strip() or "unknown"
    except OSError:
        return None


@dataclass
class AuditSegment:
    """The records written after one header (one registry's sink), in memory, and the
    closing record that ended it (``None``: it did not end with one)."""

    header: AuditHeader | None
    records: list[AuditRecord] = field(default_factory=list)
    lost: list[LostRecords] = field(default_factory=list)
    closing: ClosingRecord | None = None


@dataclass
class AuditLog:
    """What [`read_audit()`][kvlife.fsm.audit.reader.read_audit] read: segments of records plus the
    problems found.

    ``torn_tail`` is the number of bytes after the last newline (a crash mid-write); they
    were skipped. ``problems`` lists lines in the middle that were not valid records;
    they were skipped too, never joined with a neighbour.
    """

    segments: list[AuditSegment]
    torn_tail: int = 0
    problems: list[AuditProblem] = field(default_factory=list)
    problem_count: int = 0

    @property
    def records(self) -> list[AuditRecord]:
        """Every record of every segment, in file order."""
        return [r for segment in self.segments for r in segment.records]

    def events(self) -> Iterator[Event]:
        """The log as the reader's event stream (segments, records, lost markers)."""
        for index, segment in enumerate(self.segments):
            if segment.header is not None:
                yield Segment(index, segment.header, "")
            lost = iter(sorted(segment.lost, key=lambda m: m.first_seq))
            marker = next(lost, None)
            for record in segment.records:
                while marker is not None and marker.last_seq < record.seq:
                    yield marker  # where the writer put it: just before the records after it
                    marker = next(lost, None)
                yield record
            if marker is not None:
                yield marker
                yield from lost
            if segment.closing is not None:
                yield segment.closing


def read_audit(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    strict: bool = False,
    rotated: bool = True,
) -> AuditLog:
    """Read a whole audit log (and its rotated backups) into memory.

    Raises:
        FileNotFoundError: no such file.
        AuditFormatError: not a kvlife audit log; or ``strict`` and a problem was found
            (torn tails are not problems).
    """
    reader = AuditReader(source, strict=strict, rotated=rotated)
    log = AuditLog(segments=[])
    for event in reader:
        if type(event) is AuditRecord:
            log.segments[-1].records.append(event)
            log.segments[-1].closing = None  # records after a closing record reopen it
        elif type(event) is Segment:
            log.segments.append(AuditSegment(header=event.header))
        elif type(event) is LostRecords:
            log.segments[-1].lost.append(event)
        elif type(event) is ClosingRecord:
            log.segments[-1].closing = event
    log.torn_tail = reader.torn_tail
    log.problems = reader.problems
    log.problem_count = reader.problem_count
    return log


__all__ = [
    "MAX_PROBLEMS",
    "AuditFormatError",
    "AuditLog",
    "AuditProblem",
    "AuditReader",
    "AuditSchemaError",
    "AuditSegment",
    "Event",
    "Segment",
    "audit_files",
    "open_marker",
    "read_audit",
]

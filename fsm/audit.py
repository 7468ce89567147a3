"""The audit log (contract §4): records, sinks, a crash-tolerant reader and a checker.

A registry with no sink attached builds no record at all. With sinks attached, every
accepted and every refused transition (and every registration) becomes one
:class:`AuditRecord`, handed to each sink in ``seq`` order.

Sinks:

* :class:`MemorySink` -- an in-memory ring of the newest records.
* :class:`JsonLinesSink` -- a JSON-lines file with a header record, fsync policy
  ``"never"``, ``"batch"`` or ``"record"``; reopening a file for append first trims a
  torn tail left by a crash.
* :class:`LoggingSink` -- one stdlib ``logging`` call per record.

Reading (:func:`read_audit`) skips and reports a torn last line and reports (never joins)
corruption in the middle. Checking (:func:`check_audit`) replays a log against the
transition table.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import msgspec

from kvlife.fsm._version import __version__
from kvlife.fsm.errors import REASONS
from kvlife.fsm.table import LIFECYCLE, State, Trigger

#: The schema version written in every header and understood by the reader.
SCHEMA_VERSION: Final = 1

#: The trigger name of registration records (not a table trigger: it creates the instance).
REGISTER: Final = "register"

#: Allowed values of ``detail`` entries: small scalars only, never live objects.
DetailValue = int | float | str | bool | None


class AuditRecord(msgspec.Struct, frozen=True, gc=False):
    """One accepted or refused transition. Immutable; holds no live references.

    Fields follow schema version 1 of the contract (§4): ``seq`` is gap-free per registry;
    ``t_ns`` is ``time.monotonic_ns()``; ``serial`` is ``None`` only when no lifecycle was
    found (``unknown_request``); ``src`` is the state before (``None`` for a registration
    or when no lifecycle was found); ``dst`` is ``None`` when refused; ``reason`` is
    ``None`` when accepted; ``op`` is the ticket's copy number for ``start_offload``,
    ``ack`` and ``fail``; ``inflight`` is the copies in flight after the record; ``detail``
    holds small scalars (tokens, bytes, pages).

    A ``msgspec.Struct`` with ``gc=False``: building one costs about as much as a tuple and
    the cycle collector never scans the records a ring holds (they cannot form cycles:
    every field is a scalar or a dict of scalars).
    """

    seq: int
    t_ns: int
    rid: str | None
    serial: int | None
    trigger: str
    src: str | None
    dst: str | None
    ok: bool
    reason: str | None
    op: int | None
    inflight: int
    detail: dict[str, DetailValue]

    def to_json(self) -> str:
        """The record as one line of JSON (no newline)."""
        return encode_record(self)

    def replace(self, **changes: Any) -> AuditRecord:
        """A copy with some fields changed (records are immutable)."""
        return msgspec.structs.replace(self, **changes)


#: Field names in schema order.
RECORD_FIELDS: Final[tuple[str, ...]] = AuditRecord.__struct_fields__
_ENCODER: Final = msgspec.json.Encoder()
# JSON allows U+0085, U+2028 and U+2029 raw, but str.splitlines() (and JavaScript, for the
# last two) break lines there: they are escaped so a hostile rid stays on its one line for
# every reader. msgspec already escapes every character below U+0020.
_LINE_BREAKS: Final = (
    ("\u0085".encode(), b"\\u0085"),
    ("\u2028".encode(), b"\\u2028"),
    ("\u2029".encode(), b"\\u2029"),
)


def encode_lines(records: Iterable[AuditRecord]) -> bytes:
    """Encode records as JSON lines (UTF-8, each line ending in a newline).

    Strings are escaped by msgspec: quotes, backslashes, newlines and every control
    character including NUL; U+0085, U+2028 and U+2029 are escaped here. A hostile rid can
    never break a record into two lines, for any reader.
    """
    data = _ENCODER.encode_lines(records)
    if not data.isascii():
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data


def encode_record(record: AuditRecord) -> str:
    """Encode one record as a line of JSON, without the newline."""
    return encode_lines((record,))[:-1].decode()


class AuditSchemaError(ValueError):
    """A line of an audit log is valid JSON but not a schema-1 record or header."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def record_from_dict(obj: Mapping[str, Any]) -> AuditRecord:
    """Validate a decoded JSON object as a schema-1 record.

    Raises:
        AuditSchemaError: a field is missing, extra, or of the wrong type or value.
    """
    if set(obj) != set(RECORD_FIELDS):
        missing = sorted(set(RECORD_FIELDS) - set(obj))
        extra = sorted(set(obj) - set(RECORD_FIELDS))
        raise AuditSchemaError(
            f"record fields differ from schema 1: missing {missing}, extra {extra}"
        )
    states = {s.value for s in State}
    checks: list[tuple[str, bool]] = [
        ("seq", _is_int(obj["seq"]) and obj["seq"] >= 0),
        ("t_ns", _is_int(obj["t_ns"])),
        ("rid", obj["rid"] is None or isinstance(obj["rid"], str)),
        ("serial", obj["serial"] is None or (_is_int(obj["serial"]) and obj["serial"] >= 0)),
        ("trigger", obj["trigger"] == REGISTER or obj["trigger"] in {t.value for t in Trigger}),
        ("src", obj["src"] is None or obj["src"] in states),
        ("dst", obj["dst"] is None or obj["dst"] in states),
        ("ok", isinstance(obj["ok"], bool)),
        ("reason", obj["reason"] is None or obj["reason"] in REASONS),
        ("op", obj["op"] is None or (_is_int(obj["op"]) and obj["op"] >= 0)),
        ("inflight", _is_int(obj["inflight"]) and obj["inflight"] >= 0),
        ("detail", isinstance(obj["detail"], dict)),
    ]
    bad = [name for name, good in checks if not good]
    if bad:
        raise AuditSchemaError(f"bad value for {bad} in record {dict(obj)!r:.200}")
    if obj["ok"] != (obj["reason"] is None) or obj["ok"] != (obj["dst"] is not None):
        raise AuditSchemaError(f"ok/reason/dst disagree in record seq={obj['seq']}")
    return AuditRecord(**obj)


def make_header() -> dict[str, Any]:
    """The header record a JSON-lines file starts with (and each appended segment)."""
    return {
        "kvlife_audit": SCHEMA_VERSION,
        "library_version": __version__,
        "table": LIFECYCLE.digest,
        "pid": os.getpid(),
        "wall_start": time.time(),
        "t_ns_start": time.monotonic_ns(),
    }


# --------------------------------------------------------------------------- sinks


class MemorySink:
    """An in-memory ring of the newest ``capacity`` records.

    Appending is O(1); when the ring is full the oldest record is dropped (the ``seq`` of
    the oldest record held says how many went before it).
    """

    __slots__ = ("_ring", "write")

    def __init__(self, capacity: int = 65536) -> None:
        if not _is_int(capacity) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self._ring: deque[AuditRecord] = deque(maxlen=capacity)
        self.write = self._ring.append  # the hot path calls the deque directly

    @property
    def capacity(self) -> int:
        """Most records the ring keeps."""
        return self._ring.maxlen or 0

    def records(self) -> list[AuditRecord]:
        """The records held, oldest first."""
        return list(self._ring)

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator[AuditRecord]:
        return iter(list(self._ring))

    def clear(self) -> None:
        """Forget every record held."""
        self._ring.clear()

    def flush(self) -> None:
        """Nothing to flush; present so every sink can be flushed alike."""

    def close(self) -> None:
        """Nothing to close; present so every sink can be closed alike."""


FsyncPolicy = Literal["never", "batch", "record"]


def trim_torn_tail(path: str | os.PathLike[str]) -> int:
    """Cut a torn last line (bytes after the last newline) off ``path``.

    Returns the number of bytes removed (0 when the file ends with a newline, is empty or
    does not exist). Complete lines are never touched.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        end = size
        chunk = 65536
        while end > 0:
            start = max(0, end - chunk)
            os.lseek(fd, start, os.SEEK_SET)
            block = os.read(fd, end - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            os.ftruncate(fd, keep)
            os.fsync(fd)
        return size - keep
    finally:
        os.close(fd)


class JsonLinesSink:
    """Append records to a JSON-lines file, one record per line.

    On open, a torn tail left by a crash is trimmed first (``trimmed_bytes`` says how
    much), then a header record is appended: a file may hold several segments, each
    starting with its header.

    fsync policy:
        ``"never"``: records are buffered and written in batches; the OS decides when they
            reach the disk.
        ``"batch"``: records are buffered and written every ``batch_records`` records and
            on :meth:`flush`, each write followed by ``fsync``.
        ``"record"``: every record is written and fsynced before :meth:`write` returns.

    The file is closed by :meth:`close` (or the ``with`` block); records still buffered
    are written then.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy = "batch",
        batch_records: int = 4096,
    ) -> None:
        if fsync not in ("never", "batch", "record"):
            raise ValueError(f"fsync must be 'never', 'batch' or 'record', got {fsync!r}")
        if not _is_int(batch_records) or batch_records <= 0:
            raise ValueError(f"batch_records must be a positive int, got {batch_records!r}")
        self.path = Path(path)
        self.fsync: FsyncPolicy = fsync
        self.batch_records = batch_records
        self.trimmed_bytes = trim_torn_tail(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._buffer: list[AuditRecord] = []
        self.records_written = 0
        header = json.dumps(make_header(), separators=(",", ":"), ensure_ascii=True)
        self._write_bytes(f"{header}\n".encode("ascii"), sync=fsync != "never")
        self.write = self._write_record if fsync == "record" else self._buffer_record

    def _write_bytes(self, data: bytes, *, sync: bool) -> None:
        fd = self._fd
        if fd is None:
            raise ValueError(f"audit sink {self.path} is closed")
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if sync:
            os.fsync(fd)

    def _write_record(self, record: AuditRecord) -> None:
        self._write_bytes(encode_lines((record,)), sync=True)
        self.records_written += 1

    def _buffer_record(self, record: AuditRecord) -> None:
        buffer = self._buffer
        buffer.append(record)  # encoded in batches: one msgspec call per flush
        if len(buffer) >= self.batch_records:
            self.flush()

    def flush(self) -> None:
        """Write buffered records (and fsync unless the policy is ``"never"``)."""
        if not self._buffer:
            return
        records = self._buffer
        self._buffer = []
        self._write_bytes(encode_lines(records), sync=self.fsync != "never")
        self.records_written += len(records)

    def close(self) -> None:
        """Flush and close the file. Closing twice is harmless."""
        if self._fd is None:
            return
        self.flush()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> JsonLinesSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoggingSink:
    """Send each record to a stdlib logger as one JSON line (built only when enabled)."""

    def __init__(self, logger: logging.Logger | str = "kvlife.audit", level: int = logging.INFO):
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.level = level

    def write(self, record: AuditRecord) -> None:
        """Log the record if the logger is enabled for the sink's level."""
        if self.logger.isEnabledFor(self.level):
            self.logger.log(self.level, "%s", encode_record(record))

    def flush(self) -> None:
        """Flush the logger's handlers."""
        for handler in self.logger.handlers:
            handler.flush()

    def close(self) -> None:
        """Flush; the logger itself belongs to the application."""
        self.flush()


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class AuditProblem:
    """Something the reader could not take as a record: where, and why."""

    line: int  # 1-based line number
    offset: int  # byte offset of the line's start
    message: str


@dataclass
class AuditSegment:
    """The records written after one header (one registry's sink)."""

    header: dict[str, Any] | None
    records: list[AuditRecord] = field(default_factory=list)


@dataclass
class AuditLog:
    """What :func:`read_audit` read: segments of records plus the problems found.

    ``torn_tail`` is the number of bytes after the last newline (a crash mid-write); they
    were skipped. ``problems`` lists lines in the middle that were not valid records;
    they were skipped too, never joined with a neighbour.
    """

    segments: list[AuditSegment]
    torn_tail: int = 0
    problems: list[AuditProblem] = field(default_factory=list)

    @property
    def records(self) -> list[AuditRecord]:
        """Every record of every segment, in file order."""
        return [r for segment in self.segments for r in segment.records]


class AuditFormatError(ValueError):
    """The file is not a kvlife audit log (raised by :func:`read_audit` in strict mode)."""


def read_audit(path: str | os.PathLike[str], *, strict: bool = False) -> AuditLog:
    """Read a JSON-lines audit log, tolerating a crash.

    A torn last line is skipped and counted in ``torn_tail``. A complete line that is not
    a valid record or header is reported in ``problems`` and skipped; with
    ``strict=True`` it raises :class:`AuditFormatError` instead. A file whose first line
    is not a header is reported the same way.

    Raises:
        FileNotFoundError: no such file.
        AuditFormatError: ``strict`` and a problem was found (torn tails are not problems).
    """
    data = Path(path).read_bytes()
    end = data.rfind(b"\n") + 1
    log = AuditLog(segments=[], torn_tail=len(data) - end)
    offset = 0
    for number, raw in enumerate(data[:end].split(b"\n")[:-1], start=1):
        start = offset
        offset += len(raw) + 1
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise AuditSchemaError("a line is not a JSON object")
            if "kvlife_audit" in obj:
                if obj["kvlife_audit"] != SCHEMA_VERSION:
                    raise AuditSchemaError(f"unsupported schema version {obj['kvlife_audit']!r}")
                log.segments.append(AuditSegment(header=obj))
                continue
            record = record_from_dict(obj)
        except (ValueError, TypeError) as exc:
            problem = AuditProblem(number, start, f"{type(exc).__name__}: {exc}")
            if strict:
                raise AuditFormatError(f"{path}:{number}: {problem.message}") from None
            log.problems.append(problem)
            continue
        if not log.segments:
            problem = AuditProblem(number, start, "record before any header")
            if strict:
                raise AuditFormatError(f"{path}:{number}: {problem.message}")
            log.problems.append(problem)
            log.segments.append(AuditSegment(header=None))
        log.segments[-1].records.append(record)
    return log


# --------------------------------------------------------------------------- checking

ViolationKind = Literal[
    "seq_gap",
    "illegal_transition",
    "state_mismatch",
    "inflight_mismatch",
    "wrong_instance",
    "unknown_op",
    "duplicate_completion",
    "serial_reused",
    "unknown_instance",
    "leaked",
]


@dataclass(frozen=True)
class Violation:
    """One thing in a log that the table or the contract does not allow."""

    kind: ViolationKind
    seq: int | None
    serial: int | None
    message: str


@dataclass(frozen=True)
class InstanceSummary:
    """A lifecycle instance as replayed from the log."""

    serial: int
    rid: str | None
    state: str
    inflight: int
    transitions: int
    refusals: int


@dataclass
class AuditReport:
    """The result of :func:`check_audit`.

    ``instances`` maps (segment index, serial) to the replayed final state of each
    lifecycle instance; ``live`` lists those not released at the end.
    """

    records: int = 0
    segments: int = 0
    violations: list[Violation] = field(default_factory=list)
    instances: dict[tuple[int, int], InstanceSummary] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    transitions: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No violations."""
        return not self.violations

    @property
    def live(self) -> list[InstanceSummary]:
        """Instances not released at the end of the log."""
        return [i for i in self.instances.values() if i.state != State.RELEASED.value]


@dataclass
class _Replay:
    rid: str | None
    state: str
    inflight: int = 0
    transitions: int = 0
    refusals: int = 0


_BEFORE: Final[dict[str, int]] = {"start_offload": -1, "ack": 1, "fail": 1, "finish": 0, "abort": 0}


def check_audit(
    source: AuditLog | Iterable[AuditRecord], *, expect_released: bool = False
) -> AuditReport:
    """Replay audit records against the transition table.

    Per segment (each header starts a new registry): ``seq`` must be gap-free; every
    accepted transition must be legal from the instance's previous state with its
    in-flight count; every refusal must leave the instance as it was; every ``ack``/
    ``fail`` must name a copy that the same instance started and that was not completed
    before; serials are never reused. With ``expect_released``, instances not released at
    the end are violations (``leaked``); otherwise they are listed in ``report.live``.
    """
    if isinstance(source, AuditLog):
        segments = [segment.records for segment in source.segments]
    else:
        segments = [list(source)]
    report = AuditReport(segments=len(segments))
    for index, records in enumerate(segments):
        _check_segment(index, records, report)
    if expect_released:
        for (_, serial), inst in report.instances.items():
            if inst.state != State.RELEASED.value:
                report.violations.append(
                    Violation(
                        "leaked",
                        None,
                        serial,
                        f"lifecycle {serial} ({inst.rid!r}) "
                        f"ended {inst.state} with {inst.inflight} in flight",
                    )
                )
    return report


def _check_segment(index: int, records: list[AuditRecord], report: AuditReport) -> None:
    replay: dict[int, _Replay] = {}
    op_owner: dict[int, int] = {}
    completed: set[int] = set()
    previous_seq: int | None = None
    bad = report.violations.append
    for r in records:
        report.records += 1
        if previous_seq is not None and r.seq != previous_seq + 1:
            bad(Violation("seq_gap", r.seq, r.serial, f"seq {previous_seq} is followed by {r.seq}"))
        previous_seq = r.seq
        if not r.ok:
            report.refusals[r.reason or "?"] = report.refusals.get(r.reason or "?", 0) + 1
            inst = replay.get(r.serial) if r.serial is not None else None
            if inst is not None:
                inst.refusals += 1
                if r.src is not None and r.src != inst.state:
                    bad(
                        Violation(
                            "state_mismatch",
                            r.seq,
                            r.serial,
                            f"refusal reports state {r.src} but the instance is {inst.state}",
                        )
                    )
            continue
        report.transitions[r.trigger] = report.transitions.get(r.trigger, 0) + 1
        if r.serial is None:
            bad(Violation("unknown_instance", r.seq, None, "accepted record without a serial"))
            continue
        if r.trigger == REGISTER:
            if r.serial in replay:
                bad(
                    Violation(
                        "serial_reused", r.seq, r.serial, f"serial {r.serial} registered twice"
                    )
                )
            replay[r.serial] = _Replay(rid=r.rid, state=r.dst or "?")
            if r.dst != State.ALLOCATED.value or r.inflight != 0:
                bad(
                    Violation(
                        "illegal_transition",
                        r.seq,
                        r.serial,
                        f"registration to {r.dst} with {r.inflight} in flight",
                    )
                )
            continue
        inst = replay.get(r.serial)
        if inst is None:
            # The log starts after this instance was registered (a late sink, a ring):
            # take the record's own source state as the truth.
            inst = replay[r.serial] = _Replay(
                rid=r.rid, state=r.src or "?", inflight=r.inflight + _BEFORE[r.trigger]
            )
        if r.src != inst.state:
            bad(
                Violation(
                    "state_mismatch",
                    r.seq,
                    r.serial,
                    f"{r.trigger} from {r.src} but the instance was {inst.state}",
                )
            )
        before = r.inflight + _BEFORE[r.trigger]
        if before != inst.inflight:
            bad(
                Violation(
                    "inflight_mismatch",
                    r.seq,
                    r.serial,
                    f"{r.trigger} implies {before} in flight before, replay has {inst.inflight}",
                )
            )
        expected = _legal_next(r.src, r.trigger, before)
        if expected is None or expected != r.dst:
            bad(
                Violation(
                    "illegal_transition",
                    r.seq,
                    r.serial,
                    f"{r.src} --{r.trigger} (inflight {before})--> {r.dst} is not in the "
                    f"table (table says {expected})",
                )
            )
        if r.trigger == Trigger.START_OFFLOAD.value and r.op is not None:
            op_owner[r.op] = r.serial
        elif r.trigger in ("ack", "fail"):
            if r.op is None or r.op not in op_owner:
                bad(
                    Violation(
                        "unknown_op", r.seq, r.serial, f"{r.trigger} of copy {r.op} never started"
                    )
                )
            elif op_owner[r.op] != r.serial:
                bad(
                    Violation(
                        "wrong_instance",
                        r.seq,
                        r.serial,
                        f"copy {r.op} was started by lifecycle {op_owner[r.op]}, "
                        f"completed on lifecycle {r.serial}",
                    )
                )
            elif r.op in completed:
                bad(
                    Violation(
                        "duplicate_completion", r.seq, r.serial, f"copy {r.op} completed twice"
                    )
                )
            if r.op is not None:
                completed.add(r.op)
        inst.state = r.dst or inst.state
        inst.inflight = r.inflight
        inst.transitions += 1
    for serial, inst in replay.items():
        report.instances[(index, serial)] = InstanceSummary(
            serial, inst.rid, inst.state, inst.inflight, inst.transitions, inst.refusals
        )


def _legal_next(src: str | None, trigger: str, inflight_before: int) -> str | None:
    if src is None or src not in {s.value for s in State}:
        return None
    try:
        dst = LIFECYCLE.next_state(State(src), Trigger(trigger), inflight_before)
    except ValueError:
        return None
    return None if dst is None else dst.value


__all__ = [
    "REGISTER",
    "SCHEMA_VERSION",
    "AuditFormatError",
    "AuditLog",
    "AuditProblem",
    "AuditRecord",
    "AuditReport",
    "AuditSchemaError",
    "AuditSegment",
    "InstanceSummary",
    "JsonLinesSink",
    "LoggingSink",
    "MemorySink",
    "Violation",
    "check_audit",
    "encode_record",
    "read_audit",
    "record_from_dict",
    "trim_torn_tail",
]

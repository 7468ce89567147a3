"""What an audit log holds: records, headers and lost-record markers, and their encoding.

An audit log is JSON lines. Each writer (one sink of one registry) starts a *segment* with
an [`AuditHeader`][kvlife.fsm.audit.records.AuditHeader]; a size-rotated file continues its
segment in the next file with a header of the same ``segment`` id and the next ``part``.
Then come [`AuditRecord`][kvlife.fsm.audit.records.AuditRecord] lines (one per accepted or refused
transition, ``seq`` gap-free per segment) and, only after a sink failed,
[`LostRecords`][kvlife.fsm.audit.records.LostRecords] markers naming the ``seq`` range that could
not be written. A writer that closes its segment cleanly ends it with a
[`ClosingRecord`][kvlife.fsm.audit.records.ClosingRecord]: a segment whose header says its writer
closes (``closes``) and that ends without one was cut short (a crash, a kill, a full
disk).

Decoding is typed (msgspec): a line is a record only if every field has the schema's
type and value set, so the reader validates at C speed.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterable
from typing import Annotated, Any, Final, Literal, get_args

import msgspec

from kvlife.fsm import native
from kvlife.fsm._version import __version__
from kvlife.fsm.errors import Reason
from kvlife.fsm.table import LIFECYCLE, State, Trigger

SCHEMA_VERSION: Final = 1
"""The schema version written in every header and understood by the reader."""

REGISTER: Final = "register"
"""The trigger name of registration records (not a table trigger: it creates the instance)."""

DetailValue = int | float | str | bool | None
"""Allowed values of ``detail`` entries: small scalars only, never live objects."""

StateName = Literal["allocated", "offloading", "finished_pending", "released"]
"""State names as written in records."""
TriggerName = Literal["register", "start_offload", "ack", "fail", "finish", "abort"]
"""Trigger names as written in records (the table's triggers plus ``register``)."""

# The literal sets above restate the table's names so that decoding checks them in C; the
# import fails loudly if the table and the schema ever drift apart.
if set(get_args(StateName)) != {s.value for s in State} or set(get_args(TriggerName)) != {
    REGISTER,
    *(t.value for t in Trigger),
}:  # pragma: no cover - a table edit without a schema edit
    raise ImportError("kvlife.fsm.audit.records: StateName/TriggerName differ from the table")

_Count = Annotated[int, msgspec.Meta(ge=0)]


class AuditRecord(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """One accepted or refused transition. Immutable; holds no live references.

    Fields (schema version 1, see the audit page of the manual): ``seq`` is gap-free per
    segment; ``t_ns`` is ``time.monotonic_ns()``; ``serial`` is ``None`` only when no
    lifecycle was found (``unknown_request``); ``src`` is the state before (``None`` for a
    registration or when no lifecycle was found); ``dst`` is ``None`` when refused;
    ``reason`` is ``None`` when accepted; ``op`` is the ticket's copy number for
    ``start_offload``, ``ack`` and ``fail``; ``inflight`` is the copies in flight after the
    record; ``detail`` holds small scalars (tokens, bytes, pages).

    A ``msgspec.Struct`` with ``gc=False``: building one costs about as much as a tuple and
    the cycle collector never scans the records a ring holds (they cannot form cycles:
    every field is a scalar or a dict of scalars). Field types are checked when a record
    is decoded, not when the registry builds one.
    """

    seq: _Count
    t_ns: int
    rid: str | None
    serial: _Count | None
    trigger: TriggerName
    src: StateName | None
    dst: StateName | None
    ok: bool
    reason: Reason | None
    op: _Count | None
    inflight: _Count
    detail: dict[str, DetailValue]

    def to_json(self) -> str:
        """The record as one line of JSON (no newline)."""
        return encode_record(self)

    def replace(self, **changes: Any) -> AuditRecord:
        """A copy with some fields changed (records are immutable)."""
        return msgspec.structs.replace(self, **changes)


class AuditHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The first line of every segment, and of every rotated file of a segment.

    ``segment`` identifies one writer (a sink opened once); ``part`` counts the files a
    size-rotated segment was split into (0 for the first). ``table`` is the transition
    table's digest: a log is replayed only against the table that wrote it. Logs written
    before rotation existed have no ``segment``/``part``; every header of theirs starts a
    new segment.

    ``witness`` is empty in a log of kvlife's own lifecycles. A log that kvlife wrote while
    watching another component (a vLLM connector it wraps) names that component there:
    in such a segment every ticket still open at the end is a report the component never
    made, and ``kvlife audit check`` counts it as a violation (``unreported``).
    """

    kvlife_audit: int
    library_version: str
    table: str
    pid: int
    wall_start: float
    t_ns_start: int
    segment: str = ""
    part: _Count = 0
    witness: str = ""
    #: Which build of kvlife's hot path wrote the log (``kvlife.fsm.native.describe()``:
    #: ``"compiled (mypyc 2.4.1, 7 modules)"`` or ``"pure Python (...)"``); empty in logs
    #: written before builds were told apart.
    build: str = ""
    #: The writer ends the segment with a closing record when it closes cleanly: a
    #: segment that ends without one was cut short. ``False`` in logs written before
    #: closing records existed: how they ended is unknown.
    closes: bool = False

    def continues(self, previous: AuditHeader | None) -> bool:
        """Whether this header continues ``previous``'s segment (a rotated file)."""
        return (
            previous is not None
            and bool(self.segment)
            and self.segment == previous.segment
            and self.part == previous.part + 1
        )


class LostRecords(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """Records ``first_seq`` to ``last_seq`` of this segment were dropped: a sink kept
    failing and the registry's bounded backlog for it overflowed. ``error`` is the sink's
    last error. The checker reports such a range as "records lost (sink error)", not as
    a gap (tampering)."""

    kvlife_lost: _Count  # how many records: last_seq - first_seq + 1
    first_seq: _Count
    last_seq: _Count
    error: str


ClosingHow = Literal["close", "signal", "exit"]
"""How a writer closed its segment: ``close`` (the sink was closed), ``signal`` (the
process was told to stop, SIGTERM or SIGINT, and settled its log first; a kill usually
follows), ``exit`` (interpreter exit, or the sink was collected)."""


class ClosingRecord(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """The last line of a segment whose writer closed it cleanly.

    ``kvlife_closed`` says how (see [`ClosingHow`][kvlife.fsm.audit.records.ClosingHow]);
    ``t_ns`` (``time.monotonic_ns()``) and ``wall`` (``time.time()``) when; ``records``
    how many records (and lost markers) the writer wrote in the segment; ``live`` and
    ``open_tickets`` the lifecycles still live and the copies still in flight as the
    writer's registry counted them at that moment (``None`` when the sink was not
    attached to a registry). Records after it (a writer that settled on a signal and
    went on) make the segment open again: only a closing record that is the segment's
    last line closes it.
    """

    kvlife_closed: ClosingHow
    t_ns: int
    wall: float
    records: _Count
    live: _Count | None = None
    open_tickets: _Count | None = None


def make_closing(
    how: ClosingHow, records: int, state: tuple[int, int] | None = None
) -> ClosingRecord:
    """A closing record now; ``state`` is ``(live lifecycles, copies in flight)``."""
    live, open_tickets = state if state is not None else (None, None)
    return ClosingRecord(how, time.monotonic_ns(), time.time(), records, live, open_tickets)


RECORD_FIELDS: Final[tuple[str, ...]] = AuditRecord.__struct_fields__
"""Field names in schema order."""

_ENCODER: Final = msgspec.json.Encoder()
# JSON allows U+0085, U+2028 and U+2029 raw, but str.splitlines() (and JavaScript, for the
# last two) break lines there: they are escaped so a hostile rid stays on its one line for
# every reader. msgspec already escapes every character below U+0020.
_LINE_BREAKS: Final = (
    ("\u0085".encode(), b"\\u0085"),
    ("\u2028".encode(), b"\\u2028"),
    ("\u2029".encode(), b"\\u2029"),
)


def encode_lines(
    items: Iterable[AuditRecord | LostRecords | AuditHeader | ClosingRecord],
) -> bytes:
    """Encode records (and markers) as JSON lines (UTF-8, each line ending in a newline).

    Strings are escaped by msgspec: quotes, backslashes, newlines and every control
    character including NUL; U+0085, U+2028 and U+2029 are escaped here. A hostile rid can
    never break a record into two lines, for any reader.
    """
    data = _ENCODER.encode_lines(items)
    if not data.isascii():
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data


def encode_record(record: AuditRecord) -> str:
    """Encode one record as a line of JSON, without the newline."""
    return encode_lines((record,))[:-1].decode()


class AuditSchemaError(ValueError):
    """A line of an audit log is valid JSON but not a schema-1 record or header."""


def check_record(record: AuditRecord) -> AuditRecord:
    """The one rule typed decoding cannot express: ``ok`` is true exactly when there is
    a ``dst`` and no ``reason``.

    Raises:
        AuditSchemaError: they disagree.
    """
    if record.ok is not (record.reason is None) or record.ok is not (record.dst is not None):
        raise AuditSchemaError(f"ok/reason/dst disagree in record seq={record.seq}")
    return record


def record_from_dict(obj: Any) -> AuditRecord:
    """Validate a decoded JSON object as a schema-1 record.

    Raises:
        AuditSchemaError: a field is missing, extra, or of the wrong type or value.
    """
    try:
        record = msgspec.convert(obj, AuditRecord)
    except msgspec.ValidationError as exc:
        raise AuditSchemaError(f"not a schema-1 record: {exc}") from None
    return check_record(record)


def make_header(
    segment: str | None = None, part: int = 0, witness: str = "", *, closes: bool = False
) -> AuditHeader:
    """The header a segment (and each of its rotated files) starts with; ``witness``
    names the component a watching writer audits, ``closes`` says the writer ends the
    segment with a closing record (see [`AuditHeader`][kvlife.fsm.audit.records.AuditHeader])."""
    return AuditHeader(
        kvlife_audit=SCHEMA_VERSION,
        library_version=__version__,
        table=LIFECYCLE.digest,
        pid=os.getpid(),
        wall_start=time.time(),
        t_ns_start=time.monotonic_ns(),
        segment=segment if segment is not None else secrets.token_hex(8),
        part=part,
        witness=witness,
        closes=closes,
        build=native.describe(),
    )


TICKET_DETAIL: Final = ("kind", "tokens", "blocks", "first_block")
"""The one vocabulary of a ticket's ``start_offload`` detail, whoever writes it (the
offload planner, the manager, the vLLM connector, the audit wrapper), so that the checker,
``why`` and the pictures read one: ``kind`` (``store``, ``load`` or ``delayed_free``),
``tokens`` (where the writer counts them), ``blocks`` (the blocks, or host pages of one
block each, the copy moves) and ``first_block`` (the index of its first block among the
request's). A writer may add keys of its own (the wrapper's ``cut_by`` on a completion)."""

__all__ = [
    "RECORD_FIELDS",
    "REGISTER",
    "SCHEMA_VERSION",
    "TICKET_DETAIL",
    "AuditHeader",
    "AuditRecord",
    "AuditSchemaError",
    "ClosingHow",
    "ClosingRecord",
    "DetailValue",
    "LostRecords",
    "StateName",
    "TriggerName",
    "check_record",
    "encode_lines",
    "encode_record",
    "make_closing",
    "make_header",
    "record_from_dict",
]

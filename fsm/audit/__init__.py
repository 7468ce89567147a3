"""The audit log: records, sinks, a streaming crash-tolerant reader and a checker.

This package's top level gathers the audit API; the parts are its modules
[`records`][kvlife.fsm.audit.records] (what a log holds),
[`sinks`][kvlife.fsm.audit.sinks] (where records go),
[`guard`][kvlife.fsm.audit.guard] (what a registry does when a sink fails),
[`reader`][kvlife.fsm.audit.reader] (reading),
[`checker`][kvlife.fsm.audit.checker] (replaying),
[`explain`][kvlife.fsm.audit.explain] (one rid's story, ``kvlife audit why``) and
[`metrics`][kvlife.fsm.audit.metrics] (Prometheus counters; needs ``kvlife[metrics]`` and is
imported only by name).

A registry with no sink attached builds no record at all. With sinks attached, every
accepted and every refused transition (and every registration) becomes one
[`AuditRecord`][kvlife.fsm.audit.records.AuditRecord], handed to each sink in ``seq`` order, after
the transition was applied whole; a failing sink never changes what the registry does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlife.fsm._lazy import lazy_names
from kvlife.fsm.audit.guard import SinkStatistics
from kvlife.fsm.audit.records import (
    RECORD_FIELDS,
    REGISTER,
    SCHEMA_VERSION,
    TICKET_DETAIL,
    AuditHeader,
    AuditRecord,
    AuditSchemaError,
    ClosingHow,
    ClosingRecord,
    DetailValue,
    LostRecords,
    encode_lines,
    encode_record,
    make_header,
    record_from_dict,
)
from kvlife.fsm.audit.sinks import (
    AuditLogBusyError,
    AuditSinkClosedError,
    AuditSinkError,
    FsyncPolicy,
    JsonLinesSink,
    LoggingSink,
    MemorySink,
    trim_torn_tail,
)

if TYPE_CHECKING:
    from kvlife.fsm.audit.checker import (
        MAX_REUSES,
        MAX_VIOLATIONS,
        VIOLATION_MEANINGS,
        AuditChecker,
        AuditReport,
        AuditTableMismatchError,
        InstanceSummary,
        OpenAtEnd,
        RidReuse,
        SegmentEnding,
        SegmentStatus,
        Verdict,
        Violation,
        ViolationKind,
        check_audit,
        ending_lines,
        fed,
        violations_by_record,
    )
    from kvlife.fsm.audit.reader import (
        MAX_PROBLEMS,
        AuditFormatError,
        AuditLog,
        AuditProblem,
        AuditReader,
        AuditSegment,
        Event,
        Segment,
        audit_files,
        open_marker,
        read_audit,
        segment_records,
    )

# The reader and the checker load when one of their names is first asked for: a registry
# (which needs only records, the guard and sinks) never loads them.
_LAZY = {
    "MAX_REUSES": "kvlife.fsm.audit.checker",
    "MAX_VIOLATIONS": "kvlife.fsm.audit.checker",
    "VIOLATION_MEANINGS": "kvlife.fsm.audit.checker",
    "AuditChecker": "kvlife.fsm.audit.checker",
    "AuditReport": "kvlife.fsm.audit.checker",
    "AuditTableMismatchError": "kvlife.fsm.audit.checker",
    "InstanceSummary": "kvlife.fsm.audit.checker",
    "OpenAtEnd": "kvlife.fsm.audit.checker",
    "RidReuse": "kvlife.fsm.audit.checker",
    "SegmentEnding": "kvlife.fsm.audit.checker",
    "SegmentStatus": "kvlife.fsm.audit.checker",
    "ending_lines": "kvlife.fsm.audit.checker",
    "Verdict": "kvlife.fsm.audit.checker",
    "Violation": "kvlife.fsm.audit.checker",
    "ViolationKind": "kvlife.fsm.audit.checker",
    "check_audit": "kvlife.fsm.audit.checker",
    "fed": "kvlife.fsm.audit.checker",
    "violations_by_record": "kvlife.fsm.audit.checker",
    "MAX_PROBLEMS": "kvlife.fsm.audit.reader",
    "AuditFormatError": "kvlife.fsm.audit.reader",
    "AuditLog": "kvlife.fsm.audit.reader",
    "AuditProblem": "kvlife.fsm.audit.reader",
    "AuditReader": "kvlife.fsm.audit.reader",
    "AuditSegment": "kvlife.fsm.audit.reader",
    "Event": "kvlife.fsm.audit.reader",
    "Segment": "kvlife.fsm.audit.reader",
    "audit_files": "kvlife.fsm.audit.reader",
    "open_marker": "kvlife.fsm.audit.reader",
    "read_audit": "kvlife.fsm.audit.reader",
    "segment_records": "kvlife.fsm.audit.reader",
}


_load = lazy_names(globals(), _LAZY)


def __getattr__(name: str) -> Any:
    return _load(name)


__all__ = [
    "MAX_PROBLEMS",
    "MAX_REUSES",
    "MAX_VIOLATIONS",
    "RECORD_FIELDS",
    "REGISTER",
    "SCHEMA_VERSION",
    "TICKET_DETAIL",
    "VIOLATION_MEANINGS",
    "AuditChecker",
    "AuditFormatError",
    "AuditHeader",
    "AuditLog",
    "AuditLogBusyError",
    "AuditProblem",
    "AuditReader",
    "AuditRecord",
    "AuditReport",
    "AuditSchemaError",
    "AuditSegment",
    "AuditSinkClosedError",
    "AuditSinkError",
    "AuditTableMismatchError",
    "ClosingHow",
    "ClosingRecord",
    "DetailValue",
    "Event",
    "FsyncPolicy",
    "InstanceSummary",
    "JsonLinesSink",
    "LoggingSink",
    "LostRecords",
    "MemorySink",
    "OpenAtEnd",
    "RidReuse",
    "Segment",
    "SegmentEnding",
    "SegmentStatus",
    "SinkStatistics",
    "Verdict",
    "Violation",
    "ViolationKind",
    "audit_files",
    "check_audit",
    "encode_lines",
    "encode_record",
    "ending_lines",
    "fed",
    "make_header",
    "open_marker",
    "read_audit",
    "record_from_dict",
    "segment_records",
    "trim_torn_tail",
    "violations_by_record",
]

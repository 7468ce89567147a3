"""The audit log: records, sinks, a streaming crash-tolerant reader and a checker.

This module gathers the audit API in one place; the parts live in
[`kvlife.fsm.records`][kvlife.fsm.records] (what a log holds),
[`kvlife.fsm.sinks`][kvlife.fsm.sinks] (where records go),
[`kvlife.fsm.sink_guard`][kvlife.fsm.sink_guard] (what a registry does when a sink fails),
[`kvlife.fsm.reader`][kvlife.fsm.reader] (reading) and
[`kvlife.fsm.checker`][kvlife.fsm.checker] (replaying).

A registry with no sink attached builds no record at all. With sinks attached, every
accepted and every refused transition (and every registration) becomes one
[`AuditRecord`][kvlife.fsm.records.AuditRecord], handed to each sink in ``seq`` order, after
the transition was applied whole; a failing sink never changes what the registry does.
"""

from __future__ import annotations

from kvlife.fsm.checker import (
    MAX_REUSES,
    MAX_VIOLATIONS,
    VIOLATION_MEANINGS,
    AuditChecker,
    AuditReport,
    AuditTableMismatchError,
    InstanceSummary,
    RidReuse,
    Verdict,
    Violation,
    ViolationKind,
    check_audit,
    fed,
    violations_by_record,
)
from kvlife.fsm.reader import (
    MAX_PROBLEMS,
    AuditFormatError,
    AuditLog,
    AuditProblem,
    AuditReader,
    AuditSegment,
    Event,
    Segment,
    audit_files,
    read_audit,
    segment_records,
)
from kvlife.fsm.records import (
    RECORD_FIELDS,
    REGISTER,
    SCHEMA_VERSION,
    AuditHeader,
    AuditRecord,
    AuditSchemaError,
    DetailValue,
    LostRecords,
    encode_lines,
    encode_record,
    make_header,
    record_from_dict,
)
from kvlife.fsm.sink_guard import SinkStatistics
from kvlife.fsm.sinks import (
    AuditSinkClosedError,
    AuditSinkError,
    FsyncPolicy,
    JsonLinesSink,
    LoggingSink,
    MemorySink,
    trim_torn_tail,
)

__all__ = [
    "MAX_PROBLEMS",
    "MAX_REUSES",
    "MAX_VIOLATIONS",
    "RECORD_FIELDS",
    "REGISTER",
    "SCHEMA_VERSION",
    "VIOLATION_MEANINGS",
    "AuditChecker",
    "AuditFormatError",
    "AuditHeader",
    "AuditLog",
    "AuditProblem",
    "AuditReader",
    "AuditRecord",
    "AuditReport",
    "AuditSchemaError",
    "AuditSegment",
    "AuditSinkClosedError",
    "AuditSinkError",
    "AuditTableMismatchError",
    "DetailValue",
    "Event",
    "FsyncPolicy",
    "InstanceSummary",
    "JsonLinesSink",
    "LoggingSink",
    "LostRecords",
    "MemorySink",
    "RidReuse",
    "Segment",
    "SinkStatistics",
    "Verdict",
    "Violation",
    "ViolationKind",
    "audit_files",
    "check_audit",
    "encode_lines",
    "encode_record",
    "fed",
    "make_header",
    "read_audit",
    "record_from_dict",
    "segment_records",
    "trim_torn_tail",
    "violations_by_record",
]

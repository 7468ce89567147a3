"""kvlife.fsm: per-request lifecycle state machines for KV-cache offload.

The pure core of kvlife (no torch, no graphviz): the one transition table
([`kvlife.fsm.table`][kvlife.fsm.table]), the identity registry with its lifecycles and
tickets ([`kvlife.fsm.registry`][kvlife.fsm.registry]), the typed errors
([`kvlife.fsm.errors`][kvlife.fsm.errors]) and the audit log
([`kvlife.fsm.audit`][kvlife.fsm.audit]).

Typical use in a scheduler::

    registry = LifecycleRegistry(sinks=[MemorySink()])
    lc = registry.register(req)              # rid from req.rid
    ticket = registry.start_offload(req, tokens=16)
    ...                                      # the copy's CUDA event completes
    registry.complete(ticket)                # ack; ok=False for a failed copy
    registry.finish(req)                     # released once no copy is in flight
"""

from __future__ import annotations

from kvlife.fsm._version import __version__
from kvlife.fsm.audit import (
    AuditChecker,
    AuditLog,
    AuditReader,
    AuditRecord,
    AuditReport,
    JsonLinesSink,
    LoggingSink,
    LostRecords,
    MemorySink,
    SinkStatistics,
    check_audit,
    read_audit,
)
from kvlife.fsm.errors import (
    DuplicateAckError,
    DuplicateRegistrationError,
    InvalidTransitionError,
    LifecycleError,
    Reason,
    RidConflictError,
    StaleInstanceError,
    TableDefinitionError,
    UnknownRequestError,
    WrongThreadError,
)
from kvlife.fsm.registry import Lifecycle, LifecycleRegistry, RegistryStatistics, Ticket
from kvlife.fsm.table import LIFECYCLE, LIFECYCLE_EDGES, Edge, Guard, State, Trigger

__all__ = [
    "LIFECYCLE",
    "LIFECYCLE_EDGES",
    "AuditChecker",
    "AuditLog",
    "AuditReader",
    "AuditRecord",
    "AuditReport",
    "DuplicateAckError",
    "DuplicateRegistrationError",
    "Edge",
    "Guard",
    "InvalidTransitionError",
    "JsonLinesSink",
    "Lifecycle",
    "LifecycleError",
    "LifecycleRegistry",
    "LoggingSink",
    "LostRecords",
    "MemorySink",
    "Reason",
    "RegistryStatistics",
    "RidConflictError",
    "SinkStatistics",
    "StaleInstanceError",
    "State",
    "TableDefinitionError",
    "Ticket",
    "Trigger",
    "UnknownRequestError",
    "WrongThreadError",
    "__version__",
    "check_audit",
    "read_audit",
]

"""kvlife.fsm: per-request lifecycle state machines for KV-cache offload.

No torch, no graphviz. The core is the one transition table
([`kvlife.fsm.table`][kvlife.fsm.table]), the identity registry with its lifecycles and
tickets ([`kvlife.fsm.registry`][kvlife.fsm.registry]) and the typed errors
([`kvlife.fsm.errors`][kvlife.fsm.errors]); beside it, the audit package
([`kvlife.fsm.audit`][kvlife.fsm.audit]: records, sinks, the sink guard, the reader, the
checker, ``why``'s narration, Prometheus metrics). The core takes from the audit package
only the record type and what it needs to hand records to sinks (the guard).

Typical use in a scheduler::

    registry = LifecycleRegistry(sinks=[MemorySink()])
    lc = registry.register(req)              # rid from req.rid
    ticket = registry.start_offload(req, tokens=16)
    ...                                      # the copy's CUDA event completes
    registry.complete(ticket)                # ack; ok=False for a failed copy
    registry.finish(req)                     # released once no copy is in flight
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlife.fsm import native as native  # first: it decides which build the hot modules load from
from kvlife.fsm._lazy import lazy_names
from kvlife.fsm._version import __version__
from kvlife.fsm.audit.guard import SinkStatistics
from kvlife.fsm.audit.records import AuditRecord, LostRecords
from kvlife.fsm.audit.sinks import JsonLinesSink, LoggingSink, MemorySink
from kvlife.fsm.errors import (
    CompletionRaceError,
    DuplicateAckError,
    DuplicateRegistrationError,
    InvalidTransitionError,
    LifecycleError,
    ProtocolViolationError,
    Reason,
    RidConflictError,
    StaleInstanceError,
    TableDefinitionError,
    UnknownRequestError,
    WrongThreadError,
)
from kvlife.fsm.overdue import DEFAULT_OVERDUE_S, OverdueWatch
from kvlife.fsm.registry import Lifecycle, LifecycleRegistry, RegistryStatistics, Ticket
from kvlife.fsm.table import LIFECYCLE, LIFECYCLE_EDGES, Edge, Guard, State, Trigger

if TYPE_CHECKING:
    from kvlife.fsm.audit.checker import AuditChecker, AuditReport, check_audit
    from kvlife.fsm.audit.reader import AuditLog, AuditReader, read_audit

# Reading and checking logs is not the registry's business: those names load their modules
# when first asked for, so that importing the core (a scheduler's process) loads neither.
_LAZY = {
    "AuditChecker": "kvlife.fsm.audit.checker",
    "AuditReport": "kvlife.fsm.audit.checker",
    "check_audit": "kvlife.fsm.audit.checker",
    "AuditLog": "kvlife.fsm.audit.reader",
    "AuditReader": "kvlife.fsm.audit.reader",
    "read_audit": "kvlife.fsm.audit.reader",
}


#: Whether the hot modules run compiled (mypyc); ``native.describe()`` says why.
__compiled__: bool = native.compiled

_load = lazy_names(globals(), _LAZY)


def __getattr__(name: str) -> Any:
    return _load(name)


__all__ = [
    "DEFAULT_OVERDUE_S",
    "LIFECYCLE",
    "LIFECYCLE_EDGES",
    "AuditChecker",
    "AuditLog",
    "AuditReader",
    "AuditRecord",
    "AuditReport",
    "CompletionRaceError",
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
    "OverdueWatch",
    "ProtocolViolationError",
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

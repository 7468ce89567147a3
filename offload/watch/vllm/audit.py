"""``KVLifeAuditConnector``: kvlife's lifecycles, audit log and verdicts for a vLLM KV
connector that kvlife did not write (vLLM's ``OffloadingConnector``, LMCache, NIXL, ...).

Enable it by configuration alone: the wrapped connector's own config goes, unchanged,
under ``connector``::

    --kv-transfer-config '{"kv_connector": "KVLifeAuditConnectorHMA",
        "kv_connector_module_path": "kvlife.offload.engines.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"audit_log": "audit.jsonl", "mode": "observe",
          "connector": {"kv_connector": "OffloadingConnector",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 4000000000}}}}'

The wrapper builds the wrapped connector and relays every call of vLLM's
``KVConnectorBase_V1`` to it, on both sides, classmethods included, and returns what it
returns: vLLM schedules exactly as with the wrapped connector alone. Two class names,
because vLLM decides whether to keep its hybrid KV cache manager from the class the
config names, before any connector is built: ``KVLifeAuditConnectorHMA`` for a connector
that is a ``SupportsHMA`` (vLLM's ``OffloadingConnector``, ``SimpleCPUOffloadConnector``,
``MultiConnector``), ``KVLifeAuditConnector`` for one that is not (``ExampleConnector``).
The wrong one stops the engine at start-up with a line naming the right one.

On the scheduler side (the engine core), every vLLM ``Request`` *object* gets a kvlife
lifecycle when vLLM first shows it. What the connector protocol says becomes tickets: an
asynchronous load (the wrapped connector answered ``load_async=True`` and vLLM
allocated) is a ticket that ``finished_recving`` completes and a failed receive fails; a
delayed free (``request_finished`` returned ``True``) is a ticket that
``finished_sending`` completes; ``request_finished`` finishes or aborts the lifecycle. A
report that no open ticket explains (repeated, for an id whose free was never delayed, a
``finished_recving`` with no load pending) is written down as a ``stray_report``, naming
the rid and what was reported: vLLM's scheduler asserts on such a report a moment later.
An exception of the wrapped connector is written down (``connector_raised``, with the rids
of the call) before it goes on. With vLLM's KV events on, every event the wrapped
connector publishes is checked against the block hashes vLLM computed for its requests
(``event_mismatch``). The log's header names the wrapped connector, so ``kvlife audit
check`` also counts every ticket still open when the log ended (``unreported``).

A ticket open longer than ``audit_overdue_s`` (default 120 s) is written down as ``overdue``
(rid, kind, age) when it crosses the limit, once, and counted in vLLM's ``/metrics``
(``vllm:kvlife_audit_overdue_tickets_total``, ``vllm:kvlife_audit_tickets_overdue_open``,
``vllm:kvlife_audit_oldest_open_ticket_seconds``).

``"mode": "refuse"`` removes a stray report from the worker output before the wrapped
connector's scheduler side and vLLM's scheduler see it, so it no longer kills the engine
core; ``"observe"`` (the default) changes nothing.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import importlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.config import KVTransferConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from kvlife.fsm import Lifecycle, LifecycleError, OverdueWatch, Ticket, Trigger
from kvlife.fsm.audit.records import DetailValue
from kvlife.offload.engines.vllm_common.config import STOPPING, ConnectorConfig, audit_path
from kvlife.offload.engines.vllm_common.core_log import CoreLog, overdue_line
from kvlife.offload.engines.vllm_common.stats import (
    OVERDUE_COUNTERS,
    OVERDUE_GAUGES,
    KVLifePromMetrics,
    audit_growth,
    is_counter,
    overdue_gauges,
    verdict_growth,
)
from kvlife.offload.watch.vllm.handover import handed_over, taken_over
from kvlife.offload.watch.vllm.lenses import Lens, lens_for

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvlife")

MODES = ("observe", "refuse")
"""What the wrapper does with a report the lifecycle refuses: write it down only, or also
remove it before vLLM acts on it."""
AUDIT_KEYS = (
    "audit_log",
    "audit_flush_s",
    "audit_fsync",
    "audit_max_bytes",
    "audit_backups",
    "audit_overdue_s",
    "stats_interval_s",
)
"""The audit log's keys, checked as ``KVLifeConnector`` checks them."""
INDEXED_BLOCKS = 1 << 18
"""Block hashes kept to check KV events against (the newest; older ones are forgotten,
and an event naming a forgotten hash is a mismatch only if it contradicts a kept one)."""
_RECENT = 4096  # released lifecycles and completed tickets remembered per rid, to tell stories

# the trigger a call's exception is written under: the transition the call was part of
_CALL_TRIGGER = {
    "request_finished": Trigger.FINISH,
    "request_finished_all_groups": Trigger.FINISH,
    "shutdown": Trigger.FINISH,
    "update_connector_output": Trigger.ACK,
    "take_events": Trigger.ACK,
}


@dataclass(frozen=True)
class AuditConfig:
    """``kv_connector_extra_config`` of the wrapper, checked.

    Attributes:
        connector: the wrapped connector's config, with the keys of vLLM's own
            ``kv_transfer_config`` (``kv_connector``, ``kv_connector_module_path``,
            ``kv_connector_extra_config``, ...; ``kv_role`` defaults to the wrapper's).
        mode: ``"observe"`` (default) or ``"refuse"``.
        audit: the audit log's settings (``audit_log`` and the other ``audit_*`` keys of
            [`ConnectorConfig`][kvlife.offload.engines.vllm_common.config.ConnectorConfig]).
    """

    connector: dict[str, Any]
    mode: str
    audit: ConnectorConfig

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> AuditConfig:
        """Check the wrapper's extra config.

        Raises:
            ValueError: an unknown key, no ``connector`` (or one without
                ``kv_connector``, or one that names the wrapper itself), or a bad
                ``mode`` or ``audit_*`` value; the message names it.
        """
        extra = dict(extra or {})
        known = ("connector", "mode", *AUDIT_KEYS)
        for key in extra:
            if key not in known:
                raise ValueError(
                    f"kvlife: unknown kv_connector_extra_config key {key!r} of "
                    f"KVLifeAuditConnector (known: {', '.join(known)})"
                )
        wrapped = extra.get("connector")
        if not isinstance(wrapped, dict) or not isinstance(wrapped.get("kv_connector"), str):
            raise ValueError(
                "kvlife: KVLifeAuditConnector needs 'connector': the wrapped connector's "
                f"kv_transfer_config, with its 'kv_connector' name; got {wrapped!r:.200}"
            )
        if wrapped["kv_connector"].startswith("KVLifeAuditConnector"):
            raise ValueError("kvlife: KVLifeAuditConnector cannot wrap itself")
        mode = extra.get("mode", "observe")
        if mode not in MODES:
            raise ValueError(f"kvlife: mode must be one of {', '.join(MODES)}, got {mode!r}")
        audit = ConnectorConfig.parse({key: extra[key] for key in AUDIT_KEYS if key in extra})
        return cls(dict(wrapped), mode, audit)


def wrapped_config(vllm_config: VllmConfig) -> tuple[type[KVConnectorBase_V1], VllmConfig]:
    """The wrapped connector's class and the ``VllmConfig`` it is built with (the
    wrapper's, with the wrapped connector's ``kv_transfer_config``), as vLLM's
    ``MultiConnector`` builds its children.

    Raises:
        ValueError: the wrapper's extra config is wrong (see
            [`AuditConfig.parse`][kvlife.offload.watch.vllm.audit.AuditConfig.parse]).
    """
    outer = vllm_config.kv_transfer_config
    assert outer is not None  # vLLM builds a connector only from a kv_transfer_config
    child = AuditConfig.parse(outer.kv_connector_extra_config).connector
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = KVTransferConfig(
        **{"kv_role": outer.kv_role, "engine_id": outer.engine_id, **child}
    )
    return KVConnectorFactory.get_connector_class(inner.kv_transfer_config), inner


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


@functools.lru_cache(maxsize=64)
def _load_class(path: str) -> Any:
    module, _, name = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


def _merge_kvlife(
    mine: dict[str, Any] | None, theirs: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The wrapper's own stats of two intervals: counters add up, gauges are the later."""
    if not mine or not theirs:
        return dict(theirs or mine or {}) or None
    merged = {**mine, **theirs}
    for key in {*mine, *theirs}:
        if is_counter(key):
            merged[key] = mine.get(key, 0) + theirs.get(key, 0)
    return merged


@dataclass
class WrappedConnectorStats(KVConnectorStats):
    """The wrapped connector's statistics, carried with its class so that vLLM's front
    end (which knows only the wrapper's class) hands them to that class to log and
    export, and the wrapper's own (its overdue tickets). ``data`` is ``{"connector":
    "module:Class", "data": <its data or None>, "kvlife": <the wrapper's, when it has
    any>}``."""

    def _inner(self) -> KVConnectorStats | None:
        inner: KVConnectorStats | None = self.__dict__.get("_inner_stats")
        if inner is not None:  # made in this process: the wrapped connector's own object
            return inner
        path = self.data.get("connector")
        if not path or self.data.get("data") is None:
            return None
        inner = _load_class(path).build_kv_connector_stats(data=self.data.get("data"))
        self.__dict__["_inner_stats"] = inner
        return inner

    @classmethod
    def of(
        cls,
        connector: type,
        stats: KVConnectorStats | None,
        kvlife: dict[str, Any] | None = None,
    ) -> WrappedConnectorStats | None:
        if stats is None and not kvlife:
            return None
        return cls._made(_class_path(connector), stats, kvlife)

    @classmethod
    def _made(
        cls, path: str | None, inner: KVConnectorStats | None, kvlife: dict[str, Any] | None
    ) -> WrappedConnectorStats:
        data: dict[str, Any] = {"connector": path, "data": None if inner is None else inner.data}
        if kvlife:
            data["kvlife"] = kvlife
        made = cls(data=data)
        if inner is not None:  # made in this process: the wrapped connector's own object
            made.__dict__["_inner_stats"] = inner
        return made

    def to_dict(self) -> dict[str, Any]:
        """What vLLM sends from the engine core to the front end and hands the metrics:
        the inner statistics as their own ``to_dict`` makes them (``MultiConnector``'s
        are a dict of its children's, each made plain by its own class), never the
        statistics objects themselves."""
        inner = self._inner()
        plain = {key: value for key, value in self.data.items() if key != "data"}
        plain["data"] = None if inner is None else inner.to_dict()
        return plain

    def reset(self) -> None:
        inner = self._inner()
        if inner is not None:
            inner.reset()
            self.data["data"] = inner.data
        self.data.pop("kvlife", None)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs_all = (
            other
            if isinstance(other, WrappedConnectorStats)
            else WrappedConnectorStats(data=dict(other.data))
        )
        mine, theirs = self._inner(), theirs_all._inner()
        inner = (
            mine.aggregate(theirs) if mine is not None and theirs is not None else mine or theirs
        )
        return WrappedConnectorStats._made(
            self.data.get("connector") or theirs_all.data.get("connector"),
            inner,
            _merge_kvlife(self.data.get("kvlife"), theirs_all.data.get("kvlife")),
        )

    def reduce(self) -> dict[str, int | float]:
        inner = self._inner()
        reduced = {} if inner is None else inner.reduce()
        return reduced | dict(self.data.get("kvlife") or {})

    def is_empty(self) -> bool:
        inner = self._inner()
        return (inner is None or inner.is_empty()) and not self.data.get("kvlife")


class _WrappedPromMetrics(KVConnectorPromMetrics):
    """The wrapped connector's Prometheus metrics (when it has any), fed its own
    statistics, and the wrapper's own (``vllm:kvlife_audit_*``)."""

    def __init__(
        self,
        inner: KVConnectorPromMetrics | None,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.inner = inner
        self.kvlife = KVLifePromMetrics(
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
            counters=OVERDUE_COUNTERS,
            gauges=OVERDUE_GAUGES,
            prefix="vllm:kvlife_audit_",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if "connector" not in transfer_stats_data:  # not the wrapper's: the inner's own
            if self.inner is not None:
                self.inner.observe(transfer_stats_data, engine_idx)
            return
        kvlife = transfer_stats_data.get("kvlife")
        if kvlife:
            self.kvlife.observe(kvlife, engine_idx)
        inner_data = transfer_stats_data.get("data")
        if self.inner is not None and inner_data is not None:
            self.inner.observe(inner_data, engine_idx)


def _number(job: Hashable) -> int:
    """A lens's job key as the connector numbers it: the key, or its first item (a
    store event that copies for several requests is one key per request)."""
    return job if isinstance(job, int) else int(job[0])  # type: ignore[index]


def _rids(args: Iterable[Any]) -> list[str]:
    """The request ids a call was given (requests, a scheduler output, a worker output)."""
    rids: list[str] = []
    for arg in args:
        rid = getattr(arg, "request_id", None)
        if isinstance(rid, str):
            rids.append(rid)
            continue
        for new in getattr(arg, "scheduled_new_reqs", None) or ():
            rids.append(new.req_id)
        cached = getattr(arg, "scheduled_cached_reqs", None)
        if cached is not None:
            rids.extend(cached.req_ids)
        for name in ("finished_sending", "finished_recving", "failed_recving"):
            rids.extend(sorted(getattr(arg, name, None) or ()))
    return list(dict.fromkeys(rids))


def _named_in(exc: BaseException, rids: Iterable[str]) -> list[str]:
    """The ids of ``rids`` that ``exc`` names: one of its arguments (``KeyError('r1')``)
    or a whole word of its message (``r1`` is not named by ``r10``)."""
    args = {a for a in exc.args if isinstance(a, str)}
    text = str(exc)
    return [
        rid
        for rid in dict.fromkeys(rids)
        if rid in args or re.search(rf"(?<![\w-]){re.escape(rid)}(?![\w-])", text)
    ]


class _Watch:
    """The scheduler side's lifecycles: one per vLLM request object, tickets for the
    asynchronous loads and delayed frees the wrapped connector announced."""

    def __init__(
        self, config: AuditConfig, path: str | None, witness: str, events: bool, block_size: int
    ) -> None:
        self.block_size = block_size
        self.log = CoreLog(path, config.audit, witness)
        #: Write the records out now: see ``CoreLog.written``.
        self.written = self.log.written
        #: See ``CoreLog.step_ended`` and ``CoreLog.between_steps``.
        self.step_ended = self.log.step_ended
        self.between_steps = self.log.between_steps
        self.registry = self.log.registry
        self.registry.on_release(self._released)
        #: Tickets open longer than ``audit_overdue_s``, told at each step.
        self.overdue = OverdueWatch(self.registry, config.audit.audit_overdue_s)
        self.stats_interval_s = config.audit.stats_interval_s
        self._stats_at = -float("inf")
        self._overdue_reported = 0
        self._verdicts_reported: dict[str, int] = {}
        self._audit_reported = [0, 0]
        self._gauges: dict[str, float] = {}
        self.refuse = config.mode == "refuse"
        self.witness = witness
        self.events = events
        # per rid, the open tickets of each kind, oldest first
        self.loads: dict[str, list[Ticket]] = {}
        self.frees: dict[str, list[Ticket]] = {}
        self.load_blocks: dict[int, set[int]] = {}  # ticket op -> device blocks it fills
        self.failed: set[int] = set()  # ops of open loads reported failed
        self.claims: set[int] = set()  # id() of requests whose last answer was load_async
        self.recent: OrderedDict[str, Lifecycle] = OrderedDict()  # rid -> released lifecycle
        self.reported: OrderedDict[tuple[str, str], None] = OrderedDict()  # (report, rid) done
        # (report, rid) of tickets cut short when vLLM freed their request at another report
        self.cut: set[tuple[str, str]] = set()
        # KV event checks: external block hash -> (rid, parent hash, digest of its tokens)
        self.index: OrderedDict[Any, tuple[str, Any, int]] = OrderedDict()
        self.indexed: dict[int, int] = {}  # lifecycle serial -> its block hashes indexed
        # (medium, hash) -> stores not removed yet: vLLM's block pool (and a connector
        # storing one prefix for two requests) may hold one hash several times
        self.held: dict[tuple[str | None, Any], int] = {}
        #: The wrapped connector's lens (its private copies seen as tickets), if it has one.
        self.lens: Lens | None = None
        self.jobs: dict[Hashable, Ticket] = {}  # a lensed copy's job -> the ticket it counts on
        self.job_counts: dict[int, int] = {}  # ticket op -> its jobs not over yet
        self.flushes: dict[int, Ticket] = {}  # lifecycle serial -> its final-copies ticket
        self.new_flushes: list[Ticket] = []  # opened since the last step's metadata
        # finished since the last step's metadata, their state kept for its pass: by rid,
        # the lifecycle and the request object (held until that pass: one step)
        self.finishing: dict[str, tuple[Lifecycle, Any]] = {}
        self.completing: list[str] = []  # rids of the lensed jobs the last output completes

    # ------------------------------------------------------------------ lifecycles

    def lifecycle(self, request: Request) -> Lifecycle | None:
        """``request``'s lifecycle, registered now if vLLM shows it for the first time;
        ``None`` when an unfinished lifecycle holds its id (refused, audited)."""
        registry = self.registry
        if request in registry:
            return registry.lifecycle(request)
        try:
            return registry.register(request, rid=request.request_id)
        except LifecycleError:
            return None

    def _released(self, lc: Lifecycle, request: Any) -> None:
        self.recent[lc.rid] = lc
        self.recent.move_to_end(lc.rid)
        if len(self.recent) > _RECENT:
            self.recent.popitem(last=False)
        self.indexed.pop(lc.serial, None)

    def holder(self, rid: str) -> Lifecycle | None:
        """The lifecycle a report about ``rid`` is told in: the live one holding it, or
        the one that released last."""
        return self.registry.live(rid) or self.recent.get(rid)

    def open_ticket(self, request: Request, kind: str, **detail: Any) -> Ticket | None:
        """A ticket of ``kind`` on ``request``'s lifecycle (``load`` and ``delayed_free``
        kept under its rid for the report that completes it; a lens's ``store`` and
        ``flush`` by job); ``None`` when refused."""
        lc = self.lifecycle(request)
        if lc is None:
            return None
        try:
            ticket = self.registry.start_offload(lc, kind=kind, **detail)
        except LifecycleError:  # refused (a second finish, say): audited, nothing opened
            return None
        if kind in ("load", "delayed_free"):  # those a report by request id completes
            (self.loads if kind == "load" else self.frees).setdefault(lc.rid, []).append(ticket)
        self.overdue.opened(ticket, kind)
        return ticket

    def check_overdue(self) -> None:
        """Write down the tickets that crossed ``audit_overdue_s`` (once each) and warn."""
        if self.overdue.check():
            logger.warning("kvlife: %s: %s", self.witness, overdue_line(self.overdue))
            self.written()

    def stats(self) -> dict[str, Any] | None:
        """The counters' growth since they were last handed over (overdue tickets, each
        verdict by reason, the audit sinks' losses and errors), and the gauges now;
        ``None`` within ``stats_interval_s`` of the last hand-over, or when nothing
        changed."""
        now = time.monotonic()
        if now - self._stats_at < self.stats_interval_s:
            return None
        self._stats_at = now
        watch = self.overdue
        grown = watch.overdue_total - self._overdue_reported
        verdicts = verdict_growth(self.registry.refusals, self._verdicts_reported)
        verdicts |= audit_growth(self.registry, self._audit_reported)
        gauges = overdue_gauges(watch)
        if not grown and not verdicts and gauges == self._gauges:
            return None
        self._overdue_reported, self._gauges = watch.overdue_total, gauges
        return {"overdue_tickets": grown, **verdicts, **gauges}

    def end(self, request: Request, **detail: DetailValue) -> None:
        self.claims.discard(id(request))  # claimed a load, but never allocated
        lc = self.lifecycle(request)
        if lc is None:
            return
        self.index_blocks(lc)
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        with contextlib.suppress(LifecycleError):  # vLLM finished it twice: refused, audited
            (self.registry.abort if aborted else self.registry.finish)(lc, **detail)

    # ------------------------------------------------------------------ reports

    def report(self, output: KVConnectorOutput) -> None:
        """Complete the tickets the worker output reports; write down (and in refuse
        mode, remove) the reports no open ticket explains."""
        failed_ops = self.failed
        for rid in sorted(getattr(output, "failed_recving", None) or ()):
            tickets = self.loads.get(rid)
            if tickets:
                failed_ops.add(tickets[0].op)
            else:
                self.stray(output, "failed_recving", rid)
        invalid = getattr(output, "invalid_block_ids", None)
        if invalid:
            for op, blocks in self.load_blocks.items():
                if blocks & invalid:
                    failed_ops.add(op)
        for name, tickets_of in self._kinds():
            for rid in sorted(getattr(output, name, None) or ()):
                tickets = tickets_of.get(rid)
                if not tickets:
                    self.stray(output, name, rid)
                    continue
                ticket = tickets.pop(0)
                if not tickets:
                    del tickets_of[rid]
                ok = ticket.op not in failed_ops
                failed_ops.discard(ticket.op)
                self.load_blocks.pop(ticket.op, None)
                lc = ticket.lifecycle
                finished = lc.outcome is not None
                self.registry.complete(ticket, ok, report=name)
                self._remember(name, rid)
                if finished:
                    self._freed(lc, rid, name)

    def _kinds(self) -> tuple[tuple[str, dict[str, list[Ticket]]], ...]:
        """The report that completes each kind of ticket, in the order vLLM handles them."""
        return (("finished_recving", self.loads), ("finished_sending", self.frees))

    def _remember(self, name: str, rid: str) -> None:
        self.reported[(name, rid)] = None
        self.reported.move_to_end((name, rid))
        if len(self.reported) > _RECENT:
            self.reported.popitem(last=False)

    def _freed(self, lc: Lifecycle, rid: str, name: str) -> None:
        """vLLM frees a finished request (blocks and id) at its first completion report:
        every other ticket it has is cut short (failed), and a later report of it is
        stray, as vLLM's scheduler will find no request under the id."""
        for report, tickets_of in self._kinds():
            tickets = tickets_of.get(rid)
            if not tickets:
                continue
            for ticket in [t for t in tickets if t.lifecycle is lc]:
                tickets.remove(ticket)
                self.failed.discard(ticket.op)
                self.load_blocks.pop(ticket.op, None)
                self.registry.complete(ticket, False, cut_by=name)
                self.cut.add((report, rid))
            if not tickets:
                del tickets_of[rid]

    def stray(self, output: KVConnectorOutput, name: str, rid: str) -> None:
        lc = self.holder(rid)
        if (name, rid) in self.cut:
            self.cut.discard((name, rid))
            why = "already_freed"
        elif (name, rid) in self.reported:
            why = "repeated"
        elif lc is None:
            why = "unknown_request"
        elif name == "finished_sending":
            why = "free_not_delayed"
        else:
            why = "no_load_pending"
        self.registry.record_violation(
            "stray_report",
            Trigger.FAIL if name == "failed_recving" else Trigger.ACK,
            f"{self.witness} reported {name} for {rid!r} ({why})",
            lifecycle=lc,
            rid=rid,
            report=name,
            why=why,
            refused=self.refuse,
        )
        logger.warning(
            "kvlife: %s reported %s for request %r, which no open transfer explains (%s)%s",
            self.witness,
            name,
            rid,
            why,
            "; removed before vLLM sees it" if self.refuse else "",
        )
        if self.refuse:
            kept = set(getattr(output, name) or ())
            kept.discard(rid)
            setattr(output, name, kept)

    def raised(self, call: str, args: tuple[Any, ...], exc: BaseException) -> None:
        """Write the exception down on the requests it concerns: those it names (an
        argument that is a request id, or an id of the call in its message), else every
        request of the call."""
        trigger = _CALL_TRIGGER.get(call, Trigger.START_OFFLOAD)
        error = f"{type(exc).__name__}: {exc}"[:300]
        named = _rids(args)
        if call == "update_connector_output":  # the lensed jobs it was completing
            named = list(dict.fromkeys([*named, *self.completing]))
        known = [a for a in exc.args if isinstance(a, str) and self.holder(a) is not None]
        concerned = _named_in(exc, [*known, *named])
        rids: list[str | None] = list(concerned or named) or [None]
        for rid in rids[:64]:
            self.registry.record_violation(
                "connector_raised",
                trigger,
                f"{self.witness}.{call} raised {error}",
                lifecycle=self.holder(rid) if rid is not None else None,
                rid=rid,
                call=call,
                error=error,
            )
        self.written()

    # ------------------------------------------------------------------ lensed copies

    def flush(self, request: Request) -> None:
        """vLLM finished ``request`` and the lensed connector may still order its final
        copies at the next step: a ``flush`` ticket, opened before the finish, counts
        them (a final flush is ``start_offload`` then ``finish``)."""
        ticket = self.open_ticket(request, "flush")
        if ticket is not None:
            self.flushes[ticket.serial] = ticket
            self.job_counts[ticket.op] = 0
            self.new_flushes.append(ticket)

    def issued(self, lens: Lens, meta: Any, out: SchedulerOutput) -> None:
        """The copies the lensed connector's metadata orders this step become tickets on
        the request objects it issued them for; flush tickets that got none complete."""
        registry, counts, opened = self.registry, self.job_counts, self.overdue.opened
        for job, kind, request in lens.issued(meta):
            if request is None or request not in registry:
                continue  # for a request the wrapper never saw: nothing to count it on
            lc = registry.lifecycle(request)
            if lc.outcome is None:
                ticket = registry.start_offload(lc, kind=kind, job=_number(job))
                opened(ticket, kind)
                counts[ticket.op] = 1
            else:
                flush = self.flushes.get(lc.serial)
                if flush is None or flush.done:
                    continue
                counts[flush.op] += 1
                ticket = flush
            self.jobs[job] = ticket
        for ticket in self.new_flushes:
            if not self.job_counts.get(ticket.op):
                self._over(ticket, jobs=0)
        self.new_flushes.clear()
        self.finishing.clear()
        # a request's state under its id is another's: met when the request is new, or
        # when another request of its id finished (its clean-up may drop the state)
        finished = out.finished_req_ids
        suspects = [new.req_id for new in out.scheduled_new_reqs]
        self.check_owners(lens, dict.fromkeys((*suspects, *finished)) if finished else suspects)

    def replaced(self, lens: Lens, request: Request) -> None:
        """A new request took an id whose finished request's state the connector keeps
        for its next step's pass: if that state is the new request's now, the pass
        (and the old request's final copies) will use the wrong state."""
        rid = request.request_id
        lc, old = self.finishing.get(rid, (None, None))
        if lc is not None and old is not request and lens.owner(rid) is not old:
            new = self.registry.lifecycle(request) if request in self.registry else None
            self._inherited(lens, lc, new, needed=True)

    def check_owners(self, lens: Lens, rids: Iterable[str]) -> None:
        """Write down each running request of ``rids`` (vLLM scheduled it) whose state in
        the lensed connector belongs to another request object with its id, or is gone."""
        registry = self.registry
        for rid in rids:
            holder = registry.live(rid)
            if holder is None or holder.outcome is not None:
                continue
            if holder.req.status != RequestStatus.RUNNING:
                continue  # waiting (for a load, say): the connector sets its state up again
            owner = lens.owner(rid)
            if owner is holder.req or (owner is None and not lens.keeps_every_request):
                continue
            other = registry.lifecycle(owner) if owner is not None and owner in registry else None
            self._inherited(lens, holder, other, dropped=owner is None)

    def completed(self, lens: Lens, output: KVConnectorOutput) -> None:
        """The lensed copies this worker output completes, before the connector takes it:
        each completes its ticket on the request object it was issued for, and a
        completion the connector will credit to another object is written down."""
        registry = self.registry
        self.completing.clear()
        for job, ok, credited in lens.completions(output):
            ticket = self.jobs.pop(job, None)
            if ticket is None or ticket.done:
                continue
            lc = ticket.lifecycle
            self.completing.append(lc.rid)
            if credited is not lc.req:
                other = registry.lifecycle(credited) if credited in registry else None
                where = "no request" if credited is None else "another request object"
                if other is not None:
                    where += f" (lifecycle #{other.serial})"
                registry.record_violation(
                    "credited_elsewhere",
                    Trigger.ACK,
                    f"{lens.name} credits the completion of job {_number(job)}, issued for "
                    f"lifecycle #{lc.serial} of {lc.rid!r}, to {where}",
                    lifecycle=lc,
                    op=ticket.op,
                    job=_number(job),
                    credited="none" if other is None else f"serial {other.serial}",
                )
                logger.warning(
                    "kvlife: %s credits job %s of request %r (lifecycle #%s) to %s",
                    lens.name,
                    _number(job),
                    lc.rid,
                    lc.serial,
                    where,
                )
            left = self.job_counts[ticket.op] - 1
            self.job_counts[ticket.op] = left
            if not left:
                self._over(ticket, ok=ok, job=_number(job))

    def _over(self, ticket: Ticket, ok: bool = True, **detail: Any) -> None:
        del self.job_counts[ticket.op]
        flush = self.flushes.get(ticket.serial)
        if flush is ticket:
            del self.flushes[ticket.serial]
        self.registry.complete(ticket, ok, **detail)

    def _inherited(
        self,
        lens: Lens,
        lc: Lifecycle,
        other: Lifecycle | None,
        *,
        dropped: bool = False,
        needed: bool = False,
    ) -> None:
        if dropped:
            owner, said = "none", "is gone while it runs (dropped with another request of its id)"
        elif needed:
            owner = "unknown" if other is None else f"serial {other.serial}"
            said = "(which its next step's pass still needs) was taken by " + (
                "another request object" if other is None else f"lifecycle #{other.serial}"
            )
        else:
            owner = "unknown" if other is None else f"serial {other.serial}"
            said = "belongs to " + (
                "an unknown request object" if other is None else f"lifecycle #{other.serial}"
            )
        self.registry.record_violation(
            "inherited_state",
            Trigger.START_OFFLOAD,
            f"{lens.name}'s state for {lc.rid!r} (lifecycle #{lc.serial}) {said}",
            lifecycle=lc,
            owner=owner,
        )
        logger.warning("kvlife: %s's state for request %r %s", lens.name, lc.rid, said)

    # ------------------------------------------------------------------ KV events

    def index_blocks(self, lc: Lifecycle) -> None:
        """Remember the block hashes vLLM computed for ``lc``'s request (those not yet
        remembered), with each block's parent and tokens."""
        if not self.events:
            return
        request = lc.req
        hashes = request.block_hashes
        done = self.indexed.get(lc.serial, 0)
        if done >= len(hashes):
            return
        size, tokens, index = self.block_size, request.all_token_ids, self.index
        parent = maybe_convert_block_hash(hashes[done - 1]) if done else None
        for j in range(done, len(hashes)):
            key = maybe_convert_block_hash(hashes[j])
            index[key] = (lc.rid, parent, hash(tuple(tokens[j * size : (j + 1) * size])))
            parent = key
        self.indexed[lc.serial] = len(hashes)
        while len(index) > INDEXED_BLOCKS:
            index.popitem(last=False)

    def check_events(self, events: list[Any]) -> None:
        for lc in self.registry.lifecycles():
            self.index_blocks(lc)
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                held = self.held
                for key in event.block_hashes:
                    count = held.get((event.medium, key), 0)
                    if count > 1:
                        held[(event.medium, key)] = count - 1
                    elif count == 1:
                        del held[(event.medium, key)]
                    else:  # no store of this hash on this medium is left to remove
                        known = self.index.get(key)  # whose block it is, if any
                        rid = known[0] if known is not None else None
                        self._mismatch(rid, "BlockRemoved", key, "never_stored")
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()

    def _stored(self, event: BlockStored) -> None:
        size, parent = event.block_size, event.parent_block_hash
        # An event of hashes alone (no tokens, block size 0: what vLLM 0.33's
        # OffloadingConnector publishes) says nothing of parents or tokens to check.
        whole = bool(event.token_ids) and size > 0
        for i, key in enumerate(event.block_hashes):
            digest = hash(tuple(event.token_ids[i * size : (i + 1) * size])) if whole else 0
            known = self.index.get(key)
            if known is None:
                self._mismatch(None, "BlockStored", key, "unknown_hash")
            elif whole and known[1] != parent:
                self._mismatch(known[0], "BlockStored", key, "parent")
            elif whole and known[2] != digest:
                self._mismatch(known[0], "BlockStored", key, "tokens")
            else:
                held = self.held
                held[(event.medium, key)] = held.get((event.medium, key), 0) + 1
            parent = key

    def _mismatch(self, rid: str | None, event: str, key: Any, why: str) -> None:
        lc = self.holder(rid) if rid is not None else None
        self.registry.record_violation(
            "event_mismatch",
            Trigger.ACK,
            f"{self.witness} published {event} for block hash {key} ({why})",
            lifecycle=lc,
            rid=rid,
            event=event,
            why=why,
            block_hash=str(key)[:40],
        )


def _relay(name: str) -> Callable[..., Any]:
    """A method that hands the call to the wrapped connector, unchanged; an exception is
    written to the log (scheduler side) before it goes on."""

    def relay(self: KVLifeAuditConnector, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, *args, **kwargs)

    relay.__name__ = relay.__qualname__ = name
    relay.__doc__ = f"``{name}`` of the wrapped connector, relayed unchanged."
    return relay


class KVLifeAuditConnector(KVConnectorBase_V1):
    """A vLLM KV connector around another: the other one does the work, kvlife keeps its
    lifecycles, its audit log and its verdicts (see the module's text).

    For a wrapped connector that is not a ``SupportsHMA``; use
    [`KVLifeAuditConnectorHMA`][kvlife.offload.watch.vllm.audit.KVLifeAuditConnectorHMA]
    for one that is.

    Raises (at start-up):
        ValueError: the extra config is wrong, or the class name does not match the
            wrapped connector's hybrid-KV support (the message names the right one).
    """

    HMA: ClassVar[bool] = False

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = AuditConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        wrapped_cls, inner = wrapped_config(vllm_config)
        name = wrapped_cls.__name__
        if supports_hma(wrapped_cls) != self.HMA:
            right = f"KVLifeAuditConnector{'HMA' if supports_hma(wrapped_cls) else ''}"
            raise ValueError(
                f"kvlife: {name} {'is' if supports_hma(wrapped_cls) else 'is not'} a "
                f"SupportsHMA connector: configure kv_connector {right!r} so that vLLM "
                f"keeps (or turns off) its hybrid KV cache manager exactly as for {name} alone"
            )
        self.wrapped: KVConnectorBase_V1 = wrapped_cls(inner, role, kv_cache_config)
        self.wrapped_class = wrapped_cls
        self.mode = config.mode
        self.watch: _Watch | None = None
        if role == KVConnectorRole.SCHEDULER:
            log = config.audit.audit_log
            path = audit_path(log, vllm_config) if log else None
            events = vllm_config.kv_events_config
            self.watch = _Watch(
                config,
                path,
                name,
                bool(events and events.enable_kv_cache_events),
                vllm_config.cache_config.block_size,
            )
            self.watch.lens = lens_for(self.wrapped)
            logger.info(
                "kvlife: auditing %s (%s mode)%s",
                name,
                config.mode,
                f", audit log {path}" if path else ", no audit log",
            )
            self.watch.log.stop_hint(vllm_config)

    # ------------------------------------------------------------------ scheduler side

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The wrapped connector's ``name``, called with the arguments as they are; an
        exception is written to the log (scheduler side) before it goes on, whatever its
        class (a native core's panic raised through pyo3 is a ``BaseException``), but for
        the ones that stop the process (``STOPPING``)."""
        try:
            return getattr(self.wrapped, name)(*args, **kwargs)
        except BaseException as exc:
            if self.watch is not None and not isinstance(exc, STOPPING):
                self.watch.raised(name, args, exc)
            raise

    def on_new_request(self, request: Request) -> None:
        watch = self.watch
        if watch is not None:
            watch.lifecycle(request)
        self._call("on_new_request", request)
        if watch is not None:
            if watch.lens is not None and watch.finishing:
                watch.replaced(watch.lens, request)
            watch.between_steps()  # vLLM adds requests between steps

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        watch = self.watch
        assert watch is not None  # vLLM calls it on the scheduler side only
        watch.lifecycle(request)
        count, is_async = self._call("get_num_new_matched_tokens", request, num_computed_tokens)
        if count and is_async:
            watch.claims.add(id(request))
        else:
            watch.claims.discard(id(request))
        return count, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        watch = self.watch
        assert watch is not None
        self._call("update_state_after_alloc", request, blocks, num_external_tokens)
        claimed = id(request) in watch.claims
        watch.claims.discard(id(request))
        if claimed and num_external_tokens > 0:
            ticket = watch.open_ticket(
                request, "load", tokens=num_external_tokens, **taken_over(request)
            )
            if ticket is not None:
                watch.load_blocks[ticket.op] = {
                    block for group in blocks.get_block_ids() for block in group
                }

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        watch = self.watch
        if watch is not None:  # once a step, even while nothing else changes
            watch.check_overdue()
        meta = self._call("build_connector_meta", scheduler_output)
        if watch is not None:
            if watch.lens is not None:
                watch.issued(watch.lens, meta, scheduler_output)
            watch.step_ended("schedule")
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        watch = self.watch
        assert watch is not None
        lens = watch.lens
        if lens is not None:
            watch.completed(lens, connector_output)
        watch.report(connector_output)
        self._call("update_connector_output", connector_output)
        if lens is not None and watch.completing:  # a completion's clean-up may drop state
            watch.check_owners(lens, dict.fromkeys(watch.completing))
        watch.written()  # vLLM reads the reports next, and may die on them (a stray one)

    def _finished(self, call: str, request: Request, block_ids: Any) -> tuple[bool, Any]:
        watch = self.watch
        assert watch is not None
        watch.lifecycle(request)
        delay, params = self._call(call, request, block_ids)
        # prefill/decode: the request's transfer identity on either side, for the join
        identity = handed_over(params, request.request_id) or taken_over(request)
        if delay:
            watch.open_ticket(request, "delayed_free", **identity)
        lens = watch.lens
        if lens is not None and lens.finishing(request):
            lc = watch.lifecycle(request)
            if lc is not None:
                watch.finishing[lc.rid] = (lc, request)
            if lens.flushes(request):
                watch.flush(request)
        watch.end(request, **identity)
        watch.between_steps()  # an abort between steps; a finish goes with its step's
        return delay, params

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        return self._finished("request_finished", request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Any]:
        return self._finished("request_finished_all_groups", request, block_ids)

    def take_events(self) -> Iterable[Any]:
        try:  # read here: a generator raises while it is read, not when it is called
            events = list(self.wrapped.take_events())
        except BaseException as exc:
            if self.watch is not None and not isinstance(exc, STOPPING):
                self.watch.raised("take_events", (), exc)
            raise
        if self.watch is not None and self.watch.events and events:
            self.watch.check_events(events)
        return events

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        kvlife = self.watch.stats() if self.watch is not None else None
        stats = WrappedConnectorStats.of(
            self.wrapped_class, self.wrapped.get_kv_connector_stats(), kvlife
        )
        if self.watch is not None:
            self.watch.step_ended("output")  # vLLM's last connector call there
        return stats

    # ------------------------------------------------------------------ both sides

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self.wrapped.bind_connector_metadata(connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self.wrapped.clear_connector_metadata()
        super().clear_connector_metadata()

    def shutdown(self) -> None:
        try:
            self._call("shutdown")
        finally:
            if self.watch is not None:
                self.watch.log.close()

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(getattr(self.wrapped, "supports_divergent_local_hybrid_hits", False))

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(self.wrapped.requires_kv_delivery)

    # ------------------------------------------------------------------ classmethods

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        wrapped_cls, inner = wrapped_config(vllm_config)
        layout: str | None = wrapped_cls.get_required_kvcache_layout(inner)
        return layout

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        child = AuditConfig.parse(extra_config).connector
        ktc = KVTransferConfig(**{"kv_role": "kv_both", **child})
        wrapped_cls = KVConnectorFactory.get_connector_class(ktc)
        return bool(
            wrapped_cls.requires_piecewise_for_cudagraph(
                child.get("kv_connector_extra_config") or {}
            )
        )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        child = AuditConfig.parse(kv_transfer_config.kv_connector_extra_config).connector
        ktc = KVTransferConfig(
            **{
                "kv_role": kv_transfer_config.kv_role,
                "engine_id": kv_transfer_config.engine_id,
                **child,
            }
        )
        check = getattr(KVConnectorFactory.get_connector_class(ktc), "supports_sleep_mode", None)
        return True if check is None else bool(check(ktc))

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return WrappedConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        wrapped_cls, inner = wrapped_config(vllm_config)
        prom = wrapped_cls.build_prom_metrics(
            inner, metric_types, labelnames, per_engine_labelvalues
        )
        return _WrappedPromMetrics(
            prom, vllm_config, metric_types, labelnames, per_engine_labelvalues
        )


# Every other method of vLLM's connector API (worker side, handshakes, cache binding,
# ...) is relayed as it is: whatever this vLLM version has.
_OWN = set(vars(KVLifeAuditConnector))


def _api_methods() -> Iterator[str]:
    for klass in KVConnectorBase_V1.__mro__:
        for name, member in vars(klass).items():
            if name.startswith("__") or name in _OWN or name == "_get_connector_metadata":
                continue
            if callable(member) and not isinstance(member, (classmethod, staticmethod, type)):
                yield name


for _name in sorted(set(_api_methods())):
    setattr(KVLifeAuditConnector, _name, _relay(_name))
abc.update_abstractmethods(KVLifeAuditConnector)  # the relays implement vLLM's abstract ones


class KVLifeAuditConnectorHMA(KVLifeAuditConnector, SupportsHMA):
    """[`KVLifeAuditConnector`][kvlife.offload.watch.vllm.audit.KVLifeAuditConnector] for a
    wrapped connector that is a ``SupportsHMA``: vLLM keeps its hybrid KV cache manager,
    as it does for that connector alone."""

    HMA: ClassVar[bool] = True


__all__ = [
    "AUDIT_KEYS",
    "INDEXED_BLOCKS",
    "MODES",
    "AuditConfig",
    "KVLifeAuditConnector",
    "KVLifeAuditConnectorHMA",
    "WrappedConnectorStats",
    "wrapped_config",
]

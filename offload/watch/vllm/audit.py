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
import copy
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.config import KVTransferConfig
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

from kvlife.offload.engines.vllm_common.config import STOPPING, ConnectorConfig, audit_path
from kvlife.offload.watch.vllm.audit_stats import WrappedConnectorStats, WrappedPromMetrics
from kvlife.offload.watch.vllm.audit_watch import INDEXED_BLOCKS, Watch
from kvlife.offload.watch.vllm.handover import handed_over, taken_over
from kvlife.offload.watch.vllm.lenses import lens_for

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
        self.watch: Watch | None = None
        if role == KVConnectorRole.SCHEDULER:
            log = config.audit.audit_log
            path = audit_path(log, vllm_config) if log else None
            events = vllm_config.kv_events_config
            self.watch = Watch(
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
        return WrappedPromMetrics(
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

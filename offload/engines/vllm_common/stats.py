"""kvlife's counters and host page account as vLLM's connector-stats hook takes them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvlife.fsm import LifecycleRegistry, OverdueWatch, State
from kvlife.offload.planner import COUNTERS as PLANNER_COUNTERS
from kvlife.offload.planner import PageAccount

OVERDUE_COUNTERS = ("overdue_tickets",)
"""Tickets written to the audit log as overdue (see
[`OverdueWatch`][kvlife.fsm.overdue.OverdueWatch]); kvlife's own connector and the audit
wrapper both report it."""
OVERDUE_GAUGES = ("tickets_overdue_open", "oldest_open_ticket_seconds")
"""Overdue tickets still open, and the age of the oldest open ticket (0 when none is)."""

COUNTERS = (*PLANNER_COUNTERS, "stored_bytes", "loaded_bytes", *OVERDUE_COUNTERS)
"""The counters the connector reports (each interval's growth): the planner's
([`COUNTERS`][kvlife.offload.planner.COUNTERS]), the bytes its stores and loads
moved, over every worker (blocks x vLLM's block bytes x workers), and its overdue
tickets."""

GAUGES = (
    "host_pages",
    "host_pages_free",
    "host_pages_cached",
    "host_pages_pinned",
    "host_pages_storing",
    "lifecycles_allocated",
    "lifecycles_offloading",
    "lifecycles_finished_pending",
    *OVERDUE_GAUGES,
)
"""Values at the end of the interval: the host pages' account (see
[`PageAccount`][kvlife.offload.planner.PageAccount]: capacity, free, cached (evictable),
pinned by loads, written by stores in flight; the last four sum to the first) and the
lifecycles live in each state, and the overdue gauges
([`OVERDUE_GAUGES`][kvlife.offload.engines.vllm_common.stats.OVERDUE_GAUGES])."""

STAT_KEYS = COUNTERS + GAUGES
"""Every key the connector reports (and the verdict and audit counters below)."""

VERDICT_PREFIX = "verdict_"
"""A counter per verdict: ``verdict_<reason>`` is how many calls the registry refused, or
verdicts it wrote down on a watched component, with that reason (one of
[`REASONS`][kvlife.fsm.errors.REASONS]) in the interval. Exported as one labelled counter,
``<prefix>verdicts_total{verdict="<reason>"}``."""

AUDIT_COUNTERS = ("records_lost", "sink_errors")
"""Audit records a sink lost for good, and failed sink writes, in the interval."""


def verdict_growth(refusals: Mapping[str, int], reported: dict[str, int]) -> dict[str, int]:
    """The verdict counters' growth since ``reported`` (which is brought up to date):
    ``verdict_<reason>`` for each reason that grew."""
    grown: dict[str, int] = {}
    for reason, count in refusals.items():
        before = reported.get(reason, 0)
        if count > before:
            grown[VERDICT_PREFIX + reason] = count - before
            reported[reason] = count
    return grown


def audit_growth(registry: LifecycleRegistry, reported: list[int]) -> dict[str, int]:
    """The audit counters' growth since ``reported`` ([lost, errors], brought up to
    date), over every sink of ``registry``; only the counters that grew."""
    sinks = registry.sink_statistics()
    lost = sum(s.dropped for s in sinks)
    errors = sum(s.errors for s in sinks)
    grown = {}
    if lost > reported[0]:
        grown["records_lost"] = lost - reported[0]
    if errors > reported[1]:
        grown["sink_errors"] = errors - reported[1]
    reported[:] = [lost, errors]
    return grown


def is_counter(key: str) -> bool:
    """Whether a stats key adds up over intervals (every key but the gauges)."""
    return key not in GAUGES


_HELP = {
    "stores": "Stores over (every worker reported them).",
    "stored_blocks": "Blocks copied to host memory by stores over.",
    "store_failures": "Stores that failed (their host pages were freed).",
    "skipped_stores": "Stores skipped for want of free or evictable host pages.",
    "held_blocks": "Full blocks not copied: the host cache held them or a store was copying them.",
    "loads": "Loads from the host cache over.",
    "loaded_blocks": "Blocks loaded from the host cache.",
    "load_failures": "Loads that failed (vLLM recomputes their blocks).",
    "hit_blocks": "Host-cache blocks offered to vLLM for requests.",
    "evictions": "Cached host pages evicted (or dropped by a cache reset).",
    "refusals": "Calls kvlife's lifecycle registry refused (late or repeated reports).",
    "stored_bytes": "Bytes copied to host memory, over every worker.",
    "loaded_bytes": "Bytes loaded from host memory, over every worker.",
    "host_pages": "Host pages in all.",
    "host_pages_free": "Host pages no one holds.",
    "host_pages_cached": "Host pages in the host cache that no load reads.",
    "host_pages_pinned": "Host pages in the host cache that loads read now.",
    "host_pages_storing": "Host pages that stores in flight write.",
    "lifecycles_allocated": "kvlife lifecycles live in state allocated.",
    "lifecycles_offloading": "kvlife lifecycles live in state offloading.",
    "lifecycles_finished_pending": "kvlife lifecycles live in state finished_pending.",
    "overdue_tickets": "Tickets (stores, loads, delayed frees) open longer than audit_overdue_s.",
    "tickets_overdue_open": "Overdue tickets still open.",
    "oldest_open_ticket_seconds": "Age of the oldest open ticket (0 when none is open).",
    "verdicts": "kvlife's verdicts (and its registry's refusals), by reason.",
    "records_lost": "Audit records a sink lost for good (the log is incomplete).",
    "sink_errors": "Failed audit sink writes (a full disk, a closed file).",
}


def lifecycle_stats(live: dict[State, int] | Any) -> dict[str, int]:
    """Live lifecycles per state under their stats keys."""
    return {
        "lifecycles_allocated": int(live.get(State.ALLOCATED, 0)),
        "lifecycles_offloading": int(live.get(State.OFFLOADING, 0)),
        "lifecycles_finished_pending": int(live.get(State.FINISHED_PENDING, 0)),
    }


def overdue_gauges(watch: OverdueWatch) -> dict[str, float]:
    """The overdue gauges now (rounded to milliseconds)."""
    return {
        "tickets_overdue_open": watch.open_overdue(),
        "oldest_open_ticket_seconds": round(watch.oldest_age(), 3),
    }


def account_stats(account: PageAccount) -> dict[str, int]:
    """The account under its stats keys."""
    return {
        "host_pages": account.capacity,
        "host_pages_free": account.free,
        "host_pages_cached": account.cached,
        "host_pages_pinned": account.pinned,
        "host_pages_storing": account.storing,
    }


class KVLifePromMetrics(KVConnectorPromMetrics):
    """kvlife's stats in vLLM's Prometheus ``/metrics``, with vLLM's labels (engine,
    model): a counter ``vllm:kvlife_<key>`` per counter (exposed with ``_total``) and a
    gauge ``vllm:kvlife_<key>`` per gauge of the stats (``counters`` and ``gauges``: the
    keys, every one of the connector's by default; ``prefix`` replaces ``vllm:kvlife_``)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        counters: tuple[str, ...] = COUNTERS,
        gauges: tuple[str, ...] = GAUGES,
        prefix: str = "vllm:kvlife_",
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(
                name=f"{prefix}{key}", documentation=_HELP[key], labelnames=labelnames
            )
            for key in (*counters, *AUDIT_COUNTERS)
        }
        self._verdicts = self._counter_cls(
            name=f"{prefix}verdicts",
            documentation=_HELP["verdicts"],
            labelnames=[*labelnames, "verdict"],
        )
        self._gauges = {
            key: self._gauge_cls(
                name=f"{prefix}{key}",
                documentation=_HELP[key],
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            for key in gauges
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add an interval's counter growth, set the gauges to its values."""
        if not transfer_stats_data:
            return
        labels = self.per_engine_labelvalues[engine_idx]
        for key, counter in self._counters.items():
            value = transfer_stats_data.get(key)
            if value:
                counter.labels(*labels).inc(value)
        for key, value in transfer_stats_data.items():
            if value and key.startswith(VERDICT_PREFIX):
                self._verdicts.labels(*labels, key[len(VERDICT_PREFIX) :]).inc(value)
        for key, gauge in self._gauges.items():
            if key in transfer_stats_data:
                gauge.labels(*labels).set(transfer_stats_data[key])


@dataclass
class KVLifeConnectorStats(KVConnectorStats):
    """kvlife's counters for one interval and its host page account at its end, as vLLM's
    metrics logger takes them (``KV Transfer metrics: stores=..., host_pages_free=...``).
    Counters ([`COUNTERS`][kvlife.offload.engines.vllm_common.stats.COUNTERS]) add up when
    intervals are aggregated; the account
    ([`GAUGES`][kvlife.offload.engines.vllm_common.stats.GAUGES]) is the latest one's."""

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key in GAUGES:
                self.data[key] = value
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        counts: dict[str, int | float] = {key: self.data.get(key, 0) for key in COUNTERS}
        extra = {key: v for key, v in self.data.items() if key not in counts and is_counter(key)}
        return counts | extra | {key: self.data[key] for key in GAUGES if key in self.data}

    def is_empty(self) -> bool:
        return not any(v for key, v in self.data.items() if is_counter(key))

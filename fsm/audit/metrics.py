"""Prometheus metrics for a running server (the ``metrics`` extra: ``pip install
'kvlife[metrics]'``, which brings ``prometheus_client``).

[`PrometheusMetrics`][kvlife.fsm.audit.metrics.PrometheusMetrics] is an audit sink and a
Prometheus collector at once. As a sink it keeps plain counters on the registry's thread
(transitions per trigger, copy latency and time in ``finished_pending`` as histograms:
a dict increment and a bisect per record, no lock). As a collector, registered in the
``CollectorRegistry`` you pass (engines already run one), it turns them into metric
families at scrape time, together with what ``LifecycleRegistry.statistics()`` knows
(lifecycles by state, refusals by reason, copies in flight, the oldest live lifecycle's
age, each sink's errors). The scrape runs on the exposition's thread and only reads.

Metric names (with the default namespace ``kvlife``):

| metric | type | labels |
|---|---|---|
| `kvlife_lifecycles` | gauge | `state` (unreleased lifecycles) |
| `kvlife_registered_total`, `kvlife_released_total` | counter | |
| `kvlife_transitions_total` | counter | `trigger` (accepted, registrations included) |
| `kvlife_refusals_total` | counter | `reason` |
| `kvlife_copies_in_flight` | gauge | |
| `kvlife_oldest_live_age_seconds` | gauge | (0 when none is live) |
| `kvlife_copy_latency_seconds` | histogram | (start_offload to its ack or fail) |
| `kvlife_finished_pending_seconds` | histogram | (finish/abort to release, copies in flight) |
| `kvlife_sink_errors_total`, `kvlife_sink_dropped_total` | counter | `sink` (position: repr) |
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

from kvlife.fsm.audit.records import REGISTER, AuditRecord, LostRecords
from kvlife.fsm.table import State, Trigger

if TYPE_CHECKING:
    from kvlife.fsm.registry import LifecycleRegistry

DEFAULT_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
"""Histogram bounds in seconds: a copy takes from tens of microseconds to seconds."""

_PENDING: Final = State.FINISHED_PENDING.value
_RELEASED: Final = State.RELEASED.value


class _Histogram:
    """Counts per bucket and a sum, updated without a lock by one thread."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.total  # copies: the owner keeps writing
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=total)


class PrometheusMetrics:
    """Attach Prometheus metrics to ``registry``, exposed through ``prometheus_registry``.

    Args:
        registry: the lifecycle registry to measure; this object is attached to it as an
            audit sink (so the registry builds a record per transition).
        prometheus_registry: where the collector is registered, e.g. the engine's own
            ``CollectorRegistry`` (``prometheus_client.REGISTRY`` is the process default).
        namespace: the metric name prefix.
        buckets: histogram bounds in seconds, increasing.

    Raises:
        ValueError: ``buckets`` is empty or not increasing, or ``namespace`` is empty.
            Nothing attached, nothing registered.
        WrongThreadError: called from a thread other than the registry's owner. Nothing
            attached, nothing registered.

    Call `close()` to detach and unregister (for a registry that is going away).
    """

    def __init__(
        self,
        registry: LifecycleRegistry,
        prometheus_registry: CollectorRegistry,
        *,
        namespace: str = "kvlife",
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or any(b >= c for b, c in pairwise(bounds)):
            raise ValueError(f"buckets must be increasing and not empty, got {buckets!r}")
        if not namespace:
            raise ValueError("namespace must not be empty")
        self._registry = registry
        self._prometheus = prometheus_registry
        self._ns = namespace
        self._transitions = dict.fromkeys((REGISTER, *(t.value for t in Trigger)), 0)
        self._started: dict[int, int] = {}  # copy number -> t_ns of its start_offload
        self._pending: dict[int, int] = {}  # serial -> t_ns it entered finished_pending
        self._copy_latency = _Histogram(bounds)
        self._pending_time = _Histogram(bounds)
        registry.attach(self)  # first: it checks the thread
        try:
            prometheus_registry.register(self)
        except ValueError:
            registry.detach(self)
            raise

    def write(self, record: AuditRecord) -> None:
        """Count one audit record (the registry calls this on its thread)."""
        if not record.ok:
            return  # refusals are counted by the registry itself
        trigger = record.trigger
        self._transitions[trigger] += 1
        if trigger == "start_offload":
            self._started[record.op] = record.t_ns  # type: ignore[index]
        elif trigger in ("ack", "fail"):
            t_ns = record.t_ns
            start = self._started.pop(record.op, None)  # type: ignore[arg-type]
            if start is not None:
                self._copy_latency.observe((t_ns - start) / 1e9)
            if record.dst == _RELEASED:  # the last copy of a finished_pending lifecycle
                since = self._pending.pop(record.serial, None)  # type: ignore[arg-type]
                if since is not None:
                    self._pending_time.observe((t_ns - since) / 1e9)
        elif record.dst == _PENDING:  # finish or abort with copies in flight
            self._pending[record.serial] = record.t_ns  # type: ignore[index]

    def write_lost(self, marker: LostRecords) -> None:
        """Nothing to do: a range this sink missed shows in ``kvlife_sink_dropped_total``."""

    def describe(self) -> list[Metric]:
        """The families (so that Prometheus refuses a second collector with these names)."""
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        """The metric families, read at scrape time (any thread)."""
        ns = self._ns
        stats = self._registry.statistics()
        lifecycles = GaugeMetricFamily(
            f"{ns}_lifecycles", "Unreleased lifecycles by state", labels=["state"]
        )
        for state, count in stats.live.items():
            if state is not State.RELEASED:
                lifecycles.add_metric([state.value], count)
        yield lifecycles
        yield CounterMetricFamily(
            f"{ns}_registered", "Lifecycles registered", value=stats.registered
        )
        yield CounterMetricFamily(f"{ns}_released", "Lifecycles released", value=stats.released)
        transitions = CounterMetricFamily(
            f"{ns}_transitions", "Accepted transitions by trigger", labels=["trigger"]
        )
        for trigger, count in dict(self._transitions).items():
            transitions.add_metric([trigger], count)
        yield transitions
        refusals = CounterMetricFamily(
            f"{ns}_refusals", "Refused calls by reason", labels=["reason"]
        )
        for reason, count in stats.refusals.items():
            refusals.add_metric([reason], count)
        yield refusals
        yield GaugeMetricFamily(
            f"{ns}_copies_in_flight", "Copies started and not yet acked or failed",
            value=stats.inflight,
        )  # fmt: skip
        yield GaugeMetricFamily(
            f"{ns}_oldest_live_age_seconds",
            "Age of the oldest unreleased lifecycle (0 when none is live)",
            value=stats.oldest_live_age_s or 0.0,
        )
        yield self._copy_latency.family(
            f"{ns}_copy_latency_seconds", "From start_offload to the copy's ack or fail"
        )
        yield self._pending_time.family(
            f"{ns}_finished_pending_seconds",
            "From finish or abort to release, for lifecycles with copies in flight",
        )
        errors = CounterMetricFamily(
            f"{ns}_sink_errors", "Failed writes per audit sink", labels=["sink"]
        )
        dropped = CounterMetricFamily(
            f"{ns}_sink_dropped", "Records an audit sink lost", labels=["sink"]
        )
        for index, sink in enumerate(stats.sinks):
            label = f"{index}:{sink.sink}"
            errors.add_metric([label], sink.errors)
            dropped.add_metric([label], sink.dropped)
        yield errors
        yield dropped

    def close(self) -> None:
        """Detach from the registry and unregister from Prometheus."""
        self._registry.detach(self)
        self._prometheus.unregister(self)

    def __repr__(self) -> str:
        return f"<PrometheusMetrics {self._ns}>"


__all__ = ["DEFAULT_BUCKETS", "PrometheusMetrics"]

"""Prometheus metrics: scraped from a real HTTP exposition on 127.0.0.1 and parsed."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from kvlife.fsm import LifecycleRegistry, MemorySink, StaleInstanceError, WrongThreadError
from kvlife.fsm.audit.metrics import PrometheusMetrics
from tests.strategies import Req


class Broken:
    def write(self, record: object) -> None:
        raise OSError(28, "No space left on device")


@pytest.fixture
def exposition() -> Iterator[tuple[CollectorRegistry, str]]:
    prometheus = CollectorRegistry()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=prometheus)
    try:
        yield prometheus, f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_scrape_shows_what_the_registry_did(
    exposition: tuple[CollectorRegistry, str],
) -> None:
    prometheus, url = exposition
    registry = LifecycleRegistry(sinks=[MemorySink()])
    metrics = PrometheusMetrics(registry, prometheus)
    old, new, idle = Req("a"), Req("a"), Req("b")
    t1 = registry.start_offload(registry.register(old))
    t2 = registry.start_offload(old)
    registry.complete(t1)
    registry.finish(old)  # finished_pending, one copy in flight
    registry.register(new)  # the rid reused
    registry.register(idle)
    registry.complete(t2, ok=False)  # old released
    with pytest.raises(StaleInstanceError):
        registry.complete(t2)
    t3 = registry.start_offload(new)
    registry.attach(Broken())
    registry.abort(idle)  # the broken sink's first error

    m = scrape(url)
    assert m[("kvlife_lifecycles", (("state", "allocated"),))] == 0
    assert m[("kvlife_lifecycles", (("state", "offloading"),))] == 1
    assert m[("kvlife_lifecycles", (("state", "finished_pending"),))] == 0
    assert m[("kvlife_registered_total", ())] == 3
    assert m[("kvlife_released_total", ())] == 2
    for trigger, n in [("register", 3), ("start_offload", 3), ("ack", 1), ("fail", 1)]:
        assert m[("kvlife_transitions_total", (("trigger", trigger),))] == n
    assert m[("kvlife_transitions_total", (("trigger", "finish"),))] == 1
    assert m[("kvlife_refusals_total", (("reason", "stale_instance"),))] == 1
    assert m[("kvlife_refusals_total", (("reason", "rid_conflict"),))] == 0
    assert m[("kvlife_copies_in_flight", ())] == 1
    assert m[("kvlife_oldest_live_age_seconds", ())] >= 0
    assert m[("kvlife_copy_latency_seconds_count", ())] == 2  # t1 acked, t2 failed
    assert m[("kvlife_copy_latency_seconds_bucket", (("le", "+Inf"),))] == 2
    assert m[("kvlife_copy_latency_seconds_sum", ())] > 0
    assert m[("kvlife_finished_pending_seconds_count", ())] == 1  # old; idle had no copy
    errors = {k[1][0][1]: v for k, v in m.items() if k[0] == "kvlife_sink_errors_total"}
    assert sorted(errors.values()) == [0, 0, 1] and any("Broken" in s for s in errors)

    registry.complete(t3)
    registry.finish(new)
    m = scrape(url)
    assert m[("kvlife_lifecycles", (("state", "offloading"),))] == 0
    assert m[("kvlife_copy_latency_seconds_count", ())] == 3
    metrics.close()
    assert metrics not in registry.sinks
    assert ("kvlife_lifecycles", (("state", "allocated"),)) not in scrape(url)


def test_histogram_buckets_are_cumulative(exposition: tuple[CollectorRegistry, str]) -> None:
    prometheus, url = exposition
    registry = LifecycleRegistry()
    PrometheusMetrics(registry, prometheus, namespace="engine_kv", buckets=(1.0, 60.0))
    req = Req("r")
    registry.complete(registry.start_offload(registry.register(req)))
    m = scrape(url)
    le = [m[("engine_kv_copy_latency_seconds_bucket", (("le", b),))] for b in ("1.0", "60.0")]
    assert le == [1, 1] and m[("engine_kv_copy_latency_seconds_bucket", (("le", "+Inf"),))] == 1


def test_bad_arguments_change_nothing() -> None:
    registry = LifecycleRegistry()
    prometheus = CollectorRegistry()
    for kwargs in ({"buckets": ()}, {"buckets": (1.0, 0.5)}, {"namespace": ""}):
        with pytest.raises(ValueError, match=r"buckets must be|namespace must"):
            PrometheusMetrics(registry, prometheus, **kwargs)  # type: ignore[arg-type]
    assert registry.sinks == () and list(prometheus.collect()) == []
    PrometheusMetrics(registry, prometheus)
    with pytest.raises(ValueError, match="Duplicated"):  # the names are taken
        PrometheusMetrics(registry, prometheus)
    assert len(registry.sinks) == 1


def test_only_the_owner_thread_can_attach_it() -> None:
    registry = LifecycleRegistry()
    prometheus = CollectorRegistry()
    caught: list[BaseException] = []

    def other() -> None:
        try:
            PrometheusMetrics(registry, prometheus)
        except WrongThreadError as exc:
            caught.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(caught) == 1 and registry.sinks == () and list(prometheus.collect()) == []

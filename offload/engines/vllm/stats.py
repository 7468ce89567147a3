"""kvlife's counters and host page account as vLLM's connector-stats hook takes them."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvlife.offload.planner import COUNTERS, PageAccount

GAUGES = (
    "host_pages",
    "host_pages_free",
    "host_pages_cached",
    "host_pages_pinned",
    "host_pages_storing",
)
"""The host pages' account at the end of the interval (see
[`PageAccount`][kvlife.offload.planner.PageAccount]): capacity, free, cached (evictable),
pinned by loads, written by stores in flight; the last four sum to the first."""

STAT_KEYS = COUNTERS + GAUGES
"""Every key the connector reports: the planner's counters (each interval's growth) and
the page account (its value)."""


def account_stats(account: PageAccount) -> dict[str, int]:
    """The account under its stats keys."""
    return {
        "host_pages": account.capacity,
        "host_pages_free": account.free,
        "host_pages_cached": account.cached,
        "host_pages_pinned": account.pinned,
        "host_pages_storing": account.storing,
    }


@dataclass
class KVLifeConnectorStats(KVConnectorStats):
    """kvlife's counters for one interval and its host page account at its end, as vLLM's
    metrics logger takes them (``KV Transfer metrics: stores=..., host_pages_free=...``).
    Counters ([`COUNTERS`][kvlife.offload.planner.COUNTERS]) add up when intervals are
    aggregated; the account ([`GAUGES`][kvlife.offload.engines.vllm.stats.GAUGES]) is the
    latest one's."""

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
        return counts | {key: self.data[key] for key in GAUGES if key in self.data}

    def is_empty(self) -> bool:
        return not any(self.data.get(key, 0) for key in COUNTERS)

"""The wrapped connector's statistics relayed through vLLM's stats hook and
``/metrics``, with kvlife's own audit counters beside them: ``WrappedConnectorStats``
carries both across vLLM's processes (the wrapped class by its import path, rebuilt where
vLLM aggregates), ``WrappedPromMetrics`` hands each part to its own Prometheus metrics.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvlife.offload.engines.vllm_common.stats import (
    OVERDUE_COUNTERS,
    OVERDUE_GAUGES,
    KVLifePromMetrics,
    is_counter,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.kvlife")


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


class WrappedPromMetrics(KVConnectorPromMetrics):
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

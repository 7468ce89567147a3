"""The connector's configuration: ``kv_connector_extra_config``, checked at start-up,
and what follows from it (host pages, each engine core's audit log)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from kvlife.fsm import DEFAULT_OVERDUE_S

STOPPING: Final = (KeyboardInterrupt, SystemExit, GeneratorExit)
"""Exceptions that stop the process or a generator, not a connector's failure: everything
else a connector raises (``BaseException`` subclasses included, such as pyo3's
``PanicException`` from a native core) is recorded and judged as the connector's."""

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

DEFAULT_HOST_PAGES = 1024
"""Host pages (one vLLM block each) when the extra config says neither ``host_pages`` nor
``host_bytes``."""
TESTED_VLLM = ("0.32.", "0.33.")
"""vLLM release lines the connector is tested on."""


_FSYNC = ("never", "batch", "record")


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, checked. Every key is optional.

    Attributes:
        host_pages: host cache size in vLLM blocks (one page holds one block of every
            layer); default 1024 when ``host_bytes`` is not given either.
        host_bytes: host cache size in bytes instead (per worker): as many whole blocks
            as fit, counted as vLLM's KV cache spec counts a block over all layers.
        stride_blocks: blocks per store job (default 1).
        audit_log: path of the scheduler side's JSON-lines audit log (default none). Under
            data parallelism every engine core writes its own:
            [`audit_path()`][kvlife.offload.engines.vllm_common.config.audit_path].
        audit_flush_s: most seconds a record waits before it is written (default 1).
        audit_fsync: ``"never"``, ``"batch"`` (default) or ``"record"``.
        audit_max_bytes: rotate the log past this size (default: never).
        audit_backups: rotated files kept (default 5).
        audit_overdue_s: seconds a ticket (a store, a load, a delayed free) may stay open
            before it is written to the log as ``overdue`` and counted in ``/metrics``
            (default [`DEFAULT_OVERDUE_S`][kvlife.fsm.overdue.DEFAULT_OVERDUE_S], 120; 0:
            never).
        stats_interval_s: most often, in seconds, the connector hands its counters to
            vLLM's stats hook (default 0.5; 0: at every step). Counts of the steps in
            between are not lost: they are in the next interval's growth.
        block_layout: ask vLLM for a block-outermost KV cache layout, whose blocks kvlife
            copies whole by the copy engines (default ``true``; see
            [`block_layout_wish()`][kvlife.offload.engines.vllm.layouts.block_layout_wish]
            for where it is not asked); ``false`` leaves the layout to vLLM.
    """

    host_pages: int | None = None
    host_bytes: int | None = None
    stride_blocks: int = 1
    audit_log: str | None = None
    audit_flush_s: float = 1.0
    audit_fsync: str = "batch"
    audit_max_bytes: int | None = None
    audit_backups: int = 5
    audit_overdue_s: float = DEFAULT_OVERDUE_S
    stats_interval_s: float = 0.5
    block_layout: bool = True

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Check the extra config and build it.

        Raises:
            ValueError: an unknown key (the message names it and the known ones), or a
                key whose value has the wrong type or range (named, with the value).
        """
        extra = dict(extra or {})
        known = [f.name for f in fields(cls)]
        for key in extra:
            if key not in known:
                raise ValueError(
                    f"kvlife: unknown kv_connector_extra_config key {key!r} "
                    f"(known: {', '.join(known)})"
                )

        def positive_int(key: str) -> None:
            value = extra.get(key)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"kvlife: {key} must be a positive integer, got {value!r}")

        for key in ("host_pages", "host_bytes", "stride_blocks", "audit_max_bytes"):
            positive_int(key)
        if extra.get("host_pages") is not None and extra.get("host_bytes") is not None:
            raise ValueError("kvlife: give host_pages or host_bytes, not both")
        backups = extra.get("audit_backups", 5)
        if not isinstance(backups, int) or isinstance(backups, bool) or backups < 0:
            raise ValueError(f"kvlife: audit_backups must be an integer >= 0, got {backups!r}")
        interval = extra.get("stats_interval_s", 0.5)
        if (
            not isinstance(interval, (int, float))
            or isinstance(interval, bool)
            or not 0 <= interval < float("inf")
        ):
            raise ValueError(f"kvlife: stats_interval_s must be a number >= 0, got {interval!r}")
        overdue = extra.get("audit_overdue_s", DEFAULT_OVERDUE_S)
        if (
            not isinstance(overdue, (int, float))
            or isinstance(overdue, bool)
            or not 0 <= overdue < float("inf")
        ):
            raise ValueError(
                f"kvlife: audit_overdue_s must be a number >= 0 (0: never), got {overdue!r}"
            )
        flush = extra.get("audit_flush_s", 1.0)
        if (
            not isinstance(flush, (int, float))
            or isinstance(flush, bool)
            or not 0 < flush < float("inf")
        ):
            raise ValueError(f"kvlife: audit_flush_s must be a positive number, got {flush!r}")
        if extra.get("audit_fsync", "batch") not in _FSYNC:
            raise ValueError(
                f"kvlife: audit_fsync must be one of {', '.join(_FSYNC)}, "
                f"got {extra['audit_fsync']!r}"
            )
        block_layout = extra.get("block_layout", True)
        if not isinstance(block_layout, bool):
            raise ValueError(f"kvlife: block_layout must be true or false, got {block_layout!r}")
        audit = extra.get("audit_log")
        if audit is not None and (not isinstance(audit, str) or not audit):
            raise ValueError(f"kvlife: audit_log must be a file path, got {audit!r}")
        return cls(
            **{
                **extra,
                "stride_blocks": extra.get("stride_blocks") or 1,
                "audit_flush_s": float(flush),
                "audit_overdue_s": float(overdue),
                "stats_interval_s": float(interval),
            }
        )

    def pages(self, block_bytes: int) -> int:
        """Host pages for blocks of ``block_bytes`` bytes.

        Raises:
            ValueError: ``host_bytes`` holds not even one block.
        """
        if self.host_bytes is None:
            return self.host_pages or DEFAULT_HOST_PAGES
        pages = self.host_bytes // block_bytes
        if pages <= 0:
            raise ValueError(
                f"kvlife: host_bytes={self.host_bytes} holds no block of {block_bytes} bytes"
            )
        return pages


def block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one vLLM block over every layer, as vLLM's KV cache spec counts them."""
    return sum(
        group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        for group in kv_cache_config.kv_cache_groups
    )


def audit_path(audit_log: str, vllm_config: VllmConfig) -> str:
    """The audit log this engine core writes, from the one ``audit_log`` setting.

    Every engine core is a writer of its own: under data parallelism rank ``r`` writes
    ``NAME.dp<r>.jsonl`` beside ``audit_log`` (``kvlife.jsonl`` becomes
    ``kvlife.dp0.jsonl``, ``kvlife.dp1.jsonl``, ...; a name without a suffix gets
    ``.dp<r>`` appended). ``kvlife audit`` takes the directory, or the files, and checks
    each writer's records as their own sequence. Without data parallelism it is
    ``audit_log`` itself.

    An engine core is a data-parallel rank when its config says
    ``data_parallel_size > 1``, or when vLLM marked its ``kv_transfer_config.engine_id``
    with ``_dp<r>`` (vLLM does so for every rank; for a dense model it then resets the
    rank's own parallel config to a single rank, keeping the rank in
    ``data_parallel_index``).
    """
    parallel = vllm_config.parallel_config
    marked = re.search(r"_dp(\d+)$", vllm_config.kv_transfer_config.engine_id or "")
    if parallel.data_parallel_size <= 1 and marked is None:
        return audit_log
    rank = int(marked.group(1)) if marked else int(parallel.data_parallel_rank)
    path = Path(audit_log)
    if path.suffix:
        return str(path.with_name(f"{path.stem}.dp{rank}{path.suffix}"))
    return f"{audit_log}.dp{rank}"

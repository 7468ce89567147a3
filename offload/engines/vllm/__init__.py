"""kvlife as a vLLM KV connector (vLLM 0.32.x and 0.33.x, the ``vllm`` extra): stores
and loads.

Enable it with one config, no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "KVLifeConnector",
        "kv_connector_module_path": "kvlife.offload.engines.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_bytes": 4294967296, "audit_log": "kvlife.jsonl"}}'

The extra config's keys are checked at start-up (see
[`ConnectorConfig`][kvlife.offload.engines.vllm.ConnectorConfig]); an unknown key or a
bad value stops the engine with a one-line error naming it.

The package is vLLM's two processes over kvlife's offload core in two halves:
``connector`` (``KVLifeConnector``: delegation only), ``scheduler`` (the engine core's
side, over the torch-free [`OffloadPlanner`][kvlife.offload.planner.OffloadPlanner]),
``worker`` (each worker's side, over [`OffloadWorker`][kvlife.offload.worker.OffloadWorker]),
``metadata`` (what crosses between them each step), ``layouts`` (the KV cache layout it
asks for), and what the audit wrapper shares with it: ``config``, ``core_log`` and
``stats``.

Scheduler side (the engine core): every vLLM ``Request`` *object* gets its own kvlife
lifecycle when vLLM first shows it (``on_new_request``); the request id is only used to
find the request object vLLM's scheduler holds under it now. Each step, newly full
blocks (``stride_blocks`` at a time) are stored, except those the host cache holds
already or another request is storing right now (looked up by vLLM's block hashes): each
run of consecutive blocks to copy is one store, a kvlife ticket whose copy number is the
job id the workers report back. When a request finishes, its full blocks that no step
stored are stored then: the block its last step filled, under vLLM's async scheduling
(named by its block hash only once that step's output came back, after the next step
was planned), and those short of a stride; the workers launch these before the next
forward pass (``last_stores``, in ``handle_preemptions``). ``request_finished`` finishes
(or aborts) the lifecycle and never delays vLLM's free: vLLM takes the blocks and the request id
back at once, so a client may reuse the id at once (vLLM's scheduler asserts on a live
duplicate id, which a delayed free would make). A finished request's blocks that a store
still reads are *fenced* instead: when vLLM hands one to another request, that step's
metadata names the stores that read it, and the workers finish them before the forward
pass writes it (``handle_preemptions``, as for preempted requests). A store completes
when every worker reported it (tensor parallelism); a failed store is a ``fail`` of its
ticket, audited, its host pages freed. A completion for a job whose lifecycle is gone is
refused and audited by the registry, never applied to whoever holds the id now. Counters
(stores, loads, hit blocks, evictions, refusals, ...) go to vLLM's own metrics log
through its connector-stats hook.

Worker side: a vLLM *block* is the unit. ``register_kv_caches`` takes vLLM's per-layer
caches in whatever layout the attention backend chose (vLLM 0.32+ hands each layer a
``[blocks, heads, tokens, content]`` view of one allocation, strided after one of its
six ``KVCacheLayout`` permutations; a ``[2, blocks, ...]`` K/V-split tensor is taken
too) and finds the block dimension from the shapes, strides and vLLM's resolved layout
(see [`block_views`][kvlife.offload.layout.block_views]). A host page holds one
block of every layer. On a block-outermost layout (which the connector asks vLLM for on
CUDA: ``layouts``) the page is the block's one run of bytes, and a step's stores or loads
are one list of runs copied by the copy engines, no kernel; on a per-layer layout a store
is one gather per layer over the block dimension (kvlife's ``CopyEngine``: side streams
and events on CUDA, synchronous on CPU), and a load writes the pages back into the blocks
vLLM allocated, byte for byte.

Loads: a store's blocks join a host prefix cache keyed by vLLM's block hashes when every
worker reported it done (a failed store's pages are freed).
``get_num_new_matched_tokens`` reports the cached blocks that follow what vLLM computed
(never the block of the last prompt token: vLLM computes one token itself), and the load
into the blocks vLLM then allocates is a copy on the request's own lifecycle, with a
ticket like a store: a late load completion after an abort or an id reuse completes that
instance's copy and nothing else. Loads are synchronous as vLLM counts them (the request
is scheduled in the same step, and its forward pass is ordered after the load: at once
on the CPU, by a stream wait on CUDA), so no "finished receiving" report names a request
id. A page being loaded is pinned; new stores evict the least recently used cached pages
that no load reads, and a store that would need a pinned page is skipped. A load that
fails reports its blocks through ``get_block_ids_with_load_errors`` so that vLLM
recomputes them.

Audit log: every connector call's records are written to the file when the call returns
(fsynced within ``audit_flush_s`` seconds, default 1), so the log is current while the
server runs, and an engine core that is killed between calls -- as vLLM's server kills
it at every stop, before any shutdown call reaches the connector -- loses none; the next
start logs that the previous writer did not close the log. An ``LLM`` that ends closes it.
Under data parallelism every engine core writes a log of its own
([`audit_path()`][kvlife.offload.engines.vllm_common.config.audit_path]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlife.offload.engines.vllm.connector import KVLifeConnector
from kvlife.offload.engines.vllm.metadata import KVLifeConnectorMetadata, KVLifeWorkerMetadata
from kvlife.offload.engines.vllm.worker import resolved_layout, vllm_block_views
from kvlife.offload.engines.vllm_common.config import (
    DEFAULT_HOST_PAGES,
    TESTED_VLLM,
    ConnectorConfig,
    audit_path,
    block_bytes,
)
from kvlife.offload.engines.vllm_common.stats import (
    COUNTERS,
    GAUGES,
    STAT_KEYS,
    KVLifeConnectorStats,
    KVLifePromMetrics,
)

if TYPE_CHECKING:
    from kvlife.offload.watch.vllm.audit import KVLifeAuditConnector, KVLifeAuditConnectorHMA

_WATCHERS = {"KVLifeAuditConnector", "KVLifeAuditConnectorHMA"}


def __getattr__(name: str) -> Any:
    """The audit wrapper's classes under the path users' configurations name
    (``kv_connector_module_path: kvlife.offload.engines.vllm``); they live with the other
    watchers in [`kvlife.offload.watch.vllm`][kvlife.offload.watch.vllm], imported only
    when asked for."""
    if name in _WATCHERS:
        from kvlife.offload.watch.vllm import audit  # noqa: PLC0415

        return getattr(audit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "COUNTERS",
    "DEFAULT_HOST_PAGES",
    "GAUGES",
    "STAT_KEYS",
    "TESTED_VLLM",
    "ConnectorConfig",
    "KVLifeAuditConnector",
    "KVLifeAuditConnectorHMA",
    "KVLifeConnector",
    "KVLifeConnectorMetadata",
    "KVLifeConnectorStats",
    "KVLifePromMetrics",
    "KVLifeWorkerMetadata",
    "audit_path",
    "block_bytes",
    "resolved_layout",
    "vllm_block_views",
]

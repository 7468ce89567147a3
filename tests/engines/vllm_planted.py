"""KV connectors written for the exercise's tests: ``Planted`` is a correct connector of
the kind that hands blocks over by request id (NIXL's, LMCache's): it delays the free of
every request that finished with blocks until its worker has "sent" them, and loads one
block asynchronously for a prompt it saw before, its worker reporting both by request id
one step later; it also publishes a ``BlockStored`` for each finished request's first
block. Each subclass plants one lifecycle bug, which one family of ``kvlife vllm
exercise`` should catch (``CAUGHT_BY``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import RequestStatus

MODULE = "tests.engines.vllm_planted"


def config(name: str) -> dict[str, Any]:
    """The ``kv_transfer_config`` of the planted connector ``name``."""
    return {"kv_connector": name, "kv_connector_module_path": MODULE, "kv_role": "kv_both"}


@dataclass
class PlantedMeta(KVConnectorMetadata):
    sends: list[str] = field(default_factory=list)  # delayed frees to report
    loads: list[str] = field(default_factory=list)  # asynchronous loads to report


class Planted(KVConnectorBase_V1):
    """The correct connector."""

    # a config's id -> (the config, workers made with it): the config is kept so that its
    # id is never another config's (a freed config's id, reused, made a lone worker rank 1)
    _ranks: ClassVar[dict[int, tuple[Any, int]]] = {}

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block = vllm_config.cache_config.block_size
        self.seen: set[tuple[int, ...]] = set()  # prompts seen (their first block)
        self.receiving: set[str] = set()  # loads not reported yet: vLLM frees those itself
        self.meta = PlantedMeta()
        self.events: list[Any] = []
        self.tokens_of: dict[Any, list[int]] = {}
        # worker side: what to report at the next get_finished, and this worker's rank
        self.bound: PlantedMeta | None = None
        self.owed: tuple[set[str], set[str]] = (set(), set())
        self.rank = 0
        if role == KVConnectorRole.WORKER:
            seen, made = self._ranks.get(id(vllm_config), (None, 0))
            self.rank = made if seen is vllm_config else 0
            self._ranks[id(vllm_config)] = (vllm_config, self.rank + 1)

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        key = tuple(request.prompt_token_ids[: self.block])
        first = key not in self.seen
        self.seen.add(key)
        if first or num_computed_tokens + self.block >= request.num_tokens:
            return 0, False
        if request.status == RequestStatus.PREEMPTED or getattr(request, "loaded", False):
            return 0, False
        return self.block, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            request.loaded = True  # once per request object
            self.receiving.add(request.request_id)
            self.meta.loads.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self.meta = self.meta, PlantedMeta()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self.receiving -= connector_output.finished_recving or set()

    def delays(self, request: Any) -> bool:
        """Whether ``request``'s free waits for its worker's send."""
        return (
            request.status != RequestStatus.FINISHED_ABORTED
            and request.request_id not in self.receiving
        )

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        if request.block_hashes:
            self.publish(request)
        groups = block_ids if isinstance(block_ids, tuple) else (block_ids,)
        delay = any(len(group) for group in groups) and self.delays(request)
        if delay:
            self.meta.sends.append(request.request_id)
        return delay, None

    def publish(self, request: Any) -> None:
        key = maybe_convert_block_hash(request.block_hashes[0])
        self.events.append(
            BlockStored(
                block_hashes=[key],
                parent_block_hash=None,
                token_ids=self.first_block(request),
                block_size=self.block,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            )
        )

    def first_block(self, request: Any) -> list[int]:
        return list(request.all_token_ids[: self.block])

    def take_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events

    # worker side: each send and load done one step after it was ordered
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.bound = connector_metadata  # type: ignore[assignment]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.owed
        meta = self.bound or PlantedMeta()
        self.owed = (self.sent(meta, finished_req_ids), self.received(meta))
        return sending or None, recving or None

    def sent(self, meta: PlantedMeta, finished_req_ids: set[str]) -> set[str]:
        return set(meta.sends)

    def received(self, meta: PlantedMeta) -> set[str]:
        return set(meta.loads)


class InheritsState(Planted):
    """The worker remembers the ids it reported a send for, so as never to report one
    twice: a reused id's delayed free is never reported (vLLM holds it for ever)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.reported: set[str] = set()

    def sent(self, meta: PlantedMeta, finished_req_ids: set[str]) -> set[str]:
        fresh = set(meta.sends) - self.reported
        self.reported |= fresh
        return fresh


class RepeatsReport(Planted):
    """The worker reports each send again at the step after."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.last: set[str] = set()

    def sent(self, meta: PlantedMeta, finished_req_ids: set[str]) -> set[str]:
        again, self.last = self.last, set(meta.sends)
        return self.last | again


class ReportsAborted(Planted):
    """The worker reports a send for every request vLLM finished, aborted ones too (whose
    free the scheduler side did not delay)."""

    def sent(self, meta: PlantedMeta, finished_req_ids: set[str]) -> set[str]:
        return set(meta.sends) | set(finished_req_ids)


class ForgetsPreempted(Planted):
    """The scheduler side delays the free of a request that was preempted once, but never
    tells the worker to send it: its free is never reported."""

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        delay, params = super().request_finished(request, block_ids)
        if delay and request.num_preemptions > 0:
            self.meta.sends.remove(request.request_id)
        return delay, params


class LoadForAnother(Planted):
    """The second worker reports each load under the id of the load it saw before (a
    stale variable): with two workers, a load is reported for another request."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.previous: str | None = None

    def received(self, meta: PlantedMeta) -> set[str]:
        if self.rank == 0:
            return set(meta.loads)
        reported = set()
        for rid in meta.loads:
            reported.add(self.previous if self.previous is not None else rid)
            self.previous = rid
        return reported


class WrongTokens(Planted):
    """``BlockStored`` carries the tokens cached under the block's first token: two
    prompts that begin alike but differ within the block publish the first one's tokens
    under the second one's hash."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cache: dict[int, list[int]] = {}

    def first_block(self, request: Any) -> list[int]:
        tokens = list(request.all_token_ids[: self.block])
        return self.cache.setdefault(tokens[0], tokens)


class NativePanic(BaseException):
    """What pyo3 raises for a panic in a connector's Rust core (its ``PanicException``
    derives from ``BaseException``, not ``Exception``)."""


PANIC_HOOKS = (
    "__init__",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
    "get_finished",
    "shutdown",
)
"""The hooks ``Panics`` can panic in (its extra config's ``panic_in``)."""


class Panics(Planted):
    """A correct connector whose native core panics in one hook, named by its extra
    config's ``panic_in`` (from the first call of that hook on)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.panic_in = extra.get("panic_in")
        self.panic("__init__")

    def panic(self, hook: str) -> None:
        if self.panic_in == hook:
            raise NativePanic(f"panicked at src/leader.rs: {hook} contract violation")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self.panic("get_num_new_matched_tokens")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.panic("update_state_after_alloc")
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.panic("build_connector_meta")
        return super().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.panic("update_connector_output")
        super().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        self.panic("request_finished")
        return super().request_finished(request, block_ids)

    def take_events(self) -> list[Any]:
        self.panic("take_events")
        return super().take_events()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.panic("get_finished")
        return super().get_finished(finished_req_ids)

    def shutdown(self) -> None:
        self.panic("shutdown")


class HoldsPort(Planted):
    """A correct connector whose scheduler side binds a fixed loopback port (its extra
    config's ``port``), as KVBM's leader binds its ZMQ ports, and lets go of it in
    ``shutdown()``."""

    held: ClassVar[list[socket.socket]] = []  # every socket bound, for the tests to close

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.socket: socket.socket | None = None
        if role == KVConnectorRole.SCHEDULER:
            port = vllm_config.kv_transfer_config.kv_connector_extra_config["port"]
            bound = socket.socket()
            try:
                bound.bind(("127.0.0.1", port))
            except OSError:
                bound.close()
                raise
            self.socket = bound
            self.held.append(bound)

    def shutdown(self) -> None:
        if self.socket is not None:
            self.socket.close()


class KeepsPort(HoldsPort):
    """``HoldsPort`` that never lets go of its port: its ``shutdown()`` does nothing."""

    def shutdown(self) -> None:
        return None


#: planted connector -> the family that should catch it
CAUGHT_BY = {
    "InheritsState": "reuse",
    "RepeatsReport": "basic",
    "ReportsAborted": "abort",
    "ForgetsPreempted": "preempt",
    "LoadForAnother": "tp2",
    "WrongTokens": "prefix",
}

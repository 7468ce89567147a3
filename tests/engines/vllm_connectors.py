"""KV connectors written for the tests, scheduler side only: the workers are played by
the test, which reads what each connector is waiting for (``sending``, ``loading``).

``PlayConnector`` (extra config, every key optional):

- ``delay_free``: ``request_finished`` delays the free of every request that has blocks
  (``True``), as a connector that copies a finished request's KV out does;
- ``async_load_tokens``: for a request whose id starts with ``load``, claim that many
  tokens as an asynchronous load, once;
- ``raise_on``: ``request_finished`` raises ``KeyError`` for this request id;
- ``raise_in_step``: ``build_connector_meta`` raises ``ValueError`` naming this request id
  in its message (as LMCache's does) when vLLM schedules it;
- ``stored_events``: publish a ``BlockStored`` for each finished request's first block;
  ``"wrong"`` pairs it with the tokens of the request finished before it, ``"removed"``
  also publishes a ``BlockRemoved`` for its second block, which was never stored;
  ``"shared"`` publishes one ``BlockRemoved`` per store once a first block was stored twice
  (two requests with one prefix: allowed), ``"shared_extra"`` one more than that;
- ``delay_while_loading``: delay the free of a request whose load is still in flight too
  (vLLM holds such a request's blocks itself and frees them at ``finished_recving``).

``PlayConnectorHMA`` is the same connector as a ``SupportsHMA``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash


class PlayConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.delay_free = bool(extra.get("delay_free", False))
        self.async_load_tokens = int(extra.get("async_load_tokens", 0))
        self.raise_on = extra.get("raise_on")
        self.raise_in_step = extra.get("raise_in_step")
        self.stored_events = extra.get("stored_events")
        self.delay_while_loading = bool(extra.get("delay_while_loading", False))
        self.block_size = vllm_config.cache_config.block_size
        self.sending: list[str] = []  # delayed frees the workers have to report
        self.loading: list[str] = []  # asynchronous loads the workers have to report
        self.receiving: set[str] = set()  # loads not reported yet: vLLM frees those itself
        self.events: list[Any] = []
        self._previous: Any = None  # the request finished before, for "wrong" events
        self._stored: list[Any] = []  # first-block hashes published, for "shared" events

    # worker side: the tests play it
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        wanted = self.async_load_tokens
        if (
            wanted
            and request.request_id.startswith("load")
            and not getattr(request, "play_loaded", False)
            and num_computed_tokens + wanted < request.num_tokens
        ):
            return wanted, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            request.play_loaded = True  # once per request object
            self.loading.append(request.request_id)
            self.receiving.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.raise_in_step in scheduler_output.num_scheduled_tokens:
            raise ValueError(f"Request {self.raise_in_step} is not in its state")
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: Any) -> None:
        self.receiving -= connector_output.finished_recving or set()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        if request.request_id == self.raise_on:
            raise KeyError(request.request_id)
        if self.stored_events and request.block_hashes:
            self._publish(request)
        groups = block_ids if isinstance(block_ids, tuple) else (block_ids,)
        delay = (
            self.delay_free
            and any(len(group) for group in groups)
            and (self.delay_while_loading or request.request_id not in self.receiving)
        )
        if delay:
            self.sending.append(request.request_id)
        return delay, None

    def _publish(self, request: Any) -> None:
        size, source = self.block_size, request
        if self.stored_events == "wrong" and self._previous is not None:
            source = self._previous  # the new request's hash, the old request's tokens
        self._previous = request
        self.events.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(request.block_hashes[0])],
                parent_block_hash=None,
                token_ids=list(source.all_token_ids[:size]),
                block_size=size,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            )
        )

        key = maybe_convert_block_hash(request.block_hashes[0])
        self._stored.append(key)
        if self.stored_events in ("shared", "shared_extra") and self._stored.count(key) == 2:
            removals = 3 if self.stored_events == "shared_extra" else 2
            self.events += [BlockRemoved(block_hashes=[key], medium="CPU")] * removals
        if self.stored_events == "removed" and len(request.block_hashes) > 1:
            self.events.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(request.block_hashes[1])], medium="CPU"
                )
            )

    def take_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events


class PlayConnectorHMA(PlayConnector, SupportsHMA):
    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        return self.request_finished(request, block_ids)

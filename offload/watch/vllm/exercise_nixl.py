"""vLLM's NIXL prefill/decode connector in ``kvlife vllm exercise``, pull mode
(``NixlConnector``, the same class as ``NixlPullConnector``) and push mode
(``NixlPushConnector``), vLLM 0.33 and 0.32: its real scheduler side, one engine serving
both roles (``kv_role`` ``kv_both``), the other engine of each pair and the NIXL transfers
played.

The workload gives each request a role, as a P/D proxy would (``transfer_params``):

* **decode** (a third of them): ``do_remote_prefill`` with a remote engine, request id,
  host, port and block ids of a prefill engine that the exercise plays. The scheduler side
  asks vLLM for blocks for the whole prompt, vLLM waits (``WAITING_FOR_REMOTE_KVS``) until
  every worker reports the request in ``finished_recving``;
* **prefill** (a third): ``do_remote_decode``, one token decoded (as the proxy asks). When
  it finishes, the scheduler side delays the free of its blocks until a decode engine has
  read them: every worker reports it in ``finished_sending``;
* **local** (the rest): no transfer parameters, nothing for NIXL to do.

The played worker (``NixlPlay``) follows what ``NixlPullConnectorWorker`` does with the
metadata of each step (vLLM 0.33, ``nixl/pull_worker.py``, ``start_load_kv`` and the
notifications it reads in ``get_finished``): a request in ``reqs_to_recv`` that awaits KV or
has local blocks is read, and reported received after the family's delay (one with neither,
a full local hit or a request aborted before vLLM allocated it, only tells the prefill
engine to free, and is never reported); ``reqs_in_batch`` are the prefill requests it
tracks, ``reqs_not_processed`` those it drops (aborted); a request in ``reqs_to_send`` that
it tracks is read by the played decode engine and reported sent after the family's delay.
Like the real worker, it refuses an abort for a request whose send it already waits for
(``AssertionError`` there; ``NixlProtocolError`` here). The prefill engine's reads always
succeed, before any lease expires; heartbeats go nowhere. The scheduler side opens no
socket here (vLLM starts its handshake listener only when workers hand it their metadata).

Push mode (``NixlPushConnector``, ``NixlPushPlay``): the same roles and transfer
parameters, the copies the other way. A decode request's blocks are registered with the
prefill engine (``push_registrations``); the played prefill engine writes them and every
worker reports the request received after the family's delay. A request in
``reqs_to_recv`` without a registration (one aborted before vLLM allocated it) waits for a
write that never comes, and is never reported, as in NIXL's push worker. A finished
prefill request's blocks (``push_finished_blocks``) are written to the played decode
engine, which always registered for them, and every worker that tracks the request
(``reqs_in_batch``, ``reqs_to_send``) reports it sent after the family's delay; an abort
of a request whose send it waits for is refused as in pull mode.

No lens: NIXL's scheduler side keeps no request's state across steps that the wrapper
needs (``_reqs_need_recv``, ``_reqs_in_batch``, ``_reqs_not_processed``,
``_reqs_need_send`` and push mode's registrations and finished blocks are emptied into
each step's metadata); every report names its request id, which the audit wrapper
tickets as it does any connector's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

#: the played prefill engine of every decode request
PEER_ENGINE = "kvlife-exercise-prefill"
#: its side channel, as the transfer parameters name it (nothing listens there: the
#: exercise plays the transfers, the scheduler side never connects)
PEER_HOST, PEER_PORT = "127.0.0.1", 5600
#: tokens per block of the played prefill engine (the exercise's own block size)
PEER_BLOCK = 16


class NixlProtocolError(AssertionError):
    """The scheduler side told the played worker something NIXL's own worker asserts
    against (an abort of a request whose send it waits for)."""


def transfer_params(
    rng: random.Random, rid: str, prompt: int, workers: int
) -> tuple[dict[str, Any] | None, int | None]:
    """A new request's role (see the module's text): its ``kv_transfer_params`` (``None``:
    local) and the tokens it decodes where the role fixes them (``None``: the family's)."""
    role = rng.choice(("local", "prefill", "decode"))
    if role == "prefill":
        return {"do_remote_decode": True, "do_remote_prefill": False}, 1
    if role == "local":
        return None, None
    blocks = -(-prompt // PEER_BLOCK)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": PEER_ENGINE,
        "remote_request_id": f"{PEER_ENGINE}-{rid}",
        "remote_host": PEER_HOST,
        "remote_port": PEER_PORT,
        "remote_block_ids": [list(range(blocks))],
        "tp_size": workers,
    }, None


class NixlPlay:
    """The workers of ``NixlConnector`` (pull), played from each step's metadata (see the
    module's text): each worker reports each read and each send after ``delay()`` steps."""

    kind = "played"
    kv_cache_layout: str | None = None
    transfer_params = staticmethod(transfer_params)

    def __init__(self, scheduler: Any, workers: int) -> None:
        # (not at the module's top: exercise_workers lists this class among its plays)
        from kvlife.offload.watch.vllm.exercise_workers import _Held  # noqa: PLC0415

        self.workers = workers
        self.held = _Held(workers)  # each worker's reports until due
        self.tracked: set[str] = set()  # prefill requests in a batch, not yet sent
        # each worker's sends it waits for (the real worker's ``_reqs_to_send``)
        self.sending: list[set[str]] = [set() for _ in range(workers)]

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        meta = out.kv_connector_metadata
        for rid, req in meta.reqs_to_recv.items():
            if req.awaiting_kvs or any(req.local_block_ids):
                self.held.each(n, delay, finished_recving={rid})
        self.tracked.update(meta.reqs_in_batch)
        self._drops(meta.reqs_not_processed)
        for rid in meta.reqs_to_send:
            if rid in self.tracked:
                self._send(rid, n, delay)
        return self._due(n)

    def _send(self, rid: str, n: int, delay: Callable[[], int]) -> None:
        """Every worker sends the tracked prefill request ``rid`` and reports it sent."""
        self.tracked.discard(rid)
        for sends in self.sending:
            sends.add(rid)
        self.held.each(n, delay, finished_sending={rid})

    def _drops(self, aborted: Any) -> None:
        """The prefill requests ``reqs_not_processed`` names: no longer tracked; refused
        where a worker waits to send one, as NIXL's worker asserts."""
        for rid in aborted:
            self.tracked.discard(rid)
            if any(rid in sends for sends in self.sending):
                raise NixlProtocolError(
                    f"NIXL's worker asserts that no request it waits to send is aborted: "
                    f"{rid!r} is in reqs_not_processed while its send is pending"
                )

    def _due(self, n: int) -> list[Any]:
        """Each worker's reports due at step ``n``; the sends they report done."""
        outputs = self.held.due(n)
        for sends, output in zip(self.sending, outputs, strict=True):
            if output is not None:
                sends.difference_update(output.finished_sending or ())
        return outputs

    def busy(self) -> bool:
        return self.held.busy()


class NixlPushPlay(NixlPlay):
    """The workers of ``NixlPushConnector``, played from each step's metadata (see the
    module's text): each worker reports each write the played prefill engine made into
    its blocks, and each write it made into the played decode engine's, after
    ``delay()`` steps."""

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        meta = out.kv_connector_metadata
        for rid in meta.push_registrations or ():
            self.held.each(n, delay, finished_recving={rid})
        self.tracked.update(meta.reqs_in_batch)
        self._drops(meta.reqs_not_processed)
        waiting = self.tracked.intersection(meta.reqs_to_send)
        for rid in meta.push_finished_blocks or ():
            if rid in waiting:
                self._send(rid, n, delay)
        return self._due(n)


__all__ = ["NixlPlay", "NixlProtocolError", "NixlPushPlay", "transfer_params"]

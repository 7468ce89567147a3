"""LMCache's in-process connector (``LMCacheConnectorV1``: vLLM's ``lmcache_connector.py``
delegating to LMCache's ``integration/vllm/vllm_v1_adapter.py``) in ``kvlife vllm
exercise``: its real scheduler role, and its real worker role with LMCache's engine, its
lookup server and its local CPU backend, in the exercise's process, on the CPU.

LMCache reads its settings from ``LMCACHE_*`` variables (or ``LMCACHE_CONFIG_FILE``), once
per process, and from ``lmcache.*`` keys of the connector's ``kv_connector_extra_config``.
The exercise runs it with its local CPU backend (``LMCACHE_LOCAL_CPU=True``), chunks of one
vLLM block (``LMCACHE_CHUNK_SIZE=16``) and a small ``LMCACHE_MAX_LOCAL_CPU_SIZE``
([`SETTINGS`][kvlife.offload.watch.vllm.exercise_lmcache_inprocess.SETTINGS], used where
the variable is not set).

What LMCache's worker needs that a vLLM worker process would have given it, all of it here:

* vLLM's distributed state, initialised once in the process: gloo, one rank, under
  ``set_current_vllm_config`` (LMCache asks vLLM for its tensor-parallel group; without
  one it falls into its degraded mode, never starts its lookup server, and every lookup
  waits out its timeout);
* the KV cache layout resolved (``LBNHC``, which LMCache reads as ``NHD``);
* a GPU connector: LMCache has none for the CPU, so its own ``MockGPUConnector`` stands in
  (LMCache's engine, lookups, chunk keys, CPU backend, stores and retrievals all run; the
  bytes are not copied, so the exercise compares none);
* a forward context whose ``attn_metadata`` is set (``start_load_kv`` loads nothing
  without one);
* each of the ``tp2`` family's workers its own rank (its own engine, lookup server and
  chunk keys, as in two worker processes: the scheduler's lookup asks both and takes the
  smaller answer);
* at the end of a run, LMCache's services closed from the thread that made them and its
  engine destroyed, but not through LMCache's ``stop_services``, which closes a ZMQ socket
  another thread is blocked on and aborts the process in libzmq; the socket files its
  lookup and offload servers bound (``engine_<id>_service_*`` under vLLM's
  ``VLLM_RPC_BASE_PATH``, the temporary directory by default) removed, which neither
  LMCache nor libzmq does when a bound ``ipc://`` socket closes (each run would leave
  two a worker).

vLLM's wrapper makes every load of this connector synchronous (``get_num_new_matched_tokens``
answers ``load_async=False``): a load runs inside ``start_load_kv`` of the step that
carries it. LMCache's asynchronous loading mode (``enable_async_loading``) is not run: its
lookups and prefetches finish on LMCache's threads, which the exercise cannot pace so that
a seed replays the same run.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from kvlife.offload.watch.vllm.exercise_workers import RealWorkers

SETTINGS = {
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_CHUNK_SIZE": "16",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.1",
}
"""LMCache's settings for the exercise, where the environment does not set them: its local
CPU backend, chunks of one vLLM block of the exercise, 0.1 GB of chunks."""


def settings() -> None:
    """Set [`SETTINGS`][kvlife.offload.watch.vllm.exercise_lmcache_inprocess.SETTINGS]
    where the environment has none (before LMCache reads its config, which it does once per
    process)."""
    for name, value in SETTINGS.items():
        os.environ.setdefault(name, value)


def distributed(vllm_config: Any) -> None:
    """vLLM's distributed state for this process, once: one rank on gloo, a
    tensor-parallel group of one."""
    from vllm.config import set_current_vllm_config  # noqa: PLC0415
    from vllm.distributed import parallel_state  # noqa: PLC0415

    if parallel_state.model_parallel_is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, 1)


@contextlib.contextmanager
def _as_rank(rank: int) -> Iterator[None]:
    """LMCache's worker services built as tensor-parallel rank ``rank``'s (its offload
    server asks vLLM for the rank; this process's own group has one), with
    ``MockGPUConnector`` for the GPU connector."""
    from lmcache.v1 import gpu_connector  # noqa: PLC0415
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector  # noqa: PLC0415
    from vllm.distributed import parallel_state  # noqa: PLC0415

    def mock(config: Any, metadata: Any, *args: Any, **kwargs: Any) -> Any:
        return MockGPUConnector(kv_shape=metadata.kv_shape)

    saved = gpu_connector.CreateGPUConnector, parallel_state.get_tensor_model_parallel_rank
    gpu_connector.CreateGPUConnector = mock
    parallel_state.get_tensor_model_parallel_rank = lambda: rank
    try:
        yield
    finally:
        gpu_connector.CreateGPUConnector, parallel_state.get_tensor_model_parallel_rank = saved


def _impl(connector: Any) -> Any:
    """LMCache's ``LMCacheConnectorV1Impl`` inside vLLM's connector (or kvlife's wrapper)."""
    return getattr(connector, "wrapped", connector)._lmcache_engine


class LMCacheInProcessWorkers(RealWorkers):
    """LMCache's in-process worker role, one instance (and one LMCache engine) per worker;
    the scheduler's lookups served by the workers' lookup servers."""

    #: the KV cache layout vLLM must resolve before LMCache is built (LMCache's ``NHD``)
    kv_cache_layout = "LBNHC"

    def __init__(self, scheduler: Any, workers: int) -> None:
        from vllm.forward_context import ForwardContext  # noqa: PLC0415

        self.engines: list[tuple[Any, Any]] = []  # (engine, its stats logger)
        distributed(scheduler.vllm_config)
        super().__init__(scheduler, workers)
        self.context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})

    def build(self, make: Callable[[Any], Any], vllm_config: Any, rank: int) -> Any:
        from lmcache.integration.vllm.utils import ENGINE_NAME  # noqa: PLC0415
        from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: PLC0415

        mine = copy.copy(vllm_config)
        mine.parallel_config = copy.copy(vllm_config.parallel_config)
        mine.parallel_config.rank = rank
        with _as_rank(rank):
            worker = make(mine)
        manager = _impl(worker)._manager
        if manager._init_failed:
            raise RuntimeError(
                f"LMCache's worker {rank} did not start: {manager._init_failed_reason}"
            )
        # LMCache keeps one engine per process under one name; each worker keeps its own
        stats = LMCacheEngineBuilder._stat_loggers.get(ENGINE_NAME)
        for table in ("_instances", "_cfgs", "_metadatas", "_stat_loggers"):
            getattr(LMCacheEngineBuilder, table).pop(ENGINE_NAME, None)
        self.engines.append((manager.lmcache_engine, stats))
        return worker

    def forward_context(self) -> Any:
        return self.context

    @staticmethod
    def release_scheduler(scheduler: Any) -> None:
        """The scheduler role's lookup sockets, which vLLM's ``shutdown()`` leaves open
        (``LMCacheConnectorV1`` has no ``shutdown``), closed; not the process's shared ZMQ
        context, which LMCache's own ``close`` would terminate under the other sockets."""
        client = _impl(scheduler.connector)._manager.lookup_client
        for sent in getattr(getattr(client, "transport", None), "sockets", ()):
            sent.close(linger=0)

    def close(self) -> None:
        """Close what LMCache's workers started for the run, each from this thread: their
        offload and lookup servers; destroy their engines."""
        for worker in self.ranks:
            manager = _impl(worker)._manager
            if manager.offload_server is not None:
                _stop_offload_server(manager.offload_server)
            if manager.lookup_server is not None:
                _stop_lookup_server(manager.lookup_server)
        for engine, stats in self.engines:
            if stats is not None:
                stats.shutdown()
            engine.close()
            storage = engine.storage_manager  # its close stops its event loop's thread
            if storage is not None and not storage.thread.is_alive():
                storage.loop.close()  # but leaves the loop (and its sockets) open
        self.engines.clear()


def _stopped(server: Any, socket: Any, request: list[bytes]) -> bool:
    """Stop one of LMCache's server threads now: clear its flag and send its socket one
    ``request`` from here, so that its blocked ``recv`` returns and its loop ends (the
    lookup server would leave only at its 1 s receive timeout; the offload server, whose
    ``recv`` has none, never). Whether its thread is gone."""
    import zmq  # noqa: PLC0415

    server.running = False
    if server.thread.is_alive():
        context = zmq.Context()
        waker = context.socket(zmq.REQ)
        waker.setsockopt(zmq.LINGER, 0)
        waker.setsockopt(zmq.SNDTIMEO, 2000)
        waker.connect(socket.getsockopt_string(zmq.LAST_ENDPOINT))
        with contextlib.suppress(zmq.ZMQError):
            waker.send_multipart(request)
        server.thread.join(timeout=5.0)
        waker.close()
        context.term()
    return not server.thread.is_alive()


def _socket_file(socket: Any) -> str | None:
    """The file a socket bound to an ``ipc://`` endpoint made (``None`` for another
    transport): libzmq leaves it when the socket closes."""
    import zmq  # noqa: PLC0415

    endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint.removeprefix("ipc://") if endpoint.startswith("ipc://") else None


def _remove(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _stop_lookup_server(server: Any) -> None:
    """A lookup of nothing (LMCache answers it 0), then LMCache's own close, which joins
    the thread and closes the socket; then the server's own ZMQ context, and the socket's
    file."""
    import msgspec  # noqa: PLC0415

    frames: tuple[Any, ...] = ([], [], "kvlife-close", "")  # hashes, offsets, id, configs
    nothing = [msgspec.msgpack.encode(frame) for frame in frames]
    path = _socket_file(server.transport.socket)
    _stopped(server, server.transport.socket, nothing)
    server.close()
    server.transport.ctx.term()
    _remove(path)


def _stop_offload_server(server: Any) -> None:
    """Closing its socket under its blocked ``recv`` aborts the process: an empty request
    first (LMCache logs it as an error it could not decode), the socket closed once its
    thread is gone, then its file. Its context is the process's shared one: left open."""
    path = _socket_file(server.socket)
    if _stopped(server, server.socket, [b""]):
        server.socket.close(linger=0)
        _remove(path)


__all__ = ["SETTINGS", "LMCacheInProcessWorkers", "distributed", "settings"]

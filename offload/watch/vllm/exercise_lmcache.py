"""LMCache's multi-process connector (``LMCacheMPConnector``, LMCache 0.5.x) in
``kvlife vllm exercise``: its real worker role on CPU KV caches, talking to an ``lmcache
server`` the operator started (the config names it: ``lmcache.mp.host``,
``lmcache.mp.port``; set ``lmcache.mp.nonblocking_lookup_status`` to ``false``).

What LMCache needs that other connectors do not, all of it here:

* vLLM's KV cache layout resolved to ``LBNHC`` before the connector is built (LMCache reads
  it as its NHD layout);
* a paced clock: LMCache's scheduler role sends a request's lookup to the server and polls
  for the server's acknowledgement in the same call, and its worker submits its copies as
  futures; the exercise waits for each lookup's acknowledgement and, after each worker's
  ``wait_for_save``, for every store and retrieve it submitted, so that what vLLM schedules
  does not depend on how fast the server answered (a seed replays the same run). Waiting
  longer than ``PACE_S`` is an error of the run (``TimeoutError``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvlife.offload.watch.vllm.exercise_workers import RealWorkers

#: the longest the exercise waits for LMCache's server or its copies, seconds
PACE_S = 60.0


def _until(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PACE_S
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"LMCache did not {what} in {PACE_S:.0f} s")
        time.sleep(0.001)


class LMCacheWorkers(RealWorkers):
    """LMCache's worker role, one instance per worker, its lookups and copies paced."""

    #: the KV cache layout vLLM must resolve before LMCache is built
    kv_cache_layout = "LBNHC"

    def __init__(self, scheduler: Any, workers: int) -> None:
        super().__init__(scheduler, workers)
        lmcache = getattr(scheduler.connector, "wrapped", scheduler.connector)
        adapter = lmcache.scheduler_adapter
        submit = adapter.maybe_submit_lookup_request
        unacked = adapter._unacked_lookups

        def acknowledged(*args: Any, **kwargs: Any) -> Any:
            sent = submit(*args, **kwargs)
            _until(
                lambda: all(f.query() for a in unacked.values() for f in a.futures.values()),
                "acknowledge a lookup",
            )
            return sent

        adapter.maybe_submit_lookup_request = acknowledged

    def saved(self, worker: Any) -> None:
        adapter = worker.worker_adapter
        _until(
            lambda: (
                all(f.query() for f in adapter.store_futures.values())
                and all(f.query() for f, _ in adapter.retrieve_futures.values())
            ),
            "finish a copy",
        )


__all__ = ["PACE_S", "LMCacheWorkers"]

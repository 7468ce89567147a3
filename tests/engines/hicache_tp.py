"""One TP rank of SGLang 0.5.23's hierarchical cache on the CPU, the HiCache lens on it:
``python -m tests.engines.hicache_tp RANK WORLD STORE LOGDIR SCENARIO SEED LENS``.

The ranks join one gloo process group through the file ``STORE``; each builds the cache
with that group as its ``tp_cache_group`` (the cache all-reduces its ready-ack counts over
it, as in a TP server), runs the same seeded workload, and writes its lens log to
``LOGDIR/sglang-hicache-tpRANK.jsonl`` and what its cache still has pending to
``LOGDIR/rank-RANK.json`` (``LENS``: ``lens``, or ``none`` for SGLang alone). Scenarios:

* ``clean``: the same workload on every rank (the ranks must agree);
* ``write_fails``: on rank 1 only, the first device-to-host write gets no host pages (a
  host pool full on that rank alone), then the same inserts and polls as rank 0.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    from tests.engines import hicache_harness as H

from kvlife.offload.watch.sglang import HiCacheLens, attach

FIRST = list(range(100, 108))
SECOND = list(range(200, 208))


def _failing_first_write(cc: Any) -> None:
    original = cc.write
    calls = [0]

    def write(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return None if calls[0] == 1 else original(*args, **kwargs)

    cc.write = write


def main(argv: list[str]) -> int:
    rank, world, store, logdir, scenario, seed, with_lens = argv
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world)
    )
    hc = H.build("python", tp_group=dist.group.WORLD)
    if scenario == "write_fails" and rank == "1":
        _failing_first_write(hc.cache.cache_controller)  # before the lens: it sees the None
    out = Path(logdir)
    lens = None
    if with_lens == "lens":
        log = out / f"sglang-hicache-tp{rank}.jsonl"
        lens = attach(hc.cache, HiCacheLens(log, f"SGLang 0.5.23 HiCache TP rank {rank}"))
    if scenario == "clean":
        H.run_workload(hc, int(seed), steps=60)
    else:
        hc.insert(FIRST)
        hc.poll()
        hc.insert(SECOND)
        for _ in range(4):
            hc.poll()
    pending = sorted(hc.cache.ongoing_write_through)
    locked = None if lens is None else lens.locks_held()
    hc.cache.release_host_resources()
    (out / f"rank-{rank}.json").write_text(
        json.dumps({"pending_writes": pending, "locks_held": locked})
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

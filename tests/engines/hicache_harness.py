"""SGLang 0.5.23's hierarchical cache built on the CPU (kvlife's
``kvlife.offload.watch.sglang.cpu``: SGLang's own pools, cache, tree cores and
controller, with a CPU allocation and a torch copy where SGLang has only CUDA ones), for
the HiCache lens's tests and benchmark: the seeded workload they run, and a lost ack.

Runs in ``.venv-sglang``; ``torchvision`` is the stand-in of ``standins/`` (put first on
``sys.path`` by ``sglang_harness``, imported first: PyPI's build links CUDA).
"""

from __future__ import annotations

# ruff: noqa: I001  (the stand-in torchvision must be on sys.path before SGLang loads)

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import tests.engines.sglang_harness  # noqa: F401  (first: the torchvision stand-in)
from kvlife.offload.watch.sglang.cpu import CORES, PAGE, POLICIES, build
from kvlife.offload.watch.sglang.cpu import CpuCache as HiCache

__all__ = ["CORES", "PAGE", "POLICIES", "HiCache", "Workload", "build", "held_acks", "run_workload"]


@dataclass
class Workload:
    """What a seeded random workload did, and what the cache answered (to compare a run
    with the lens to one without)."""

    answers: list[Any] = field(default_factory=list)
    loads: int = 0
    host_evictions: int = 0


def run_workload(hc: HiCache, seed: int, steps: int = 120, *, check_bytes: bool = True) -> Workload:
    """Seeded random work on ``hc``: inserts of prefixes that share and split (a few
    families of token sequences, and branches off them: a branch inserted while the
    family's write is pending splits its node mid-write), matches, device eviction to
    host, load-backs with their bytes checked, host eviction; a poll after most steps
    (three in four), so that copies are sometimes still pending at the next step."""
    rng = random.Random(seed)
    done = Workload()
    families = [[100 * f + i for i in range(PAGE * 6)] for f in range(1, 6)]  # exact in fp16
    for _ in range(steps):
        op = rng.random()
        family = rng.choice(families)
        cut = PAGE * rng.randint(1, 6)
        tokens = family[:cut]
        if rng.random() < 0.25:  # a branch: the family's first pages, then its own
            tokens = family[: PAGE * rng.randint(1, 3)] + [t + 50 for t in family[: PAGE * 2]]
        if op < 0.35:
            result = hc.insert(tokens)
            done.answers.append(("insert", None if result is None else result.prefix_len))
        elif op < 0.5:
            m = hc.match(tokens)
            done.answers.append(("match", m.device_prefix_len, m.host_hit_length))
        elif op < 0.7:
            done.answers.append(("evict", hc.evict(PAGE * rng.randint(1, 8))))
        elif op < 0.85:
            started = hc.load_back(tokens)
            done.loads += started
            done.answers.append(("load_back", started))
        else:
            freed = hc.evict_host(PAGE * rng.randint(1, 4))
            done.host_evictions += bool(freed)
            done.answers.append(("evict_host", freed))
        if rng.random() >= 0.75:
            continue  # loads not submitted yet: their device pages hold nothing to check
        hc.poll()
        m = hc.match(tokens)
        if check_bytes and m.device_prefix_len:  # what the device holds for it is its own tokens
            got = hc.device_tokens(tokens)
            assert got == tokens[: len(got)], (seed, tokens[: len(got)], got)
    hc.poll()
    return done


@contextmanager
def held_acks(hc: HiCache, queue: str = "load") -> Iterator[list[Any]]:
    """Take the acks off ``queue`` (``write`` or ``load``) while inside: a lost ack."""
    cc = hc.cache.cache_controller
    q = cc.ack_write_queue if queue == "write" else cc.ack_load_queue
    held = list(q)
    q.clear()
    yield held

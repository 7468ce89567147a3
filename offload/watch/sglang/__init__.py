"""kvlife's lens on a hierarchical KV cache kvlife did not write: SGLang's HiCache
(``--enable-hierarchical-cache``), every node's write-back, load-back, storage backup and
host eviction a lifecycle in kvlife's audit log, with verdicts on the cache's acks, host
frees and locks.

Knowledge of one cache generation lives in one module, picked by the class of the cache it
is given ([`GENERATIONS`][kvlife.offload.watch.sglang.GENERATIONS]); the bookkeeping is
[`HiCacheLens`][kvlife.offload.watch.sglang.lens.HiCacheLens]. A cache whose class no
module knows, or a release that renamed what the module reads, gets no lens
([`NoLensError`][kvlife.offload.watch.sglang.NoLensError], naming what is missing),
never a wrong one. Switched on in a server by kvlife's SGLang plugin
(``KVLIFE_SGLANG_HICACHE=observe``); see ``docs/sglang-hicache.md``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kvlife.offload.watch.sglang.lens import MODES, HiCacheLens, NodeCopy

#: (module, class) of a cache -> the module that knows that generation.
GENERATIONS: dict[tuple[str, str], str] = {
    ("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache"): (
        "kvlife.offload.watch.sglang.unified"
    ),
}


class NoLensError(RuntimeError):
    """No lens for this cache: its class is not one kvlife knows, or the release renamed
    what the lens reads (the message names it). The cache runs as it would without
    kvlife; nothing was wrapped."""


def generation_for(cache: Any) -> ModuleType:
    """The module that knows ``cache``'s generation (its class, or a base class).

    Raises:
        NoLensError: no module knows the class, or one does and names it reads are gone.
    """
    for cls in type(cache).__mro__:
        name = GENERATIONS.get((cls.__module__, cls.__qualname__))
        if name is None:
            continue
        module = importlib.import_module(name)
        gone: list[str] = module.missing(cache)
        if gone:
            raise NoLensError(
                f"kvlife: no HiCache lens for this {cls.__qualname__}: the release renamed "
                f"or dropped what the lens reads ({', '.join(gone)}); the cache runs "
                "without one"
            )
        return module
    raise NoLensError(
        f"kvlife: no HiCache lens for {type(cache).__module__}.{type(cache).__qualname__} "
        f"(kvlife knows {', '.join(cls for _, cls in GENERATIONS)}); the cache runs without one"
    )


def attach(cache: Any, lens: HiCacheLens) -> HiCacheLens:
    """Put ``lens`` on ``cache`` (after its ``init_hicache``) and return it.

    Raises:
        NoLensError: see [`generation_for`][kvlife.offload.watch.sglang.generation_for];
            nothing was wrapped.
        ValueError: the cache already has a lens, or HiCache is not initialised.
    """
    generation_for(cache).install(cache, lens)
    return lens


__all__ = [
    "GENERATIONS",
    "MODES",
    "HiCacheLens",
    "NoLensError",
    "NodeCopy",
    "attach",
    "generation_for",
]

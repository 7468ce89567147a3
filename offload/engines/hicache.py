"""The HiCache lens under its first path (users' code imports ``attach`` from here):
``kvlife.offload.watch.sglang`` is where it lives, with the other watchers."""

from __future__ import annotations

from kvlife.offload.watch.sglang import (
    GENERATIONS,
    MODES,
    HiCacheLens,
    NodeCopy,
    NoLensError,
    attach,
    generation_for,
)

__all__ = [
    "GENERATIONS",
    "MODES",
    "HiCacheLens",
    "NoLensError",
    "NodeCopy",
    "attach",
    "generation_for",
]

"""The audit tools' module paths before they moved into the ``kvlife.fsm.audit`` package.

``import kvlife.fsm.sinks`` (and ``records``, ``reader``, ``checker``, ``explain``,
``metrics``, ``sink_guard``) still works: it warns (``DeprecationWarning``) and gives a
module holding the same objects as its new home, so ``from kvlife.fsm.sinks import
JsonLinesSink`` is ``kvlife.fsm.audit.sinks.JsonLinesSink``. Nothing is imported until an
old path is asked for (``metrics`` needs the optional ``prometheus_client``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Final

MOVED: Final = {
    "kvlife.fsm.records": "kvlife.fsm.audit.records",
    "kvlife.fsm.sinks": "kvlife.fsm.audit.sinks",
    "kvlife.fsm.sink_guard": "kvlife.fsm.audit.guard",
    "kvlife.fsm.reader": "kvlife.fsm.audit.reader",
    "kvlife.fsm.checker": "kvlife.fsm.audit.checker",
    "kvlife.fsm.explain": "kvlife.fsm.audit.explain",
    "kvlife.fsm.metrics": "kvlife.fsm.audit.metrics",
}
"""Old module path -> where the module is now."""


class _Alias(importlib.abc.Loader):
    """Loads an old path as a module with the new module's public names."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default: a fresh module named after the old path

    def exec_module(self, module: ModuleType) -> None:
        warnings.warn(
            f"{module.__name__} is now {self.target}: import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        target = importlib.import_module(self.target)
        module.__dict__.update(
            (name, value) for name, value in vars(target).items() if not name.startswith("__")
        )
        module.__dict__["__all__"] = list(getattr(target, "__all__", ()))
        module.__doc__ = f"Moved: see {self.target}."


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Let the old paths be imported (once per interpreter)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())

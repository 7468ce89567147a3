"""Which build of kvlife's hot path is running: compiled (mypyc) or pure Python.

The modules in [`COMPILED`][kvlife.fsm.native.COMPILED] are compiled with mypyc when kvlife
is installed where a C compiler and Python's headers are present (``setup.py``); their
pure-Python source is installed beside them and means the same. This module decides, once,
before any of them is imported, which one runs:

- ``KVLIFE_PURE=1`` in the environment: pure Python, whatever is installed (at install
  time it also skips the compile);
- no compiled build installed: pure Python;
- a compiled build made from other sources than the ones installed beside it (an
  editable install edited since it was built): pure Python, with a ``RuntimeWarning`` that
  says to reinstall, so that no edit is ever silently shadowed by an old extension;
- otherwise compiled.

[`describe()`][kvlife.fsm.native.describe] says which, and why; ``kvlife --version``,
``kvlife bench`` and every audit log's header carry it, so that no figure is quoted without
its build.

What differs when compiled: a compiled function checks its arguments' types itself and
raises ``TypeError`` with mypyc's message (``"str object expected; got int"``) before the
function's own check runs; a compiled method replaced on its class (monkeypatching) is
still the one compiled callers call.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

COMPILED: Final[tuple[str, ...]] = (
    "kvlife.fsm.registry",
    "kvlife.fsm.table",
    "kvlife.fsm.hooks",
    "kvlife.fsm.overdue",
    "kvlife.offload.pages",
    "kvlife.offload.prefix_cache",
    "kvlife.offload.planner",
    "kvlife.offload.engines.vllm.scheduler",
)
"""The modules compiled when kvlife is installed with a C compiler (``setup.py`` reads
this list)."""

ENGINE_MODULES: Final[dict[str, str]] = {"kvlife.offload.engines.vllm.scheduler": "vllm"}
"""The compiled modules that import a serving engine, and the engine's package: compiled
with the others (the engine's classes are only read there, never typed), importable only
where the engine is installed."""

_STAMP: Final = "kvlife.fsm._native_build"  # written and compiled by setup.py only


def _source(module: str) -> Path | None:
    """Where ``module``'s pure-Python source is installed (None when it is not)."""
    package, _, name = module.rpartition(".")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder, f"{name}.py")
        if path.is_file():
            return path
    return None


def source_digest(sources: Iterable[tuple[str, bytes]]) -> str:
    """The digest of the compiled modules' sources, ``(module, its source's bytes)`` in
    ``COMPILED``'s order: ``setup.py`` writes it into the build's stamp, and a build whose
    stamp differs from the installed sources' is stale."""
    digest = hashlib.sha256()
    for module, text in sources:
        digest.update(module.encode() + b"\0" + text + b"\0")
    return digest.hexdigest()


def _digest(modules: Sequence[str]) -> str | None:
    sources = []
    for module in modules:
        path = _source(module)
        if path is None:
            return None
        sources.append((module, path.read_bytes()))
    return source_digest(sources)


class _PureFinder(importlib.abc.MetaPathFinder):
    """Loads the compiled modules from their ``.py`` source instead of the extension."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED or path is None:
            return None
        name = fullname.rpartition(".")[2]
        for folder in path:
            source = Path(folder, f"{name}.py")
            if source.is_file():
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def _forced_pure(environ: Mapping[str, str]) -> bool:
    return environ.get("KVLIFE_PURE", "") not in ("", "0")


def _decide(
    environ: Mapping[str, str], stamp: ModuleType | None, digest: str | None
) -> tuple[bool, str]:
    """(compiled?, why) from the environment, the compiled build's stamp (None when none is
    installed) and the digest of the sources installed beside it."""
    if _forced_pure(environ):
        return False, "pure Python (KVLIFE_PURE is set)"
    if stamp is None:
        return False, "pure Python (installed without the compiled build)"
    if tuple(stamp.MODULES) != COMPILED or digest != stamp.DIGEST:
        warnings.warn(
            "kvlife's compiled modules were built from other sources than the ones installed "
            "beside them (edited since the install?): running pure Python; reinstall kvlife "
            "(make venv) to compile them again",
            RuntimeWarning,
            stacklevel=2,
        )
        return False, "pure Python (the compiled build is stale: reinstall)"
    return True, f"compiled (mypyc {stamp.MYPYC}, {len(COMPILED)} modules)"


def _stamp() -> ModuleType | None:
    if _forced_pure(os.environ) or not _HOME:
        return None  # not even loaded
    try:
        return importlib.import_module(_STAMP)
    except ImportError:
        return None


# False in another kvlife tree loaded beside this one (kvlife.fsm.against), whose own finder
# loads every module from source
_HOME: Final = __name__.partition(".")[0] == "kvlife"
_installed = _stamp()
compiled: bool
_why: str
compiled, _why = _decide(
    os.environ, _installed, _digest(COMPILED) if _installed is not None else None
)
if not compiled and _HOME:
    sys.meta_path.insert(0, _PureFinder())


def describe() -> str:
    """The build that runs, e.g. ``"compiled (mypyc 2.4.1, 7 modules)"`` or
    ``"pure Python (KVLIFE_PURE is set)"``."""
    return _why


def loaded() -> dict[str, bool]:
    """For each compiled module imported so far: whether it runs as a C extension."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return {
        name: str(getattr(sys.modules[name], "__file__", "")).endswith(suffixes)
        for name in COMPILED
        if name in sys.modules
    }


__all__ = ["COMPILED", "ENGINE_MODULES", "compiled", "describe", "loaded"]

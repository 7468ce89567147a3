"""Another kvlife source tree, loaded beside the installed one, for benchmarks that compare
two versions in one process (``kvlife bench fsm --against DIR``, ``make bench-vllm
AGAINST=DIR``, ``make bench AGAINST=DIR``): the same workload, interleaved, on the same
machine state, so a ratio between the two is not the noise between two runs.

``load_tree(DIR)`` makes the tree's ``fsm/``, ``offload/`` and ``diagrams/`` folders (a
checkout or a ``git archive`` of this repository at another commit) importable as
``kvlife_against.fsm``, ``kvlife_against.offload`` and ``kvlife_against.diagrams``. Their
own ``kvlife.fsm`` / ``kvlife.offload`` / ``kvlife.diagrams`` imports are rewritten to the
same prefix as the source is compiled, so the old tree uses its own modules throughout and
never the installed ones. Nothing is written to the tree (no ``__pycache__``). Not API.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import CodeType, ModuleType
from typing import Final

PREFIX: Final = "kvlife_against"
"""The package name the other tree is loaded under."""

_FOLDERS: Final = ("fsm", "offload", "diagrams")
_IMPORTS: Final = re.compile(rb"\bkvlife\.(fsm|offload|diagrams)\b")


class TreeError(ValueError):
    """The directory is not a kvlife source tree (no ``fsm/__init__.py``), or another tree
    is loaded already. Nothing was loaded."""


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Compiles a module of the other tree with its kvlife imports moved to ``PREFIX``."""

    def get_code(self, fullname: str) -> CodeType:
        """Compile the rewritten source; no bytecode is read or written."""
        path = self.get_filename(fullname)
        source = _IMPORTS.sub(PREFIX.encode() + rb".\1", self.get_data(path))
        return compile(source, path, "exec", dont_inherit=True)


class _TreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        parts = fullname.split(".")
        if parts[0] != PREFIX or len(parts) < 2 or parts[1] not in _FOLDERS:
            return None
        base = self.root.joinpath(*parts[1:])
        if (base / "__init__.py").is_file():
            init = base / "__init__.py"
            return importlib.util.spec_from_file_location(
                fullname,
                init,
                loader=_RewritingLoader(fullname, str(init)),
                submodule_search_locations=[str(base)],
            )
        module = base.with_suffix(".py")
        if module.is_file():
            return importlib.util.spec_from_file_location(
                fullname, module, loader=_RewritingLoader(fullname, str(module))
            )
        return None


def load_tree(root: str | Path) -> ModuleType:
    """Make the kvlife source tree at ``root`` importable under ``PREFIX`` and return its
    ``kvlife_against.fsm`` package. Loading the same tree again returns it again.

    Raises:
        TreeError: ``root`` has no ``fsm/__init__.py``, or a different tree is loaded.
    """
    root = Path(root).resolve()
    if not (root / "fsm" / "__init__.py").is_file():
        raise TreeError(f"{root} is not a kvlife source tree (no fsm/__init__.py)")
    for finder in sys.meta_path:
        if isinstance(finder, _TreeFinder):
            if finder.root != root:
                raise TreeError(f"{finder.root} is loaded as {PREFIX} already; not {root}")
            return importlib.import_module(f"{PREFIX}.fsm")
    if PREFIX not in sys.modules:
        package = ModuleType(PREFIX)
        package.__path__ = []
        sys.modules[PREFIX] = package
    sys.meta_path.insert(0, _TreeFinder(root))
    return importlib.import_module(f"{PREFIX}.fsm")


__all__ = ["PREFIX", "TreeError", "load_tree"]

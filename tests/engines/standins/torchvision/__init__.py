"""Stand-in for torchvision in the SGLang tests (tests/engines/sglang_harness.py puts this
folder first on sys.path; nothing else sees it).

Why: PyPI's torchvision links CUDA and does not load beside CPU torch (``operator
torchvision::nms does not exist``), and an unpinned install replaces torch with a CUDA
build. SGLang imports it at module level from its multimodal helpers, which these tests
never run. Every ``torchvision.*`` module resolves here and every name in it is a
placeholder that raises if it is ever called, so a test that reached real torchvision code
would fail loudly instead of passing on a stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvlife.standin"


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        raise RuntimeError(f"{self._name} is part of the torchvision stand-in and cannot run")

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


class _Module(types.ModuleType):
    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``torchvision.<sub>`` module on demand."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module

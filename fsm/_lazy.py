"""Names a package re-exports but imports only when first asked for (PEP 562), so that
importing the package does not load the modules behind them. Not API."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(namespace: dict[str, Any], homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The body of a package's module ``__getattr__``: ``name`` is imported from the module
    ``homes[name]`` on first use and kept in ``namespace`` (the package's ``globals()``),
    so the next look-up does not come here.

    Raises (from the returned function):
        AttributeError: ``name`` is not one of ``homes``.
    """
    package = namespace["__name__"]

    def load(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    return load

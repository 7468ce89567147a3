"""The installed distribution's version (``0+unknown`` when running from a bare tree)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvlife")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

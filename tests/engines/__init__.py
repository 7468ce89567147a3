"""Tests against the serving engines' real classes, each run in the engine's own virtual
environment (``make test-vllm``); in the main environment they skip."""

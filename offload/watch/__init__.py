"""What kvlife watches: offload kvlife did not write, seen whole.

kvlife's own offload for the engines is in ``kvlife.offload.engines``;
this package holds the other product, one sub-package per engine:

* [`kvlife.offload.watch.vllm`][kvlife.offload.watch.vllm]: the audit wrapper around any
  vLLM KV connector (``KVLifeAuditConnector``), its lenses (one small module per connector
  whose private state the wrapper reads), the P/D hand-over records, and the exercise
  (``kvlife vllm exercise``) with its LMCache families;
* ``kvlife.offload.watch.sglang``: the lens on SGLang's hierarchical cache (HiCache) and
  its exercise (``kvlife sglang exercise``);
* ``exercise_cli``: the command-line options both exercises share.

A watcher imports kvlife's core and, from an engine's adapter, only what both products
share (for vLLM: ``config``, ``core_log``, ``stats``), never kvlife's own connector; a
test holds that boundary.
"""

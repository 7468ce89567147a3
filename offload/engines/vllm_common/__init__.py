"""What kvlife's own vLLM connector ([`kvlife.offload.engines.vllm`][kvlife.offload.engines.vllm])
and the watchers of other connectors ([`kvlife.offload.watch.vllm`][kvlife.offload.watch.vllm])
both need, and nothing else: importing it imports neither product.

* ``config``: ``kv_connector_extra_config`` checked (``ConnectorConfig``), each engine
  core's audit log path, what stops a process;
* ``core_log``: one engine core's audit log and registry (``CoreLog``), settled by vLLM's
  termination signals before vLLM's own handlers run, and the overdue warning line;
* ``stats``: the counters and gauges handed to vLLM's stats hook and ``/metrics``.
"""

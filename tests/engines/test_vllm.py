"""kvlife against vLLM 0.33.0's real scheduler on CPU (run in ``.venv-vllm`` by
``make test-vllm``; in the main environment this module skips).

The first test pins down the failure kvlife exists to prevent, on vLLM's own
``OffloadingConnector``: it keys its state by request id, so a store that completes after
its request finished and the id was reused resolves to the new request, and the scheduler
raises inside ``update_from_output`` (in a server, the engine core dies). It is a strict
xfail: if vLLM fixes it, the test says so.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="runs in the vLLM environment: make test-vllm")

from tests.engines.vllm_harness import make_request, make_scheduler, step


@pytest.mark.xfail(raises=KeyError, strict=True, reason="vLLM keys offload state by request id")
def test_vllms_offloading_connector_dies_on_a_late_store_after_an_id_reuse() -> None:
    scheduler = make_scheduler("OffloadingConnector", extra={"cpu_bytes_to_use": 64 << 20})
    old = make_request("0", max_tokens=2)
    scheduler.add_request(old)
    out = step(scheduler)  # prefill: a store of its full blocks is launched
    jobs = list(out.kv_connector_metadata.store_jobs)
    assert jobs and all(job.req_id == "0" for job in out.kv_connector_metadata.store_jobs.values())
    step(scheduler)  # its last token: finished, with the store still in flight
    assert old.is_finished() and not scheduler.running
    scheduler.add_request(make_request("0", first=5000))  # the id is reused at once
    step(scheduler)
    step(scheduler, completed=jobs)  # the old store completes: KeyError in the scheduler

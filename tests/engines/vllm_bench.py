"""Scheduler-side step time of vLLM's real ``Scheduler`` with no connector, with a connector
that does nothing (``null``: what vLLM's own plumbing costs a step once any connector is
configured), with vLLM's own ``OffloadingConnector`` (alone, and inside kvlife's audit
wrapper ``KVLifeAuditConnectorHMA`` with its log and its lens: ``vllm+audit``), with vLLM's
``SimpleCPUOffloadConnector`` in eager mode (``simple``, ``simple+audit``) and with
``KVLifeConnector`` (as built, and with its scheduler side run from its ``.py`` source
over the same core: ``kvlife@source``, what compiling the adapter gains): the same seeded
workload through each, interleaved in one process, timing only ``schedule()`` +
``update_from_output()`` per step (median and p99), each as a ratio to no connector and to
the connector that does nothing. ``make bench-vllm``.

The workload keeps ``concurrent`` requests running (prompts of 64-400 distinct tokens,
16-64 output tokens), admitting a new one whenever one finishes, until ``requests`` have
been admitted. Every store a connector starts is reported done by the (stand-in) workers
in the next step, as an asynchronous copy would be; no copy runs, so this is the
bookkeeping each connector adds to a step, not copy time. The host cache of both
connectors holds 1024 blocks of 16 tokens: the workload fills it, so both evict.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

from kvlife.fsm.native import describe
from kvlife.offload.engines.vllm import KVLifeWorkerMetadata
from tests.engines.vllm_harness import (
    BLOCK,
    make_request,
    make_scheduler,
    model_output,
    vllm_caches,
)

KVLIFE = "kvlife.offload.engines.vllm"
AGAINST = "kvlife_against.offload.engines.vllm"  # another kvlife tree: --against DIR
NULL = "tests.engines.vllm_connectors"
CONFIGS = (
    "none",
    "null",
    "vllm",
    "vllm+audit",
    "simple",
    "simple+audit",
    "kvlife",
    "kvlife@source",
    "kvlife+log",
)
SOURCE = "kvlife_bench_scheduler_source"  # the scheduler side's .py, loaded under this name


def _scheduler_side_from_source() -> type:
    """``SchedulerSide`` run from its ``.py`` source, whatever the build (kvlife's compiled
    core beneath it): ``kvlife@source`` against ``kvlife`` is what compiling the adapter
    gains, in the same process."""
    module = sys.modules.get(SOURCE)
    if module is None:
        compiled = importlib.import_module(f"{KVLIFE}.scheduler")
        path = Path(str(compiled.__file__)).with_name("scheduler.py")
        spec = importlib.util.spec_from_file_location(SOURCE, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[SOURCE] = module
        spec.loader.exec_module(module)
    side: type = module.SchedulerSide
    return side


def _scheduler(config: str, host_blocks: int, audit: str) -> Any:
    module = AGAINST if config.endswith("@before") else KVLIFE  # whose kvlife: see --against
    config = config.removesuffix("@before")
    if config == "none":
        return make_scheduler(None, blocks=4096, max_seqs=64)  # type: ignore[arg-type]
    if config == "null":  # a connector that claims nothing, stores nothing, delays nothing
        return make_scheduler("PlayConnector", NULL, {}, blocks=4096, max_seqs=64)
    if config.startswith("simple"):  # vLLM's SimpleCPUOffloadConnector, eager mode
        inner = {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_connector_extra_config": {"num_cpu_blocks": host_blocks},
        }
        if config == "simple":
            return make_scheduler(
                inner["kv_connector"],
                extra=inner["kv_connector_extra_config"],  # type: ignore[arg-type]
                blocks=4096,
                max_seqs=64,
            )
        audited = {"connector": inner, "audit_log": audit}
        return make_scheduler("KVLifeAuditConnectorHMA", module, audited, blocks=4096, max_seqs=64)
    if config.startswith("vllm"):
        bytes_per_block = 2 * BLOCK * 12 * 64 * 2  # the harness model: K+V, fp16
        extra = {"cpu_bytes_to_use": host_blocks * bytes_per_block}
        if config == "vllm":
            return make_scheduler("OffloadingConnector", extra=extra, blocks=4096, max_seqs=64)
        # vLLM's connector inside kvlife's audit wrapper, with its log, as a server runs it
        inner = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}
        audited = {"connector": inner, "audit_log": audit}
        return make_scheduler("KVLifeAuditConnectorHMA", module, audited, blocks=4096, max_seqs=64)
    extra: dict[str, Any] = {"host_pages": host_blocks}
    if config.startswith("kvlife+log"):  # with its audit log, as a server would run it
        extra["audit_log"] = audit
    if config == "kvlife@source":
        connector = importlib.import_module(f"{KVLIFE}.connector")
        compiled = connector.SchedulerSide
        connector.SchedulerSide = _scheduler_side_from_source()
        try:
            return make_scheduler("KVLifeConnector", module, extra, blocks=4096, max_seqs=64)
        finally:
            connector.SchedulerSide = compiled
    return make_scheduler("KVLifeConnector", module, extra, blocks=4096, max_seqs=64)


def _worker_meta(config: str, jobs: Iterable[int]) -> Any:
    done = dict.fromkeys(jobs, 1)
    if not done:
        return None
    if config.startswith("vllm"):
        return OffloadingWorkerMetadata(completed_jobs=done)
    if config.startswith("simple"):
        return SimpleCPUOffloadWorkerMetadata(completed_store_events=done)
    if config.endswith("@before"):  # the other tree's own class: its isinstance checks
        return importlib.import_module(AGAINST).KVLifeWorkerMetadata(done=done)
    return KVLifeWorkerMetadata(done=done)


def _new_jobs(config: str, out: Any) -> list[int]:
    meta = out.kv_connector_metadata
    if config.startswith("vllm"):
        return list(meta.store_jobs)
    if config.startswith("kvlife"):
        return [store.op for store in meta.stores]
    if config.startswith("simple"):
        return [meta.store_event] if meta.store_event >= 0 else []
    return []


SCHEDULER_CALLS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "get_kv_connector_stats",
    "take_events",
)
"""The connector's scheduler-side calls the breakdown times."""


def _timed(connector: Any, spent: dict[str, float]) -> None:
    """Time each of ``connector``'s scheduler-side calls into ``spent`` (seconds)."""
    for name in SCHEDULER_CALLS:
        call = getattr(connector, name)

        def timed(*args: Any, _call: Any = call, _name: str = name, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - started

        setattr(connector, name, timed)


class Collections:
    """CPython's garbage collections that run inside timed steps (``on``): the generation
    and seconds of each, through ``gc.callbacks`` while installed (a ``with`` block)."""

    def __init__(self) -> None:
        self.on = False
        self.seen: list[tuple[int, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seen.append((info["generation"], time.perf_counter() - self._started))

    def __enter__(self) -> Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run(
    config: str,
    *,
    seed: int,
    requests: int,
    concurrent: int,
    host_blocks: int,
    audit: str,
    spent: dict[str, float] | None = None,
    collections: Collections | None = None,
) -> list[float]:
    """Seconds per step of ``schedule()`` + ``update_from_output()``; with ``spent``, each
    scheduler-side connector call is timed into it (a clock around each: not the timed
    rounds); with ``collections``, the garbage collections inside the steps go there."""
    rng = random.Random(seed)
    scheduler = _scheduler(config, host_blocks, audit)
    if spent is not None and scheduler.connector is not None:
        _timed(scheduler.connector, spent)
    admitted = 0
    first = 10_000

    def admit() -> None:
        nonlocal admitted, first
        prompt = rng.randint(64, 400)
        request = make_request(
            f"r{admitted}", prompt=prompt, max_tokens=rng.randint(16, 64), first=first
        )
        first += prompt
        scheduler.add_request(request)
        admitted += 1

    while admitted < min(concurrent, requests):
        admit()
    times: list[float] = []
    pending: list[int] = []  # stores to report done in the next step
    gc.collect()
    watched = collections if collections is not None else Collections()
    while scheduler.requests:
        watched.on = True
        started = time.perf_counter()
        out = scheduler.schedule()
        scheduler.update_from_output(out, model_output(out, _worker_meta(config, pending)))
        times.append(time.perf_counter() - started)
        watched.on = False
        pending = _new_jobs(config, out)
        while admitted < requests and len(scheduler.requests) < concurrent:
            admit()
    if scheduler.connector is not None:
        scheduler.connector.shutdown()
    return times


def copy_speed(
    *, layers: int = 8, blocks: int = 1024, copied: int = 128, reps: int = 7
) -> dict[str, float]:
    """GB/s of the connector's worker side storing and loading ``copied`` scattered
    blocks of vLLM's own KV caches (``LBHNC``, 16 tokens x 8 heads x 128 of bf16 K and V
    per block and layer), against one contiguous copy of the same number of bytes; median
    of ``reps``, interleaved."""
    import torch  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
        KVConnectorRole,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: PLC0415
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415

    from kvlife.offload.engines.vllm import (  # noqa: PLC0415
        KVLifeConnector,
        KVLifeConnectorMetadata,
    )
    from kvlife.offload.planner import LoadOrder, StoreOrder  # noqa: PLC0415

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    config, caches = vllm_caches(KVCacheLayout.LBHNC, spec, layers=layers, blocks=blocks)
    vllm_config = make_scheduler("KVLifeConnector", KVLIFE, {"host_pages": copied}).vllm_config
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    worker = KVLifeConnector(vllm_config, KVConnectorRole.WORKER, config)
    worker.register_kv_caches(caches)
    raw = next(iter(caches.values())).untyped_storage()
    source = torch.empty(0, dtype=torch.uint8).set_(raw)
    nbytes = copied * page * layers
    target = torch.empty(nbytes, dtype=torch.uint8)
    rng = random.Random(0)
    times: dict[str, list[float]] = {"store": [], "load": [], "contiguous": []}
    for r in range(reps):
        block_ids = rng.sample(range(blocks), copied)
        pages = list(range(copied))
        for kind in ("store", "load", "contiguous") if r % 2 else ("contiguous", "load", "store"):
            started = time.perf_counter()
            if kind == "contiguous":
                target.copy_(source[:nbytes])
            else:
                meta = KVLifeConnectorMetadata(
                    stores=[StoreOrder(r, tuple(block_ids), tuple(pages), 0)]
                    if kind == "store"
                    else [],
                    loads=[LoadOrder(r, tuple(block_ids), tuple(pages), 0)]
                    if kind == "load"
                    else [],
                )
                worker.bind_connector_metadata(meta)
                worker.start_load_kv(None)  # type: ignore[arg-type]
                worker.wait_for_save()
                worker.build_connector_worker_meta()
                worker.clear_connector_metadata()
            times[kind].append(time.perf_counter() - started)
    out = {f"{kind}_gbs": nbytes / statistics.median(t) / 1e9 for kind, t in times.items()}
    out["store_ratio"] = out["store_gbs"] / out["contiguous_gbs"]
    out["load_ratio"] = out["load_gbs"] / out["contiguous_gbs"]
    out["mib"] = nbytes / 2**20
    return out


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def _interleaved(
    configs: tuple[str, ...],
    *,
    rounds: int,
    seed: int,
    requests: int,
    concurrent: int,
    timed: bool = False,
) -> Iterator[tuple[str, list[float], dict[str, float] | None, list[tuple[int, float]]]]:
    """``run`` every config ``rounds`` times, the order reversed every other round, each
    round on its own seed, after a run of every config that is not kept (``concurrent``
    requests: the first runs of a process are slower, and the config that ran first would
    pay for it); yields each kept run's config, step times, (``timed``) the seconds each
    scheduler-side call took, and the garbage collections inside its steps (generation,
    seconds)."""
    with tempfile.TemporaryDirectory(prefix="kvlife-vllm-bench-") as tmp, Collections() as seen:
        for config in configs:
            run(
                config,
                seed=seed + rounds,
                requests=min(requests, concurrent),
                concurrent=concurrent,
                host_blocks=1024,
                audit=f"{tmp}/{config}-warm-up.jsonl",
            )
        for r in range(rounds):
            for config in configs if r % 2 == 0 else tuple(reversed(configs)):
                spent = dict.fromkeys(SCHEDULER_CALLS, 0.0) if timed else None
                seen.seen = []
                steps = run(
                    config,
                    seed=seed + r,
                    requests=requests,
                    concurrent=concurrent,
                    host_blocks=1024,
                    audit=f"{tmp}/{config}-{r}.jsonl",
                    spent=spent,
                    collections=seen,
                )
                yield config, steps, spent, seen.seen


def breakdown(
    configs: tuple[str, ...],
    *,
    seed: int = 0,
    requests: int = 400,
    concurrent: int = 48,
    rounds: int = 2,
) -> dict[str, dict[str, float]]:
    """Microseconds per step each scheduler-side call of each config's connector took (a
    clock around every call), the median over ``rounds`` runs per config, in alternating
    order (the first run of a process is slower), and their sum (``total``)."""
    spent_per_run: dict[str, list[dict[str, float]]] = {config: [] for config in configs}
    for config, steps, spent, _ in _interleaved(
        configs, rounds=rounds, seed=seed, requests=requests, concurrent=concurrent, timed=True
    ):
        assert spent is not None
        spent_per_run[config].append(
            {name: value / len(steps) * 1e6 for name, value in spent.items()}
        )
    result = {}
    for config, runs in spent_per_run.items():
        row = {name: statistics.median(one[name] for one in runs) for name in SCHEDULER_CALLS}
        row["total"] = sum(row.values())
        result[config] = row
    return result


def measure(
    *,
    seed: int = 0,
    rounds: int = 3,
    requests: int = 400,
    concurrent: int = 48,
    configs: tuple[str, ...] = CONFIGS,
) -> dict[str, dict[str, float]]:
    """Median and p99 step time (microseconds) of each config over ``rounds``
    interleaved runs (each run's steps pooled), the ratios to no connector, and the
    young-generation garbage collections inside the steps (how many a run, the median
    one's microseconds)."""
    configs = ("none", *(c for c in configs if c != "none"))
    steps: dict[str, list[float]] = {config: [] for config in configs}
    young: dict[str, list[float]] = {config: [] for config in configs}
    for config, times, _, collected in _interleaved(
        configs, rounds=rounds, seed=seed, requests=requests, concurrent=concurrent
    ):
        steps[config] += times
        young[config] += [seconds for generation, seconds in collected if generation == 0]
    result = {
        config: {
            "median_us": statistics.median(times) * 1e6,
            "p99_us": _p99(times) * 1e6,
            "max_us": max(times) * 1e6,
            "steps": float(len(times)),
            "young_gcs": len(young[config]) / rounds,
            "young_gc_us": statistics.median(young[config]) * 1e6 if young[config] else 0.0,
        }
        for config, times in steps.items()
    }
    base = result["none"]
    null = result.get("null")
    for config in configs[1:]:
        row = result[config]
        row["median_ratio"] = row["median_us"] / base["median_us"]
        row["p99_ratio"] = row["p99_us"] / base["p99_us"]
        if null is not None and config != "null":
            row["median_null_ratio"] = row["median_us"] / null["median_us"]
            row["p99_null_ratio"] = row["p99_us"] / null["p99_us"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrent", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS)} (no connector always runs)",
    )
    parser.add_argument("--no-copy", action="store_true", help="skip the copy speed")
    parser.add_argument(
        "--against",
        metavar="DIR",
        help="another kvlife source tree: its KVLifeConnector and audit wrapper run in the "
        "same rounds (configs kvlife@before, kvlife+log@before, vllm+audit@before, "
        "simple+audit@before, for those of --configs)",
    )
    args = parser.parse_args(argv)
    configs = tuple(c for c in args.configs.split(",") if c)
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)} (known: {', '.join(CONFIGS)})")
    if args.against:
        from kvlife.fsm.against import load_tree  # noqa: PLC0415

        load_tree(args.against)
        compared = ("kvlife", "kvlife+log", "vllm+audit", "simple+audit")
        configs += tuple(f"{c}@before" for c in compared if c in configs)
    result = measure(
        seed=args.seed,
        rounds=args.rounds,
        requests=args.requests,
        concurrent=args.concurrent,
        configs=configs,
    )
    print(
        f"vLLM {vllm.__version__} scheduler step, schedule() + update_from_output(), "
        f"{args.concurrent} concurrent, {args.requests} requests x {args.rounds} rounds "
        f"(interleaved); kvlife {describe()}"
        + (f", before: {args.against} from source" if args.against else "")
    )
    for config, row in result.items():
        ratios = (
            f"  median {row['median_ratio']:.2f}x  p99 {row['p99_ratio']:.2f}x of no connector"
            if config != "none"
            else ""
        )
        if "median_null_ratio" in row:
            ratios += (
                f", {row['median_null_ratio']:.2f}x / {row['p99_null_ratio']:.2f}x of one "
                "that does nothing"
            )
        print(
            f"  {config:17s} median {row['median_us']:7.1f} us  p99 {row['p99_us']:7.1f} us  "
            f"max {row['max_us']:8.1f} us  ({int(row['steps'])} steps; young GCs "
            f"{row['young_gcs']:.1f} a run, {row['young_gc_us']:.0f} us){ratios}"
        )
    ours = tuple(c for c in configs if c.startswith("kvlife"))
    if ours:
        calls = breakdown(ours, seed=args.seed, requests=args.requests, concurrent=args.concurrent)
        print(
            "per-call breakdown, us per step (median of 2 runs each, alternating order, a "
            "clock around every call):"
        )
        for config, row in calls.items():
            parts = ", ".join(
                f"{name} {row[name]:.1f}" for name in SCHEDULER_CALLS if row[name] >= 0.05
            )
            print(f"  {config:17s} total {row['total']:6.1f}: {parts}")
    compiled, source = result.get("kvlife"), result.get("kvlife@source")
    if compiled is not None and source is not None:
        print(
            "  kvlife / kvlife@source (the scheduler side as built / from its source): median "
            f"{compiled['median_us'] / source['median_us']:.2f}, p99 "
            f"{compiled['p99_us'] / source['p99_us']:.2f}"
        )
    for config in ("kvlife", "kvlife+log", "vllm+audit", "simple+audit"):
        before, now = result.get(f"{config}@before"), result.get(config)
        if before is not None and now is not None:
            print(
                f"  {config}: now / before median {now['median_us'] / before['median_us']:.2f}, "
                f"p99 {now['p99_us'] / before['p99_us']:.2f}"
            )
    if not args.no_copy:
        speed = copy_speed()
        print(
            f"copy speed, {speed['mib']:.0f} MiB of scattered blocks (8 layers, LBHNC, CPU): "
            f"store {speed['store_gbs']:.2f} GB/s ({speed['store_ratio']:.2f} of one "
            f"contiguous copy, {speed['contiguous_gbs']:.2f} GB/s), load "
            f"{speed['load_gbs']:.2f} GB/s ({speed['load_ratio']:.2f})"
        )
    for alone, name in (("vllm", "OffloadingConnector"), ("simple", "SimpleCPUOffloadConnector")):
        if alone in result and f"{alone}+audit" in result:
            audited, bare = result[f"{alone}+audit"], result[alone]
            print(
                f"  {alone}+audit / vLLM's {name} alone: median "
                f"{audited['median_us'] / bare['median_us']:.2f}, p99 "
                f"{audited['p99_us'] / bare['p99_us']:.2f} (target: <= 1.05)"
            )
    theirs = result.get("vllm")
    if theirs is None:
        return 0
    for config in ("kvlife", "kvlife+log"):
        if config not in result:
            continue
        ours = result[config]
        median = ours["median_us"] / theirs["median_us"]
        p99 = ours["p99_us"] / theirs["p99_us"]
        print(
            f"  {config} / vLLM's OffloadingConnector: median {median:.2f}, p99 {p99:.2f} "
            "(target: <= 1 for both)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

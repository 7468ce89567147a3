"""``kvlife vllm exercise``: a conformance run of a vLLM KV connector, for the people who
write connectors.

Given a connector's ``kv_transfer_config`` (the JSON an operator passes to vLLM), the
exercise builds vLLM's real ``Scheduler`` with that connector's real scheduler side inside
kvlife's audit wrapper, runs the connector's worker side, and drives a seeded random
workload through *families* of schedules that break connectors (ids reused while work is in
flight, aborts wherever a request is, preemption, reports held back, shared prefixes, two
workers reporting in different steps). Each run checks what vLLM needs of a connector:

* no exception from vLLM or the connector (the exception and the innermost frame);
* every request drained: vLLM's engine steps while it holds a request, and after the
  workload the exercise steps until vLLM holds none (a delayed free never reported keeps
  its request, for ever); a drain ends undrained only when none of the requests vLLM
  holds moved in ``STALL_STEPS`` steps, however long the drain took;
* every device block back in vLLM's free pool at the end (a leak is a block count);
* kvlife's audit log of the run checks clean, every lifecycle released (each verdict with
  the rid it names and the ``kvlife audit why`` command that tells its story). A run that
  raised stopped there: the copies then open are counted (``open_at_raise``), not
  ``unreported``, since the run, not the connector, left them open.

The worker side (``worker`` in the report):

* ``real``: the connector's own worker role, one instance per worker, on CPU KV caches,
  called in the order vLLM's model runner calls it (``handle_preemptions``,
  ``bind_connector_metadata``, ``start_load_kv``, ``wait_for_save``,
  ``get_transfer_results``, ``get_block_ids_with_load_errors``,
  ``build_connector_worker_meta``, ``clear_connector_metadata``); no forward pass runs, so
  the per-layer calls (``wait_for_layer_load``, ``save_kv_layer``) are not made. Each
  worker's output of a step reaches the scheduler after the family's delay, through
  vLLM's own ``KVOutputAggregator``. kvlife's own connector and connectors written the same
  way run like this.
* ``played``: vLLM's ``OffloadingConnector`` and ``SimpleCPUOffloadConnector`` need a GPU
  worker; their workers are played from the jobs their metadata orders (what their lens
  reads), each completion reported by each worker after the family's delay (a job vLLM
  waits for -- a flush, a synchronous load -- in its own step).
* ``none``: vLLM's ``ExampleConnector`` reports nothing by request id and loads
  synchronously; its worker (files on disk, per-layer calls) is not run.
* LMCache's ``LMCacheMPConnector``: its real worker, paced against the ``lmcache server``
  the config names (see [`exercise_lmcache`][kvlife.offload.watch.vllm.exercise_lmcache]).
* LMCache's in-process ``LMCacheConnectorV1``: its real worker with LMCache's engine,
  lookup server and local CPU backend in this process (see
  [`exercise_lmcache_inprocess`][kvlife.offload.watch.vllm.exercise_lmcache_inprocess]).

Request ids carry the family and the seed (``reuse3-p1``), so that no two runs share one.

The model is facebook/opt-125m's config, a generating model (no weights; only its shape
matters to the scheduler), blocks of 16 tokens, one KV cache group. The model runner is
played: one token sampled for each request scheduled, none for a step that computes part
of a prompt only (``prefill_chunks``).

Why one module: it is the run, whose parts share one run's state (the families and the
runners, vLLM's scheduler built around the connector, the workload and one run's checks,
every family over every seed under each runner, and the command). How the
worker side runs is in
[`exercise_workers`][kvlife.offload.watch.vllm.exercise_workers], what is reported in
[`exercise_report`][kvlife.offload.watch.vllm.exercise_report].
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import random
import secrets
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlife.offload.engines.vllm_common.config import STOPPING
from kvlife.offload.watch.exercise_cli import (
    add_run_options,
    listed,
    print_reports,
    progress_line,
    run_counts_error,
)
from kvlife.offload.watch.vllm.exercise_report import FamilyReport, RunResult, why_command
from kvlife.offload.watch.vllm.exercise_workers import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    LAYERS,
    PLAYED,
    RealWorkers,
    Workers,
    transfer_params_of,
    workers_class,
)

#: A prompt the workload repeats is drawn from those before the latest this many, which
#: vLLM's own prefix cache (96 blocks, about 28 prompts) may still hold: the connector
#: loads it (from the most recent ones, vLLM's cache serves most repeats, and a connector
#: with its KV outside the process loads little within one run).
RECENT = 24
#: After the workload vLLM steps until it holds no request and no worker owes a report
#: (drained), or, while it holds requests, until none of them moved (status, computed and
#: output tokens) in this many steps: more than any family's report delay, so that only a
#: request held for good stops the drain. (With no request held the workers' reports
#: still move it: a lazy offload's stores of cached blocks.)
STALL_STEPS = 100
#: the most steps a drain takes however its requests move (a backstop; a drain that
#: moves ends long before)
DRAIN_LIMIT = 5000
MODULE = "kvlife.offload.engines.vllm"


@dataclass(frozen=True)
class Family:
    """One kind of schedule that breaks connectors: what the workload and the workers do."""

    name: str
    #: what the family does, for the report
    what: str
    #: request ids drawn from a pool of this many (reused as soon as vLLM lets go of
    #: one); 0: every request a fresh id
    pool: int = 0
    #: per step, the chance that one request vLLM holds is aborted, wherever it is
    abort: float = 0.0
    #: device blocks (few: vLLM preempts running requests)
    blocks: int = 96
    #: each worker's reports of a step reach vLLM after this many steps (a range)
    delay: tuple[int, int] = (0, 3)
    #: the share of prompts that begin with a prefix other prompts share
    prefix: float = 0.0
    #: workers (tensor parallelism), each reporting in its own steps
    workers: int = 1


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("basic", "fresh ids, each worker's reports after 0-3 steps"),
        Family(
            "reuse",
            "ids from a pool of 3, added again as soon as vLLM lets go of one, while the "
            "earlier request's copies may be in flight; reports after 0-8 steps",
            pool=3,
            delay=(0, 8),
        ),
        Family(
            "abort",
            "one request in five steps aborted wherever it is (waiting for a load, running "
            "with stores in flight, finished with its free delayed)",
            abort=0.2,
        ),
        Family("preempt", "a KV cache of 24 blocks: vLLM preempts running requests", blocks=24),
        Family(
            "hold",
            "every report held back 4-20 steps, so that reports arrive out of order",
            delay=(4, 20),
        ),
        Family(
            "prefix",
            "most prompts begin with a prefix of 4-40 tokens that other prompts share",
            prefix=0.7,
        ),
        Family("tp2", "two workers, each reporting in steps of its own", workers=2),
        Family(
            "resume",
            "a KV cache of 24 blocks and reports after 2-8 steps: requests preempted while "
            "their stores or loads are in flight, resumed, preempted again (under model "
            "runner V2 each resume comes back as new request data)",
            blocks=24,
            delay=(2, 8),
        ),
    )
}

RUNNERS: dict[str, str] = {
    "v1": "model runner V1's scheduler output (vLLM on the CPU): a preempted request "
    "resumes in scheduled_cached_reqs.resumed_req_ids",
    "v2": "model runner V2's (vLLM 0.33 wherever Triton is): a preempted request resumes "
    "as new request data, told only by preempted_req_ids",
    "v2-async": "V2's output from vLLM's AsyncScheduler, stepped as the engine core steps it "
    "(vLLM 0.33's default on every CUDA deployment): step N+1 is scheduled before step N's "
    "output comes back, so a request may finish, or be aborted, with a step of it already "
    "scheduled",
}
"""The two shapes of vLLM's scheduler output a connector meets, and the two ways vLLM's
engine core steps its scheduler (``v2-async``: the shape of V2); every family runs under
each by default (``--runners``). vLLM's CPU platform turns async scheduling off, so that
a whole engine on this machine runs ``v1`` only: ``v2-async`` is what a CUDA deployment
runs unless ``--no-async-scheduling`` (or a setting it refuses, as pipeline parallelism
under model runner V1) turns it off."""


class ExerciseConfigError(ValueError):
    """The connector's config does not build (a bad JSON, an unknown connector, a setting
    the connector refuses). Nothing ran."""


# -- vLLM's scheduler with the connector under the wrapper ---------------------------------

_MODEL_DIRS: list[tempfile.TemporaryDirectory[str]] = []


def model_dir() -> str:
    """facebook/opt-125m's config (transformers' ``OPTConfig`` defaults, and its
    architecture, ``OPTForCausalLM``, as the model's own config names it), no weights:
    written once per process into a directory that is removed when the process exits.

    Without the architecture vLLM takes the model for a pooling model
    (``model_config.runner_type == "pooling"``): its scheduler then reserves no slot for a
    sampled token, and vLLM's ``AsyncScheduler`` keeps no output placeholders, so that a
    step ahead would not be what a generating model's engine runs."""
    if not _MODEL_DIRS:
        from transformers import OPTConfig  # noqa: PLC0415

        directory = tempfile.TemporaryDirectory(prefix="kvlife-opt-")
        OPTConfig(architectures=["OPTForCausalLM"]).save_pretrained(directory.name)
        _MODEL_DIRS.append(directory)
    return _MODEL_DIRS[0].name


def per_layer_kv_cache_config(blocks: int, groups: Sequence[tuple[Sequence[str], Any]]) -> Any:
    """vLLM's ``KVCacheConfig`` for ``blocks`` blocks: one tensor per layer, one KV cache
    group per ``(layers, spec)`` of ``groups`` (every spec of one page size)."""
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    page = groups[0][1].page_size_bytes
    return KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * blocks, layers=[name], layer_stride=page * blocks, block_stride=page
            )
            for layers, _ in groups
            for name in layers
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec) for layers, spec in groups],
    )


def parse_config(text: str) -> dict[str, Any]:
    """A ``kv_transfer_config`` from JSON text, or from a file when ``text`` starts with
    ``@``.

    Raises:
        ExerciseConfigError: not JSON, not an object, or no ``kv_connector``.
    """
    try:
        raw = Path(text[1:]).read_text() if text.startswith("@") else text
        config = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ExerciseConfigError(f"the connector's config is not readable JSON: {exc}") from exc
    if not isinstance(config, dict) or not isinstance(config.get("kv_connector"), str):
        raise ExerciseConfigError(
            "the connector's config must be a JSON object with a 'kv_connector' (the "
            "--kv-transfer-config an operator passes to vLLM)"
        )
    return config


def build_scheduler(
    transfer: dict[str, Any],
    audit_log: Path,
    *,
    blocks: int = 96,
    workers: int = 1,
    layout: str | None = None,
    speculative: dict[str, Any] | None = None,
    asynchronous: bool = False,
) -> Any:
    """vLLM's ``Scheduler`` over ``blocks`` device blocks with the connector of
    ``transfer`` inside ``KVLifeAuditConnector`` (or its HMA form, as the connector
    needs), writing ``audit_log``; KV events on (published nowhere), so that the wrapper
    checks the connector's. ``speculative``: vLLM's speculative config (the
    ``--speculative-config`` fields), for a connector that needs one.

    Raises:
        ExerciseConfigError: the connector does not build; the message says why.
    """
    import torch  # noqa: PLC0415
    from vllm.config import (  # noqa: PLC0415
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: PLC0415
        KVConnectorFactory,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: PLC0415
    from vllm.v1.structured_output import StructuredOutputManager  # noqa: PLC0415

    try:
        role = transfer.get("kv_role", "kv_both")
        inner = KVTransferConfig(**{"kv_role": role, **transfer})
        hma = supports_hma(KVConnectorFactory.get_connector_class(inner))
        wrapper = KVTransferConfig(
            kv_connector="KVLifeAuditConnector" + ("HMA" if hma else ""),
            kv_connector_module_path=MODULE,
            kv_role=role,
            kv_connector_extra_config={
                "connector": transfer,
                "audit_log": str(audit_log),
                "stats_interval_s": 0,
            },
        )
        model = ModelConfig(
            model=model_dir(),
            skip_tokenizer_init=True,
            dtype="float16",
            seed=0,
            max_model_len=1024,
        )
        parallel = ParallelConfig(tensor_parallel_size=workers)
        drafting = None
        if speculative is not None:
            drafting = SpeculativeConfig(
                **speculative, target_model_config=model, target_parallel_config=parallel
            )
        vllm_config = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=512,
                max_model_len=1024,
                is_encoder_decoder=False,
            ),
            model_config=model,
            cache_config=CacheConfig(
                block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True
            ),
            kv_transfer_config=wrapper,
            device_config=DeviceConfig("cpu"),
            parallel_config=parallel,
            speculative_config=drafting,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        )
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16
        )
        kv_cache_config = per_layer_kv_cache_config(blocks, [(LAYERS, spec)])
        vllm_config.cache_config.num_gpu_blocks = blocks
        if layout is not None:
            vllm_config.cache_config.kv_cache_layout = layout
        return scheduler_class(vllm_config, asynchronous)(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
        )
    except BaseException as exc:  # whatever vLLM or the connector raise on a bad config
        if isinstance(exc, STOPPING):
            raise
        raise ExerciseConfigError(
            f"the connector does not build: {type(exc).__name__}: {_first_line(exc)}"
        ) from exc


def scheduler_class(vllm_config: Any, asynchronous: bool) -> type[Any]:
    """vLLM's scheduler class for ``vllm_config``: its ``AsyncScheduler`` when
    ``asynchronous`` (async scheduling set on in the config again: vLLM's CPU platform
    turns it off), else its ``Scheduler``."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: PLC0415
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415

    made: type[Any] = Scheduler
    if asynchronous:
        vllm_config.scheduler_config.async_scheduling = True
        made = AsyncScheduler
    return made


class StepQueue:
    """The engine core's queue of steps scheduled whose output ``scheduler`` was not given
    yet: one under ``runner`` ``v2-async`` (the batch queue of two: step N+1 is scheduled
    before step N's output comes back), none otherwise."""

    def __init__(self, scheduler: Any, runner: str) -> None:
        self.scheduler = scheduler
        self.depth = 2 if runner == "v2-async" else 1
        self.steps: list[tuple[Any, Any]] = []

    def __len__(self) -> int:
        return len(self.steps)

    def put(self, out: Any, output: Any) -> None:
        """Step ``out`` ran with ``output``: give the scheduler the oldest step's output
        once ``depth`` steps are scheduled (at once, unless async)."""
        self.steps.append((out, output))
        if len(self.steps) == self.depth:
            self.scheduler.update_from_output(*self.steps.pop(0))

    def give_back(self) -> bool:
        """With no request to schedule and a step's output not given back, give it back
        instead of scheduling a step, as the engine core does; whether it did."""
        if self.steps and not self.scheduler.has_requests():
            self.scheduler.update_from_output(*self.steps.pop(0))
            return True
        return False


def shut_down(
    scheduler: Any, workers: Any = None, made: type[Any] | None = None
) -> BaseException | None:
    """Shut down what a run built, the way vLLM does at an engine's end: the played
    workers (their connectors' ``shutdown()``), then the scheduler (which calls the
    connector's ``shutdown()``, through the audit wrapper, which then closes its log), then
    what the scheduler side still holds past that (sockets, say), let go by the worker
    class ``made`` that knows it (its ``release_scheduler``). Returns what one of them
    raised (the last, ``STOPPING`` ones raised at once), so that a connector that fails to
    let go is told, not hidden."""
    release = getattr(made, "release_scheduler", None)
    steps = (
        getattr(workers, "close", None),
        getattr(scheduler, "shutdown", None),
        None if release is None else functools.partial(release, scheduler),
    )
    raised: BaseException | None = None
    for close in steps:
        if close is None:
            continue
        try:
            close()
        except BaseException as exc:
            if isinstance(exc, STOPPING):
                raise
            raised = exc
    return raised


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


# -- one run -----------------------------------------------------------------------------


class _Workload:
    """The family's requests: 0-2 arrivals a step, prompts of 20-90 tokens (one in four an
    earlier prompt of the run again, one before the ``RECENT`` latest where there are
    more, which a connector may load), 1-24 tokens decoded, ids fresh or from the
    family's pool, and the family's aborts; every prompt carries a cache salt of its run's
    own, and the connector's transfer parameters where it has a role for the request."""

    def __init__(
        self,
        family: Family,
        rng: random.Random,
        tag: str = "",
        params: Callable[..., Any] | None = None,
    ) -> None:
        self.family, self.rng, self.tag = family, rng, tag
        # every prompt salted with this run alone (not drawn from the seed): what a
        # connector keeps outside the process (LMCache's server) from any other run, this
        # seed's before included, never hits, so that a seed replays the same run
        # whatever ran before it
        self.salt = f"kvlife-exercise:{tag}{secrets.token_hex(8)}"
        #: the connector's transfer parameters of a request (``transfer_params_of``)
        self.params = params
        self.arrived = 0
        self.seen: list[list[int]] = []  # every new prompt so far
        self.prefix = [rng.randrange(3, 30_000) for _ in range(40)]
        from vllm.utils.hashing import sha256  # noqa: PLC0415
        from vllm.v1.core.kv_cache_utils import (  # noqa: PLC0415
            get_request_block_hasher,
            init_none_hash,
        )

        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)

    def arrive(self, scheduler: Any) -> None:
        from vllm import SamplingParams  # noqa: PLC0415
        from vllm.v1.request import Request, RequestStatus  # noqa: PLC0415

        family, rng = self.family, self.rng
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            if family.pool:  # an id vLLM let go of (vLLM asserts on one it holds)
                pool = [f"{self.tag}p{i}" for i in range(family.pool)]
                free = [rid for rid in pool if rid not in scheduler.requests]
                if not free:
                    continue
                rid = rng.choice(free)
            else:
                rid = f"{self.tag}r{self.arrived}"
            self.arrived += 1
            if self.seen and rng.random() < 0.25:  # a prompt again: a load, where cached
                tokens = list(rng.choice(self.seen[: max(1, len(self.seen) - RECENT)]))
            else:
                length = rng.randint(20, 90)
                head = self.prefix[: rng.randint(4, 40)] if rng.random() < family.prefix else []
                tokens = head + [rng.randrange(3, 30_000) for _ in range(length - len(head))]
                self.seen.append(tokens)
            max_tokens, transfer = rng.randint(1, 24), None
            if self.params is not None:  # the connector's role for the request
                transfer, fixed = self.params(rng, rid, len(tokens), family.workers)
                max_tokens = max_tokens if fixed is None else fixed
            params = SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                extra_args=None if transfer is None else {"kv_transfer_params": transfer},
            )
            scheduler.add_request(
                Request(rid, tokens, params, None, block_hasher=self.hasher, cache_salt=self.salt)
            )
        if scheduler.requests and rng.random() < family.abort:
            rid = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)


def _held(scheduler: Any) -> frozenset[tuple[str, Any, int, int]]:
    """Where each request vLLM holds is (its id, status, computed and output tokens): a
    drain moves while this changes."""
    return frozenset(
        (rid, r.status, r.num_computed_tokens, r.num_output_tokens)
        for rid, r in scheduler.requests.items()
    )


def _model_output(out: Any, kv_output: Any, chunks: frozenset[str]) -> Any:
    """What the model runner returns for ``out``: token 7 sampled for every scheduled
    request but those in ``chunks`` (a prompt not computed to its end in the step: the
    runner discards what it sampled for them), and the workers' ``kv_output``."""
    from vllm.v1.outputs import ModelRunnerOutput  # noqa: PLC0415

    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[] if rid in chunks else [7] for rid in req_ids],
        kv_connector_output=kv_output,
    )


def prefill_chunks(scheduler: Any, out: Any) -> frozenset[str]:
    """The requests of ``out`` (just scheduled) whose step computes part of their prompt
    only (vLLM's ``Request.is_prefill_chunk``, set when the step was scheduled)."""
    requests = scheduler.requests
    return frozenset(rid for rid in out.num_scheduled_tokens if requests[rid].is_prefill_chunk)


def _where(exc: BaseException) -> str:
    """The innermost frame of ``exc``'s traceback, its path from the package down."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    frame = frames[-1]
    path = frame.filename
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    else:
        with contextlib.suppress(ValueError):
            path = str(Path(path).relative_to(Path.cwd()))
    return f"{path}:{frame.lineno} in {frame.name}"


def _check_runnable(made: type[Any], transfer: dict[str, Any]) -> None:
    """Raise ``ExerciseConfigError`` when the workers ``made`` cannot run ``transfer``'s
    connector (their ``refused(transfer)`` says why; most workers have none)."""
    refused = getattr(made, "refused", None)
    why = refused(transfer) if refused is not None else None
    if why is not None:
        raise ExerciseConfigError(why)


def run_one(
    transfer: dict[str, Any],
    family: Family,
    seed: int,
    steps: int,
    directory: Path,
    runner: str = "v1",
) -> RunResult:
    """One seeded run of ``family`` under ``runner``'s scheduler output (see ``RUNNERS``):
    ``steps`` steps of workload, then the drain; the audit log is
    ``DIRECTORY/FAMILY-SEED.jsonl`` (``FAMILY-RUNNER-SEED.jsonl`` under another runner
    than ``v1``).

    Raises:
        ExerciseConfigError: the connector does not build, or the exercise cannot run its
            workers (a MultiConnector with a child that runs alone only). Nothing ran.
        ValueError: ``runner`` is not one of ``RUNNERS``.
    """
    if runner not in RUNNERS:
        raise ValueError(f"unknown runner {runner!r}: choose from {', '.join(RUNNERS)}")
    from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: PLC0415
        KVOutputAggregator,
    )

    from kvlife.fsm import AuditReader, check_audit  # noqa: PLC0415

    directory.mkdir(parents=True, exist_ok=True)
    name = f"{family.name}-{seed}" if runner == "v1" else f"{family.name}-{runner}-{seed}"
    log = directory / f"{name}.jsonl"
    own = directory / f"{name}.kvlife.jsonl"
    for path in (log, own):
        path.unlink(missing_ok=True)
    result = RunResult(family.name, seed, steps, str(log), runner=runner)
    if transfer["kv_connector"] == "KVLifeConnector":  # kvlife's own keeps its own log too
        extra = {**transfer.get("kv_connector_extra_config", {}), "audit_log": str(own)}
        transfer = {**transfer, "kv_connector_extra_config": extra}
    made = workers_class(transfer["kv_connector"])
    _check_runnable(made, transfer)
    scheduler = build_scheduler(
        transfer,
        log,
        blocks=family.blocks,
        workers=family.workers,
        layout=made.kv_cache_layout,
        speculative=getattr(made, "speculative_config", None),
        asynchronous=runner == "v2-async",
    )
    # the shape of the output vLLM's scheduler builds (it reads the flag at every step)
    scheduler.use_v2_model_runner = runner != "v1"
    queue = StepQueue(scheduler, runner)
    rng = random.Random(seed)
    tag = f"{family.name}{seed}-" if runner == "v1" else f"{family.name}{seed}{runner}-"
    workload = _Workload(family, rng, tag, transfer_params_of(transfer))
    preempted: set[str] = set()
    workers: Workers | None = None
    try:
        workers = made(scheduler, family.workers)
        aggregator = KVOutputAggregator.from_connector(scheduler.connector, family.workers)

        def delay() -> int:
            return rng.randint(*family.delay)

        def step(n: int, arrivals: bool) -> None:
            if arrivals:
                workload.arrive(scheduler)
            if queue.give_back():
                return
            out = scheduler.schedule()
            result.preemptions += len(out.preempted_req_ids or ())
            # resumes: V1 names them; V2 sends a preempted request as new request data
            resumed = set(getattr(out.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
            resumed |= {r.req_id for r in out.scheduled_new_reqs if r.req_id in preempted}
            result.resumes += len(resumed)
            preempted.difference_update(resumed)
            preempted.update(out.preempted_req_ids or ())
            chunks = prefill_chunks(scheduler, out)
            outputs = workers.step(out, n, delay)
            ranks = [_model_output(out, o, chunks) for o in outputs]
            queue.put(out, aggregator.aggregate(ranks))

        for n in range(steps):
            step(n, arrivals=True)
        moved_at, seen = steps, _held(scheduler)
        for n in range(steps, steps + DRAIN_LIMIT):
            if not scheduler.has_requests() and not workers.busy() and not queue:
                break
            if n - moved_at >= STALL_STEPS and scheduler.requests:
                result.undrained = sorted(scheduler.requests)
                break
            result.drain_steps += 1
            step(n, arrivals=False)
            now = _held(scheduler)
            if now != seen:
                moved_at, seen = n, now
        else:
            result.undrained = sorted(scheduler.requests)
        if not result.undrained:  # (an undrained request holds its blocks: said above)
            pool = scheduler.kv_cache_manager.block_pool
            result.leaked_blocks = max(0, family.blocks - 1 - pool.get_num_free_blocks())
    except BaseException as exc:  # vLLM's or the connector's (a native panic too)
        if isinstance(exc, STOPPING):
            raise
        result.raised = f"{type(exc).__name__}: {_first_line(exc)}"
        result.raised_at = _where(exc)
    finally:
        stopped = shut_down(scheduler, workers, made)
    raised_in_run = result.raised is not None
    if stopped is not None and result.raised is None:  # the run found it at shutdown
        result.raised = f"{type(stopped).__name__} at shutdown(): {_first_line(stopped)}"
        result.raised_at = _where(stopped)
    clean_end = result.raised is None and not result.undrained
    report = check_audit(AuditReader(log), expect_released=clean_end)
    result.lifecycles = report.lifecycles
    result.aborts = report.transitions.get("abort", 0)
    checks = [(log, report)]
    if own.exists():
        checks.append((own, check_audit(AuditReader(own), expect_released=clean_end)))
    for where, checked in checks:
        for violation in checked.violations:
            if raised_in_run and violation.kind == "unreported":  # stopped by the raise
                result.open_at_raise += 1
                continue
            rids = result.verdicts.setdefault(violation.kind, [])
            rids.append(str(violation.rid))
            if len(rids) == 1 and where != log:
                result.verdict_logs[violation.kind] = str(where)
        result.copies += checked.transitions.get("start_offload", 0)
        result.reuses += checked.reused_while_unreleased
    return result


# -- many runs, the report ----------------------------------------------------------------


def exercise(
    transfer: dict[str, Any],
    families: Sequence[str],
    seeds: Sequence[int],
    steps: int,
    directory: Path,
    progress: Callable[[str, int, int], None] | None = None,
    runners: Sequence[str] = tuple(RUNNERS),
) -> tuple[list[FamilyReport], list[RunResult]]:
    """Every family over every seed under each of ``runners`` (default: every one of
    ``RUNNERS``); the reports (one per family and runner; a failure that only one runner
    shows is said in that report), and every run. Each run's audit log stays
    in ``directory`` (a clean run's is removed).

    Raises:
        ExerciseConfigError: the connector does not build, or a family or a runner is
            unknown.
    """
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ExerciseConfigError(f"unknown families {unknown}: choose from {sorted(FAMILIES)}")
    strange = [r for r in runners if r not in RUNNERS] or ([] if runners else ["(none)"])
    if strange:
        raise ExerciseConfigError(f"unknown runners {strange}: choose from {list(RUNNERS)}")
    directory.mkdir(parents=True, exist_ok=True)
    name = transfer["kv_connector"]
    made = workers_class(name)
    _check_runnable(made, transfer)
    scheduler = build_scheduler(
        transfer,
        directory / "build-check.jsonl",
        layout=made.kv_cache_layout,
        speculative=getattr(made, "speculative_config", None),
    )
    checked = shut_down(scheduler, made=made)
    if checked is not None:
        raise ExerciseConfigError(
            f"{name} built, then its shutdown() raised {type(checked).__name__}: "
            f"{_first_line(checked)}"
        )
    (directory / "build-check.jsonl").unlink(missing_ok=True)
    reports, runs = [], []
    for family_name, runner in ((f, r) for f in families for r in runners):
        family = FAMILIES[family_name]
        report = FamilyReport(family_name, family.what, runner=runner)
        for i, seed in enumerate(seeds):
            try:
                run = run_one(transfer, family, seed, steps, directory, runner)
            except ExerciseConfigError as exc:  # it built once, and not after a shutdown
                raise ExerciseConfigError(
                    f"{name} built once and shut down, then did not build again: "
                    f"{exc.__cause__ and type(exc.__cause__).__name__}: "
                    f"{_first_line(exc.__cause__ or exc)}. It still holds something its next "
                    "build needs (a fixed port, a process-wide singleton): release it in "
                    "shutdown()"
                ) from exc
            report.add(run)
            runs.append(run)
            if not run.failed:
                Path(run.log).unlink(missing_ok=True)
                Path(run.log).with_suffix(".kvlife.jsonl").unlink(missing_ok=True)
            if progress is not None:
                progress(f"{family_name} ({runner})", i + 1, len(seeds))
        reports.append(report)
    only_one_runner(reports)
    return reports, runs


def only_one_runner(reports: Sequence[FamilyReport]) -> None:
    """Mark each family's report whose runs failed under one runner while the family
    was clean under another (``only``: the runners it was clean under)."""
    by_family: dict[str, list[FamilyReport]] = {}
    for report in reports:
        by_family.setdefault(report.family, []).append(report)
    for same in by_family.values():
        clean = [r.runner for r in same if not r.failed]
        for report in same:
            report.clean_under = clean if report.failed else []


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlife vllm exercise CONFIG [--families ...] [--seeds N] [--seed S] [--steps N]
    [--out DIR] [--json]``: exit 0 when every run is clean, 1 when one failed, 2 for a
    config that does not build (one line)."""
    parser = argparse.ArgumentParser(
        prog="kvlife vllm exercise",
        description="Drive a vLLM KV connector through the schedules that break connectors, "
        "inside vLLM's real scheduler, and check vLLM's invariants and kvlife's audit log.",
    )
    parser.add_argument(
        "config", help="the connector's kv_transfer_config as JSON, or @FILE holding it"
    )
    add_run_options(parser, FAMILIES)
    parser.add_argument(
        "--runners",
        default=",".join(RUNNERS),
        help="comma-separated, the runners to run each family under: v1 (model runner V1's "
        "scheduler output), v2 (V2's), v2-async (V2's from vLLM's AsyncScheduler, a step "
        "ahead: every CUDA deployment's default) (default: all three)",
    )
    args = parser.parse_args(argv)
    error = run_counts_error(args, "kvlife vllm exercise")
    if error:
        print(error, file=sys.stderr)
        return 2
    families = listed(args.families)
    progress = progress_line()

    import vllm.logger  # noqa: F401, PLC0415  (vLLM sets its loggers up when imported)

    # vLLM's warnings (and the wrapper's live ones) for every scheduler built: the report
    # says what they would
    logging.getLogger("vllm").setLevel(logging.ERROR)
    try:
        transfer = parse_config(args.config)
        reports, runs = exercise(
            transfer,
            families,
            range(args.seed, args.seed + args.seeds),
            args.steps,
            Path(args.out),
            progress,
            listed(args.runners),
        )
    except ExerciseConfigError as exc:
        print(f"kvlife vllm exercise: {exc}", file=sys.stderr)
        return 2
    title = f"kvlife vllm exercise: {transfer['kv_connector']}, {args.steps} steps a run"
    return print_reports(
        reports, runs, title, as_json=args.json, head={"connector": transfer.get("kv_connector")}
    )


__all__ = [
    "BLOCK",
    "FAMILIES",
    "PLAYED",
    "RUNNERS",
    "ExerciseConfigError",
    "Family",
    "FamilyReport",
    "RealWorkers",
    "RunResult",
    "StepQueue",
    "Workers",
    "build_scheduler",
    "exercise",
    "main",
    "model_dir",
    "only_one_runner",
    "parse_config",
    "per_layer_kv_cache_config",
    "prefill_chunks",
    "run_one",
    "scheduler_class",
    "why_command",
    "workers_class",
]

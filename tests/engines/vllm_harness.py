"""vLLM's real scheduler on the CPU platform, with a model config and no weights.

``make_scheduler`` builds vLLM 0.33.0's ``Scheduler`` with a KV connector from its config
(as ``--kv-transfer-config`` would), over a KV cache of ``blocks`` blocks of one layer
group. ``step`` runs one scheduler step the way the engine core does, standing in for the
model runner: every scheduled request samples one token, and the worker side reports the
transfer jobs named in ``completed`` as done.
"""

from __future__ import annotations

import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # else configs fail validation on CPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvlife.fsm import AuditReader, AuditRecord
from kvlife.offload.engines.vllm import KVLifeConnector
from kvlife.offload.watch.vllm.exercise import (
    FAMILIES,
    StepQueue,
    exercise,
    model_dir,
    per_layer_kv_cache_config,
    prefill_chunks,
    run_one,
    scheduler_class,
)

BLOCK = 16
#: The token every scheduled request samples.
TOKEN = 7

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


def make_scheduler(
    connector: str | None,
    module: str | None = None,
    extra: dict[str, Any] | None = None,
    *,
    blocks: int = 128,
    tensor_parallel: int = 1,
    max_seqs: int = 16,
    kv_events: bool = False,
    window: int | None = None,
    layout: str | None = None,
    asynchronous: bool = False,
) -> Scheduler:
    """``window``: a hybrid model instead, of two KV cache groups: a sliding window of
    ``window`` tokens (layer ``swa``) and full attention (layer ``full``), one block pool.
    ``layout``: the KV cache layout vLLM resolved (a ``KVCacheLayout`` name, e.g.
    ``"LBNHC"``), set before the connector is built. ``asynchronous``: vLLM's
    ``AsyncScheduler``, as a CUDA deployment builds by default (the CPU platform turns
    async scheduling off in the config: on again here)."""
    model_config = ModelConfig(
        model=model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=1024
    )
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True
        ),
        kv_transfer_config=None
        if connector is None
        else KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=extra or {},
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if kv_events
        else None,
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=12, head_size=64, dtype=torch.float16)
    groups: list[tuple[list[str], Any]] = [(["layer"], spec)]
    if window is not None:
        swa = SlidingWindowSpec(
            block_size=BLOCK,
            num_kv_heads=HEADS,
            head_size=HEAD_DIM,
            dtype=torch.float16,
            sliding_window=window,
        )
        full = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16
        )
        groups = [(["swa"], swa), (["full"], full)]
    kv_cache_config = per_layer_kv_cache_config(blocks, groups)
    vllm_config.cache_config.num_gpu_blocks = blocks
    if layout is not None:
        vllm_config.cache_config.kv_cache_layout = layout
    return scheduler_class(vllm_config, asynchronous)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )


def copies_started(log: str) -> Counter[str]:
    """The copies an audit log opened (``start_offload``), by kind (``store``, ``load``,
    ``delayed_free``, ...)."""
    return Counter(
        str(record.detail.get("kind"))
        for record in AuditReader(log)
        if isinstance(record, AuditRecord) and record.trigger == "start_offload"
    )


def exercised_clean(
    config: dict[str, Any], families: Iterable[str], tmp_path: Path, *, kept: str, steps: int = 80
) -> tuple[list[Any], Any]:
    """``kvlife vllm exercise`` of the connector ``config`` in ``families`` (seeds 0 and 1,
    both runners), every report checked clean with copies; then one run of family ``kept``
    (seed 0) whose log stays under ``tmp_path / "kept"``. Returns the reports and that run
    (``copies_started(run.log)`` tells its copies)."""
    reports, _ = exercise(config, list(families), range(2), steps, tmp_path)
    for report in reports:
        assert report.failed == 0 and report.copies > 0, report.lines()
    return reports, run_one(config, FAMILIES[kept], 0, steps, tmp_path / "kept")


def run_with_step(
    monkeypatch: pytest.MonkeyPatch,
    play: type,
    config: dict[str, Any],
    tmp_path: Path,
    *,
    before: Callable[[Any, Any], None] | None = None,
    after: Callable[[Any], None] | None = None,
    steps: int = 80,
) -> Any:
    """One exercise run of ``config`` (family ``basic``, seed 0) whose played workers
    (``play``) misbehave: ``before(play, out)`` runs before each of their steps (it may
    change the step's scheduler output), ``after(play)`` after each. Returns the run."""
    step = play.step  # type: ignore[attr-defined]

    def changed(self: Any, out: Any, n: int, delay: Callable[[], int]) -> list[Any]:
        if before is not None:
            before(self, out)
        outputs: list[Any] = step(self, out, n, delay)
        if after is not None:
            after(self)
        return outputs

    monkeypatch.setattr(play, "step", changed)
    return run_one(config, FAMILIES["basic"], 0, steps, tmp_path)


def finished_then_again(scheduler: Scheduler, rid: str = "x") -> None:
    """``rid`` finishes in one step (one token), and a new request with the same id comes
    right after it, before the next step: a client reusing an id at once."""
    scheduler.add_request(make_request(rid, prompt=40, max_tokens=1, first=1000))
    out = scheduler.schedule()  # it prefills and samples its one token
    scheduler.update_from_output(out, model_output(out))  # finished
    assert rid not in scheduler.requests
    scheduler.add_request(make_request(rid, prompt=40, max_tokens=4, first=2000))


def make_request(rid: str, *, prompt: int = 40, max_tokens: int = 8, first: int = 1000) -> Request:
    """A request of ``prompt`` distinct tokens that finishes after ``max_tokens``."""
    return Request(
        rid,
        list(range(first, first + prompt)),
        SamplingParams(max_tokens=max_tokens),
        None,
        block_hasher=_HASHER,
    )


def model_output(
    out: Any, worker_meta: Any = None, chunks: frozenset[str] = frozenset()
) -> ModelRunnerOutput:
    """What the model runner returns for scheduler output ``out``: every scheduled request
    sampled ``TOKEN`` but those in ``chunks`` (see ``prefill_chunks``: the runner discards
    what it sampled for a prompt not computed to its end), and the workers' connector
    metadata ``worker_meta``."""
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[] if rid in chunks else [TOKEN] for rid in req_ids],
        kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=worker_meta),
    )


def step(scheduler: Scheduler, completed: Iterable[int] = ()) -> Any:
    """One engine step; returns the scheduler output (with the connector's metadata)."""
    out = scheduler.schedule()
    jobs = dict.fromkeys(completed, 1)
    meta = OffloadingWorkerMetadata(completed_jobs=jobs) if jobs else None
    scheduler.update_from_output(out, model_output(out, meta, prefill_chunks(scheduler, out)))
    return out


def vllm_caches(
    layout: Any,
    spec: FullAttentionSpec,
    *,
    layers: int,
    blocks: int,
    kernel_block: int | None = None,
    prefix: str = "model.layers",
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """KV caches of ``layers`` layers made by vLLM's own allocator in ``layout`` (a
    ``KVCacheLayout``), placed as vLLM's planner places them (block-outermost layouts pack
    every layer into each block). Returns the config and the per-layer views."""
    from vllm.v1.kv_cache_interface import compute_layout_strides  # noqa: PLC0415
    from vllm.v1.worker.utils import allocate_kv_cache  # noqa: PLC0415

    page = spec.page_size_bytes
    packed = page * layers if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, blocks, layers, layout, fixed_strides=(None, packed, None, None, None)
    )
    names = [f"{prefix}.{i}.attn" for i in range(layers)]
    config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * blocks * layers,
                layers=names,
                layer_stride=layer_stride,
                block_stride=block_stride,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    caches = allocate_kv_cache(
        config,
        torch.device("cpu"),
        layout,
        kernel_block_sizes=[kernel_block] if kernel_block else None,
    )
    return config, caches


KVLIFE = "kvlife.offload.engines.vllm"
LAYERS, HEADS, HEAD_DIM = 2, 2, 8


class Engine:
    """vLLM's real scheduler with the kvlife connector on both sides, and a stand-in model
    runner: CPU KV caches shaped like vLLM's (NHD), a forward pass that writes a value
    derived from (request, position) into each scheduled token's slots, and the worker
    connector called as vLLM's model runner calls it. ``hold`` keeps store completions
    from being reported (a copy still in flight) until ``release``."""

    def __init__(
        self,
        *,
        blocks: int = 64,
        host_pages: int = 64,
        tensor_parallel: int = 1,
        kv_events: bool = False,
        audit: str | None = None,
        runner: str = "v1",
        **extra: Any,
    ) -> None:
        """``audit``: the scheduler side runs inside ``KVLifeAuditConnectorHMA``, which
        writes its log there. ``runner``: the shape of the scheduler's output, model runner
        V1's (a resumed request in ``resumed_req_ids``) or V2's (as new request data), or
        ``v2-async``: V2's from vLLM's ``AsyncScheduler``, stepped as the engine core's
        batch queue of two steps it (``step`` schedules step N+1, runs its worker side,
        then gives the scheduler step N's output)."""
        config = {"host_pages": host_pages, **extra}
        if audit is None:
            name, settings = "KVLifeConnector", config
        else:
            inner = {
                "kv_connector": "KVLifeConnector",
                "kv_connector_module_path": KVLIFE,
                "kv_connector_extra_config": config,
            }
            name, settings = "KVLifeAuditConnectorHMA", {"connector": inner, "audit_log": audit}
        self.scheduler = make_scheduler(
            name,
            KVLIFE,
            settings,
            blocks=blocks,
            tensor_parallel=tensor_parallel,
            kv_events=kv_events,
            asynchronous=runner == "v2-async",
        )
        self.scheduler.use_v2_model_runner = runner != "v1"  # read at every step
        self.queue = StepQueue(self.scheduler, runner)  # outputs not given back yet
        self.events: list[Any] = []  # every KV event vLLM published, in order
        publisher = self.scheduler.kv_event_publisher
        publish = publisher.publish
        publisher.publish = lambda batch: (self.events.extend(batch.events), publish(batch))
        self.connector = self.scheduler.connector
        vllm_config = self.scheduler.vllm_config
        if audit is not None:  # the worker side as the wrapper builds it: kvlife's own
            from kvlife.offload.watch.vllm.audit import wrapped_config  # noqa: PLC0415

            vllm_config = wrapped_config(vllm_config)[1]
        self.worker = KVLifeConnector(
            vllm_config, KVConnectorRole.WORKER, self.scheduler.kv_cache_config
        )
        shape = (2, blocks, BLOCK, HEADS, HEAD_DIM)
        self.kv = {f"layer.{i}": torch.zeros(shape, dtype=torch.float16) for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv)
        self.held: dict[int, int] = {}  # job id -> 1 (done), held back
        self.hold_all = False
        self.stores: list[Any] = []  # every StoreOrder the scheduler sent
        self.loads: list[Any] = []  # every LoadOrder the scheduler sent
        self.fail: set[int] = set()  # job ids the worker reports failed
        self.expected: dict[int, list[torch.Tensor]] = {}  # job id -> device blocks at launch
        self.preemptions = 0  # requests vLLM preempted

    def prefill_holding_its_store(self, request: Request) -> Any:
        """Admit ``request`` and run its prefill; its one store's completion is held back
        (the copy is in flight as far as the scheduler knows). Returns the store."""
        self.scheduler.add_request(request)
        self.hold_all = True
        before = len(self.stores)
        self.step()
        (store,) = self.stores[before:]
        return store

    def value(self, req_id: str, position: int) -> float:
        return float((zlib.crc32(req_id.encode()) % 97) * 1000 + position % 997)

    def step(self, release: Iterable[int] = ()) -> Any:
        """Schedule a step and run its worker side; give the scheduler the output of the
        step ``depth`` steps back (this one's, unless async). With nothing to schedule and
        a step's output not given back, give it back only (as the engine core does) and
        return ``None``."""
        if self.queue.give_back():
            return None
        out = self.scheduler.schedule()
        chunks = prefill_chunks(self.scheduler, out)
        self.preemptions += len(out.preempted_req_ids or ())
        meta = out.kv_connector_metadata
        self.stores += meta.last_stores + meta.stores
        self.loads += meta.loads
        self._expect(meta.last_stores)
        self.worker.handle_preemptions(meta)  # first, as vLLM's model runners call it
        self.assert_host_copies_exact(meta.last_stores)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # before the forward pass, as the model runner does
        self.assert_loads_exact(meta.loads)
        self._forward(out)
        self._expect(meta.stores)
        self.worker.wait_for_save()
        # CPU copies run at launch: each store's host pages hold its blocks now, before
        # any page is freed and reused by a later store
        self.assert_host_copies_exact(meta.stores)
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        assert sending is None and recving is None  # nothing is reported by request id
        wmeta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        for job_id in list(wmeta.done):
            if self.hold_all or job_id in self.held:
                self.held[job_id] = wmeta.done.pop(job_id)
        for job_id in list(wmeta.done):
            if job_id in self.fail:
                wmeta.failed[job_id] = wmeta.done.pop(job_id)
        for job_id in release:
            wmeta.done[job_id] = self.held.pop(job_id, 1)
        self.queue.put(out, model_output(out, wmeta, chunks))
        return out

    def run_until_idle(self, steps: int = 200) -> None:
        """Step until vLLM holds no request (every free reported, every copy reported)."""
        self.hold_all = False
        for _ in range(steps):
            self.step(release=list(self.held))
            # as the engine core: a step more while a finish is not told to the workers
            if not self.scheduler.has_requests() and not self.queue:
                return
        raise AssertionError(f"still busy after {steps} steps: {list(self.scheduler.requests)}")

    def _forward(self, out: Any) -> None:
        for new in out.scheduled_new_reqs:
            self._write(new.req_id, list(new.block_ids[0]), new.num_computed_tokens, out)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            self._write(req_id, list(ids), cached.num_computed_tokens[i], out)

    def _write(self, req_id: str, block_ids: list[int], start: int, out: Any) -> None:
        for position in range(start, start + out.num_scheduled_tokens[req_id]):
            block, offset = block_ids[position // BLOCK], position % BLOCK
            for tensor in self.kv.values():
                tensor[:, block, offset] = self.value(req_id, position)

    def _expect(self, stores: Iterable[Any]) -> None:
        """Note what each store must copy: its blocks as the device holds them now."""
        for store in stores:
            self.expected[store.op] = [self.device_block(b).clone() for b in store.slots]

    def assert_host_copies_exact(self, stores: Iterable[Any]) -> None:
        """Each store's host pages hold exactly the device blocks it was given."""
        for store in stores:
            for page, block in zip(store.pages, self.expected[store.op], strict=True):
                assert torch.equal(self.host_block(page), block), (store.op, page)

    def assert_loads_exact(self, loads: Iterable[Any]) -> None:
        """Each load's device blocks hold exactly its host pages (CPU copies run at
        launch)."""
        for load in loads:
            for page, block in zip(load.pages, load.slots, strict=True):
                assert torch.equal(self.device_block(block), self.host_block(page)), load

    def host_block(self, page: int) -> torch.Tensor:
        """Host page ``page`` as the worker holds it: [components, BLOCK, elems]."""
        components = 2 * len(self.kv)
        return self.worker.host_pages.page_view(page, 1)[0].reshape(components, BLOCK, -1)

    def device_block(self, block: int) -> torch.Tensor:
        """Device block ``block`` in the host page's order: K0, V0, K1, V1, ..."""
        parts = [t[c, block].reshape(BLOCK, -1) for t in self.kv.values() for c in (0, 1)]
        return torch.stack(parts)

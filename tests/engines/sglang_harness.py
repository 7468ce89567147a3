"""SGLang 0.5.23's real pools, requests and offload manager on CPU, for the drop-in's tests.

Runs in ``.venv-sglang`` (``make sglang-venv``). What is substituted, and only here:

* ``torchvision``: a stand-in module (``standins/torchvision``; PyPI's build links CUDA).
  Put first on ``sys.path`` by this module, before SGLang is imported.
* Inside SGLang, for its *own* manager only (kvlife's drop-in needs neither): its host
  pool pins memory with ``cudaHostRegister`` (no CPU entry: "Torch not compiled with CUDA
  enabled"), so registration is a no-op here; and its device-to-host transfer is a kernel
  from ``sgl_kernel`` with no CPU build, so ``MHATokenToKVPoolHost.backup_from_device_all_layer``
  becomes the same copy written with torch indexing for the two layouts used here.

Everything else is SGLang's code: ``Req``, ``ReqToTokenPool``, ``MHATokenToKVPool``,
``PagedTokenToKVPoolAllocator``, ``RadixCache`` (disabled, as a decode node runs it), the
server-args publication, ``HiCacheController``, ``HiCacheFile`` storage and
``DecodeKVCacheOffloadManager``.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import time
import warnings
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).with_name("standins")))

import torch
import torch.distributed as dist

with warnings.catch_warnings():  # SGLang's imports warn (torch.jit, SWIG, AWQ/GGUF)
    warnings.simplefilter("ignore")
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
        DecodeKVCacheOffloadManager,
    )
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ReqKvInfo
    from sglang.srt.mem_cache import pool_host
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.pool_host import common as pool_host_common
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.version import __version__ as SGLANG_VERSION

    try:
        from sglang.srt.runtime_context import SpawnRanks
    except ImportError:  # SGLang <= 0.5.18 publishes without launcher ranks
        SpawnRanks = None

from kvlife.offload.engines.sglang import (
    ROW_ON_KV,
    KVLifeDecodeOffloadManager,
    request_row,
)

#: The manager's constructor takes the server args (SGLang <= 0.5.18).
TAKES_SERVER_ARGS = not ROW_ON_KV
_published: list[Any] = []  # the last ServerArgs published
_rank_override: list[Any] = []  # SGLang <= 0.5.18: the rank override, entered once

__all__ = [
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "SGLANG_VERSION",
    "DecodeKVCacheOffloadManager",
    "KVLifeDecodeOffloadManager",
    "Req",
    "pool_host",
    "request_row",
]

PAGE = 4
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
DTYPE = torch.float16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def init_dist() -> Any:
    """A one-rank gloo group (SGLang's TP group on a decode node is a CPU group)."""
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    return dist.group.WORLD


def publish_args(
    storage_dir: Path | str,
    *,
    layout: str = "page_first",
    hicache_size_gb: float = 0.0,
    stride: int | None = None,
    storage_backend: str = "file",
) -> None:
    """Publish SGLang server args for a decode node with KV offload to ``HiCacheFile``."""
    # SGLang <= 0.5.18 reads HiCacheFile's directory from this variable only
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(storage_dir)
    if stride is None:
        os.environ.pop("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", None)
    else:
        os.environ["SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE"] = str(stride)
    args = ServerArgs(
        model_path="dummy",
        device="cpu",
        page_size=PAGE,
        disaggregation_mode="decode",
        disaggregation_decode_enable_offload_kvcache=True,
        hicache_storage_backend=storage_backend,
        hicache_storage_backend_extra_config=f'{{"file_storage_path": "{storage_dir}"}}',
        hicache_mem_layout=layout,
        hicache_size=hicache_size_gb,
        hicache_ratio=None if hicache_size_gb > 0 else 2.0,
    )
    if SpawnRanks is None:
        publish(args, role="test")
        if not _rank_override:  # one rank, no SGLang TP group: say so (0.5.18 has no ranks=)
            override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
            override.__enter__()
            _rank_override.append(override)
    else:
        publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    _published[:] = [args]


@contextmanager
def sglang_on_cpu() -> Iterator[None]:
    """The two substitutions SGLang's own manager needs on CPU (see the module doc)."""
    register = pool_host_common._cuda_host_register
    backup = MHATokenToKVPoolHost.backup_from_device_all_layer

    def no_register(buffer: torch.Tensor, granularity: int | None = None) -> None:
        return None

    def cpu_backup(
        self: Any, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: Any
    ) -> None:
        host, dev = host_indices.long(), device_indices.long()
        for layer in range(self.layer_num):
            for host_buf, dev_buf in (
                (self.k_buffer, device_pool.k_buffer[layer]),
                (self.v_buffer, device_pool.v_buffer[layer]),
            ):
                if self.layout == "layer_first":
                    host_buf[layer, host] = dev_buf[dev]
                elif self.layout == "page_first":
                    host_buf[host, layer] = dev_buf[dev]
                else:  # pragma: no cover - the tests use these two
                    raise NotImplementedError(self.layout)

    pool_host_common._cuda_host_register = no_register
    MHATokenToKVPoolHost.backup_from_device_all_layer = cpu_backup
    try:
        yield
    finally:
        pool_host_common._cuda_host_register = register
        MHATokenToKVPoolHost.backup_from_device_all_layer = backup


@dataclass
class Release:
    """One device release the engine saw: who, which row, which slots went back."""

    rid: str
    row: int
    slots: tuple[int, ...]


@dataclass
class Pools:
    """SGLang's device pools, with a log of every release made through them."""

    r2t: Any
    kv: Any
    alloc: Any
    tree: Any
    gen: torch.Generator
    releases: list[Release] = field(default_factory=list)

    def slot_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """Device KV of ``slots`` as ``[2*layers, tokens, heads*head_dim]`` (k0, v0, k1...)."""
        rows = []
        for layer in range(self.kv.layer_num):
            rows.append(self.kv.k_buffer[layer][slots].reshape(len(slots), -1))
            rows.append(self.kv.v_buffer[layer][slots].reshape(len(slots), -1))
        return torch.stack(rows)


def make_pools(*, slots: int = 1024, rows: int = 32, context: int = 256, seed: int = 0) -> Pools:
    """Real SGLang pools on CPU; the tree cache's releases and row frees are recorded."""
    r2t = ReqToTokenPool(
        size=rows, max_context_len=context, device="cpu", enable_memory_saver=False
    )
    kv = MHATokenToKVPool(
        size=slots,
        page_size=PAGE,
        dtype=DTYPE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = PagedTokenToKVPoolAllocator(
        size=slots, page_size=PAGE, dtype=DTYPE, device="cpu", kvcache=kv, need_sort=False
    )
    tree = RadixCache(
        CacheInitParams(
            disable=True, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=PAGE
        )
    )
    gen = torch.Generator().manual_seed(seed)
    pools = Pools(r2t, kv, alloc, tree, gen)
    free_row = r2t.free

    def logged_free(req: Any) -> None:  # every release ends with the row; log what it held
        row = request_row(req)
        held = r2t.req_to_token[row, : req.kv.kv_allocated_len].tolist()
        pools.releases.append(Release(req.rid, int(row), tuple(held)))
        free_row(req)

    r2t.free = logged_free
    return pools


def admit(
    pools: Pools,
    rid: str,
    prompt: int,
    max_new: int,
    *,
    req_class: type = Req,
    first_token: int = 7,
    extra_key: str | None = None,
) -> Any:
    """A decode node admitting a request from prefill: a row, slots for its whole length,
    the prompt's KV written, and the first sampled token (from the prefill node)."""
    ids = array("q", ((i * 31 + len(rid)) % 50_000 for i in range(prompt)))
    params = SamplingParams(max_new_tokens=max_new)
    if extra_key is None:
        req = req_class(rid, "", ids, params)
    else:  # a storage namespace (SGLang >= 0.5.19 seeds the page hash chain with it)
        req = req_class(rid, "", ids, params, extra_key=extra_key)
    if pools.r2t.alloc([req]) is None:
        raise RuntimeError("no req_to_token row free")
    length = -(-(prompt + max_new) // PAGE) * PAGE
    slots = pools.alloc.alloc(length)
    if slots is None:
        raise RuntimeError("device KV pool exhausted")
    pools.r2t.req_to_token[request_row(req), :length] = slots.to(torch.int32)
    if req.kv is None:  # SGLang <= 0.5.18 makes it at the first extend
        req.kv = ReqKvInfo(kv_allocated_len=length, swa_evicted_seqlen=0)
    req.kv.kv_allocated_len = length
    write_kv(pools, req, 0, prompt)
    _set_committed(req, prompt)
    req.output_ids = array("q", [first_token])
    return req


def _set_committed(req: Any, tokens: int) -> None:
    if ROW_ON_KV:
        req.kv.kv_committed_len = tokens
    else:
        req.kv_committed_len = tokens


def write_kv(pools: Pools, req: Any, start: int, end: int) -> None:
    """The forward pass writing fresh KV for tokens ``[start, end)`` of ``req``."""
    slots = pools.r2t.req_to_token[request_row(req), start:end].long()
    n = len(slots)
    for bufs in (pools.kv.k_buffer, pools.kv.v_buffer):
        for buf in bufs:
            buf[slots] = torch.randn((n, HEADS, HEAD_DIM), generator=pools.gen).to(DTYPE)


def decode(pools: Pools, req: Any, token: int) -> None:
    """One decode step: the last token's KV is computed, a new token is sampled."""
    done = len(req.origin_input_ids) + len(req.output_ids) - 1
    write_kv(pools, req, done, done + 1)
    _set_committed(req, done + 1)
    req.output_ids.append(token)
    if len(req.output_ids) >= req.sampling_params.max_new_tokens:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))


class RidKeyedReq(Req):  # type: ignore[misc]
    """A ``Req`` that compares and hashes by rid (what keyed-by-rid bookkeeping assumes)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Req) and other.rid == self.rid

    def __hash__(self) -> int:
        return hash(self.rid)


def sglang_manager(pools: Pools, storage_dir: Path | str, **args: Any) -> Any:
    """SGLang's own ``DecodeKVCacheOffloadManager`` (inside ``sglang_on_cpu()``)."""
    publish_args(storage_dir, **args)
    extra = _published if TAKES_SERVER_ARGS else []
    return DecodeKVCacheOffloadManager(pools.r2t, pools.alloc, init_dist(), pools.tree, *extra)


def kvlife_manager(
    pools: Pools, storage_dir: Path | str, **kwargs: Any
) -> KVLifeDecodeOffloadManager:
    """kvlife's drop-in, built exactly as the scheduler builds SGLang's."""
    names = ("layout", "hicache_size_gb", "stride", "storage_backend")
    args = {k: kwargs.pop(k) for k in names if k in kwargs}
    publish_args(storage_dir, **args)
    extra = _published if TAKES_SERVER_ARGS else []
    return KVLifeDecodeOffloadManager(
        pools.r2t, pools.alloc, init_dist(), pools.tree, *extra, **kwargs
    )


def settle_backups(manager: Any, timeout_s: float = 30.0) -> None:
    """Wait until every storage backup started so far is done (either manager), so that
    host memory is freed at the same scheduler step in both runs."""
    deadline = time.monotonic() + timeout_s
    if isinstance(manager, KVLifeDecodeOffloadManager):
        for future, _, _ in list(manager._pending_backups):
            future.result(timeout=max(deadline - time.monotonic(), 0.1))
        return
    cc = manager.cache_controller
    while cc.ack_backup_queue.qsize() < len(manager.ongoing_backup):
        if time.monotonic() > deadline:
            raise TimeoutError("SGLang's backup thread did not finish")
        time.sleep(0.001)


def close(manager: Any) -> None:
    """Stop a manager's storage threads."""
    if isinstance(manager, KVLifeDecodeOffloadManager):
        manager.release_host_resources()
    else:
        manager.cache_controller._stop_storage_threads()


def storage_files(directory: Path | str) -> dict[str, bytes]:
    """Every page file in a ``HiCacheFile`` directory: name -> bytes."""
    return {p.name: p.read_bytes() for p in sorted(Path(directory).glob("*.bin"))}


@dataclass
class Workload:
    """What one run of ``run_workload`` did and saw."""

    admitted: int = 0
    aborted: int = 0
    reused_rids: int = 0
    offloads: int = 0
    manager_s: list[float] = field(default_factory=list)  # per step, in manager calls


def run_workload(
    pools: Pools, manager: Any, *, seed: int, steps: int = 120, rids: int = 6
) -> Workload:
    """A seeded decode workload driven the way SGLang's scheduler drives its manager:
    admissions (rids drawn from a few names, so they are reused), one decode per running
    request per step with ``offload_kv_cache`` / ``finalize_release_on_finish`` as the
    batch result processor calls them, aborts through ``finalize_release_on_finish``,
    and ``check_offload_progress`` every step; backups are settled between steps so that
    both managers free host memory at the same step."""
    rng = random.Random(seed)
    running: list[Any] = []
    seen: set[str] = set()
    out = Workload()
    for step in range(steps + 200):
        admitting = step < steps
        if admitting and len(running) < 5 and rng.random() < 0.5:
            names = [f"r{i}" for i in range(rids) if all(r.rid != f"r{i}" for r in running)]
            if names:
                rid = rng.choice(names)
                out.reused_rids += rid in seen
                seen.add(rid)
                tenant = rng.choice([None, None, "tenant-a"])
                running.append(
                    admit(pools, rid, rng.randint(3, 20), rng.randint(2, 24), extra_key=tenant)
                )
                out.admitted += 1
        spent = 0.0
        for req in list(running):
            if admitting and rng.random() < 0.03:
                req.finished_reason = FINISH_ABORT()
                t0 = time.perf_counter()
                manager.finalize_release_on_finish(req)
                spent += time.perf_counter() - t0
                running.remove(req)
                out.aborted += 1
                continue
            decode(pools, req, rng.randrange(50_000))
            t0 = time.perf_counter()
            if not req.finished():
                out.offloads += bool(manager.offload_kv_cache(req))
            elif not manager.offload_kv_cache(req):
                manager.finalize_release_on_finish(req)
            else:
                out.offloads += 1
            spent += time.perf_counter() - t0
            if req.finished():
                running.remove(req)
        t0 = time.perf_counter()
        manager.check_offload_progress()
        spent += time.perf_counter() - t0
        out.manager_s.append(spent)
        settle_backups(manager)
        if not admitting and not running and not len(manager.ongoing_offload):
            break
    for _ in range(3):  # the last backups' host pages
        manager.check_offload_progress()
        settle_backups(manager)
    return out


# ------------------------------------------------- a late completion after a rid reuse


def decode_to_end(pools: Pools, manager: Any, req: Any, *, first: int = 100) -> None:
    """Decode ``req`` until it finishes, calling the manager as SGLang's scheduler does."""
    token = first
    while not req.finished():
        decode(pools, req, token)
        token += 1
        if not req.finished():
            manager.offload_kv_cache(req)
        elif not manager.offload_kv_cache(req):
            manager.finalize_release_on_finish(req)


def decode_steps(pools: Pools, manager: Any, req: Any, steps: int, *, first: int = 500) -> None:
    """``steps`` decode steps of a request that does not finish in them."""
    for i in range(steps):
        decode(pools, req, first + i)
        assert not req.finished()
        manager.offload_kv_cache(req)


class JobRecorder:
    """Every copy the drop-in launches, in order (with ``defer=True``: held back until
    ``run()``)."""

    def __init__(self, manager: KVLifeDecodeOffloadManager) -> None:
        self.jobs: list[Any] = []
        launch = manager.copier.launch

        def recording(slots: Any, pages: Any, **how: Any) -> Any:
            job = launch(slots, pages, **how)
            self.jobs.append(job)
            return job

        manager.copier.launch = recording  # type: ignore[method-assign]


def late_completion_scenario_on_kvlife(
    pools: Pools,
    tmp_path: Path,
    req_class: type,
    manager: KVLifeDecodeOffloadManager | None = None,
    *,
    shut_down: bool = True,
) -> None:
    """A late completion after a rid reuse, on the drop-in: an old request finishes with
    its last chunk held back, a new request with the same rid starts a chunk (held back
    too), and only the old chunk completes. The old request must be released alone, once;
    the new one's progress and in-flight count must be untouched.

    ``manager``: one built elsewhere (by SGLang's scheduler code, backing pages up to
    ``tmp_path / "storage"``); its copies are held back from here on. Else one is built.
    ``shut_down``: end with SGLang's shutdown call (``release_host_resources``)."""
    from kvlife.fsm import State  # noqa: PLC0415

    free_at_start = pools.alloc.available_size()
    if manager is None:
        manager = kvlife_manager(pools, tmp_path / "storage", defer=True)
    else:
        manager.copier.defer = True  # CPU copies wait for run(): completions are the test's
    jobs = JobRecorder(manager).jobs
    old = admit(pools, "r", prompt=8, max_new=5, req_class=req_class)
    decode_to_end(pools, manager, old)  # its one chunk, tokens 8..12, is held back
    assert len(jobs) == 1
    old_row, old_lc = request_row(old), manager.registry.lifecycle(old)
    assert old_lc.state is State.FINISHED_PENDING
    new = admit(pools, "r", prompt=8, max_new=9, req_class=req_class)  # the rid reused
    if req_class is RidKeyedReq:
        assert new == old and hash(new) == hash(old)
    decode_steps(pools, manager, new, 5)  # its first chunk, tokens 8..12, also held back
    assert len(jobs) == 2
    new_lc = manager.registry.lifecycle(new)
    assert new_lc is not old_lc and (new_lc.state, new_lc.inflight) == (State.OFFLOADING, 1)

    jobs[0].run()  # only the old copy completes
    manager.check_offload_progress()

    assert [(r.rid, r.row) for r in pools.releases] == [("r", old_row)]  # alone, once
    assert request_row(old) is None and old_lc.state is State.RELEASED
    assert (new_lc.state, new_lc.inflight) == (State.OFFLOADING, 1)  # untouched
    assert request_row(new) is not None and list(manager.ongoing_offload.values()) == [new]
    assert manager.offload_kv_cache(new) is False  # its progress is its own: 12 launched

    jobs[1].run()
    decode_to_end(pools, manager, new, first=900)
    assert len(jobs) == 3
    jobs[2].run()
    manager.check_offload_progress()
    settle_backups(manager)
    manager.check_offload_progress()
    assert [r.row for r in pools.releases] == [old_row, pools.releases[1].row]
    assert len(storage_files(tmp_path / "storage")) == 3  # old: 1 page; new: 2 (strides)
    assert manager.host.available == manager.host.capacity
    assert pools.alloc.available_size() == free_at_start  # every slot back, once
    if shut_down:
        close(manager)


class RequestsMixedUp(AssertionError):
    """SGLang's manager applied one request's offload state to another."""


def late_completion_scenario_on_sglang(pools: Pools, tmp_path: Path, req_class: type) -> None:
    """The same story through SGLang's own manager. Its copies run at once on CPU; holding
    a copy back is holding its ack back in the controller's queue."""
    with sglang_on_cpu():
        manager = sglang_manager(pools, tmp_path / "sglang")
        acks = manager.cache_controller.ack_write_queue
        old = admit(pools, "r", prompt=8, max_new=5, req_class=req_class)
        decode_to_end(pools, manager, old)
        old_row = request_row(old)
        new = admit(pools, "r", prompt=8, max_new=9, req_class=req_class)
        decode_steps(pools, manager, new, 5)
        held = acks[1:]  # the new request's copy is held back
        del acks[1:]
        manager.check_offload_progress()
        key = new if ROW_ON_KV else new.rid  # 0.5.19+: by Req; before: by rid
        try:
            released = [(r.rid, r.row) for r in pools.releases]
            if released != [("r", old_row)] or request_row(old) is not None:
                raise RequestsMixedUp(f"the old request was not released alone: {released}")
            if request_row(new) is None:
                raise RequestsMixedUp("the new request's row was released")
            if len(held) != 1 or manager.offload_inflight.get(key) != 1:
                raise RequestsMixedUp(
                    f"the new request's first chunk is not in flight alone: {len(held)} "
                    f"copies held, in-flight count {manager.offload_inflight.get(key)}"
                )
        finally:
            acks.extend(held)
            manager.check_offload_progress()
            close(manager)


def tp_rank_main(rank: int, world: int, store: str, out: str) -> None:
    """One TP rank of the drop-in (``torch.multiprocessing``): one request's chunk, which
    rank 0 finishes first and rank 1 later. Writes, per check, the lifecycle's state and
    whether the request's row was released, to ``out/rank{rank}.json``."""
    import json  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        pools = make_pools(seed=rank)  # each rank holds its own shard of the KV
        manager = kvlife_manager(pools, Path(out) / f"storage{rank}", defer=True)
        jobs = JobRecorder(manager).jobs
        req = admit(pools, "tp", prompt=8, max_new=5)
        decode_to_end(pools, manager, req)  # one chunk in flight, the request finished
        lc = manager.registry.lifecycle(req)
        seen = []
        for check in range(3):
            if (check == 0 and rank == 0) or (check == 1 and rank == 1):
                jobs[0].run()  # this rank's copy is over
            manager.check_offload_progress()  # a collective: every rank calls it
            seen.append([check, lc.state.value, len(pools.releases)])
        Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
        close(manager)
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears down first
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown (gloo's threads; see tests/test_manager.py)


# ------------------------------------------- a scheduler process, as SGLang launches one


def scheduler_offload_branch() -> str:
    """The source of the branch of SGLang's ``Scheduler.__init__`` that builds the decode
    offload manager (from ``if (... disaggregation_decode_enable_offload_kvcache`` to
    ``self.decode_offload_manager = None``), dedented. The rest of the constructor needs
    a model runner on a GPU; this branch needs only the pools it passes."""
    import inspect  # noqa: PLC0415
    import textwrap  # noqa: PLC0415

    with warnings.catch_warnings():  # importing the scheduler warns (Triton on CPU)
        warnings.simplefilter("ignore")
        from sglang.srt.managers.scheduler import Scheduler  # noqa: PLC0415

    lines = inspect.getsource(Scheduler.__init__).splitlines()
    test = next(
        i for i, line in enumerate(lines) if "disaggregation_decode_enable_offload_kvcache" in line
    )
    start = max(i for i in range(test) if lines[i].strip() == "if (")
    end = next(
        i for i in range(test, len(lines)) if "self.decode_offload_manager = None" in lines[i]
    )
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def build_as_the_scheduler_does(pools: Pools) -> Any:
    """Run SGLang's own scheduler code that builds the decode offload manager (the branch
    above, in the scheduler module's namespace: the class it names is whatever that
    module's ``DecodeKVCacheOffloadManager`` is now) with real pools, the TP CPU group and
    the published server args; return what it built."""
    from types import SimpleNamespace  # noqa: PLC0415

    from sglang.srt.managers import scheduler as scheduler_module  # noqa: PLC0415

    scheduler = SimpleNamespace(
        req_to_token_pool=pools.r2t,
        token_to_kv_pool_allocator=pools.alloc,
        dp_tp_cpu_group=init_dist(),
        tree_cache=pools.tree,
    )
    exec(scheduler_offload_branch(), vars(scheduler_module), {"self": scheduler})
    return scheduler.decode_offload_manager


def scheduler_process_main(out: str, mode: str) -> None:
    """A process started the way SGLang starts a scheduler (``multiprocessing`` spawn):
    SGLang's ``load_plugins()`` first, as ``run_scheduler_process`` calls it, then the
    server args published, then SGLang's construction of the decode offload manager.

    ``mode``: ``"scenario"`` runs the late-completion scenario through what was built and
    shuts it down as SGLang's graceful exit does; ``"killed"`` runs it without the
    shutdown, writes ``out/ready`` and waits to be killed; ``"version"`` first makes the
    installed SGLang say it is 0.5.99. Writes ``out/result.json`` (the class built, its
    audit log) and SGLang's and kvlife's log lines to ``out/process.log``."""
    import json  # noqa: PLC0415
    import logging  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, filename=Path(out, "process.log"), force=True)
    if mode == "version":
        import sglang.version  # noqa: PLC0415

        sglang.version.__version__ = "0.5.99"
    from sglang.srt.plugins import load_plugins  # noqa: PLC0415

    load_plugins()
    storage = Path(out, "storage")
    publish_args(storage)
    pools = make_pools()
    kvlife = False
    with sglang_on_cpu():  # (SGLang's own manager needs it on CPU; kvlife's does not)
        manager = build_as_the_scheduler_does(pools)
        kind = type(manager)
        kvlife = isinstance(manager, KVLifeDecodeOffloadManager)
        result = {
            "class": f"{kind.__module__}.{kind.__qualname__}",
            "kvlife": kvlife,
            "audit_log": str(getattr(manager, "audit_log", "")),
        }
        Path(out, "result.json").write_text(json.dumps(result))
        if kvlife and mode != "version":
            late_completion_scenario_on_kvlife(pools, Path(out), Req, manager, shut_down=False)
            result["scenario"] = "passed"
            Path(out, "result.json").write_text(json.dumps(result))
        if mode == "killed":
            Path(out, "ready").touch()
            time.sleep(600)
        close(manager)
    logging.shutdown()

"""vLLM's real scheduler on the CPU platform, with a model config and no weights.

``make_scheduler`` builds vLLM 0.33.0's ``Scheduler`` with a KV connector from its config
(as ``--kv-transfer-config`` would), over a KV cache of ``blocks`` blocks of one layer
group. ``step`` runs one scheduler step the way the engine core does, standing in for the
model runner: every scheduled request samples one token, and the worker side reports the
transfer jobs named in ``completed`` as done.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # else configs fail validation on CPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import OPTConfig
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
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
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
#: The token every scheduled request samples.
TOKEN = 7

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


def _model_dir() -> str:
    """facebook/opt-125m's config (transformers' OPTConfig defaults), no weights."""
    path = tempfile.mkdtemp(prefix="kvlife-opt-")
    OPTConfig().save_pretrained(path)
    return path


def make_scheduler(
    connector: str,
    module: str | None = None,
    extra: dict[str, Any] | None = None,
    *,
    blocks: int = 128,
) -> Scheduler:
    model_config = ModelConfig(
        model=_model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=1024
    )
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=extra or {},
        ),
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=12, head_size=64, dtype=torch.float16)
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * blocks, layers=["layer"], layer_stride=page * blocks, block_stride=page
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )


def make_request(rid: str, *, prompt: int = 40, max_tokens: int = 8, first: int = 1000) -> Request:
    """A request of ``prompt`` distinct tokens that finishes after ``max_tokens``."""
    return Request(
        rid,
        list(range(first, first + prompt)),
        SamplingParams(max_tokens=max_tokens),
        None,
        block_hasher=_HASHER,
    )


def step(scheduler: Scheduler, completed: Iterable[int] = ()) -> Any:
    """One engine step; returns the scheduler output (with the connector's metadata)."""
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    jobs = dict.fromkeys(completed, 1)
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[TOKEN] for _ in req_ids],
        kv_connector_output=KVConnectorOutput(
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=jobs) if jobs else None
        ),
    )
    scheduler.update_from_output(out, output)
    return out

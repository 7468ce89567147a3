"""A tiny random-weight Llama that a whole vLLM engine loads on the CPU (no hub, no
network), with a word-level tokenizer (token ``i`` is the word ``w{i}``) that an OpenAI
server needs to start; the tests send token ids and read token ids back. Weights are
float32: greedy tokens then do not depend on how requests were batched (in bf16 on the
CPU they can).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

VOCAB = 1024
BLOCK = 32  # vLLM's CPU attention takes multiples of 32


def make_model(directory: Path, *, kv_heads: int = 1, hybrid: bool = False) -> Path:
    """Write the model and its tokenizer into ``directory``; returns it. ``kv_heads``: 2
    for a model that tensor parallelism of 2 splits. ``hybrid``: a Gemma2-style model
    instead (4 layers alternating sliding-window and full attention, window 256): vLLM
    gives it two KV cache groups."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import (  # noqa: PLC0415
        Gemma2Config,
        Gemma2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(0)
    common: dict[str, Any] = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": kv_heads,
        "vocab_size": VOCAB,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if hybrid:
        gemma = Gemma2Config(
            num_hidden_layers=4,
            head_dim=64,
            max_position_embeddings=16384,
            sliding_window=256,
            pad_token_id=2,
            **common,
        )
        Gemma2ForCausalLM(gemma).to(torch.float32).save_pretrained(directory)
    else:
        llama = LlamaConfig(num_hidden_layers=2, max_position_embeddings=2048, **common)
        LlamaForCausalLM(llama).to(torch.float32).save_pretrained(directory)
    words = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="w2", bos_token="w0", eos_token="w1"
    )
    fast.save_pretrained(directory)
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["add_bos_token"] = False
    config_path.write_text(json.dumps(tokenizer_config))
    return directory


def prompts(count: int, length: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids (3 and up: no special token), each
    starting with ``prefix`` when given."""
    rng = random.Random(seed)
    head = list(prefix or [])
    rest = length - len(head)
    return [head + [rng.randrange(3, VOCAB) for _ in range(rest)] for _ in range(count)]


def make_llm(model: Path, *, max_model_len: int = 1024, **kwargs: Any) -> Any:
    """``vllm.LLM`` over the model: float32, greedy-friendly, eager (no compile), blocks
    of ``BLOCK`` tokens, token ids in and out."""
    from vllm import LLM  # noqa: PLC0415

    return LLM(
        model=str(model),
        dtype="float32",
        max_model_len=max_model_len,
        block_size=BLOCK,
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        **kwargs,
    )

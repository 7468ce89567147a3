"""``kvlife.offload.watch.sglang.cpu``: SGLang 0.5.23's hierarchical cache built on the
CPU, both tree cores. Runs in ``.venv-sglang``."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs SGLang 0.5.23 (make sglang-venv)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from tests.engines import hicache_harness as H  # noqa: F401  (the torchvision stand-in)

from sglang.srt.mem_cache.pool_host import mha

from kvlife.offload.watch.sglang import cpu

TOKENS = list(range(100, 116))


@pytest.mark.parametrize("core", cpu.CORES)
@pytest.mark.parametrize("policy", cpu.POLICIES)
def test_a_prompt_written_to_host_evicted_and_loaded_back_comes_back_whole(
    core: str, policy: str
) -> None:
    hc = cpu.build(core, policy)
    assert type(hc.cache.tree_core).__name__.startswith("Rust") == (core == "rust")
    hc.insert(TOKENS)
    hc.poll()
    assert hc.evict(len(TOKENS)) == len(TOKENS)
    hc.poll()
    m = hc.match(TOKENS)
    assert m.device_prefix_len == 0 and m.host_hit_length == len(TOKENS)
    assert hc.load_back(TOKENS)
    hc.poll()
    assert hc.device_tokens(TOKENS) == TOKENS
    host = hc.host_pool()
    assert host.available_size() < host.size  # the host copy is kept
    hc.cache.release_host_resources()


def test_a_core_or_policy_it_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="core of"):
        cpu.build("cpp")
    with pytest.raises(ValueError, match="policy of"):
        cpu.build("python", "write_around")


def test_a_kernel_sglang_imported_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def kernel(*_: object) -> None: ...

    monkeypatch.setattr(mha, "transfer_kv_direct", kernel, raising=False)
    cpu.use_cpu_standins()
    assert mha.transfer_kv_direct is kernel


def test_the_storage_directory_given_is_used_whatever_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's HiCacheFile takes ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` before its
    config (another cache of the process may have set it): a cache built here writes to
    its own directory all the same."""
    other = tmp_path / "somebody-elses"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(other))
    mine = tmp_path / "l3"
    hc = cpu.build("rust", storage_dir=str(mine))
    hc.insert(TOKENS)
    for _ in range(200):
        hc.poll()
        if any(mine.iterdir()) and not hc.cache.ongoing_backup:
            break
        time.sleep(0.01)
    hc.cache.release_host_resources()
    assert any(p.suffix == ".bin" for p in mine.iterdir())
    assert not other.exists() or not any(other.iterdir())

"""The offload benchmark runs end to end on CPU, every way's bytes compared (figures are
printed, not asserted); its CUDA parts run on a GPU (tests/gpu/check.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvlife.offload import bench_copies
from kvlife.offload.bench import (
    CPU_LAYERS,
    CPU_TOKENS,
    commit,
    main,
    measure_delivery,
    measure_poll,
    peak_bytes,
)
from kvlife.offload.bench_blocks import measure_outermost
from kvlife.offload.bench_copies import measure_layouts, measure_ways
from kvlife.offload.block_copy import BlockRuns
from kvlife.offload.peer_copies import CopyList

CPU = torch.device("cpu")
SMALL = ("--device", "cpu", "--reps", "1", "--layers", "1", "--layout-blocks", "2")
"""A whole run of the benchmark in seconds."""


def test_every_way_stores_and_loads_the_right_bytes_on_cpu() -> None:
    rows = measure_ways(64, CPU, reps=1, layers=2)
    assert {(r.direction, r.way) for r in rows} == {
        (d, w) for d in ("store", "load") for w in ("kvlife", "per-block", "contiguous")
    }
    for row in rows:
        assert row.error is None and row.gbs > 0 and row.bytes == 64 * 2 * 2 * 8 * 128 * 2
        assert row.equal is (None if row.way == "contiguous" else True), row
    [store] = [r for r in rows if r.way == "kvlife" and r.direction == "store"]
    assert store.first_ms is not None and store.steady_ms is not None
    assert store.launches == 2 * 2 + 1  # one chunk: an index_select per component, one copy


def test_a_way_that_copies_the_wrong_bytes_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench_copies.copy_per_block

    def drops_the_last_block(copies: CopyList, stream: torch.cuda.Stream | None) -> None:
        real(CopyList(*(t[:-1] for t in copies)), stream)

    monkeypatch.setattr(bench_copies, "copy_per_block", drops_the_last_block)
    rows = measure_ways(64, CPU, reps=1, layers=2)
    assert {r.direction for r in rows if r.equal is False} == {"store", "load"}
    assert all(r.equal is False for r in rows if r.way == "per-block")
    assert all(r.equal is True for r in rows if r.way == "kvlife")


def test_vllm_layouts_go_through_the_worker_byte_for_byte_both_ways() -> None:
    rows = measure_layouts(4, CPU, layers=2, reps=1)
    assert {r.layout for r in rows} == {"FlashAttention NHD", "FlashInfer HND", "MLA"}
    for row in rows:
        assert row.error is None and row.gbs > 0, row
        assert row.equal is (None if row.way == "contiguous" else True), row


def test_a_block_outermost_cache_is_copied_by_every_way_byte_for_byte_on_cpu() -> None:
    rows = measure_outermost(64, CPU, reps=1, layers=2)
    assert {(r.direction, r.way) for r in rows} == {
        (d, w) for d in ("store", "load") for w in ("kvlife", "runs", "per-block", "contiguous")
    }
    for row in rows:
        assert row.error is None and row.gbs > 0 and row.bytes == 64 * 2 * 8 * 256 * 2, row
        assert row.layout == "BLNHC (2 layers)"
        assert row.equal is (None if row.way == "contiguous" else True), row
    launches = {(r.direction, r.way): r.launches for r in rows}
    assert launches["store", "kvlife"] == 1  # its one run of host pages: one call
    assert launches["store", "per-block"] == 4 * 2  # a block and a layer each


def test_a_direct_copy_that_drops_a_block_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    real = BlockRuns.copy_cpu

    def drops_the_last_block(
        self: BlockRuns, blocks: torch.Tensor, pages: tuple[int, ...], *, to_host: bool
    ) -> int:
        return real(self, blocks[:-1], pages[:-1], to_host=to_host)

    monkeypatch.setattr(BlockRuns, "copy_cpu", drops_the_last_block)
    rows = measure_outermost(64, CPU, reps=1, layers=2)
    assert {(r.direction, r.way) for r in rows if r.equal is False} == {
        (d, w) for d in ("store", "load") for w in ("kvlife", "runs")
    }


def test_poll_measurement_sees_nothing_done() -> None:
    assert measure_poll(CPU, inflight=500, polls=5) >= 0


def test_main_prints_every_part_and_what_held(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_file = tmp_path / "bench" / "offload.json"
    argv = [*SMALL, "--tokens", "32", "1k", "--json", str(out_file)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "per-block" in out and "contiguous" in out and "none done" in out
    assert "100,000 done in one poll" in out and "first store after the engine was built" in out
    assert "FlashInfer HND" in out and "== what held" in out and "DIFFER" not in out
    assert "measuring 1024 tokens x 2 rounds ..." in captured.err
    data = json.loads(out_file.read_text())
    assert set(data["parts"]) == {"ways", "outermost", "layouts", "poll"}
    assert "a block-outermost cache (vLLM's BLNHC)" in out
    assert data["environment"]["device"] == "CPU" and data["environment"]["commit"] == commit()
    assert {v["what"] for v in data["verdicts"]} >= {
        "kvlife store 1024 tokens",
        "MLA load",
        "kvlife BLNHC load 1024 tokens",
    }


def test_bytes_that_differ_fail_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench_copies.copy_per_block
    monkeypatch.setattr(
        bench_copies,
        "copy_per_block",
        lambda copies, stream: real(CopyList(*(t[:-1] for t in copies)), stream),
    )
    argv = [*SMALL, "--tokens", "32"]
    assert main(argv) == 1


def test_the_commit_can_be_named_where_the_tree_has_no_git(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVLIFE_COMMIT", "0123abc")
    assert commit() == "0123abc"


def test_the_default_cpu_settings_fit_2_gb() -> None:
    assert max(peak_bytes(n, CPU_LAYERS) for n in CPU_TOKENS) <= 1.25 * 2**30
    assert 1024 in CPU_TOKENS and 4096 in CPU_TOKENS  # the sizes the targets name


def test_delivery_measures_both_cases() -> None:
    single, backlog = measure_delivery(backlog=2000, rounds=1)
    assert single > 0 and backlog > 0


@pytest.mark.parametrize("argv", [["--tokens", "10"], ["--reps", "0"], ["--layout-blocks", "0"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--device", "cpu", *argv])
    assert info.value.code == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_benchmark_finishes_with_every_part(tmp_path: Path) -> None:
    out_file = tmp_path / "offload.json"
    argv = [
        "--tokens",
        "1k",
        "--reps",
        "1",
        "--layers",
        "4",
        "--layout-blocks",
        "16",
        "--json",
        str(out_file),
    ]
    assert main(argv) == 0
    data = json.loads(out_file.read_text())
    assert set(data["parts"]) == {
        "ways",
        "outermost",
        "concurrent",
        "concurrent_outermost",
        "compute",
        "layouts",
        "poll",
        "completion",
    }
    assert {row["way"] for row in data["parts"]["compute"]} >= {"kvlife BLNHC", "batch BLNHC"}
    assert data["environment"]["driver"] and data["environment"]["link"]
    modes = {row["mode"]: row for row in data["parts"]["completion"]}
    assert modes["poll"]["delivered"] == modes["callback"]["delivered"] == 200

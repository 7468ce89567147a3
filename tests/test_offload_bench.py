"""The offload benchmark runs end to end on CPU (figures are printed, not asserted)."""

from __future__ import annotations

import pytest
import torch

from kvlife.offload.bench import (
    CPU_LAYERS,
    CPU_TOKENS,
    main,
    measure_delivery,
    measure_poll,
    measure_throughput,
    peak_bytes,
)


def test_throughput_row_on_cpu() -> None:
    row = measure_throughput(64, torch.device("cpu"), reps=1, layers=2)
    assert row.tokens == 64 and row.bytes == 64 * 2 * 2 * 8 * 128 * 2
    assert row.manager_gbs > 0 and row.baseline_gbs > 0


def test_poll_measurement_sees_nothing_done() -> None:
    assert measure_poll(torch.device("cpu"), inflight=500, polls=5) >= 0


def test_main_prints_the_table_and_its_progress(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "--tokens", "32", "1k", "--reps", "1", "--layers", "1"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "contiguous copy_" in out and "none done" in out and "100,000 done in one poll" in out
    assert "   1024 " in out and "allocates about" in out
    assert "measuring 32 tokens x 2 rounds ..." in captured.err
    assert "measuring 1024 tokens x 2 rounds ..." in captured.err


def test_the_default_cpu_settings_fit_2_gb() -> None:
    # tensors at most 1.25 GiB, leaving room for torch and Python under 2 GB (1.48 GB RSS
    # measured with /usr/bin/time on the defaults)
    assert max(peak_bytes(n, CPU_LAYERS) for n in CPU_TOKENS) <= 1.25 * 2**30
    assert 1024 in CPU_TOKENS and 4096 in CPU_TOKENS  # the sizes the targets name


def test_delivery_measures_both_cases() -> None:
    single, backlog = measure_delivery(backlog=2000, rounds=1)
    assert single > 0 and backlog > 0


@pytest.mark.parametrize("argv", [["--tokens", "10"], ["--reps", "0"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--device", "cpu", *argv])
    assert info.value.code == 2

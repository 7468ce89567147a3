"""``kvlife.offload.engines.exercise_cli``: the options and progress line both exercises
share (``kvlife vllm exercise``, ``kvlife sglang exercise``)."""

from __future__ import annotations

import argparse

import pytest

from kvlife.offload.engines.exercise_cli import (
    add_run_options,
    listed,
    progress_line,
    run_counts_error,
)


def test_the_run_options_default_to_every_family_and_twenty_seeds() -> None:
    parser = argparse.ArgumentParser()
    add_run_options(parser, ["basic", "hold"])
    args = parser.parse_args([])
    assert (args.families, args.seeds, args.seed, args.steps) == ("basic,hold", 20, 0, 120)
    assert args.out == "kvlife-exercise" and args.json is False
    assert listed(args.families) == ["basic", "hold"] and listed(" a, ,b ") == ["a", "b"]
    assert run_counts_error(args, "x") is None
    args = parser.parse_args(["--seeds", "0"])
    assert run_counts_error(args, "kvlife x") == "kvlife x: --seeds and --steps must be at least 1"


def test_progress_redraws_only_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    into_a_file = progress_line(redraw=False)
    for done in (1, 2, 3):
        into_a_file("basic", done, 3)
    assert capsys.readouterr().err == "basic: 3 runs\n"  # one line, no \r
    on_a_terminal = progress_line(redraw=True)
    for done in (1, 2):
        on_a_terminal("hold", done, 2)
    assert capsys.readouterr().err == "\rhold: 1/2 runs\rhold: 2/2 runs\n"

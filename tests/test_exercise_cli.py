"""``kvlife.offload.watch.exercise_cli``: the options and progress line both exercises
share (``kvlife vllm exercise``, ``kvlife sglang exercise``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvlife.offload.watch.exercise_cli import (
    add_run_options,
    listed,
    print_reports,
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


@dataclass
class _Report:
    family: str
    failed: int

    def lines(self) -> list[str]:
        return [f"{self.family}: {self.failed} failed"]


@dataclass
class _Run:
    seed: int
    failed: bool


def test_reports_print_as_text_or_json_and_the_status_says_whether_a_run_failed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    clean = print_reports([_Report("basic", 0)], [_Run(0, False)], "title", as_json=False)
    assert clean == 0 and capsys.readouterr().out == "title\nbasic: 0 failed\n"
    failed = print_reports(
        [_Report("hold", 1)], [_Run(0, False), _Run(1, True)], "t", as_json=False, out=tmp_path
    )
    assert failed == 1 and f"the failing runs' logs are in {tmp_path}" in capsys.readouterr().out
    as_json = print_reports(
        [_Report("hold", 1)], [_Run(1, True)], "t", as_json=True, head={"connector": "X"}
    )
    body = json.loads(capsys.readouterr().out)
    assert as_json == 1 and body == {
        "connector": "X",
        "families": [{"family": "hold", "failed": 1}],
        "runs": [{"seed": 1, "failed": True}],
    }

"""The argument types and the benchmarks' parser refuse bad input in one line."""

from __future__ import annotations

import argparse

import pytest

from kvlife.fsm.cli_args import BenchParser, int_in, positive_ints


def test_int_in_takes_the_range_and_names_what_it_expected() -> None:
    seed = int_in(0, 9, "a digit")
    assert seed("0") == 0 and seed("9") == 9
    for bad, shown in (("10", "got 10"), ("-1", "got -1"), ("x", "got 'x'")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected a digit, {shown}"):
            seed(bad)
    assert int_in(1, None, "a positive integer")("123456789012") == 123456789012


def test_positive_ints() -> None:
    assert positive_ints("1000,4000") == [1000, 4000] and positive_ints("7") == [7]
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers"):
        positive_ints("1000,x")
    with pytest.raises(argparse.ArgumentTypeError, match="positive integers, got '5,0'"):
        positive_ints("5,0")


def test_bench_parser_says_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = BenchParser(prog="kvlife bench x")
    parser.add_argument("--rounds", type=int_in(1, None, "a positive integer"))
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--rounds", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("kvlife bench x: argument --rounds: expected a positive integer")
    assert err.endswith("(see kvlife bench x --help)\n")

"""Argument parsing shared by the ``kvlife`` command and the benchmarks it runs
(``kvlife bench fsm|offload|audit``, each also runnable with ``python -m``): the parser
the benchmarks use and the argparse ``type`` functions. Plain ``argparse``, in the core
so that every package may use it (``kvlife.fsm`` and ``kvlife.offload`` import nothing
from ``kvlife.diagrams``). Not API."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn


class BenchParser(argparse.ArgumentParser):
    """The benchmarks' argument parser: a bad argument is one line on stderr (``prog:
    message``, with a pointer to ``--help``) and exit status 2, not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def int_in(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[low, high]`` (no upper bound when ``None``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive integers (``"1000,4000"``)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


__all__ = ["BenchParser", "int_in", "positive_ints"]

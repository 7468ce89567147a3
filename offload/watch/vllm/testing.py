"""``kvlife vllm exercise`` in a connector's own pytest suite: the same families as
parametrized tests, the family and the seed in each test's id.

In the connector's tests (an environment with vLLM and kvlife)::

    import pytest
    from kvlife.offload.watch.vllm.testing import check_connector, exercise_cases

    CONFIG = {"kv_connector": "MyConnector", "kv_connector_module_path": "my.module",
              "kv_role": "kv_both", "kv_connector_extra_config": {}}

    @pytest.mark.parametrize(("family", "seed"), exercise_cases(seeds=range(10)))
    def test_lifecycle(family: str, seed: int, tmp_path) -> None:
        check_connector(CONFIG, family, seed, directory=tmp_path)

A failing case is named ``test_lifecycle[reuse-seed3]``; each case runs under every runner
(model runner V1's scheduler output, as on the CPU; V2's; V2's from vLLM's
``AsyncScheduler`` a step ahead, as on every CUDA deployment by default), and its failure
says under which (and under which others it was clean), what
broke (the exception and where, the requests never drained, the blocks never returned,
each verdict with the ``kvlife audit why`` command that tells it) and the command that runs
the same case again from the shell.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvlife.offload.watch.vllm.exercise import FAMILIES, RUNNERS, RunResult, run_one


class ConnectorFailure(AssertionError):
    """A case of the exercise failed; the message says how. The run's audit log stays in
    the directory the case was given."""


def exercise_cases(
    families: Sequence[str] | None = None, seeds: Iterable[int] = range(10)
) -> list[Any]:
    """``pytest.param(family, seed, id="FAMILY-seedSEED")`` for every family (default:
    all of them) and seed, for ``pytest.mark.parametrize(("family", "seed"), ...)``.

    Raises:
        ValueError: a family that does not exist.
    """
    import pytest  # noqa: PLC0415

    chosen = list(families) if families is not None else list(FAMILIES)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {unknown}: choose from {sorted(FAMILIES)}")
    return [pytest.param(f, s, id=f"{f}-seed{s}") for f in chosen for s in seeds]


def check_connector(
    config: dict[str, Any],
    family: str,
    seed: int,
    *,
    steps: int = 120,
    directory: Path,
    runners: Sequence[str] = tuple(RUNNERS),
) -> list[RunResult]:
    """Run one case under each of ``runners`` (default: every one of ``RUNNERS``: model
    runner V1's scheduler output, V2's, V2's from vLLM's ``AsyncScheduler``); the runs when
    clean.

    Raises:
        ConnectorFailure: a run raised, left requests or blocks behind, or its audit log
            has verdicts (the message names the runner, and those it was clean under).
        kvlife.offload.watch.vllm.exercise.ExerciseConfigError: the connector does not
            build.
    """
    runs = [run_one(config, FAMILIES[family], seed, steps, Path(directory), r) for r in runners]
    failed = [run for run in runs if run.failed]
    if failed:
        clean = [run.runner.upper() for run in runs if not run.failed]
        run = failed[0]
        only = f" (clean under {', '.join(clean)})" if clean else ""
        again = (
            f"kvlife vllm exercise '{json.dumps(config)}' --families {family} "
            f"--seed {seed} --seeds 1 --steps {steps} --runners {run.runner}"
        )
        raise ConnectorFailure(
            f"{family} seed {seed}, runner {run.runner.upper()}{only}: {run.describe()}\n"
            f"again: {again}"
        )
    return runs


__all__ = ["ConnectorFailure", "check_connector", "exercise_cases"]

"""The GPU check (tests/gpu/check.sh) runs as it would on a bare GPU machine: the project
carried as wheels into a folder of its own, no editable install, everything it writes in
the folder named on its command line, one table of what held at the end. Here it runs on
the CPU (the CUDA tests skip); its summary reads a failed test and a missing part as not
held."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.summary import main as summary

ROOT = Path(__file__).resolve().parent.parent


def test_the_check_runs_from_wheels_and_writes_everything_to_its_folder(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = subprocess.run(
        [*pip, "wheel", "--quiet", "--no-deps", str(ROOT), "-w", str(wheels)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    fetched = subprocess.run(
        [
            *pip,
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "msgspec",
            "transitions",
            "graphviz",
            "-d",
            str(wheels),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    (wheels / "COMMIT").write_text("c0ffee\n")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVLIFE_COMMIT")}
    env |= {
        "PY": sys.executable,
        "KVLIFE_WHEELS": str(wheels),
        "KVLIFE_CHECK_CPU": "1",
        "KVLIFE_BENCH_ARGS": "--device cpu --tokens 32 --reps 1 --layers 1 --layout-blocks 2",
    }
    ran = subprocess.run(
        ["bash", str(ROOT / "tests/gpu/check.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        cwd=tmp_path,
    )
    assert ran.returncode in (0, 1), ran.stdout[-3000:] + ran.stderr[-3000:]
    names = {p.name for p in out.iterdir()}
    assert {
        "site",
        "cuda-tests.xml",
        "cuda-tests.log",
        "bench.json",
        "bench.log",
        "summary.txt",
        "environment.txt",
    } <= names, names
    assert "kvlife" in os.listdir(out / "site")  # installed from the wheel, not the tree
    assert str(out / "site") in (out / "environment.txt").read_text()
    bench = json.loads((out / "bench.json").read_text())
    assert bench["environment"]["commit"] == "c0ffee"
    summary_text = (out / "summary.txt").read_text()
    assert "checks," in summary_text and "test_cuda_no_call_waits_on_the_device" in summary_text
    assert ran.stdout.rstrip().endswith(summary_text.rstrip().splitlines()[-1])


EVERY_PART = ("ways", "outermost", "concurrent_outermost", "poll", "completion")


def _write_bench(folder: Path, *, parts: list[str], held: bool | None) -> None:
    data = {
        "environment": {"device": "NVIDIA H200"},
        "parts": {part: [] for part in parts},
        "verdicts": [
            {
                "what": "kvlife store 4096 tokens",
                "figure": "96.0% of contiguous",
                "target": ">= 95%",
                "held": held,
            }
        ],
    }
    (folder / "bench.json").write_text(json.dumps(data))


def _write_tests(folder: Path, failure: bool) -> None:
    failed = '<failure message="assert 31 == 0&#10;more"/>' if failure else ""
    (folder / "cuda-tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_completion" '
        f'name="test_cuda_host_callbacks" time="1.5">{failed}</testcase></testsuite></testsuites>'
    )


def test_the_summary_holds_when_every_test_passed_and_every_target_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_tests(tmp_path, failure=False)
    _write_bench(tmp_path, parts=[*EVERY_PART], held=True)
    assert summary(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "test_completion::test_cuda_host_callbacks  held" in out and "0 not held" in out


@pytest.mark.parametrize(
    ("failure", "parts", "held"),
    [
        (True, [*EVERY_PART], True),  # a CUDA test failed
        (False, [*EVERY_PART], False),  # a target missed
        (False, ["ways"], True),  # the benchmark died part way
        (False, ["ways", "poll", "completion"], True),  # before the block-outermost part
    ],
)
def test_the_summary_tells_what_did_not_hold(
    tmp_path: Path, failure: bool, parts: list[str], held: bool
) -> None:
    _write_tests(tmp_path, failure=failure)
    _write_bench(tmp_path, parts=parts, held=held)
    assert summary(str(tmp_path)) == 1


def test_a_missing_report_is_not_held(tmp_path: Path) -> None:
    assert summary(str(tmp_path)) == 1


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_check_refuses_a_machine_without_cuda_unless_told(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVLIFE_CHECK_CPU"} | {"PY": sys.executable}
    ran = subprocess.run(
        ["bash", str(ROOT / "tests/gpu/check.sh"), str(tmp_path / "o")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if "no CUDA device" not in ran.stdout:
        pytest.skip("this machine has CUDA")
    assert ran.returncode == 1

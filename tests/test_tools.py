"""tests/tools.py: a program the tests need skips them where it is missing, and fails the
run where `make test` was to install it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE = """
from tests.tools import needs

pytestmark = needs(False, "a-missing-program", "make nothing")


def test_it() -> None:
    pass
"""


@pytest.mark.parametrize(("required", "code", "said"), [("1", 2, "make test` was to install"),
                                                        ("", 0, "1 skipped")])  # fmt: skip
def test_a_missing_program_skips_unless_make_test_was_to_install_it(
    tmp_path: Path, required: str, code: int, said: str
) -> None:
    test = tmp_path / "test_needs.py"
    test.write_text(MODULE)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "-c",
            "/dev/null",
            str(test),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "KVLIFE_REQUIRE_TOOLS": required},
        timeout=120,
    )
    assert done.returncode == code, done.stdout + done.stderr
    assert said in done.stdout

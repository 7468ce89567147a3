"""The README's usage example runs, so it cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert blocks, "the README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    assert "stale_instance 0 a" in capsys.readouterr().out


def test_readme_shows_the_two_commands_and_the_diagram() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
    assert "diagrams/lifecycle.svg" in text

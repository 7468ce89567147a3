"""The README's usage example runs, so it cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlife.diagrams.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_readme_python_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert blocks, "the README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    assert "stale_instance 0 a" in capsys.readouterr().out


def test_readme_shows_the_two_commands_and_the_diagram() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
    assert (ROOT / "diagrams" / "lifecycle.svg").is_file() and "diagrams/lifecycle.svg" in text
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test"):  # the two commands exist, and CI runs the second
        assert re.search(rf"^{target}:", makefile, re.M), target
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)


def test_readme_lists_every_audit_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    commands = re.findall(r"^    (\w+)  ", capsys.readouterr().out, re.M)
    assert {"check", "stats", "why", "report", "timeline"} <= set(commands)
    text = README.read_text(encoding="utf-8")
    missing = [c for c in commands if f"kvlife audit {c} " not in text]
    assert not missing, f"the README's command list lacks kvlife audit {missing}"
    assert "python -m kvlife.fsm.demo" in text

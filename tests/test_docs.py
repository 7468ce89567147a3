"""The manual and the README: every code block runs as written, cross-references are
links, the site publishes no build files, and nothing points outside the repository."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Fenced blocks that are run: Python in one namespace per page, shell through bash.
RUN = {"python", "sh"}
#: Fenced blocks that are data, not programs.
DATA = {"mermaid", "text", "json"}
_FENCE = re.compile(
    r"(?:<!-- docs-test: skip, (?P<skip>[^\n]*?) -->\n)?^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```",
    re.S | re.M,
)
_ROLE = re.compile(r":(class|meth|mod|func|attr|data|exc|obj):`")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str
    skip: str | None


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [
        Block(page, text.count("\n", 0, m.start("lang")) + 1, m["lang"], m["body"], m["skip"])
        for m in _FENCE.finditer(text)
    ]


def _id(block: Block) -> str:
    return f"{block.page.name}:{block.line}"


SKIPPED = [b for page in PAGES for b in blocks(page) if b.skip]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_code_blocks_run_as_written(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks(page):
        where = _id(block)
        assert block.lang in RUN | DATA, (
            f"{where}: a ```{block.lang} block neither runs nor is data"
        )
        if block.skip or block.lang in DATA:
            continue
        if block.lang == "python":
            exec(compile(block.body, where, "exec"), namespace)
            continue
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.body],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{proc.stderr[-2000:]}"


def test_every_block_that_does_not_run_says_why() -> None:
    unexplained = [_id(b) for b in SKIPPED if len((b.skip or "").strip()) <= 10]
    assert SKIPPED and not unexplained, f"say why these do not run: {unexplained}"


def test_the_quickstart_prints_what_it_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (program,) = [b for b in blocks(ROOT / "docs" / "quickstart.md") if "ToyEngine" in b.body]
    monkeypatch.chdir(tmp_path)
    expected = program.body.rstrip().splitlines()[-1].split("# ", 1)[1]
    exec(compile(program.body, _id(program), "exec"), {"__name__": "__docs__"})
    assert capsys.readouterr().out.strip() == expected
    assert (tmp_path / "audit.jsonl").stat().st_size > 0


def test_docstrings_use_links_not_sphinx_roles() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("fsm", "offload", "diagrams")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _ROLE.search(line)
    ]
    assert not found, f"Sphinx roles render as literal text in the manual: {found}"


_TEXT_SUFFIXES = {".py", ".md", ".yml", ".toml", ".sh", ".txt", ""}
_UPWARD = re.compile(r"(?:\.\./)+[\w.-]+")
_CITATION = re.compile(r"(\S*\s*)§(\d+)(?:\.(\d+))?")


def _project_texts() -> list[Path]:
    names = [ROOT / n for n in ("README.md", "Makefile", "pyproject.toml", "mkdocs.yml")]
    for folder in ("fsm", "offload", "diagrams", "tests", "docs", ".ci"):
        names += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in _TEXT_SUFFIXES]
    return [p for p in names if p.is_file() and "__pycache__" not in p.parts]


def test_nothing_points_outside_the_repository() -> None:
    """A relative path that climbs out of the repository (from the file's folder or from
    the root) names something a user of kvlife does not have."""
    found = []
    for path in _project_texts():
        for match in _UPWARD.finditer(path.read_text(encoding="utf-8", errors="replace")):
            # a script climbs from its own folder; prose may mean either
            for base in (path.parent,) if path.suffix == ".sh" else (path.parent, ROOT):
                target = (base / match.group(0)).resolve()
                if not target.is_relative_to(ROOT):
                    found.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
                    break
    assert not found, found


def test_section_citations_name_sections_of_the_design_page() -> None:
    """Every "§N" in the project is "design §N" (or "§7.k", an invariant) and that section
    exists on docs/design.md, the contract users can read."""
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", design, re.M)}
    invariants = len(re.findall(r"^\d+\. ", design.split("## 7. Invariants")[1], re.M))
    found = []
    for path in _project_texts():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in _CITATION.finditer(text):
            before, section, item = match.group(1), int(match.group(2)), match.group(3)
            known = section in sections and (item is None or section == 7)
            known = known and (item is None or 1 <= int(item) <= invariants)
            cited = before.strip().endswith(("design", ",", "and")) or before.strip() == ""
            if path in (Path(__file__), ROOT / "docs" / "design.md") or (known and cited):
                continue
            found.append(f"{path.relative_to(ROOT)}: {match.group(0)!r}")
    assert not found, found


def test_the_design_page_states_the_contract() -> None:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    for heading in (
        "## 2. States and transitions",
        "## 3. The registry",
        "## 4. Tickets and refusals",
        "## 5. Completions",
        "## 6. The audit log",
        "## 7. Invariants",
    ):
        assert heading in text
    assert "docs/design.md" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    proc = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_api_reference_links_instead_of_showing_roles(site: Path) -> None:
    for name in ("fsm", "audit", "offload", "diagrams"):
        html = (site / "reference" / name / "index.html").read_text(encoding="utf-8")
        assert not _ROLE.search(html), f"reference/{name}: a Sphinx role shows as text"
        assert html.count('class="autorefs autorefs-internal"') > 5, f"reference/{name}"
    registry = (site / "reference" / "fsm" / "index.html").read_text(encoding="utf-8")
    assert 'href="#kvlife.fsm.errors.WrongThreadError"' in registry


def test_the_site_publishes_no_build_files(site: Path) -> None:
    published = {p.name for p in site.rglob("*") if p.is_file()}
    assert "hooks.py" not in published
    assert {"lifecycle.svg", "lifecycle.mmd"} <= published
    assert not any("-before" in name for name in published)  # docs/incident-pictures/


def test_the_site_renders_mermaid_with_no_network(site: Path, browser: Any) -> None:
    page = browser.new_page()
    fetched: list[str] = []

    def offline(route: Any) -> None:
        fetched.append(route.request.url)
        route.abort()

    page.route(re.compile(r"^https?://"), offline)  # any network request fails
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto((site / "diagrams" / "index.html").as_uri())
    # Material draws the diagram in a closed shadow root: its size shows it was drawn
    page.wait_for_function(
        "document.querySelector('div.mermaid')?.getBoundingClientRect().height > 100",
        timeout=30_000,
    )
    assert page.evaluate("typeof mermaid") == "object"  # the site's own copy
    assert fetched == [] and errors == []
    page.close()


def test_the_architecture_chart_is_drawn_at_a_readable_size(site: Path, browser: Any) -> None:
    """Its 15 boxes one above the other in the text column: a chart laid out left to right
    was squeezed into a strip about 150 px high, its labels about 6 px."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto((site / "architecture" / "index.html").as_uri())
    page.wait_for_function(
        "document.querySelector('div.mermaid')?.getBoundingClientRect().height > 100",
        timeout=30_000,
    )
    box = page.evaluate(
        "(() => { const r = document.querySelector('div.mermaid').getBoundingClientRect();"
        " return [r.width, r.height]; })()"
    )
    assert box[1] > 700 and box[1] > box[0], box
    page.close()


def test_every_documented_kv_transfer_config_is_json_naming_a_real_connector() -> None:
    """The vLLM config lines the pages show parse as JSON, and a kvlife connector they name
    is one the package exports (checked by its text: vLLM is not installed here)."""
    exported = (ROOT / "offload" / "engines" / "vllm" / "__init__.py").read_text()
    found = 0
    for page in PAGES:
        for match in re.finditer(r"--kv-transfer-config\s+'(.*?)'", page.read_text(), re.S):
            config = json.loads(match[1])
            found += 1
            if config.get("kv_connector_module_path") == "kvlife.offload.engines.vllm":
                assert f'"{config["kv_connector"]}"' in exported, (page.name, config)
    assert found >= 2


def _command_lines(block: Block) -> list[str]:
    """The ``kvlife ...`` command lines of a block (continuations joined)."""
    text = block.body.replace("\\\n", " ")
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip().startswith("kvlife ") and block.lang == "sh"
    ]


def test_every_kvlife_command_line_in_the_docs_parses() -> None:
    """Every ``kvlife ...`` line of a code block in the README and the manual, skipped
    blocks included, is accepted by the command's own parser: a block that only shows a
    command (it needs a vLLM run's log) cannot rot unseen."""
    import shlex  # noqa: PLC0415

    from kvlife.diagrams.cli import UsageError, _parser  # noqa: PLC0415

    parser = _parser()
    checked, wrong = 0, []
    for page in PAGES:
        for block in blocks(page):
            for line in _command_lines(block):
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.whitespace_split = True
                words = list(lexer)
                ends = [i for i, word in enumerate(words) if set(word) <= set("|&;<>()")]
                args = words[1 : ends[0] if ends else len(words)]
                try:
                    parser.parse_args(args)
                except UsageError as exc:
                    wrong.append(f"{_id(block)}: {line} ({exc})")
                except SystemExit as exc:  # --help, --version
                    if exc.code not in (0, None):
                        wrong.append(f"{_id(block)}: {line}")
                checked += 1
    assert checked >= 20 and not wrong, wrong

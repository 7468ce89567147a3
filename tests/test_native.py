"""kvlife.fsm.native: which build of the hot path runs, and the build that makes it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvlife.fsm import native
from kvlife.fsm.audit.records import make_header

ROOT = Path(__file__).resolve().parents[1]


def test_the_build_the_environment_requires_is_the_one_loaded() -> None:
    """``make test`` sets KVLIFE_REQUIRE_BUILD: a compiled build that silently fell back
    to pure Python (no compiler, a compile error, stale sources) fails here."""
    here = _importable()
    for module in here:
        importlib.import_module(module)
    loaded = native.loaded()
    assert sorted(loaded) == sorted(here)
    assert set(loaded.values()) == {native.compiled}, loaded
    assert native.describe().startswith("compiled" if native.compiled else "pure Python")
    required = os.environ.get("KVLIFE_REQUIRE_BUILD", "")
    if required:
        assert required in ("compiled", "pure"), required
        assert native.compiled == (required == "compiled"), native.describe()


def _importable() -> list[str]:
    """The compiled modules this environment can import: all but those of an engine that
    is not installed here (``ENGINE_MODULES``; the engine's own tests load those)."""
    return [
        module
        for module in native.COMPILED
        if module not in native.ENGINE_MODULES
        or importlib.util.find_spec(native.ENGINE_MODULES[module]) is not None
    ]


def test_an_engines_compiled_module_is_one_of_the_build() -> None:
    for module, engine in native.ENGINE_MODULES.items():
        assert module in native.COMPILED
        assert module.startswith(f"kvlife.offload.engines.{engine}.")


def test_kvlife_pure_loads_every_hot_module_from_its_source() -> None:
    code = (
        "import kvlife.offload.planner, kvlife.fsm.native as n; "
        "print(n.compiled, sorted(set(n.loaded().values())), n.describe())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, KVLIFE_PURE="1"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "False [False] pure Python (KVLIFE_PURE is set)"


def test_each_build_makes_lifecycles_and_tickets_its_own_fast_way() -> None:
    """Pure Python: ``object.__new__`` and stores inline (half the cost of calling the
    class; the pure build is no slower than before the build existed). Compiled: the
    keyed constructor, the only way a native class can be made."""
    from kvlife.fsm import registry  # noqa: PLC0415

    assert registry._PLAIN is (not native.compiled)
    reg = registry.LifecycleRegistry()
    lc = reg.register(SimpleNamespace(rid="r"))
    ticket = reg.start_offload(lc)
    assert (type(lc), type(ticket)) == (registry.Lifecycle, registry.Ticket)
    assert (lc.state, lc.inflight, lc.copies_started, lc.outcome) == ("offloading", 1, 1, None)
    assert (ticket.lifecycle, ticket.op) == (lc, 0)


def _stamp(digest: str, modules: tuple[str, ...] = native.COMPILED) -> SimpleNamespace:
    return SimpleNamespace(DIGEST=digest, MODULES=modules, MYPYC="9.9")


def test_the_decision() -> None:
    digest = "d" * 64
    assert native._decide({}, None, None) == (
        False,
        "pure Python (installed without the compiled build)",
    )
    stamp = _stamp(digest)
    assert native._decide({}, stamp, digest) == (  # type: ignore[arg-type]
        True,
        f"compiled (mypyc 9.9, {len(native.COMPILED)} modules)",
    )
    assert native._decide({"KVLIFE_PURE": "1"}, stamp, digest)[0] is False  # type: ignore[arg-type]
    assert native._decide({"KVLIFE_PURE": "0"}, stamp, digest)[0] is True  # type: ignore[arg-type]


def test_a_compiled_build_of_other_sources_is_not_run_and_says_so() -> None:
    """An editable install edited since it was compiled: the old extensions would run
    code that is no longer the source; pure Python runs instead, with a warning."""
    with pytest.warns(RuntimeWarning, match="reinstall kvlife"):
        decided = native._decide({}, _stamp("a" * 64), "b" * 64)  # type: ignore[arg-type]
    assert decided == (False, "pure Python (the compiled build is stale: reinstall)")
    stamp = _stamp("a" * 64, native.COMPILED[:-1])  # a module left out of the build
    with pytest.warns(RuntimeWarning, match="reinstall kvlife"):
        decided = native._decide({}, stamp, "a" * 64)  # type: ignore[arg-type]
    assert decided[0] is False


def test_the_digest_is_of_the_sources_installed_beside_the_build() -> None:
    first = native._digest(native.COMPILED)
    assert first is not None and len(first) == 64
    assert native._digest(native.COMPILED[1:]) != first
    assert native._digest(("kvlife.fsm.no_such_module",)) is None


def test_every_audit_log_and_the_version_say_which_build_wrote_them() -> None:
    assert make_header().build == native.describe()
    out = subprocess.run(
        [sys.executable, "-m", "kvlife.diagrams.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip().endswith(native.describe())


def test_the_makefile_recompiles_when_a_compiled_module_changes() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    lines = iter(makefile.split("HOT_SOURCES :=", 1)[1].split("\n"))
    listed = [next(lines)]
    while listed[-1].endswith("\\"):  # continued
        listed.append(next(lines))
    sources = " ".join(listed).replace("\\", " ").split()
    expected = [
        module.removeprefix("kvlife.").replace(".", "/") + ".py" for module in native.COMPILED
    ]
    assert sources == expected


@pytest.mark.skipif(
    importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("mypy") is None,
    reason="builds a wheel with this environment's setuptools and mypy",
)
def test_without_a_c_compiler_the_install_is_pure_python_and_says_so(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path), "-v", str(ROOT)],
        env={**{k: v for k, v in os.environ.items() if k != "KVLIFE_PURE"}, "CC": "/no/cc"},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "kvlife build: no C compiler (/no/cc not found): pure Python installed" in said
    [wheel] = tmp_path.glob("kvlife-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")  # no platform tag: nothing compiled
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvlife/fsm/registry.py" in names
    assert not [name for name in names if name.endswith(".so")]

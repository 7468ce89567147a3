"""kvlife's build: pyproject.toml holds the metadata; this file adds the compiled hot path.

The modules in ``kvlife.fsm.native.COMPILED`` are compiled with mypyc into C extensions
that sit beside their pure-Python source (Python imports the extension first). Where
mypyc, a C compiler or Python's headers are missing, or ``KVLIFE_PURE=1`` is set, or the
compile fails, the build says so and installs pure Python: the same code, slower.

mypyc names a module from the folders it lies in, and this repository maps its top-level
folders onto import names (``fsm/`` is ``kvlife.fsm``): the build compiles from a tree laid
out as the import names (``build/mypyc-tree/kvlife/fsm`` linking to ``fsm/``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
TREE = ROOT / "build" / "mypyc-tree"
# The compile sees only kvlife's own modules (not torch's or msgspec's: faster, and the same
# with or without them installed) and reports errors in the compiled ones only.
_MYPY_FLAGS = ("--ignore-missing-imports", "--no-site-packages", "--follow-imports=silent")
FOLDERS = {"fsm": "fsm", "offload": "offload"}  # import name under kvlife -> folder


@functools.cache
def _native() -> ModuleType:
    """``kvlife.fsm.native``, loaded from its file (it needs the standard library only; the
    build environment has none of kvlife's dependencies): the list of compiled modules and
    the digest its stamp check recomputes come from there."""
    spec = importlib.util.spec_from_file_location("_kvlife_native", ROOT / "fsm" / "native.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("fsm/native.py cannot be loaded")
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    return native


def _say(message: str) -> None:
    print(f"kvlife build: {message}", file=sys.stderr, flush=True)


def _why_pure() -> str | None:
    """Why this build is pure Python, or None when it can compile."""
    if _native()._forced_pure(os.environ):
        return "KVLIFE_PURE is set"
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed"
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None:
        return f"no C compiler ({compiler.split()[0]} not found)"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        return f"Python's headers are missing ({include}/Python.h)"
    return None


def _mypyc_version() -> str:
    from mypy.version import __version__

    return __version__


def _tree(native: ModuleType, modules: tuple[str, ...]) -> list[str]:
    """Lay the packages out as their import names; return the hot modules' paths there
    and write the digest module that tells a compiled build from stale sources."""
    shutil.rmtree(TREE, ignore_errors=True)
    kvlife = TREE / "kvlife"
    kvlife.mkdir(parents=True)
    (kvlife / "__init__.py").write_text("", encoding="utf-8")  # for naming only
    for name, folder in FOLDERS.items():
        for source in (ROOT / folder).rglob("*.py"):
            link = kvlife / name / source.relative_to(ROOT / folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source)
    sources, paths = [], []
    for module in modules:
        _, package, *rest = module.split(".")
        source = Path(FOLDERS[package], *rest).with_suffix(".py")
        sources.append((module, (ROOT / source).read_bytes()))
        paths.append(str(TREE / "kvlife" / package / Path(*rest).with_suffix(".py")))
    stamp = TREE / "kvlife" / "fsm" / "_native_build.py"
    stamp.write_text(
        '"""Written by setup.py: which sources this compiled build was made from."""\n\n'
        f"DIGEST = {native.source_digest(sources)!r}\nMODULES = {modules!r}\n"
        f"MYPYC = {_mypyc_version()!r}\n",
        encoding="utf-8",
    )
    return [*paths, str(stamp)]


@functools.cache  # setuptools may finalize build_ext more than once in one build
def _compiled_extensions() -> list[Extension]:
    from mypyc.build import mypycify

    native = _native()
    modules = tuple(native.COMPILED)
    try:
        paths = _tree(native, modules)
        config = TREE / "mypy.ini"  # not the project's strict one: `make types` runs that
        config.write_text("[mypy]\n", encoding="utf-8")
        extensions = mypycify(
            [*paths, *_MYPY_FLAGS, f"--config-file={config}"], opt_level="3", group_name="kvlife"
        )
    except (Exception, SystemExit) as exc:  # mypyc refuses a source: it still runs
        _say(f"mypyc refused the sources ({type(exc).__name__}: {exc}): pure Python installed")
        return []
    _say(f"compiling {len(modules)} modules with mypyc")
    return list(extensions)


class CompiledBuildExt(build_ext):
    """Compiles the hot modules: mypyc writes their C here, when the extensions are built
    (not at each of the other steps pip runs this file for), and a failed compile leaves a
    pure-Python install that says so."""

    def finalize_options(self) -> None:
        self.distribution.ext_modules = _compiled_extensions()
        super().finalize_options()

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # CCompilerError, CompileError, ...
            _say(f"compiling failed ({type(exc).__name__}: {exc}): pure Python installed")
            self.extensions = []


def _ext_modules() -> list[Extension]:
    """One placeholder when the build can compile (CompiledBuildExt replaces it): it makes
    the wheel platform-specific and has build_ext run."""
    why = _why_pure()
    if why is not None:
        _say(f"{why}: pure Python installed")
        return []
    return [Extension("kvlife.fsm._native_build", sources=[])]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": CompiledBuildExt})

"""Another kvlife tree loaded beside the installed one (``kvlife.fsm.against``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import kvlife.fsm.registry
from kvlife.fsm.against import PREFIX, TreeError, load_tree

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_uses_its_own_modules_throughout() -> None:
    fsm = load_tree(ROOT)
    assert fsm.__name__ == f"{PREFIX}.fsm"
    from kvlife_against.fsm.registry import LifecycleRegistry  # type: ignore[import-not-found]  # noqa: PLC0415
    from kvlife_against.offload.planner import OffloadPlanner  # type: ignore[import-not-found]  # noqa: PLC0415

    assert LifecycleRegistry is not kvlife.fsm.registry.LifecycleRegistry
    planner = OffloadPlanner(4)
    assert type(planner.registry) is LifecycleRegistry  # its own registry, not ours
    assert OffloadPlanner.__module__ == f"{PREFIX}.offload.planner"
    assert sys.modules[OffloadPlanner.__module__].LifecycleRegistry is LifecycleRegistry
    assert load_tree(ROOT) is fsm  # loading it again gives it again


def test_no_bytecode_is_written_into_the_tree(tmp_path: Path) -> None:
    load_tree(ROOT)
    import kvlife_against.fsm.table  # type: ignore[import-not-found]  # noqa: F401, PLC0415

    cached = ROOT / "fsm" / "__pycache__"
    names = [p.name for p in cached.glob("*.pyc")] if cached.exists() else []
    assert not any(PREFIX in name for name in names)


def test_a_directory_without_fsm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TreeError, match="not a kvlife source tree"):
        load_tree(tmp_path)


def test_a_second_tree_is_refused(tmp_path: Path) -> None:
    load_tree(ROOT)
    (tmp_path / "fsm").mkdir()
    (tmp_path / "fsm" / "__init__.py").write_text("")
    with pytest.raises(TreeError, match="loaded as kvlife_against already"):
        load_tree(tmp_path)

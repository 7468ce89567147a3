"""Running every hook even when one raises, then raising the first error."""

from __future__ import annotations

import pytest

from kvlife.fsm.hooks import FirstError, run_all


def test_every_hook_runs_and_the_first_error_is_raised_after_all() -> None:
    ran: list[int] = []

    def hook(n: int) -> None:
        ran.append(n)
        if n in (1, 2):
            raise ValueError(f"hook {n}")

    with pytest.raises(ValueError, match="hook 1"):
        run_all([lambda: hook(0), lambda: hook(1), lambda: hook(2), lambda: hook(3)])
    assert ran == [0, 1, 2, 3]
    run_all([])  # nothing to run, nothing raised


def test_a_hook_that_removes_hooks_does_not_skip_any() -> None:
    ran: list[str] = []
    hooks = []

    def first() -> None:
        ran.append("first")
        hooks.clear()

    hooks += [first, lambda: ran.append("second")]
    run_all(hooks)
    assert ran == ["first", "second"]


def test_an_interrupt_is_not_held_back() -> None:
    first = FirstError()
    with pytest.raises(KeyboardInterrupt), first:
        raise KeyboardInterrupt
    assert first.error is None
    with first:
        raise RuntimeError("kept")
    with pytest.raises(RuntimeError, match="kept"):
        first.reraise()

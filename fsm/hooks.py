"""Running several hooks that must all run even when one of them raises.

A release or a completion calls user hooks (``on_release``, ``on_copy``) and its own
bookkeeping; one hook that raises must not keep the others (one of which may be the one
that frees pages) from running. [`FirstError`][kvlife.fsm.hooks.FirstError] is the one way
kvlife does that: every call runs inside it, the first error is kept, and it is raised once
everything ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, final


@final
class FirstError:
    """Keep the first ``Exception`` raised inside ``with`` blocks, to raise after all ran::

        first = FirstError()
        for hook in hooks:
            with first:
                hook(req)
        first.reraise()

    ``BaseException``\\s that are not ``Exception``\\s (``KeyboardInterrupt``) are not
    held back.
    """

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: Exception | None = None

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if isinstance(error, Exception):
            if self.error is None:
                self.error = error
            return True
        return False

    def reraise(self) -> None:
        """Raise the first error kept, if any."""
        if self.error is not None:
            raise self.error


def run_all(hooks: Iterable[Callable[..., object]], *args: Any) -> None:
    """Call every hook with ``args`` (a snapshot of ``hooks``, so a hook may add or remove
    hooks), then raise the first error one of them raised."""
    first = FirstError()
    for hook in list(hooks):
        with first:
            hook(*args)
    first.reraise()


__all__ = ["FirstError", "run_all"]

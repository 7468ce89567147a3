"""Shared hypothesis strategies and request classes that set identity traps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

#: rids drawn from three values, so reuse is the common case.
RIDS = st.sampled_from(["r0", "r1", "r2"])

#: rids that try to break logs and diagrams: quotes, backslashes, newlines, U+2028, NUL.
HOSTILE_RIDS: list[str] = [
    'quote"inside',
    "back\\slash",
    "new\nline",
    "carriage\rreturn",
    "line\u2028separator",
    "para\u2029graph",
    "next\x85line",
    "nul\x00byte",
    "\\N",
    "<b>html</b>",
    "{}[],:",
    "ünïcödé-☃",
    "",
]

hostile_rids = st.one_of(st.sampled_from(HOSTILE_RIDS), st.text(max_size=20))


class Req:
    """A plain request: identity equality and hash."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def __repr__(self) -> str:
        return f"Req({self.rid!r})"


class EqByRid:
    """A request whose ``__eq__``/``__hash__`` use the rid: two requests collapse into one
    in any dict keyed by the request."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EqByRid) and other.rid == self.rid

    def __hash__(self) -> int:
        return hash(self.rid)

    def __repr__(self) -> str:
        return f"EqByRid({self.rid!r})"


@dataclass
class Unhashable:
    """A non-frozen dataclass: ``__eq__`` by fields and ``__hash__ = None``."""

    rid: str


class Slotted:
    """``__slots__`` without ``__weakref__``: no weak reference can be taken."""

    __slots__ = ("rid",)

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def __repr__(self) -> str:
        return f"Slotted({self.rid!r})"


REQUEST_KINDS = (Req, EqByRid, Unhashable, Slotted)
request_kinds = st.sampled_from(REQUEST_KINDS)


def raised_in_thread(call: Callable[[], object]) -> BaseException | None:
    """What ``call()`` raised when run on a thread of its own (``None`` if nothing)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return errors[0] if errors else None

"""What differs when kvlife's hot modules run compiled (``kvlife.fsm.native``): the tests
that meet a difference say so through these, and run unchanged on the pure build."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvlife.fsm import native

COMPILED = native.compiled

#: The start of mypyc's own message for an argument of the wrong type.
MYPYC_TYPE_ERROR = r"object expected; got"


@contextmanager
def refused(error: type[BaseException], match: str | None = None) -> Iterator[None]:
    """``pytest.raises(error, match=match)`` for a bad argument; compiled, mypyc's own
    ``TypeError`` may come first, before the function's own check."""
    with pytest.raises((error, TypeError) if COMPILED else error) as info:
        yield
    raised, message = info.value, str(info.value)
    if isinstance(raised, error) and (match is None or re.search(match, message)):
        return
    if COMPILED and isinstance(raised, TypeError) and re.search(MYPYC_TYPE_ERROR, message):
        return
    raise AssertionError(f"{type(raised).__name__}({message!r}) is not {error.__name__} {match!r}")


#: A test that replaces a method of a compiled class: compiled callers keep calling the
#: original, so the test cannot hold compiled (it still runs on the pure build).
patches_compiled = pytest.mark.skipif(
    COMPILED, reason="replaces a method of a compiled class: compiled callers call the original"
)

#: A ``bool`` passed where a compiled function takes an ``int`` or a ``float`` is taken as
#: that number (mypyc converts it at the call) instead of refused.
takes_bool_as_number = pytest.mark.skipif(
    COMPILED, reason="compiled, a bool given for an int or float parameter is taken as the number"
)

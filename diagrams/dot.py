"""DOT helpers: escaping user-controlled text, and running Graphviz's ``dot``.

Every string that comes from a user (rids, file names) goes through
[`dot_text()`][kvlife.diagrams.dot.dot_text] before it reaches a DOT source: non-printable
characters are shown as escapes (a newline in a rid is drawn as the two characters ``\\n``,
not as a line break), and the result is marked so that the ``graphviz`` package neither
treats ``<...>`` as an HTML label nor lets ``\\N``, ``\\G``, ``\\l`` act as DOT escape
sequences.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Literal

import graphviz

Format = Literal["dot", "svg", "png", "mermaid"]

INSTALL_HINT = (
    "Graphviz's `dot` is not installed: SVG and PNG need it "
    "(Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz); "
    "DOT and Mermaid output work without it"
)


class DotNotFoundError(RuntimeError):
    """Graphviz's ``dot`` executable is missing; the message says how to install it."""


def visible(text: str) -> str:
    """``text`` with every non-printable character shown as a Python escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def shortened(text: str, limit: int = 40) -> str:
    """``visible(text)``, cut to ``limit`` characters with ``…`` when longer (a 10 kB rid
    must not make a picture 30,000 px wide; the report page shows the whole value)."""
    shown = visible(text)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def dot_text(text: str) -> str:
    """Escape ``text`` for a DOT label or identifier: shown literally, whatever it holds."""
    # graphviz.escape returns a str subclass that quote() never takes for an HTML label:
    # keep its type (str() would drop the mark)
    escaped: str = graphviz.escape(visible(text))
    return escaped


def render(source: str, fmt: Literal["svg", "png"]) -> bytes:
    """Render DOT ``source`` with Graphviz's ``dot``.

    Raises:
        DotNotFoundError: ``dot`` is not on the PATH.
        subprocess.CalledProcessError: ``dot`` rejected the source.
    """
    exe = shutil.which("dot")
    if exe is None:
        raise DotNotFoundError(INSTALL_HINT)
    result = subprocess.run(
        [exe, f"-T{fmt}"], input=source.encode(), capture_output=True, check=True, timeout=60
    )
    return result.stdout


def dot_version() -> str | None:
    """The installed ``dot``'s version line, or ``None`` when it is missing."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    result = subprocess.run([exe, "-V"], capture_output=True, text=True, check=False, timeout=30)
    return (result.stderr or result.stdout).strip() or None

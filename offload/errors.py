"""The errors of the offload core's compiled modules (pages, the prefix cache, the planner).

They live here, in a module that is never compiled, because a class that mypyc compiles
cannot derive from ``ValueError`` or ``KeyError`` (see
[`kvlife.fsm.native`][kvlife.fsm.native]); each is also importable from the module that
raises it (``kvlife.offload.pages.DoubleFreeError``, ...).
"""

from __future__ import annotations


class HostPageError(ValueError):
    """A free that the pool refuses. Nothing was freed: the call is all or nothing."""


class DoubleFreeError(HostPageError):
    """A page is already free (or listed twice in one call)."""


class ForeignPageError(HostPageError):
    """The pages belong to another pool, or an index is out of range."""


class PrefixCacheError(ValueError):
    """A call the cache refuses. Nothing changed."""


class UnknownOrderError(KeyError):
    """A report names a copy number this planner never ordered (or forgot: more than
    [`MAX_REMEMBERED_ORDERS`][kvlife.offload.planner.MAX_REMEMBERED_ORDERS] ago). Nothing
    changed."""

    def __init__(self, op: object) -> None:
        super().__init__(op)
        self.op = op

    def __str__(self) -> str:
        return f"a report for copy {self.op!r}, which this planner never ordered"


class ReportCountError(ValueError):
    """A report's count of workers is not a positive int (one worker's report counts 1;
    vLLM's worker metadata sums them). Nothing changed: the report was not taken."""

    def __init__(self, op: object, count: object) -> None:
        super().__init__(op, count)
        self.op = op
        self.count = count

    def __str__(self) -> str:
        return (
            f"a report for copy {self.op!r} from {self.count!r} workers: a report counts a "
            "positive int of workers"
        )


__all__ = [
    "DoubleFreeError",
    "ForeignPageError",
    "HostPageError",
    "PrefixCacheError",
    "ReportCountError",
    "UnknownOrderError",
]

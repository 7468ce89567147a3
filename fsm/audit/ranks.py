"""Per-rank logs of one tensor-parallel group, compared: ``kvlife audit ranks``.

Under tensor parallelism each rank runs the same cache on its shard of the KV and writes
its own log. The ranks must copy the same things in the same order: SGLang's HiCache
all-reduces only the *number* of acks ready (the minimum over ranks) and then each rank
pops that many from its own queue, so two ranks that agree on a count but not on the
copies behind it complete different nodes, and a copy left behind on one rank stays
pending, its pages and locks held, with no error on any rank.

[`compare_ranks()`][kvlife.fsm.audit.ranks.compare_ranks] reads one log per rank (each with
its rotated files) in one streaming pass each and keeps, per rid and ticket kind, the
copies started and the copies completed (``ack`` or ``fail``), and per kind the order of
completions. The ranks agree when every rid has the same counts on every rank and every
kind's completions came in the same order; otherwise the comparison names the rids they
disagree on, with each rank's counts, and the first completion where the order differs.
It knows nothing of an engine: rids and ticket kinds are compared as the logs write them
(a log whose rids differ by rank, such as a per-rank prefix, is not for this tool).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvlife.fsm.audit.reader import AuditReader, Segment
from kvlife.fsm.audit.records import AuditRecord

MAX_NAMED = 50
"""Disagreeing (rid, kind) pairs kept in a comparison (the count is always whole)."""


@dataclass(frozen=True)
class CopyCounts:
    """One rank's copies of one kind for one rid: started, and completed (acked or
    failed)."""

    started: int = 0
    completed: int = 0

    @property
    def open(self) -> int:
        """Started and never completed in this log."""
        return self.started - self.completed

    def __str__(self) -> str:
        return f"{self.started} started, {self.completed} completed" + (
            f", {self.open} open" if self.open else ""
        )


@dataclass(frozen=True)
class Disagreement:
    """A rid whose copies of one kind differ between ranks: ``counts[i]`` is rank ``i``'s."""

    rid: str
    kind: str
    counts: tuple[CopyCounts, ...]


@dataclass(frozen=True)
class OrderDifference:
    """The first completion of ``kind`` that differs between ranks: the ``index``-th
    (from 0) on each rank completed ``rids[i]`` on rank ``i`` (``None``: none)."""

    kind: str
    index: int
    rids: tuple[str | None, ...]


@dataclass
class RankComparison:
    """What [`compare_ranks()`][kvlife.fsm.audit.ranks.compare_ranks] found.

    ``ranks`` names each rank (its log's path, as given); ``copies[i]`` counts rank
    ``i``'s copies; ``disagreements`` holds up to [`MAX_NAMED`][kvlife.fsm.audit.ranks.MAX_NAMED]
    of the ``disagreeing`` (rid, kind) pairs, the ones with copies left open first.
    """

    ranks: tuple[str, ...]
    copies: tuple[int, ...]
    disagreeing: int = 0
    disagreements: list[Disagreement] = field(default_factory=list)
    order: list[OrderDifference] = field(default_factory=list)
    unreadable: int = 0

    @property
    def agree(self) -> bool:
        """The ranks started and completed the same copies, in the same order."""
        return self.disagreeing == 0 and not self.order

    def lines(self) -> list[str]:
        """The comparison told in lines, as ``kvlife audit ranks`` prints it."""
        names = ", ".join(
            f"rank {i} {Path(name).name} ({n} copies)"
            for i, (name, n) in enumerate(zip(self.ranks, self.copies, strict=True))
        )
        out = [f"{len(self.ranks)} ranks: {names}"]
        if self.agree:
            out.append("the ranks agree: the same copies of every rid, completed in the same order")
            return out
        for diff in self.order:
            said = "; ".join(
                f"rank {i} {'nothing' if rid is None else rid}" for i, rid in enumerate(diff.rids)
            )
            out.append(f"{diff.kind} completions differ from number {diff.index + 1}: {said}")
        out.append(
            f"{self.disagreeing} rid/kind pair(s) differ between ranks"
            + (
                f" (the first {len(self.disagreements)} below)"
                if self.disagreeing > MAX_NAMED
                else ""
            )
            + ":"
        )
        for d in self.disagreements:
            per_rank = "; ".join(f"rank {i}: {c}" for i, c in enumerate(d.counts))
            out.append(f"  {d.rid} {d.kind}: {per_rank}")
        stuck = sorted({d.rid for d in self.disagreements if any(c.open for c in d.counts)})
        if stuck:
            out.append(
                "copies left open on some ranks only (their pages and locks held there): "
                + ", ".join(stuck)
            )
        return out


@dataclass
class _Rank:
    counts: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # [started, done]
    order: dict[str, list[str]] = field(default_factory=dict)  # kind -> rids completed
    copies: int = 0
    unreadable: int = 0


def _read(path: str | Sequence[str]) -> _Rank:
    rank = _Rank()
    reader = AuditReader(path)
    segment = -1
    tickets: dict[tuple[int, int | None, int], tuple[str, str]] = {}  # (seg, serial, op)
    for event in reader:
        if type(event) is Segment:
            segment = event.index
            continue
        if type(event) is not AuditRecord or not event.ok or event.op is None:
            continue
        record = event
        key = (segment, record.serial, event.op)
        if record.trigger == "start_offload":
            kind = str(record.detail.get("kind", "copy"))
            rid = record.rid or "?"
            tickets[key] = (rid, kind)
            rank.counts.setdefault((rid, kind), [0, 0])[0] += 1
            rank.copies += 1
        elif record.trigger in ("ack", "fail"):
            found = tickets.pop(key, None)
            if found is None:
                continue  # its start is in a segment or file not given
            rank.counts[found][1] += 1
            rank.order.setdefault(found[1], []).append(found[0])
    rank.unreadable = reader.problem_count
    return rank


def _first_difference(kind: str, orders: list[list[str]]) -> OrderDifference | None:
    longest = max(len(o) for o in orders)
    for i in range(longest):
        seen = [o[i] if i < len(o) else None for o in orders]
        if len(set(seen)) > 1:
            return OrderDifference(kind, i, tuple(seen))
    return None


def compare_ranks(logs: Sequence[str | Sequence[str]]) -> RankComparison:
    """Compare the logs of one TP group's ranks (``logs[i]``: rank ``i``'s log, a path
    read with its rotated files, or a list of files read in that order).

    Raises:
        ValueError: fewer than two logs.
        FileNotFoundError: a log does not exist.
        AuditFormatError: a file is not a kvlife audit log.
    """
    if len(logs) < 2:
        raise ValueError(f"kvlife: comparing ranks needs two logs or more, got {len(logs)}")
    ranks = [_read(path) for path in logs]
    names = tuple(path if isinstance(path, str) else path[-1] for path in logs)
    result = RankComparison(
        ranks=names,
        copies=tuple(r.copies for r in ranks),
        unreadable=sum(r.unreadable for r in ranks),
    )
    kinds = sorted({kind for r in ranks for kind in r.order})
    for kind in kinds:
        diff = _first_difference(kind, [r.order.get(kind, []) for r in ranks])
        if diff is not None:
            result.order.append(diff)
    differing: list[Disagreement] = []
    for pair in sorted(_pairs(ranks)):
        counts = tuple(CopyCounts(*r.counts.get(pair, (0, 0))) for r in ranks)
        if len(set(counts)) > 1:
            differing.append(Disagreement(pair[0], pair[1], counts))
    result.disagreeing = len(differing)
    differing.sort(key=lambda d: not any(c.open for c in d.counts))  # stable: open first
    result.disagreements = differing[:MAX_NAMED]
    return result


def _pairs(ranks: Iterable[_Rank]) -> set[tuple[str, str]]:
    return {pair for r in ranks for pair in r.counts}


__all__ = [
    "MAX_NAMED",
    "CopyCounts",
    "Disagreement",
    "OrderDifference",
    "RankComparison",
    "compare_ranks",
]

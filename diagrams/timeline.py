"""A timeline of an audit log: one row per lifecycle instance (rid + serial), coloured by
state over time, so rid reuse and overlapping instances show at a glance.

Needs matplotlib (the ``plot`` extra: ``pip install 'kvlife[plot]'``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from kvlife.diagrams.dot import visible
from kvlife.fsm.audit import REGISTER, AuditLog, AuditRecord
from kvlife.fsm.table import State

#: Colour per state (released is not drawn: the row ends there).
COLOURS: Final = {
    State.ALLOCATED.value: "#9ecae1",
    State.OFFLOADING.value: "#3182bd",
    State.FINISHED_PENDING.value: "#fd8d3c",
}


@dataclass
class Row:
    """One lifecycle instance's history: (start, end, state) spans and refusal times."""

    serial: int
    rid: str
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    refusals: list[float] = field(default_factory=list)
    released: bool = False


def timeline_rows(source: AuditLog | Iterable[AuditRecord]) -> tuple[list[Row], float]:
    """Replay a log into rows (times in ms from the first record); returns rows and the end."""
    records = source.records if isinstance(source, AuditLog) else list(source)
    if not records:
        return [], 0.0
    t0 = records[0].t_ns
    end = (records[-1].t_ns - t0) / 1e6
    rows: dict[int, Row] = {}
    current: dict[int, tuple[float, str]] = {}  # serial -> (since, state) while unreleased
    for r in records:
        if r.serial is None:
            continue
        t = (r.t_ns - t0) / 1e6
        row = rows.get(r.serial)
        if row is None:
            row = rows[r.serial] = Row(r.serial, r.rid or "")
            if r.trigger != REGISTER and r.src is not None:  # the log began mid-lifecycle
                current[r.serial] = (t, r.src)
        if not r.ok:
            row.refusals.append(t)
            continue
        since, state = current.get(r.serial, (t, ""))
        if r.dst == state:
            continue  # offloading -> offloading: one span
        if state:
            row.spans.append((since, t, state))
        if r.dst == State.RELEASED.value:
            row.released = True
            current.pop(r.serial, None)
        elif r.dst is not None:
            current[r.serial] = (t, r.dst)
    for serial, (since, state) in current.items():
        rows[serial].spans.append((since, end, state))
    return sorted(rows.values(), key=lambda row: row.serial), end


def plot_timeline(
    source: AuditLog | Iterable[AuditRecord],
    path: Path,
    *,
    title: str = "kvlife lifecycles",
    max_rows: int = 80,
) -> int:
    """Draw the timeline to ``path`` (PNG or SVG by suffix); return the rows drawn.

    Rows are grouped by rid (then serial), so the instances that reused a rid sit one
    under the other and overlaps show. With more than ``max_rows`` instances, whole rid
    groups are drawn until ``max_rows`` is reached (the title says so). Raises
    ``ModuleNotFoundError`` with an install hint without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.artist import Artist
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ModuleNotFoundError as exc:  # pragma: no cover - the plot extra is installed in CI
        raise ModuleNotFoundError(
            "the timeline needs matplotlib: pip install 'kvlife[plot]'"
        ) from exc
    rows, end = timeline_rows(source)
    rows.sort(key=lambda row: (row.rid, row.serial))
    shown: list[Row] = []
    for rid in dict.fromkeys(row.rid for row in rows):
        group = [row for row in rows if row.rid == rid]
        if shown and len(shown) + len(group) > max_rows:
            break
        shown += group
    height = 1.4 + 0.2 * max(len(shown), 1)
    fig, ax = plt.subplots(figsize=(11, min(height, 40)), dpi=110)
    for y, row in enumerate(shown):
        for start, stop, state in row.spans:
            ax.broken_barh(
                [(start, max(stop - start, end * 0.002))],
                (y - 0.4, 0.8),
                facecolors=COLOURS.get(state, "gray"),
                edgecolor="none",
            )
        if row.refusals:
            ax.plot(row.refusals, [y] * len(row.refusals), "x", color="red", markersize=5)
    for y in range(1, len(shown)):
        if shown[y].rid != shown[y - 1].rid:
            ax.axhline(y - 0.5, color="gray", linewidth=0.5)
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"{visible(row.rid)[:24]} #{row.serial}" for row in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since the first record (ms)")
    rids = len({row.rid for row in shown})
    note = (
        f" ({len(shown)} of {len(rows)} lifecycles, {rids} rids)" if len(rows) > len(shown) else ""
    )
    ax.set_title(f"{visible(title)}{note}")
    handles: list[Artist] = [Patch(color=colour, label=state) for state, colour in COLOURS.items()]
    handles.append(Line2D([], [], marker="x", color="red", linestyle="none", label="refused"))
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return len(shown)

"""The rid-reuse race, played through a registry, with its audit trail.

Run: ``python -m kvlife.fsm.demo [--out DIR]``. Two request objects share rid ``"a"``
(and compare equal). The old one starts a copy and finishes; the new one registers and
starts its own copy; the old copy's ack arrives late and is delivered twice. kvlife
releases the old lifecycle only, refuses the duplicate as stale, and the new request
keeps its copy in flight. The audit trail is printed, written as JSON lines and checked.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from kvlife.fsm.audit import AuditRecord, JsonLinesSink, MemorySink, check_audit, read_audit
from kvlife.fsm.registry import LifecycleRegistry


class Request:
    """A request whose equality and hash use the rid, as many engines' do."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Request) and other.rid == self.rid

    def __hash__(self) -> int:
        return hash(self.rid)


def play_race(registry: LifecycleRegistry) -> list[str]:
    """Play the race; return what happened, one line per step."""
    said: list[str] = []
    old, new = Request("a"), Request("a")
    registry.register(old)
    old_ticket = registry.start_offload(old, tokens=16)
    registry.finish(old)
    said.append(f"old request finished with a copy in flight: {registry.lifecycle(old)!r}")
    new_lc = registry.register(new)
    new_ticket = registry.start_offload(new, tokens=16)
    said.append(f"rid 'a' reused at once, new copy in flight: {new_lc!r}")
    old_lc = registry.complete(old_ticket)
    said.append(f"late ack of the old copy released the old lifecycle: {old_lc!r}")
    said.append(f"the new one is untouched: {new_lc!r}")
    reason = registry.deliver(old_ticket)
    said.append(f"the old ack delivered again is refused: {reason}")
    registry.complete(new_ticket)
    registry.finish(new)
    said.append(f"the new request completes and finishes: {new_lc!r}")
    return said


def format_trail(records: Sequence[AuditRecord]) -> str:
    """The audit records as a fixed-width table."""
    head = f"{'seq':>3} {'serial':>6} {'rid':<4} {'trigger':<14} {'src':<17} {'dst':<17} op  reason"
    rows = [head, "-" * len(head)]
    for r in records:
        rows.append(
            f"{r.seq:>3} {r.serial if r.serial is not None else '-':>6} {r.rid or '':<4} "
            f"{r.trigger:<14} {r.src or '-':<17} {r.dst or '(refused)':<17} "
            f"{r.op if r.op is not None else '-':>2}  {r.reason or ''}".rstrip()
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Play the race, print the trail, write and check ``DIR/race-audit.jsonl``."""
    parser = argparse.ArgumentParser(prog="python -m kvlife.fsm.demo", description=__doc__)
    parser.add_argument("--out", default="out", help="directory for the audit log (default out)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "race-audit.jsonl"
    path.unlink(missing_ok=True)
    memory = MemorySink()
    with JsonLinesSink(path, fsync="batch") as sink:
        registry = LifecycleRegistry(sinks=[memory, sink])
        for line in play_race(registry):
            print(line)
    print()
    print(format_trail(memory.records()))
    report = check_audit(read_audit(path), expect_released=True)
    print()
    print(
        f"audit log {path}: {report.records} records, {len(report.violations)} violations, "
        f"{len(report.live)} live at the end"
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Audit logs with known contents for the log tools' tests: a clean one, one edited to hold
each violation kind the checker knows, and one with known rid reuses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlife.fsm import JsonLinesSink, LifecycleRegistry
from tests.strategies import Req

Line = dict[str, Any]


def clean_log(path: Path) -> Path:
    """Rid ``r`` reused while its first lifecycle's copy is in flight, then that copy
    completing late: records 0 register #0, 1 start copy 0, 2 finish #0, 3 register #1,
    4 start copy 1, 5 ack copy 0 (#0 released), 6 ack copy 1, 7 finish #1 (released)."""
    sink = JsonLinesSink(path, fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    old, new = Req("r"), Req("r")
    registry.register(old)
    old_copy = registry.start_offload(old, tokens=4)
    registry.finish(old)
    registry.register(new)
    new_copy = registry.start_offload(new, tokens=4)
    registry.complete(old_copy)
    registry.complete(new_copy)
    registry.finish(new)
    registry.flush()
    sink.close()
    return path


def _renumber(lines: list[Line]) -> list[Line]:
    return [line | {"seq": i} if "seq" in line else line for i, line in enumerate(lines, -1)]


def _edit(seq: int, **fields: Any) -> Callable[[list[Line]], list[Line]]:
    def edit(lines: list[Line]) -> list[Line]:
        return [line | fields if line.get("seq") == seq else line for line in lines]

    return edit


def _drop(seq: int) -> Callable[[list[Line]], list[Line]]:
    return lambda lines: [line for line in lines if line.get("seq") != seq]


def _append(make: Callable[[list[Line]], Line]) -> Callable[[list[Line]], list[Line]]:
    def edit(lines: list[Line]) -> list[Line]:
        return [*lines, make(lines) | {"seq": lines[-1]["seq"] + 1}]

    return edit


def _verdict(reason: str, **detail: Any) -> Callable[[list[Line]], list[Line]]:
    """A wrapper's verdict on its connector after the log's last record: a refusal of
    ``reason`` on the released lifecycle #1 of rid ``r``."""
    return _append(
        lambda lines: (
            dict(lines[-1])
            | {
                "serial": 1,
                "trigger": "ack",
                "src": "released",
                "dst": None,
                "ok": False,
                "reason": reason,
                "op": None,
                "inflight": 0,
                "detail": detail,
            }
        )
    )


def _unreported(lines: list[Line]) -> list[Line]:
    """A watcher's log (its header names the connector) whose last ticket, copy 1 of #1,
    is never reported: its ack and the finish after it are cut."""
    header, *records = lines
    return [header | {"witness": "ExampleConnector"}, *records[:-2]]


def _overdue(lines: list[Line]) -> list[Line]:
    """Copy 1 of #1 written down as overdue while it was open, then never completed: its
    ack and the finish after it are cut."""
    *kept, _, _ = lines
    return [
        *kept,
        dict(kept[-1])
        | {
            "seq": kept[-1]["seq"] + 1,
            "serial": 1,
            "trigger": "ack",
            "src": "offloading",
            "dst": None,
            "ok": False,
            "reason": "overdue",
            "op": 1,
            "inflight": 1,
            "detail": {"kind": "store", "age_s": 130.5, "limit_s": 120.0},
        },
    ]


def _handed_over(
    digest: str = "00000001", freed_first: bool = False
) -> Callable[[list[Line]], list[Line]]:
    """#0 a prefill side that hands ``r`` over (its copy 0 the delayed free, freed by its
    ack), #1 the decode side that reads it (its copy 1 the load, naming blocks
    ``digest``). With ``freed_first`` the ack of copy 0 comes before copy 1 starts, 10 ms
    earlier: copy 1 starts at seq 5 (else at seq 4)."""
    identity = {"engine": "e", "rid": "r", "blocks": 2}
    handoff = {f"handoff_{k}": v for k, v in identity.items()} | {"handoff_digest": "00000001"}
    peer = {f"peer_{k}": v for k, v in identity.items()} | {"peer_digest": digest}

    def edit(lines: list[Line]) -> list[Line]:
        said = {1: handoff, 2: handoff, 4: peer}  # seq -> the identity its record carries
        out = [
            line | {"detail": line["detail"] | said[line["seq"]]}
            if line.get("seq") in said
            else line
            for line in lines
        ]
        if freed_first:  # records 4 and 5 trade places (and times); what follows moves on
            at = next(i for i, line in enumerate(out) if line.get("seq") == 4)
            load, ack = out[at], out[at + 1]
            later = 10_000_000
            out[at] = ack | {"seq": 4, "t_ns": load["t_ns"]}
            out[at + 1] = load | {"seq": 5, "t_ns": ack["t_ns"] + later}
            out[at + 2 :] = [line | {"t_ns": line["t_ns"] + later} for line in out[at + 2 :]]
        return out

    return edit


#: One edit of the clean log per violation kind (``leaked`` needs ``--expect-released``).
EDITS: dict[str, Callable[[list[Line]], list[Line]]] = {
    "seq_gap": _drop(4),
    "illegal_transition": _edit(2, dst="released"),
    "state_mismatch": _edit(6, src="allocated"),
    "inflight_mismatch": _edit(4, inflight=3),
    "rid_mismatch": _edit(6, rid="s"),
    "wrong_instance": _edit(5, serial=1, src="offloading", dst="offloading", inflight=1),
    "unknown_op": _edit(6, op=99),
    "duplicate_completion": lambda lines: _renumber([*lines[:8], lines[7], *lines[8:]]),
    "serial_reused": lambda lines: _renumber(
        [*lines[:8], dict(lines[1]) | {"serial": 0}, *lines[8:]]
    ),
    "unknown_instance": _append(lambda lines: dict(lines[2]) | {"serial": 7}),
    "after_release": _append(lambda lines: dict(lines[2]) | {"src": "released"}),
    "leaked": lambda lines: lines[:-1],
    "stray_report": _verdict("stray_report", report="finished_sending", why="repeated"),
    "connector_raised": _verdict(
        "connector_raised", call="request_finished", error="KeyError: 'r'"
    ),
    "event_mismatch": _verdict("event_mismatch", event="BlockStored", why="tokens"),
    "credited_elsewhere": _verdict("credited_elsewhere", job=7, credited="serial 2"),
    "inherited_state": _verdict("inherited_state", owner="serial 0"),
    "host_freed_in_flight": _verdict("host_freed_in_flight", copy="load_back", slots=4),
    "failed_write_backed": _verdict("failed_write_backed", node=7),
    "unbalanced_lock": _verdict("unbalanced_lock", lock="device", node=7),
    "pending_overwritten": _verdict("pending_overwritten", entry="ongoing_write_through"),
    "unreported": _unreported,
    "overdue": _overdue,
    "freed_before_read": _handed_over(freed_first=True),
    "handover_mismatch": _handed_over(digest="0000000f"),
}
#: The kinds that are about no record (they are in the verdict's list only).
UNRECORDED = frozenset({"leaked", "unreported"})


def edited_log(clean: Path, kind: str, path: Path) -> Path:
    """``clean`` with the edit that makes a ``kind`` violation, written to ``path``."""
    lines = [json.loads(text) for text in clean.read_text().splitlines()]
    # the edits work on the records; the writer's closing record stays the last line,
    # counting the lines the edit left, as the writer of such a log would have (else
    # records cut from the end read as missing, not as what the edit means)
    edited = EDITS[kind]([line for line in lines if "kvlife_closed" not in line])
    count = sum("seq" in line or "kvlife_lost" in line for line in edited)
    edited += [line | {"records": count} for line in lines if "kvlife_closed" in line]
    path.write_text("".join(json.dumps(line) + "\n" for line in edited))
    return path


def reuse_log(path: Path, rids: int = 3, generations: int = 4) -> tuple[Path, set[int]]:
    """Each of ``rids`` rids held by ``generations`` lifecycles in turn, every new one
    registered while the one before still had a copy in flight (a rid reuse while
    unreleased), plus one rid registered again only after its release (not such a reuse).
    Returns the log and the serials of the lifecycles that reused a rid while unreleased."""
    sink = JsonLinesSink(path, fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    reused: set[int] = set()
    for i in range(rids):
        previous = None
        for generation in range(generations):
            req = Req(f"req-{i}")
            lc = registry.register(req)
            if generation:
                reused.add(lc.serial)
            ticket = registry.start_offload(req, tokens=4)
            if previous is not None:
                registry.complete(previous)  # the old copy completes after the reuse
            registry.finish(req)
            previous = ticket
        assert previous is not None
        registry.complete(previous)
    for _ in range(2):  # registered again after its release: a new request, no reuse
        req = Req("later")
        registry.register(req)
        registry.finish(req)
    registry.flush()
    sink.close()
    return path, reused

"""A failing audit sink never changes what the registry does: transitions are applied
whole, hooks run, other sinks get every record, and what the sink could not take is
counted, logged once, retried, and marked as lost when it had to be dropped."""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvlife.fsm import LifecycleRegistry, LoggingSink, MemorySink, State, read_audit
from kvlife.fsm.audit import AuditRecord, LostRecords, check_audit
from tests.strategies import Req


class Flaky:
    """A sink that raises on chosen calls and keeps what it took. Each has its own
    ``repr``: a registry from an earlier test, collected later, logs about its own."""

    _ids = itertools.count()

    def __init__(self, fail: Any = lambda n: True) -> None:
        self.fail = fail
        self.id = next(self._ids)
        self.calls = 0
        self.took: list[AuditRecord] = []
        self.lost: list[LostRecords] = []
        self.flushes = 0

    def write(self, record: AuditRecord) -> None:
        self.calls += 1
        if self.fail(self.calls):
            raise OSError(28, "No space left on device")
        self.took.append(record)

    def write_lost(self, marker: LostRecords) -> None:
        self.calls += 1
        if self.fail(self.calls):
            raise OSError(28, "No space left on device")
        self.lost.append(marker)

    def flush(self) -> None:
        self.flushes += 1

    def __repr__(self) -> str:
        return f"<Flaky {self.id}>"


def about(sink: object, caplog: pytest.LogCaptureFixture) -> list[str]:
    """The messages logged about ``sink`` (not about another test's sinks, whose
    registries the garbage collector may finalize at any time)."""
    name = repr(sink)
    return [m for m in caplog.messages if name in m]


def test_start_offload_with_a_raising_sink_still_returns_its_ticket() -> None:
    registry = LifecycleRegistry(sinks=[Flaky()])
    req = Req("a")
    registry.register(req)
    ticket = registry.start_offload(req)  # the sink raises; the transition stays whole
    lc = registry.lifecycle(req)
    assert lc.state is State.OFFLOADING and lc.inflight == 1
    registry.finish(req)
    assert registry.complete(ticket).released and len(registry) == 0


def test_a_failing_last_complete_still_releases_runs_hooks_and_feeds_later_sinks() -> None:
    memory = MemorySink()
    registry = LifecycleRegistry(sinks=[Flaky(), memory])
    released: list[str] = []
    registry.on_release(lambda lc, req: released.append(req.rid))
    req = Req("a")
    ticket = registry.start_offload(registry.register(req))
    registry.finish(req)
    lc = registry.complete(ticket)
    assert lc.released and req not in registry and len(registry) == 0
    assert released == ["a"]
    assert [r.trigger for r in memory.records()] == ["register", "start_offload", "finish", "ack"]
    stats = registry.statistics().sinks
    # one failed call: later records queue behind it until the next retry (sink_retry_s)
    assert [s.errors for s in stats] == [1, 0] and stats[0].pending == 4


def test_the_first_failure_is_logged_once_then_the_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing = [True]
    sink = Flaky(lambda n: failing[0])
    registry = LifecycleRegistry(sinks=[sink], sink_retry_s=0)
    with caplog.at_level(logging.WARNING, logger="kvlife.fsm.sinks"):
        for i in range(20):
            registry.register(Req(f"r{i}"))
        failing[0] = False
        registry.register(Req("after"))
    messages = about(sink, caplog)
    assert len(messages) == 2, messages
    assert "failed (write)" in messages[0] and "No space left" in messages[0]
    assert "recovered" in messages[1]
    assert [r.seq for r in sink.took] == list(range(21))  # the backlog first, in order
    assert registry.statistics().sinks[0].pending == 0


def test_backlog_overflow_is_marked_as_lost_and_checked_as_such() -> None:
    failing = [True]
    sink = Flaky(lambda n: failing[0])
    registry = LifecycleRegistry(sinks=[sink], sink_backlog=5, sink_retry_s=0)
    for i in range(12):
        registry.register(Req(f"r{i}"))
    stats = registry.statistics().sinks[0]
    assert stats.pending == 5 and stats.dropped == 7
    failing[0] = False
    registry.flush()
    assert sink.lost == [LostRecords(7, 0, 6, "OSError: [Errno 28] No space left on device")]
    assert [r.seq for r in sink.took] == list(range(7, 12))
    report = check_audit([*sink.lost, *sink.took])  # type: ignore[list-item]
    assert report.ok and report.lost_records == 7 and report.lifecycles == 5


def test_a_gap_without_a_marker_is_still_tampering() -> None:
    memory = MemorySink()
    registry = LifecycleRegistry(sinks=[memory])
    for i in range(5):
        registry.register(Req(f"r{i}"))
    records = memory.records()
    del records[2]
    assert [v.kind for v in check_audit(records).violations] == ["seq_gap"]


def test_detaching_a_failing_sink_logs_what_it_never_took(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = Flaky()
    registry = LifecycleRegistry(sinks=[sink])
    registry.register(Req("a"))
    with caplog.at_level(logging.ERROR, logger="kvlife.fsm.sinks"):
        registry.detach(sink)
    assert "never written" in about(sink, caplog)[-1]
    assert registry.sinks == () and registry.statistics().sinks == ()


@pytest.mark.parametrize("k", [2, 3, 7])
def test_a_sink_raising_on_every_kth_write_loses_nothing_unreported(k: int) -> None:
    """Random workload; the flaky sink's records plus its lost ranges are exactly the
    memory sink's records; the registry ends consistent (nothing half-applied)."""
    rng = random.Random(k)
    flaky = Flaky(lambda n: n % k == 0)
    memory = MemorySink(capacity=1 << 20)
    registry = LifecycleRegistry(sinks=[flaky, memory], sink_backlog=50, sink_retry_s=0)
    hooks: list[int] = []
    registry.on_release(lambda lc, req: hooks.append(lc.serial))
    live: list[Any] = []
    tickets: list[Any] = []
    for step in range(3000):
        action = rng.random()
        if action < 0.25 or not live:
            req = Req(f"r{step % 17}")
            if registry.live(req.rid) is None or registry.live(req.rid).outcome is not None:
                registry.register(req)
                live.append(req)
        elif action < 0.55:
            req = rng.choice(live)
            if registry.lifecycle(req).outcome is None:
                tickets.append(registry.start_offload(req))
        elif action < 0.8 and tickets:
            registry.deliver(tickets.pop(rng.randrange(len(tickets))), ok=rng.random() < 0.9)
        else:
            req = live.pop(rng.randrange(len(live)))
            registry.finish(req) if rng.random() < 0.5 else registry.abort(req)
    for ticket in tickets:
        registry.deliver(ticket)
    for req in live:
        registry.finish(req)
    registry.flush()
    assert len(registry) == 0
    assert sorted(hooks) == list(range(registry.statistics().registered))
    expected = [r.seq for r in memory.records()]
    lost = {s for m in flaky.lost for s in range(m.first_seq, m.last_seq + 1)}
    assert sorted([r.seq for r in flaky.took] + sorted(lost)) == expected
    assert [r for r in flaky.took] == [r for r in memory.records() if r.seq not in lost]
    report = check_audit(sorted([*flaky.lost, *flaky.took], key=_order), expect_released=True)
    assert report.ok, report.violations[:3]
    assert check_audit(memory.records(), expect_released=True).ok


def _order(item: AuditRecord | LostRecords) -> tuple[int, int]:
    return (item.first_seq, 0) if isinstance(item, LostRecords) else (item.seq, 1)


_RECOVERS_BEFORE_EXIT = """
import sys
from kvlife.fsm import LifecycleRegistry
class Req:
    def __init__(self, rid): self.rid = rid
class Recovering:
    # fails its first write, then writes each record's seq to a file
    def __init__(self, path): self.path, self.calls = path, 0
    def write(self, record):
        self.calls += 1
        if self.calls == 1:
            raise OSError("not yet")
        with open(self.path, "a") as f:
            f.write(f"{record.seq}\\n")
registry = LifecycleRegistry(sinks=[Recovering(sys.argv[1])], sink_retry_s=3600)
for i in range(10):
    registry.register(Req(f"r{i}"))
# no flush: the records queued behind the failure are settled at exit
"""

_NEVER_RECOVERS = """
from kvlife.fsm import LifecycleRegistry
class Req:
    def __init__(self, rid): self.rid = rid
class Broken:
    def write(self, record):
        raise OSError("disk gone")
registry = LifecycleRegistry(sinks=[Broken()])
for i in range(10):
    registry.register(Req(f"r{i}"))
"""


def test_records_owed_to_a_sink_are_settled_at_exit(tmp_path: Path) -> None:
    out = tmp_path / "seqs"
    done = subprocess.run(
        [sys.executable, "-c", _RECOVERS_BEFORE_EXIT, str(out)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.read_text().split() == [str(seq) for seq in range(10)]
    broken = subprocess.run(
        [sys.executable, "-c", _NEVER_RECOVERS],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert broken.returncode == 0
    assert "10 records were never written (seq 0-9)" in broken.stderr  # lost, never silently


def test_a_failure_is_charged_to_the_sink_that_failed_when_another_is_switched_off() -> None:
    quiet = logging.getLogger("kvlife.test.off")
    quiet.setLevel(logging.WARNING)
    off, flaky = LoggingSink(quiet), Flaky(lambda n: n == 1)
    registry = LifecycleRegistry(sinks=[off, flaky], sink_retry_s=0)
    registry.register(Req("a"))  # only the flaky sink takes records: its first write fails
    registry.register(Req("b"))
    stats = registry.statistics().sinks
    assert [s.errors for s in stats] == [0, 1]
    assert [r.seq for r in flaky.took] == [0, 1]  # the failed record was retried, in order


_DISK_STAYS_FULL = """
import json, os, resource, signal, sys
from kvlife.fsm import JsonLinesSink, LifecycleRegistry
class Req:
    def __init__(self, rid): self.rid = rid
path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
sink = JsonLinesSink(path, fsync="batch", batch_records=16)
registry = LifecycleRegistry(sinks=[sink], sink_backlog=int(sys.argv[2]), sink_retry_s=0)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 8_000, hard))
for i in range(1000):
    req = Req(f"r{i}")
    t = registry.start_offload(registry.register(req), tokens=i)
    registry.finish(req)
    registry.complete(t)
registry.flush()
try:
    sink.close()
except OSError as exc:
    print("close failed:", exc, file=sys.stderr)
def account():
    stats = registry.statistics()
    s = stats.sinks[0]
    return {"records": stats.records, "pending": s.pending, "buffered": s.buffered,
            "dropped": s.dropped, "lost": s.lost}
print(json.dumps(account()))
registry.detach(sink)  # given up on: what it never wrote is logged lost, by range
"""


@pytest.mark.parametrize("backlog", [100_000, 500])
def test_a_disk_that_stays_full_accounts_for_every_record(tmp_path: Path, backlog: int) -> None:
    path = tmp_path / "audit.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", _DISK_STAYS_FULL, str(path), str(backlog)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    closed = json.loads(done.stdout)
    in_file = [r.seq for r in read_audit(path).records]
    produced = closed["records"]
    assert produced == 4000 and 0 < len(in_file) < produced
    # after close(): in the file, buffered in the sink, pending in the backlog, or lost
    assert closed["buffered"] > 0  # the sink's own batch is counted too
    held = closed["buffered"] + closed["pending"] + closed["dropped"]
    assert len(in_file) + held == produced
    lost = [seq for first, last in closed["lost"] for seq in range(first, last + 1)]
    assert len(lost) == closed["dropped"] and not set(lost) & set(in_file)
    # after detach: what was held is given up on, and the message names every range
    said = re.search(r"(\d+) records were never written \(seq ([-0-9, ]+)\)", done.stderr)
    assert said is not None, done.stderr
    lost = []
    for part in said.group(2).split(", "):
        first, _, last = part.partition("-")
        lost += range(int(first), int(last or first) + 1)
    assert int(said.group(1)) == len(lost) == produced - len(in_file)
    assert sorted(in_file + lost) == list(range(produced))  # each seq exactly once


def test_a_sink_that_raises_on_every_write_accounts_for_every_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        def write(self, record: object) -> None:
            raise OSError("disk gone")

        def close(self) -> None:
            pass

    sink = Broken()
    registry = LifecycleRegistry(sinks=[sink], sink_backlog=50, sink_retry_s=0)
    for i in range(30):
        req = Req(f"r{i}")
        registry.finish(registry.register(req))
    sink.close()
    stats = registry.statistics()
    (account,) = stats.sinks
    assert stats.records == 60 == account.pending + account.dropped
    assert account.lost == ((0, 9),) and account.dropped == 10  # the oldest, by range
    with caplog.at_level(logging.ERROR, logger="kvlife.fsm.sinks"):
        registry.detach(sink)
    assert "60 records were never written (seq 0-59)" in about(sink, caplog)[-1]


# --- the one record path --------------------------------------------------------------------


def test_every_record_is_built_in_one_place() -> None:
    """Only the audit path's ``emit`` builds an ``AuditRecord`` of a single call among the
    modules a registry runs (the registry hands it the fields of each accepted or refused
    transition); a batch's records are built in the registry's ``apply`` (accepted ones)
    and its ``collect`` (refusals within the batch), numbered where the audit path's count
    stands, and handed over by the audit path's ``hand_over``, which checks that."""
    import ast  # noqa: PLC0415

    import kvlife.fsm  # noqa: PLC0415

    root = Path(kvlife.fsm.__file__).parent
    builders = []
    for path in [*root.glob("*.py"), root / "audit" / "guard.py"]:
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "AuditRecord"
                ):
                    builders.append(f"{path.name}:{fn.name}")
    # bench.py times the build of a record against the loop around it, and its floor
    assert sorted(set(builders)) == [
        "bench.py:build",
        "bench.py:measure_audit_floor",
        "bench.py:measure_limits",
        "guard.py:emit",
        "registry.py:_collector",  # its nested collect, found twice by the walk
        "registry.py:apply",
        "registry.py:collect",
    ]


def test_the_audit_path_numbers_records_and_takes_none_while_no_sink_does() -> None:
    from kvlife.fsm.audit.guard import AuditPath  # noqa: PLC0415

    path = AuditPath(backlog=4, retry_s=0.0)
    assert not path.active and path.records == 0
    sink = MemorySink()
    path.attach(sink)
    assert path.active and path.sinks == (sink,)
    path.emit("r", 0, "register", None, "allocated", None, None, 0, {})
    path.emit("r", 0, "ack", "offloading", None, "duplicate_ack", 3, 1, {"job": 3})
    first, second = sink.records()
    assert (first.seq, first.ok, first.reason) == (0, True, None)
    assert (second.seq, second.ok, second.reason, second.op) == (1, False, "duplicate_ack", 3)
    assert path.detach(sink) and not path.active and not path.detach(sink)
    with pytest.raises(TypeError, match=r"write\(record\)"):
        path.attach(object())
    assert path.sinks == () and path.records == 2


def test_a_sink_failing_on_the_fast_path_moves_the_path_to_its_guard() -> None:
    from kvlife.fsm.audit.guard import AuditPath  # noqa: PLC0415

    path = AuditPath(backlog=8, retry_s=0.0)
    flaky = Flaky(fail=lambda n: n == 2)
    path.attach(flaky)
    for serial in range(4):
        path.emit("r", serial, "register", None, "allocated", None, None, 0, {})
    (stats,) = path.statistics()
    assert stats.errors == 1 and stats.pending == 0  # the failed record was retried
    assert [r.seq for r in flaky.took] == [0, 1, 2, 3]

"""Checking logs while they are written (``kvlife.fsm.audit.watch``, ``kvlife audit watch``):
logs followed as they grow and rotate, hand-overs joined across two servers' logs live,
each verdict counted once and only when the whole logs would give it too."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvlife.diagrams.cli import main
from kvlife.fsm import JsonLinesSink, LifecycleRegistry
from kvlife.fsm.audit import AuditReader, LostRecords, check_audit, sinks
from kvlife.fsm.audit.handover import block_digest
from kvlife.fsm.audit.reader import MAX_PROBLEMS
from kvlife.fsm.audit.watch import AuditWatch, WatchCollector
from tests.strategies import Req
from tests.violations import clean_log

ENGINE = "prefill-engine-1"
BLOCKS = [3, 4, 5]


def _identity(side: str, rid: str) -> dict[str, str | int]:
    return {
        f"{side}_engine": ENGINE,
        f"{side}_rid": rid,
        f"{side}_blocks": len(BLOCKS),
        f"{side}_digest": block_digest(BLOCKS),
    }


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Servers:
    """A prefill and a decode server's audit logs, written record by record as the audit
    wrapper writes them (each record reaches its file at once unless ``held``)."""

    def __init__(self, directory: Path, **sink: int) -> None:
        self.sinks = {
            name: JsonLinesSink(directory / f"{name}.jsonl", witness="Nixl", **sink)
            for name in ("prefill", "decode")
        }
        self.prefill = LifecycleRegistry(sinks=[self.sinks["prefill"]])
        self.decode = LifecycleRegistry(sinks=[self.sinks["decode"]])
        self.held: set[str] = set()

    def flush(self) -> None:
        for name, sink in self.sinks.items():
            if name not in self.held:
                sink.flush()

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()


def _prefill(servers: Servers, rid: str) -> tuple[Req, object]:
    req = Req(rid)
    servers.prefill.register(req)
    free = servers.prefill.start_offload(req, kind="delayed_free", **_identity("handoff", rid))
    servers.prefill.finish(req, **_identity("handoff", rid))
    servers.flush()
    return req, free


def _decode(servers: Servers, rid: str, of: str) -> tuple[Req, object]:
    req = Req(rid)
    servers.decode.register(req)
    load = servers.decode.start_offload(req, kind="load", tokens=48, **_identity("peer", of))
    servers.flush()
    return req, load


def _watch(tmp_path: Path, clock: Clock) -> AuditWatch:
    return AuditWatch([tmp_path], settle_s=2.0, clock=clock)


def test_a_clean_hand_over_followed_live_gives_no_verdict(tmp_path: Path) -> None:
    clock = Clock()
    servers = Servers(tmp_path)
    watch = _watch(tmp_path, clock)
    _, free = _prefill(servers, "p-1")
    assert watch.poll() == []
    d_req, load = _decode(servers, "d-1", "p-1")
    assert watch.poll() == []
    time.sleep(0.01)
    servers.decode.complete(load, report="finished_recving")  # type: ignore[arg-type]
    servers.prefill.complete(free, report="finished_sending")  # type: ignore[arg-type]
    servers.decode.finish(d_req, **_identity("peer", "p-1"))
    servers.flush()
    for _ in range(3):
        clock.now += 5
        assert watch.poll() == []
    assert sum(watch.violations().values()) == 0
    assert {log.label: log.checker.report.records for log in watch.logs.values()} == {
        str(tmp_path / "decode.jsonl"): 4,
        str(tmp_path / "prefill.jsonl"): 4,
    }
    servers.close()
    watch.close()
    assert check_audit(AuditReader(sorted(tmp_path.glob("*.jsonl")))).ok


def test_blocks_freed_before_the_read_are_counted_once_settled_on_the_decode_log(
    tmp_path: Path,
) -> None:
    clock = Clock()
    servers = Servers(tmp_path)
    watch = _watch(tmp_path, clock)
    _, free = _prefill(servers, "p-1")
    time.sleep(0.02)
    servers.prefill.complete(free, report="finished_sending")  # type: ignore[arg-type]  # lease
    servers.flush()
    assert watch.poll() == []
    time.sleep(0.02)
    d_req, load = _decode(servers, "d-1", "p-1")
    assert watch.poll() == []  # found, but not counted before it has held settle_s
    clock.now += 1
    assert watch.poll() == []
    clock.now += 1.5
    (found,) = watch.poll()
    decode_log = str(tmp_path / "decode.jsonl")
    assert (found.log, found.kind, found.rid) == (decode_log, "freed_before_read", "d-1")
    assert "freed the blocks of 'p-1' (finished_sending)" in found.message
    assert found.line().startswith(f"VIOLATION freed_before_read in {decode_log} rid='d-1': ")
    clock.now += 10
    assert watch.poll() == []  # counted once
    assert watch.violations()[(decode_log, "freed_before_read")] == 1
    servers.decode.complete(load, report="finished_recving")  # type: ignore[arg-type]
    servers.decode.finish(d_req)
    servers.close()
    watch.close()
    whole = check_audit(AuditReader(sorted(tmp_path.glob("*.jsonl"))))
    assert [(v.kind, v.rid) for v in whole.violations] == [("freed_before_read", "d-1")]


def test_a_prefill_log_read_late_makes_no_verdict_the_whole_logs_would_not_give(
    tmp_path: Path,
) -> None:
    """The proxy reuses a prefill id: the first prefill's blocks were freed long ago, the
    second one's are held for the decode side. While the prefill server's newer records
    wait in its buffer, the decode side's load looks like a read of the first prefill's
    freed blocks; once they are read, it is the second's: nothing is counted."""
    clock = Clock()
    servers = Servers(tmp_path)
    watch = _watch(tmp_path, clock)
    _, first = _prefill(servers, "p-1")
    servers.prefill.complete(first, report="finished_sending")  # type: ignore[arg-type]
    servers.flush()
    assert watch.poll() == []
    servers.held.add("prefill")  # its next records stay in its buffer a while
    time.sleep(0.02)
    _, second = _prefill(servers, "p-1")
    time.sleep(0.02)
    _, load = _decode(servers, "d-1", "p-1")
    assert watch.poll() == []
    assert watch._pending, "the partial logs do look wrong"
    clock.now += 1
    servers.sinks["prefill"].flush()
    assert watch.poll() == []
    assert not watch._pending
    clock.now += 10
    servers.decode.complete(load, report="finished_recving")  # type: ignore[arg-type]
    servers.prefill.complete(second, report="finished_sending")  # type: ignore[arg-type]
    servers.sinks["prefill"].flush()
    servers.flush()
    assert watch.poll() == []
    assert sum(watch.violations().values()) == 0
    servers.close()
    watch.close()
    assert check_audit(AuditReader(sorted(tmp_path.glob("*.jsonl")))).ok


def test_a_log_that_rotates_while_followed_is_read_whole(tmp_path: Path) -> None:
    log = tmp_path / "engine.jsonl"
    sink = JsonLinesSink(log, max_bytes=2000, backups=50)
    registry = LifecycleRegistry(sinks=[sink])
    watch = AuditWatch([log], clock=Clock())
    for i in range(60):
        req = Req(f"r-{i}")
        registry.register(req)
        ticket = registry.start_offload(req, tokens=16)
        registry.finish(req)
        registry.complete(ticket)
        if i % 7 == 0:
            sink.flush()
            watch.poll()
    sink.close()
    watch.poll()
    watch.close()
    assert sink.rotations >= 3
    whole = check_audit(AuditReader(log))
    (followed,) = watch.logs.values()
    report = followed.checker.report
    assert (
        (report.records, report.lifecycles, report.released)
        == (
            whole.records,
            whole.lifecycles,
            whole.released,
        )
        == (240, 60, 60)
    )
    assert report.segments == 1 and followed.reader.problem_count == 0
    assert sum(watch.violations().values()) == 0


def _copytruncate(log: Path) -> None:
    """What logrotate's ``copytruncate`` does: copy the log to ``.1``, cut it to 0."""
    log.with_name(f"{log.name}.1").write_bytes(log.read_bytes())
    with log.open("r+b") as file:
        file.truncate(0)


def _rename_create(log: Path) -> None:
    """What logrotate does by default: rename the log to ``.1``, create an empty one."""
    log.rename(log.with_name(f"{log.name}.1"))
    log.touch()


@pytest.mark.parametrize(
    ("move", "after"),
    [(_copytruncate, 3), (_copytruncate, 40), (_rename_create, 3), (Path.unlink, 3)],
    ids=["copytruncate-shorter", "copytruncate-longer-than-read", "rename-create", "rm"],
)
def test_a_log_rotated_by_another_process_while_followed_is_read_whole(
    tmp_path: Path, move: Callable[[Path], None], after: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``after``: lifecycles written after the rotation, before the next poll (40: a file
    cut short is longer again than what was read before, only its first line tells). The
    sink looks at its path at every write here, not once a second."""
    monkeypatch.setattr(sinks, "PATH_CHECK_S", 0.0)
    log = tmp_path / "engine.jsonl"
    sink = JsonLinesSink(log)
    registry = LifecycleRegistry(sinks=[sink])
    watch = AuditWatch([log], clock=Clock())

    def lifecycles(first: int, count: int) -> None:
        for i in range(first, first + count):
            req = Req(f"r-{i}")
            ticket = registry.start_offload(registry.register(req), tokens=16)
            registry.finish(req)
            registry.complete(ticket)
        sink.flush()

    lifecycles(0, 10)
    watch.poll()
    lifecycles(10, 2)  # written before the rotation, not read by the watch yet
    move(log)
    lifecycles(12, after)
    watch.poll()
    lifecycles(12 + after, 5)
    sink.close()
    watch.poll()
    watch.close()
    total = 17 + after
    assert sink.truncations + sink.reopened == 1
    (followed,) = watch.logs.values()
    report = followed.checker.report
    assert (report.records, report.lifecycles, report.released) == (4 * total, total, total)
    assert report.segments == 1 and followed.reader.problem_count == 0
    assert sum(watch.violations().values()) == 0 and followed.failed is None
    if move is not Path.unlink:
        whole = check_audit(AuditReader(log))  # the moved file and the log, one segment
        assert (whole.records, whole.segments, whole.ok) == (4 * total, 1, True)


def test_a_log_already_rotated_when_the_watch_starts_is_read_from_its_oldest_file(
    tmp_path: Path,
) -> None:
    log = tmp_path / "engine.jsonl"
    sink = JsonLinesSink(log, max_bytes=2000, backups=50)
    registry = LifecycleRegistry(sinks=[sink])
    for i in range(30):
        req = Req(f"r-{i}")
        registry.register(req)
        registry.finish(req)
        sink.flush()
    assert sink.rotations >= 2
    watch = AuditWatch([log], clock=Clock())
    watch.poll()
    (followed,) = watch.logs.values()
    assert followed.checker.report.lifecycles == 30 and followed.checker.report.released == 30
    sink.close()
    watch.close()


def test_a_line_still_being_written_is_read_when_it_is_complete(tmp_path: Path) -> None:
    source = tmp_path / "written.jsonl"
    registry = LifecycleRegistry(sinks=[JsonLinesSink(source)])
    req = Req("a")
    registry.register(req)
    registry.finish(req)
    registry.sinks[0].close()
    data = source.read_bytes()
    cut = data.index(b"\n", data.index(b"\n") + 1) + 7  # seven bytes into the 2nd record
    log = tmp_path / "live" / "engine.jsonl"
    log.parent.mkdir()
    watch = AuditWatch([log.parent], clock=Clock())
    assert watch.poll() == [] and not watch.logs  # nothing there yet
    log.write_bytes(data[:cut])
    watch.poll()
    (followed,) = watch.logs.values()
    assert followed.checker.report.records == 1
    with log.open("ab") as f:
        f.write(data[cut:])
    watch.poll()
    assert followed.checker.report.records == 2 and followed.reader.problem_count == 0
    assert followed.checker.report.released == 1 and followed.reader.torn_tail == 0
    watch.close()


def test_a_file_that_is_not_a_log_is_not_followed_and_the_others_are(tmp_path: Path) -> None:
    (tmp_path / "notes.jsonl").write_text('{"hello": 1}\n')
    registry = LifecycleRegistry(sinks=[JsonLinesSink(tmp_path / "engine.jsonl")])
    registry.register(Req("a"))
    registry.sinks[0].flush()
    watch = AuditWatch([tmp_path], clock=Clock())
    watch.poll()
    notes = watch.logs[tmp_path / "notes.jsonl"]
    assert notes.failed is not None and "not a kvlife audit log" in notes.failed
    assert watch.logs[tmp_path / "engine.jsonl"].checker.report.records == 1
    collector = WatchCollector(watch)
    collector.publish()
    registry_ = CollectorRegistry(auto_describe=False)
    registry_.register(collector)  # type: ignore[arg-type]
    text = generate_latest(registry_).decode()
    assert f'kvlife_watch_log_failed{{log="{tmp_path / "notes.jsonl"}"}} 1.0' in text
    assert f'kvlife_watch_log_failed{{log="{tmp_path / "engine.jsonl"}"}} 0.0' in text
    registry.sinks[0].close()
    watch.close()
    watch.close()


def test_a_log_that_cannot_be_read_is_not_followed_and_the_others_are(tmp_path: Path) -> None:
    """Before: ``IsADirectoryError`` out of the poll, and the watch (of every log) died."""
    gone, kept = tmp_path / "gone.jsonl", tmp_path / "kept.jsonl"
    for path in (gone, kept):
        with JsonLinesSink(path) as sink:
            LifecycleRegistry(sinks=[sink]).register(Req(path.stem))
    watch = AuditWatch([gone, kept], clock=Clock())
    assert watch.poll() == []
    gone.unlink()
    gone.mkdir()  # something else at the path now
    kept_sink = JsonLinesSink(kept)
    registry = LifecycleRegistry(sinks=[kept_sink])
    registry.register(Req("later"))
    kept_sink.close()
    assert watch.poll() == []
    failed = watch.logs[gone].failed
    assert failed == f"{gone} cannot be read: Is a directory"
    assert watch.logs[kept].checker.report.records == 2  # still followed
    watch.close()


def test_a_directory_removed_and_made_again_is_still_a_directory_of_logs(
    tmp_path: Path,
) -> None:
    """Before: once removed, its path was taken for a log of its own (a log ``logs`` in
    the counts), which failed the watch when the directory came back."""
    logs = tmp_path / "logs"
    logs.mkdir()
    clean_log(logs / "a.jsonl")
    watch = AuditWatch([logs], clock=Clock())
    watch.poll()
    shutil.rmtree(logs)
    assert watch.poll() == [] and list(watch.logs) == [logs / "a.jsonl"]
    logs.mkdir()
    clean_log(logs / "b.jsonl")
    assert watch.poll() == []
    assert list(watch.logs) == [logs / "a.jsonl", logs / "b.jsonl"]
    assert [log.failed for log in watch.logs.values()] == [None, None]
    assert watch.logs[logs / "b.jsonl"].checker.report.records == 8
    watch.close()


def test_the_watch_tells_unreadable_lines_and_lost_records_as_check_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: counted in ``/metrics`` only; ``--once`` exited 0 where ``check`` fails."""
    path = clean_log(tmp_path / "a.jsonl")
    watch = AuditWatch([path], clock=Clock())
    watch.poll()
    log = watch.logs[path]
    assert log.incomplete() == []
    with path.open("a") as file:
        file.write("not json\n" + "".join(f"junk {i}\n" for i in range(MAX_PROBLEMS + 2)))
    watch.poll()
    told = log.incomplete()
    assert told[0].startswith(f"{path}: unreadable line a.jsonl:11: ")
    assert len(told) == MAX_PROBLEMS + 1 and told[-1] == f"{path}: 3 more unreadable line(s)"
    assert log.incomplete() == []  # each told once
    with path.open("a") as file:
        file.write("junk again\n")
    watch.poll()
    assert log.incomplete() == [f"{path}: 1 more unreadable line(s)"]
    watch.close()
    assert main(["audit", "check", str(path)]) == 1
    assert main(["audit", "watch", "--once", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"kvlife audit watch: {path}: unreadable line a.jsonl:11: " in out
    lost = tmp_path / "lost.jsonl"
    with JsonLinesSink(lost) as sink:
        sink.write_lost(LostRecords(kvlife_lost=2, first_seq=3, last_seq=4, error="disk full"))
    assert main(["audit", "watch", "--once", str(lost)]) == 1
    assert (
        f"kvlife audit watch: {lost}: records lost (sink error): seq 3-4 (2 records): disk full"
        in capsys.readouterr().out
    )


def test_the_collector_serves_every_kind_from_zero_and_the_verdicts_found(
    tmp_path: Path,
) -> None:
    clock = Clock()
    servers = Servers(tmp_path)
    watch = _watch(tmp_path, clock)
    collector = WatchCollector(watch, "edge")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    watch.poll()
    collector.publish()
    decode_log = tmp_path / "decode.jsonl"
    text = generate_latest(registry).decode()
    zero = f'edge_watch_violations_total{{kind="freed_before_read",log="{decode_log}"}} 0.0'
    assert zero in text
    assert f'edge_watch_violations_total{{kind="seq_gap",log="{decode_log}"}} 0.0' in text
    _, free = _prefill(servers, "p-1")
    servers.prefill.complete(free, report="finished_sending")  # type: ignore[arg-type]
    servers.flush()
    time.sleep(0.02)
    _decode(servers, "d-1", "p-1")
    watch.poll()
    clock.now += 3
    watch.poll()
    collector.publish()
    text = generate_latest(registry).decode()
    assert zero.replace("0.0", "1.0") in text
    assert f'edge_watch_records_total{{log="{decode_log}"}} 2.0' in text
    assert "edge_watch_logs 2.0" in text and "edge_watch_handovers 1.0" in text
    servers.close()
    watch.close()


def test_watch_once_prints_the_verdicts_and_exits_as_check_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = Servers(tmp_path)
    _, free = _prefill(servers, "p-1")
    servers.prefill.complete(free, report="finished_sending")  # type: ignore[arg-type]
    time.sleep(0.02)
    _decode(servers, "d-1", "p-1")
    servers.close()
    assert main(["audit", "watch", "--once", str(tmp_path / "prefill.jsonl")]) == 0
    assert main(["audit", "watch", "--once", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "kvlife audit watch: VIOLATION freed_before_read in " in out and "rid='d-1'" in out


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--interval", "0"], "expected seconds between 0.01 and 3600"),
        (["--settle", "-1"], "expected seconds between 0 and 3600"),
        (["--port", "70000"], "a port (0-65535)"),
    ],
)
def test_watch_refuses_bad_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    assert main(["audit", "watch", *argv, str(tmp_path)]) == 2
    assert said in capsys.readouterr().err


def test_watch_says_why_it_cannot_serve_its_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``kvlife: standard output: Address already in use``."""
    path = clean_log(tmp_path / "a.jsonl")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["audit", "watch", "--port", str(port), str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvlife audit watch: cannot serve /metrics on 127.0.0.1:{port}: Address already in use\n"
    )


def test_watch_refuses_a_path_in_no_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "watch", "--once", str(tmp_path / "no" / "such.jsonl")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_an_audit_watch_needs_a_path_and_a_settle_time_that_is_not_negative() -> None:
    with pytest.raises(ValueError, match="no log given"):
        AuditWatch([])
    with pytest.raises(ValueError, match="settle_s must be >= 0"):
        AuditWatch(["x.jsonl"], settle_s=-1)

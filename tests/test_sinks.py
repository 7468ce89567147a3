"""Audit sinks: JSON lines written whole or not at all, flushed at exit and on collection,
owner-only files, rotation, writes after close; a full disk in a subprocess."""

from __future__ import annotations

import errno
import gc
import json
import os
import random
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvlife.fsm import LifecycleRegistry, LoggingSink, MemorySink
from kvlife.fsm.audit import (
    AuditLog,
    AuditLogBusyError,
    AuditRecord,
    AuditSinkClosedError,
    JsonLinesSink,
    LostRecords,
    audit_files,
    check_audit,
    read_audit,
    sinks,
)
from tests.crash import kill_midway
from tests.strategies import Req


def _lifecycles(registry: LifecycleRegistry, n: int) -> None:
    """n lifecycles of four records each: register, start_offload, finish, ack."""
    for i in range(n):
        req = Req(f"r{i}")
        ticket = registry.start_offload(registry.register(req))
        registry.finish(req)
        registry.complete(ticket)


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_sink_never_closed_is_flushed_at_interpreter_exit(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    done = _run(
        """
        import sys
        from kvlife.fsm import JsonLinesSink, LifecycleRegistry
        class Req:
            def __init__(self, rid): self.rid = rid
        registry = LifecycleRegistry(sinks=[JsonLinesSink(sys.argv[1])])  # as the docs show
        for i in range(1000):
            req = Req(f"r{i}")
            t = registry.start_offload(registry.register(req))
            registry.finish(req)
            registry.complete(t)
        """,
        str(path),
    )
    assert done.returncode == 0, done.stderr
    log = read_audit(path)
    assert len(log.records) == 4000 and not log.problems
    assert check_audit(log, expect_released=True).ok
    closing = log.segments[0].closing  # closed at exit: the log says so
    assert closing is not None and closing.kvlife_closed == "exit" and closing.records == 4000


def test_a_collected_sink_writes_its_buffer(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    registry = LifecycleRegistry(sinks=[JsonLinesSink(path, fsync="never")])
    _lifecycles(registry, 10)
    del registry
    gc.collect()
    assert len(read_audit(path).records) == 40


def test_writing_after_close_is_an_error_and_counted_by_the_registry(tmp_path: Path) -> None:
    sink = JsonLinesSink(tmp_path / "a.jsonl", fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    _lifecycles(registry, 1)
    sink.close()
    record = read_audit(sink.path).records[0]
    with pytest.raises(AuditSinkClosedError, match="closed"):
        sink.write(record)
    _lifecycles(registry, 1)  # the registry carries on; the sink's errors are counted
    stats = registry.statistics().sinks[0]
    assert stats.errors >= 1 and stats.pending == 4 and "closed" in (stats.last_error or "")
    assert registry.statistics().released == 2
    for policy in ("record", "batch"):
        closed = JsonLinesSink(tmp_path / f"{policy}.jsonl", fsync=policy)  # type: ignore[arg-type]
        closed.close()
        with pytest.raises(AuditSinkClosedError):
            closed.write(record)


def test_new_files_are_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    old = os.umask(0)
    try:
        JsonLinesSink(path).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def _with_memory(sink: JsonLinesSink) -> tuple[JsonLinesSink, MemorySink, LifecycleRegistry]:
    """``sink`` and a ``MemorySink`` beside it on a new registry: what the file should hold."""
    memory = MemorySink()
    return sink, memory, LifecycleRegistry(sinks=[memory, sink])


def test_rotation_keeps_a_segment_across_files_and_drops_the_oldest(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    sink, memory, registry = _with_memory(
        JsonLinesSink(path, fsync="never", batch_records=8, max_bytes=4000, backups=3)
    )
    _lifecycles(registry, 60)
    sink.close()
    files = audit_files(path)
    assert [f.name for f in files] == ["a.jsonl.3", "a.jsonl.2", "a.jsonl.1", "a.jsonl"]
    assert sink.rotations > 3  # so the oldest files were dropped
    assert all(f.stat().st_size <= 4000 for f in files[:-1])
    log = read_audit(path)
    assert len(log.segments) == 1  # one writer: one segment, continued through the files
    records = log.records
    assert records == memory.records()[-len(records) :]  # the newest, in order
    report = check_audit(log)
    assert report.ok, report.violations[:3]  # starts mid-way: taken as it is found
    # every file alone is a readable log too (each starts with a continuation header)
    assert sum(len(read_audit(f, rotated=False).records) for f in files) == len(records)


def test_a_watchers_log_names_the_witness_in_every_header(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    sink = JsonLinesSink(
        path, fsync="never", batch_records=8, max_bytes=2000, witness="OffloadingConnector"
    )
    _lifecycles(LifecycleRegistry(sinks=[sink]), 30)
    sink.close()
    files = audit_files(path)
    assert len(files) > 1
    headers = [read_audit(f, rotated=False).segments[0].header for f in files]
    assert {h.witness for h in headers if h is not None} == {"OffloadingConnector"}
    with pytest.raises(TypeError, match="witness"):
        JsonLinesSink(tmp_path / "b.jsonl", witness=1)  # type: ignore[arg-type]
    assert not (tmp_path / "b.jsonl").exists()


def test_rotation_with_no_backups_starts_over(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    sink = JsonLinesSink(path, fsync="never", batch_records=4, max_bytes=2000, backups=0)
    _lifecycles(LifecycleRegistry(sinks=[sink]), 40)
    sink.close()
    assert audit_files(path) == [path] and path.stat().st_size <= 2000
    assert check_audit(read_audit(path)).ok


def _next_part(path: Path, sink: JsonLinesSink, memory: MemorySink) -> AuditLog:
    """``path`` alone (its rotated files left out), checked to be part 1 of ``sink``'s
    segment that holds the newest of the records ``memory`` holds too."""
    alone = read_audit(path, rotated=False)
    [header] = [s.header for s in alone.segments]
    assert header is not None and (header.segment, header.part) == (sink.segment, 1)
    assert alone.records == memory.records()[-len(alone.records) :]
    return alone


def test_a_log_cut_short_in_place_goes_on_as_the_next_part_of_its_segment(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.jsonl"
    sink, memory, registry = _with_memory(JsonLinesSink(path, fsync="never", batch_records=8))
    _lifecycles(registry, 10)
    sink.flush()
    path.with_name("a.jsonl.1").write_bytes(path.read_bytes())  # logrotate's copytruncate
    os.truncate(path, 0)
    _lifecycles(registry, 10)
    sink.close()
    assert sink.truncations == 1 and "cut short by another process" in caplog.text
    alone = _next_part(path, sink, memory)  # before: "not a kvlife audit log"
    assert check_audit(alone).ok
    whole = read_audit(path)  # the copy, then the log: one segment, every record
    assert len(whole.segments) == 1 and whole.records == memory.records()
    report = check_audit(whole, expect_released=True)
    assert report.ok and report.endings[0].status == "closed"


@pytest.mark.parametrize("how", ["rename-create", "rename", "rm"])
def test_a_log_moved_away_under_its_writer_goes_on_at_its_path(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What logrotate does by default (rename, then create an empty file), a rename with no
    new file, and an ``rm``: before, every later record went to the file moved away (or
    to one nobody could open) and the path stayed empty or absent. (The sink looks at
    every write here, not once a second.)"""
    monkeypatch.setattr(sinks, "PATH_CHECK_S", 0.0)
    path = tmp_path / "a.jsonl"
    sink, memory, registry = _with_memory(JsonLinesSink(path, fsync="never", batch_records=8))
    _lifecycles(registry, 5)
    sink.flush()
    if how == "rm":
        path.unlink()
    else:
        path.rename(tmp_path / "a.jsonl.1")
        if how == "rename-create":
            path.touch()
    _lifecycles(registry, 5)
    sink.close()
    assert sink.reopened == 1 and "removed or renamed by another process" in caplog.text
    alone = _next_part(path, sink, memory)
    assert len(alone.records) == 20 and check_audit(alone).ok
    if how != "rm":
        whole = read_audit(path)  # the moved file, then the new one: one segment
        assert len(whole.segments) == 1 and whole.records == memory.records()
        assert check_audit(whole, expect_released=True).ok


def test_a_rename_is_seen_within_a_second_and_what_came_before_is_in_the_moved_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.jsonl"
    sink, memory, registry = _with_memory(JsonLinesSink(path, fsync="never", batch_records=4))
    _lifecycles(registry, 2)
    path.rename(tmp_path / "a.jsonl.1")
    path.touch()
    _lifecycles(registry, 2)  # the sink looked less than a second ago: to the moved file
    assert sink.reopened == 0
    time.sleep(sinks.PATH_CHECK_S)
    _lifecycles(registry, 2)
    sink.close()
    assert sink.reopened == 1
    assert len(read_audit(path, rotated=False).records) == 8
    whole = read_audit(path)
    assert whole.records == memory.records() and check_audit(whole, expect_released=True).ok


def test_a_log_whose_directory_is_gone_fails_its_writes_until_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not written into a file nobody can open: a failing sink, its records kept and
    retried, and written once the directory is back."""
    monkeypatch.setattr(sinks, "PATH_CHECK_S", 0.0)
    directory = tmp_path / "logs"
    directory.mkdir()
    memory = MemorySink()
    sink = JsonLinesSink(directory / "a.jsonl", fsync="never", batch_records=1)
    registry = LifecycleRegistry(sinks=[memory, sink], sink_retry_s=0)
    _lifecycles(registry, 1)
    shutil.rmtree(directory)
    _lifecycles(registry, 2)
    [stats] = [s for s in registry.sink_statistics() if "JsonLinesSink" in s.sink]
    assert stats.errors >= 1 and stats.pending and "No such file" in stats.last_error
    directory.mkdir()
    _lifecycles(registry, 1)  # the next write retries the kept records first
    sink.close()
    log = read_audit(directory / "a.jsonl", rotated=False)
    assert log.records == memory.records()[4:] and sink.reopened == 1
    assert check_audit(log).ok


def test_a_relative_path_keeps_naming_the_file_it_opened_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    sink = JsonLinesSink("a.jsonl", fsync="never", batch_records=4, max_bytes=2000, backups=50)
    registry = LifecycleRegistry(sinks=[sink])
    _lifecycles(registry, 2)
    monkeypatch.chdir(tmp_path / "there")
    _lifecycles(registry, 20)  # written, and rotated, where the sink was opened
    sink.close()
    assert not list((tmp_path / "there").iterdir()) and sink.reopened == 0
    log = read_audit(tmp_path / "here" / "a.jsonl")
    assert len(log.records) == 88 and check_audit(log, expect_released=True).ok


def test_sink_arguments_for_rotation_are_checked(tmp_path: Path) -> None:
    for bad in ({"max_bytes": 0}, {"max_bytes": 1.5}, {"backups": -1}, {"backups": True}):
        with pytest.raises(ValueError, match=r"max_bytes|backups"):
            JsonLinesSink(tmp_path / "x.jsonl", **bad)  # type: ignore[arg-type]


def test_memory_sink_keeps_lost_markers() -> None:
    sink = MemorySink()
    sink.write_lost(LostRecords(3, 10, 12, "OSError: boom"))
    assert sink.lost() == [LostRecords(3, 10, 12, "OSError: boom")] and len(sink) == 0


_FULL_DISK = """
import os, resource, sys
from kvlife.fsm import JsonLinesSink, LifecycleRegistry
class Req:
    def __init__(self, rid): self.rid = rid
path, policy, backlog = sys.argv[1], sys.argv[2], int(sys.argv[3])
sink = JsonLinesSink(path, fsync=policy, batch_records=16)
registry = LifecycleRegistry(sinks=[sink], sink_backlog=backlog, sink_retry_s=0)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 20_000, hard))
def work(n, start):
    for i in range(start, start + n):
        req = Req(f"r{i}")
        t = registry.start_offload(registry.register(req), tokens=i)
        registry.finish(req)
        registry.complete(t)
work(500, 0)                                   # the disk fills up during this
stats = registry.statistics()
assert stats.released == 500 and len(registry) == 0, stats
assert stats.sinks[0].errors > 0, stats.sinks
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))   # space again
work(50, 500)
registry.flush()
sink.close()
print(registry.statistics().sinks[0])
"""


@pytest.mark.parametrize(
    ("policy", "backlog"), [("batch", 100_000), ("record", 100_000), ("batch", 100)]
)
def test_a_full_disk_loses_nothing_that_is_not_reported_as_lost(
    tmp_path: Path, policy: str, backlog: int
) -> None:
    path = tmp_path / "audit.jsonl"
    done = _run(_FULL_DISK, str(path), policy, str(backlog))
    assert done.returncode == 0, done.stderr
    # logged through logging once per failure episode (a smaller write may fit again
    # for a moment near the limit), never once per failed record
    failed, recovered = done.stderr.count("failed (write)"), done.stderr.count("recovered")
    errors = int(re.search(r"errors=(\d+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert 1 <= failed == recovered and failed * 10 < errors, (failed, recovered, errors)
    log = read_audit(path)
    assert not log.problems and log.torn_tail == 0  # no partial line anywhere
    seqs = [r.seq for r in log.records]
    lost = [(m.first_seq, m.last_seq) for s in log.segments for m in s.lost]
    covered = sorted(seqs + [s for lo, hi in lost for s in range(lo, hi + 1)])
    assert covered == list(range(550 * 4))  # every record written or reported lost, once
    report = check_audit(log, expect_released=True)
    assert report.ok, report.violations[:3]
    if backlog >= 2200:
        assert not lost and report.lost_records == 0
    else:
        assert lost and report.lost_records == sum(hi - lo + 1 for lo, hi in lost)


def _rotating_writer(path: Path, run: int, report_fd: int) -> None:  # pragma: no cover - child
    sink = JsonLinesSink(path, fsync="record", max_bytes=1200, backups=10_000)
    registry = LifecycleRegistry(sinks=[sink])
    i = 0
    while True:
        rid = f"run{run}-{i}"
        req = Req(rid)
        registry.register(req)
        os.write(report_fd, f"{rid}\n".encode())  # its record is on disk now
        registry.finish(req)
        i += 1


def test_sigkill_during_rotation_loses_no_returned_record(tmp_path: Path) -> None:
    rng = random.Random(5)
    path = tmp_path / "audit.jsonl"
    returned: list[str] = []
    for run in range(25):
        returned += kill_midway(
            lambda fd, run=run: _rotating_writer(path, run, fd),
            rng.randint(1, 30),
            rng.random() * 0.003,  # mid-write and mid-rotation included
        )
    files = audit_files(path)
    assert len(files) > 10  # it did rotate, many times
    log = read_audit(path)
    assert not log.problems, log.problems[:3]
    registered = [r.rid for r in log.records if r.trigger == "register"]
    assert len(registered) == len(set(registered))  # no record in two files
    assert set(returned) <= set(registered)  # every returned record is in the set
    assert len(log.segments) == 25  # one per writer, whatever the files
    assert check_audit(log).ok


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_a_flush_interval_bounds_how_long_a_record_waits(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    sink = JsonLinesSink(path, flush_interval_s=0.05)
    registry = LifecycleRegistry(sinks=[sink])
    _lifecycles(registry, 3)  # fewer than a batch: nothing would be written yet
    assert _lines(path) == 1  # the header
    deadline = time.monotonic() + 5
    while _lines(path) == 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    written = _lines(path)
    assert written > 1  # written by the sink's own thread, no call from the writer
    _lifecycles(registry, 1)
    sink.close()
    assert _lines(path) > written and sink.closed


def test_flush_interval_is_checked(tmp_path: Path) -> None:
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="flush_interval_s"):
            JsonLinesSink(tmp_path / "a.jsonl", flush_interval_s=bad)  # type: ignore[arg-type]


def test_an_open_marker_tells_the_next_writer_of_an_unclean_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.jsonl"
    marker = tmp_path / "a.jsonl.open"
    first = JsonLinesSink(path, open_marker=True)
    assert marker.exists() and first.previous_unclean is None
    first.close()
    assert not marker.exists()  # closed: nothing to say next time
    clean = JsonLinesSink(path, open_marker=True)
    assert clean.previous_unclean is None
    clean.close()
    # a writer that never closes (killed outright) leaves its marker behind
    marker.write_text("pid 4242, opened 2026-12-01T00:00:00+0000")
    with caplog.at_level("WARNING", logger="kvlife.fsm.sinks"):
        after = JsonLinesSink(tmp_path / "a.jsonl", open_marker=True)
    assert after.previous_unclean == "pid 4242, opened 2026-12-01T00:00:00+0000"
    assert "pid 4242" in caplog.text and "stopped without closing" in caplog.text
    after.close()


def test_a_second_writer_of_a_file_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    first = JsonLinesSink(path, open_marker=True)
    _lifecycles(LifecycleRegistry(sinks=[first]), 2)
    first.flush()
    with path.open("ab") as file:
        file.write(b'{"seq": 8, "t_ns"')  # a line the first writer is writing now
    written, marker = path.read_bytes(), Path(f"{path}.open").read_text()
    with pytest.raises(AuditLogBusyError, match=r"another writer \(its marker a.jsonl.open: pid"):
        JsonLinesSink(path, open_marker=True)  # before: interleaved, and trimmed that line
    assert path.read_bytes() == written and Path(f"{path}.open").read_text() == marker
    other = _run(  # another process: the same
        """
        import sys
        from kvlife.fsm.audit import AuditLogBusyError, JsonLinesSink
        try:
            JsonLinesSink(sys.argv[1])
        except AuditLogBusyError as exc:
            print("busy:", exc)
        """,
        str(path),
    )
    assert other.stdout.startswith("busy: audit log"), other.stderr
    assert path.read_bytes() == written
    first.close()
    JsonLinesSink(path).close()  # the first writer closed: the file is free again


def test_write_out_puts_the_records_in_the_file_and_the_thread_syncs_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.jsonl"
    sink = JsonLinesSink(path, flush_interval_s=0.05, fsync="batch")
    registry = LifecycleRegistry(sinks=[sink])
    _lifecycles(registry, 2)
    sink.write_out()
    assert len(read_audit(path).records) == 8  # in the file: a killed process keeps them
    deadline = time.monotonic() + 5
    while sink._file.unsynced and time.monotonic() < deadline:  # fsynced on the period
        time.sleep(0.01)
    assert not sink._file.unsynced
    sink.close()


def test_a_writer_killed_outright_loses_at_most_its_last_interval_and_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.jsonl"
    child = _run(
        """
        import os, sys, time
        from kvlife.fsm import JsonLinesSink, LifecycleRegistry
        from tests.strategies import Req
        sink = JsonLinesSink(sys.argv[1], flush_interval_s=0.1, open_marker=True)
        registry = LifecycleRegistry(sinks=[sink])
        def lifecycle(rid):
            req = Req(rid)
            ticket = registry.start_offload(registry.register(req))
            registry.finish(req)
            registry.complete(ticket)
        lifecycle("old")
        time.sleep(1.0)  # ten intervals: these four records are in the file
        lifecycle("new")  # these are not, when the process dies at once
        os._exit(9)
        """,
        str(path),
    )
    assert child.returncode == 9, child.stderr
    assert [r.rid for r in read_audit(path).records] == ["old"] * 4
    assert Path(f"{path}.open").exists()
    with caplog.at_level("WARNING", logger="kvlife.fsm.sinks"):
        sink = JsonLinesSink(path, open_marker=True)
    assert sink.previous_unclean is not None and "stopped without closing" in caplog.text
    sink.close()


def test_a_sink_nobody_holds_any_more_does_not_keep_its_file_from_the_next(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.jsonl"
    registry = LifecycleRegistry(sinks=[JsonLinesSink(path)])
    _lifecycles(registry, 1)
    del registry  # never closed; its sink waits for the garbage collector
    sink = JsonLinesSink(path)  # collected first: its records and closing are written
    sink.close()
    log = read_audit(path)
    assert [s.closing.kvlife_closed for s in log.segments if s.closing] == ["exit", "close"]
    assert check_audit(log, expect_released=True).lifecycles == 1


def test_a_second_writer_waits_for_the_first_to_close_when_told_to(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.jsonl"
    first = JsonLinesSink(path, open_marker=True)
    closing = threading.Timer(0.3, first.close)  # a restarted server's old process
    closing.start()
    with caplog.at_level("WARNING", logger="kvlife.fsm.sinks"):
        second = JsonLinesSink(path, open_marker=True, lock_wait_s=30)
    closing.join()
    assert "held by another writer (its marker a.jsonl.open: pid" in caplog.text
    assert second.previous_unclean is None  # the first one closed cleanly
    began = time.monotonic()
    with pytest.raises(AuditLogBusyError):
        JsonLinesSink(path, lock_wait_s=0.2)
    assert time.monotonic() - began >= 0.2
    second.close()
    assert check_audit(read_audit(path)).ok and len(read_audit(path).segments) == 2
    for bad in (-1, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="lock_wait_s"):
            JsonLinesSink(path, lock_wait_s=bad)  # type: ignore[arg-type]


def test_a_child_forked_while_a_sink_is_open_writes_nothing_and_holds_no_lock(
    tmp_path: Path,
) -> None:
    """Before: a child that exited normally wrote the records its parent had buffered
    (the parent wrote them too: ``seq_gap`` and ``serial_reused`` violations nobody
    committed) and an ``exit`` closing record, removed the parent's ``.open`` marker, and
    a child still running kept a restarted writer from the file."""
    path = tmp_path / "a.jsonl"
    child = _run(
        """
        import os, sys
        from kvlife.fsm import JsonLinesSink, LifecycleRegistry
        from tests.strategies import Req
        path = sys.argv[1]
        sink = JsonLinesSink(path, open_marker=True, flush_interval_s=3600)
        registry = LifecycleRegistry(sinks=[sink])
        held = [Req("parent-1")]
        registry.register(held[0])  # buffered when the children are forked
        print("parent:", os.getpid(), flush=True)
        pid = os.fork()
        if pid == 0:  # exits normally: interpreter exit, finalizers
            registry.register(Req("child"))
            print("child:", registry.statistics().sinks[0].last_error, flush=True)
            sys.exit(0)
        os.waitpid(pid, 0)
        print("marker after the child:", os.path.exists(path + ".open"), flush=True)
        held.append(Req("parent-2"))
        registry.register(held[1])
        ready, go = os.pipe()
        pid = os.fork()
        if pid == 0:  # still running while its parent closes and a new writer opens
            os.read(ready, 1)
            os._exit(0)
        try:
            sink.close()
            JsonLinesSink(path).close()  # before: AuditLogBusyError, the child held the lock
            print("reopened while the child ran", flush=True)
        finally:
            os.write(go, b"x")
            os.waitpid(pid, 0)
        """,
        str(path),
    )
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    parent = lines[0].removeprefix("parent: ")
    assert lines[1:] == [
        f"child: AuditSinkClosedError: audit sink {path} belongs to process {parent}: "
        "a process forked from it writes nothing to its log",
        "marker after the child: True",
        "reopened while the child ran",
    ], child.stdout
    log = read_audit(path)
    assert [r.rid for r in log.records] == ["parent-1", "parent-2"]
    assert [s.closing.kvlife_closed for s in log.segments if s.closing] == ["close", "close"]
    assert check_audit(log).ok


def test_a_sink_that_cannot_open_lets_go_of_its_file_and_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a marker that could not be written (here a link to nowhere) left the file
    open, locked and begun (a header: a segment cut short), and every later sink of this
    process on the path was refused with ``AuditLogBusyError``."""
    path = tmp_path / "a.jsonl"
    marker = Path(f"{path}.open")
    marker.symlink_to(tmp_path / "nowhere" / "marker")
    with pytest.raises(FileNotFoundError):
        JsonLinesSink(path, open_marker=True)
    assert path.read_bytes() == b""
    JsonLinesSink(path).close()  # the file is free
    written = path.read_bytes()
    marker.unlink()
    marker.write_text("pid 1, opened earlier")  # a writer that stopped without closing

    def full(*_args: object, **_kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sinks._JsonFile, "_write_all", full)  # the header cannot be written
    with pytest.raises(OSError, match="No space left"):
        JsonLinesSink(path, open_marker=True)
    monkeypatch.undo()
    assert path.read_bytes() == written
    assert marker.read_text() == "pid 1, opened earlier"  # as it was: the next one is told
    sink = JsonLinesSink(path, open_marker=True)
    assert sink.previous_unclean == "pid 1, opened earlier"
    sink.close()


def test_settle_writes_out_and_drops_the_marker_but_keeps_writing(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    sink = JsonLinesSink(path, flush_interval_s=3600, open_marker=True)
    registry = LifecycleRegistry(sinks=[sink])
    _lifecycles(registry, 2)
    assert sink.settle() is True  # a termination signal: the log is whole up to now
    assert not Path(f"{path}.open").exists()
    assert check_audit(read_audit(path).events(), expect_released=True).lifecycles == 2
    _lifecycles(registry, 1)  # the writer goes on: its records are still written
    sink.close()
    assert check_audit(read_audit(path).events(), expect_released=True).lifecycles == 3
    assert JsonLinesSink(path, open_marker=True).previous_unclean is None


def test_settle_never_waits_and_refuses_a_sink_whose_writes_take_no_lock(
    tmp_path: Path,
) -> None:
    sink = JsonLinesSink(tmp_path / "a.jsonl", flush_interval_s=3600, open_marker=True)
    with sink._file.lock:  # the signal arrived in the middle of a write
        assert sink.settle() is False
    assert Path(f"{tmp_path / 'a.jsonl'}.open").exists()
    sink.close()
    plain = JsonLinesSink(tmp_path / "b.jsonl", open_marker=True)  # no flush thread
    assert plain.settle() is False and Path(f"{tmp_path / 'b.jsonl'}.open").exists()
    plain.close()
    assert sink.settle() is True  # closed: nothing to settle


def test_waiting_says_whether_a_write_out_has_anything_to_write(tmp_path: Path) -> None:
    sink = JsonLinesSink(tmp_path / "a.jsonl", fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    assert not sink.waiting
    registry.register(Req("a"))
    assert sink.waiting
    sink.write_out()
    assert not sink.waiting
    sink.close()


def test_the_flush_thread_fsyncs_without_holding_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timed flush writes the buffer under the sink's lock and fsyncs outside it: a
    record written while the disk is slow to sync is taken at once, and the sync is
    recorded once it is over."""
    from kvlife.fsm.audit import sinks  # noqa: PLC0415

    syncing = threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        syncing.set()
        time.sleep(0.6)
        real_fsync(fd)

    sink = JsonLinesSink(tmp_path / "a.jsonl", fsync="batch", flush_interval_s=0.05)
    registry = LifecycleRegistry(sinks=[sink])
    registry.register(Req("a"))
    monkeypatch.setattr(sinks.os, "fsync", slow_fsync)
    assert syncing.wait(5)  # the flush thread is inside its fsync now
    started = time.monotonic()
    registry.register(Req("b"))  # takes the sink's lock
    assert time.monotonic() - started < 0.3
    monkeypatch.setattr(sinks.os, "fsync", real_fsync)
    deadline = time.monotonic() + 5
    while sink.buffered or sink._file.unsynced:  # the next interval writes and syncs "b"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sink.close()
    assert [r.rid for r in read_audit(tmp_path / "a.jsonl").records] == ["a", "b"]


# --- the closing record: a log that closed says so ---------------------------------------


def test_a_closed_sink_ends_its_segment_with_a_closing_record(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    sink = JsonLinesSink(path, fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    _lifecycles(registry, 3)  # released
    held = Req("held")
    registry.start_offload(registry.register(held))  # live, one copy in flight
    registry.flush()
    sink.close()
    log = read_audit(path)
    assert log.segments[0].header is not None and log.segments[0].header.closes
    closing = log.segments[0].closing
    assert closing is not None and closing.kvlife_closed == "close"
    assert (closing.records, closing.live, closing.open_tickets) == (len(log.records), 1, 1)
    assert json.loads(path.read_text().splitlines()[-1])["kvlife_closed"] == "close"
    report = check_audit(log)
    assert [e.status for e in report.endings] == ["closed"]


def test_a_settled_sink_says_it_closed_on_a_signal_and_a_later_close_closes_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    sink = JsonLinesSink(path, flush_interval_s=60, open_marker=True)
    registry = LifecycleRegistry(sinks=[sink])
    _lifecycles(registry, 2)
    assert sink.settle()
    assert not Path(f"{path}.open").exists()
    log = read_audit(path)
    assert log.segments[0].closing is not None
    assert log.segments[0].closing.kvlife_closed == "signal"
    _lifecycles(registry, 1)  # the writer went on after all
    registry.flush()
    sink.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("kvlife_closed") for line in lines if "kvlife_closed" in line] == [
        "signal",
        "close",
    ]
    assert read_audit(path).segments[0].closing.kvlife_closed == "close"  # type: ignore[union-attr]


def test_a_sink_not_attached_to_a_registry_counts_nothing_live(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with JsonLinesSink(path) as sink:
        sink.write(
            AuditRecord(0, 1, "r", 0, "register", None, "allocated", True, None, None, 0, {})
        )
    closing = read_audit(path).segments[0].closing
    assert closing is not None and (closing.records, closing.live, closing.open_tickets) == (
        1,
        None,
        None,
    )


def test_a_rotated_segment_ends_with_one_closing_record_in_its_last_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    sink = JsonLinesSink(path, fsync="never", max_bytes=2000, backups=10)
    registry = LifecycleRegistry(sinks=[sink])
    _lifecycles(registry, 40)
    registry.flush()
    sink.close()
    assert sink.rotations > 0
    texts = [p.read_text() for p in sorted(tmp_path.glob("audit.jsonl*"))]
    assert sum(text.count("kvlife_closed") for text in texts) == 1
    assert "kvlife_closed" in path.read_text().splitlines()[-1]
    report = check_audit(read_audit(path))
    assert [e.status for e in report.endings] == ["closed"]


@pytest.mark.parametrize(
    ("logger", "level", "error"),
    [(None, 20, TypeError), (42, 20, TypeError), ("x", "INFO", ValueError), ("x", -1, ValueError)],
)
def test_a_logging_sink_refuses_what_is_no_logger_or_level(
    logger: object, level: object, error: type[Exception]
) -> None:
    """Before: built, and the first record raised inside ``logging`` (a level that is not
    an int) or on ``None``."""
    with pytest.raises(error, match=r"logger must be|level must be"):
        LoggingSink(logger, level)  # type: ignore[arg-type]

"""Audit sinks: where a registry's records go.

A sink is any object with ``write(record)``; it may also have ``write_lost(marker)``,
``flush()`` and ``close()``. A sink's ``write`` either takes the record (it will be in the
log, or the sink reports otherwise when it is closed) or raises, and then the record was
not taken: the registry keeps it in a bounded backlog and offers it again (see
[`kvlife.fsm.audit.guard`][kvlife.fsm.audit.guard]). A sink never takes a record half.

* [`MemorySink`][kvlife.fsm.audit.sinks.MemorySink] -- an in-memory ring of the newest records.
* [`JsonLinesSink`][kvlife.fsm.audit.sinks.JsonLinesSink] -- a JSON-lines file: header per
  segment, fsync policy, owner-only permissions, size-based rotation, flushed at interpreter
  exit and when collected, never a partial line in the middle of the file, a closing
  record at the end of every segment it closes (so a log that ends without one was cut
  short).
* [`LoggingSink`][kvlife.fsm.audit.sinks.LoggingSink] -- one stdlib ``logging`` call per record.

Why one module: the sinks are one interface (``write``, ``write_many``, ``flush``,
``close``) with a few implementations that share the record encoding; what guards them
from failing is ``guard``'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import gc
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, Literal

from kvlife.fsm.audit.guard import format_ranges, seq_ranges
from kvlife.fsm.audit.records import (
    AuditHeader,
    AuditRecord,
    ClosingHow,
    LostRecords,
    encode_lines,
    encode_record,
    make_closing,
    make_header,
)

_log: Final = logging.getLogger("kvlife.fsm.sinks")


class AuditSinkError(OSError):
    """A sink could not take a record. The record was not written, and nothing half."""


class AuditLogBusyError(AuditSinkError):
    """Another writer holds the audit log file (another process, or another sink of this
    one): two writers would interleave their segments in one file, which reads as records
    missing and serials reused. Nothing was written, trimmed or marked; give each writer
    (each server, each data-parallel rank) a path of its own."""


PATH_CHECK_S: Final = 1.0
"""How often (seconds, at most) a [`JsonLinesSink`][kvlife.fsm.audit.sinks.JsonLinesSink]
looks whether its file was removed or its path names another file (a rename by
logrotate); a file cut short in place is seen at every write."""

SERVER_LOCK_WAIT_S: Final = 10.0
"""How long kvlife's engine adapters (the vLLM connectors, SGLang's manager, the HiCache
lens) wait for another writer to close their audit log before they refuse to start: a
server restarted while its old process is still stopping."""


def _holder(path: Path) -> str:
    """What the ``.open`` marker beside ``path`` says of its writer, for a message."""
    marker = Path(f"{path}.open")
    try:
        return f" (its marker {marker.name}: {marker.read_text(errors='replace').strip()})"
    except OSError:
        return ""


def _claim(path: Path, wait_s: float = 0.0) -> int:
    """Open ``path`` for appending (created owner-only) and take the writer's lock on it
    (``flock``: released when the writer closes it or dies, so a crash leaves none),
    waiting up to ``wait_s`` seconds for a writer that holds it.

    Raises:
        AuditLogBusyError: another writer still holds it. Nothing was changed.
    """
    # Owner-only: rids can identify users. An existing file keeps its mode.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    told = collected = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not collected:  # a sink nobody holds any more closes when it is collected
                collected = True
                gc.collect()
                continue
            if time.monotonic() < deadline:
                if not told:
                    told = True
                    _log.warning(
                        "audit log %s is held by another writer%s; waiting up to %.0f s "
                        "for it to close",
                        path,
                        _holder(path),
                        wait_s,
                    )
                time.sleep(0.05)
                continue
            os.close(fd)
            raise AuditLogBusyError(
                f"audit log {path} is being written by another writer{_holder(path)}; "
                f"two writers would interleave their records in one file: give each its "
                f"own path. Nothing was written"
            ) from None
        except OSError:  # a file system without locks: written unguarded
            pass
        return fd


class AuditSinkClosedError(AuditSinkError, ValueError):
    """A record was given to a sink after
    [`JsonLinesSink.close()`][kvlife.fsm.audit.sinks.JsonLinesSink.close], or in a child
    process forked while it was open (a ``ValueError`` too, like writing to a closed
    file)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class MemorySink:
    """An in-memory ring of the newest ``capacity`` records.

    Appending is O(1); when the ring is full the oldest record is dropped (the ``seq`` of
    the oldest record held says how many went before it). Markers of records the
    registry had to drop for this sink are kept in
    [`lost()`][kvlife.fsm.audit.sinks.MemorySink.lost].
    """

    __slots__ = ("_lost", "_ring", "write", "write_many")

    def __init__(self, capacity: int = 65536) -> None:
        if not _is_int(capacity) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self._ring: deque[AuditRecord] = deque(maxlen=capacity)
        self._lost: list[LostRecords] = []
        self.write = self._ring.append  # the hot path calls the deque directly
        #: A batch's records, in order (a registry's ``apply``): one ``deque.extend``.
        self.write_many = self._ring.extend

    @property
    def capacity(self) -> int:
        """Most records the ring keeps."""
        return self._ring.maxlen or 0

    def records(self) -> list[AuditRecord]:
        """The records held, oldest first."""
        return list(self._ring)

    def write_lost(self, marker: LostRecords) -> None:
        """Remember that the registry dropped a range of records for this sink."""
        self._lost.append(marker)

    def lost(self) -> list[LostRecords]:
        """Ranges of records the registry had to drop for this sink, oldest first."""
        return list(self._lost)

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator[AuditRecord]:
        return iter(list(self._ring))

    def clear(self) -> None:
        """Forget every record held."""
        self._ring.clear()

    def flush(self) -> None:
        """Nothing to flush; present so every sink can be flushed alike."""

    def close(self) -> None:
        """Nothing to close; present so every sink can be closed alike."""


FsyncPolicy = Literal["never", "batch", "record"]


def trim_torn_tail(path: str | os.PathLike[str]) -> int:
    """Cut a torn last line (bytes after the last newline) off ``path``.

    Returns the number of bytes removed (0 when the file ends with a newline, is empty or
    does not exist). Complete lines are never touched.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        end = size
        chunk = 65536
        while end > 0:
            start = max(0, end - chunk)
            os.lseek(fd, start, os.SEEK_SET)
            block = os.read(fd, end - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            os.ftruncate(fd, keep)
            os.fsync(fd)
        return size - keep
    finally:
        os.close(fd)


def rotated_name(path: Path, index: int) -> Path:
    """The name of the ``index``-th backup of ``path`` (``audit.jsonl.1`` is the newest)."""
    return path if index == 0 else path.with_name(f"{path.name}.{index}")


_Item = AuditRecord | LostRecords

WRITE_CHUNK: Final = 256
"""Most records a [`JsonLinesSink`][kvlife.fsm.audit.sinks.JsonLinesSink] buffers before it
writes them (one msgspec call, one ``write``). Measured on a 2-core VM with CPython 3.11
(``kvlife bench audit``): 256-512 records a write cost about 290 ns a record, encoding
included; 4096 (45 KB against 720 KB a write) cost 650 ns, the copy of a buffer that no
longer fits the CPU's cache into the page cache taking most of it."""


class _JsonFile:
    """The open file of a [`JsonLinesSink`][kvlife.fsm.audit.sinks.JsonLinesSink]: everything its
    exit-time flush needs, and no reference to the sink, so the sink can be collected."""

    def __init__(
        self,
        path: Path,
        fsync: FsyncPolicy,
        max_bytes: int | None,
        backups: int,
        marker: Path | None = None,
        witness: str = "",
        fd: int | None = None,
    ) -> None:
        self.path = path
        self.marker = marker
        # held by every buffer and file operation when a flush thread runs beside the
        # writer
        self.lock = threading.Lock()
        self.unsynced = False  # written by write_out() and not fsynced yet
        self.sync = fsync != "never"
        self.max_bytes = max_bytes
        self.backups = backups
        self.buffer: list[_Item] = []
        self.records_written = 0
        self.in_file = 0  # records in the current file: a file with none is not rotated
        self.rotations = 0
        self.truncations = 0
        self.reopened = 0
        self.where = str(path)
        self.ident = (0, 0)  # (device, inode) of the file open
        self.look_at = 0.0  # monotonic time of the next look at what the path names
        # (live lifecycles, copies in flight) of the registry the sink is attached to,
        # for the closing record; weak, so that the sink keeps no registry alive
        self.state: weakref.WeakMethod[Callable[[], tuple[int, int]]] | None = None
        self.header = make_header(witness=witness, closes=True)
        self.owner = os.getpid()  # a child forked from it lets go of the file: forked()
        self.fd: int | None = None
        self.size = 0
        self.fd, self.size = self._open(self.header, fd)
        _OPEN_FILES.add(self)

    def closed_error(self) -> AuditSinkClosedError:
        """Why nothing more is written: the sink was closed, or this is a forked child."""
        if os.getpid() != self.owner:
            return AuditSinkClosedError(
                f"audit sink {self.path} belongs to process {self.owner}: a process forked "
                f"from it writes nothing to its log"
            )
        return AuditSinkClosedError(f"audit sink {self.path} is closed")

    def forked(self) -> None:
        """In a child forked while the file was open: let go of it, writing nothing. The
        parent writes what was buffered, holds the lock (the child's copy of the
        descriptor is closed, not unlocked: ``flock`` locks belong to the open file, which
        the parent keeps) and keeps its ``.open`` marker; the child's sink is closed."""
        self.lock = threading.Lock()  # a thread of the parent may have held it at the fork
        self.buffer = []
        self.marker = None
        self.state = None
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _open(self, header: AuditHeader, fd: int | None = None) -> tuple[int, int]:
        """Write ``header`` to the path (claimed now unless ``fd`` holds it already)."""
        if fd is None:
            fd = _claim(self.path)
        try:
            stat = os.fstat(fd)
            size = stat.st_size + self._write_all(fd, stat.st_size, encode_lines((header,)))
        except BaseException:
            os.close(fd)
            raise
        self.ident = (stat.st_dev, stat.st_ino)
        return fd, size

    def _write_all(self, fd: int, size: int, data: bytes, sync: bool = True) -> int:
        """Append ``data`` whole (and fsync per policy unless ``sync`` is False), or leave
        the file at ``size`` and raise."""
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
            if self.sync and sync:
                os.fsync(fd)
                self.unsynced = False
            elif self.sync:
                self.unsynced = True
        except OSError:
            # a partial line would glue itself to the next record: cut it off again
            with contextlib.suppress(OSError):  # the file is gone or read-only now
                os.ftruncate(fd, size)
            raise
        return len(data)

    def write(self, data: bytes, sync: bool = True) -> None:
        fd = self.fd
        if fd is None:
            raise self.closed_error()
        end = os.lseek(fd, 0, os.SEEK_END)
        if end < self.size:  # cut short under us: logrotate's copytruncate
            self._cut_short(fd, end)
        elif self._moved_away(fd):  # removed or renamed: rm, logrotate's default
            fd = self._moved(fd)
        limit = self.max_bytes
        if limit is not None and self.size + len(data) > limit and self.in_file:
            fd = self._rotate(fd)
        self.size += self._write_all(fd, self.size, data, sync)

    def _rotate(self, fd: int) -> int:
        """Move the full file to ``.1`` (older ones one up; the oldest is dropped) and
        continue the segment in a new file. A crash at any point leaves every complete
        line in exactly one file of the set."""
        if self.sync:
            os.fsync(fd)
        if self.backups == 0:
            os.unlink(self.path)
        else:
            for index in range(self.backups, 0, -1):
                older = rotated_name(self.path, index - 1)
                if older.exists():
                    os.replace(older, rotated_name(self.path, index))
        new_fd = self._go_on_at_path(fd)
        self.rotations += 1
        return new_fd

    def _next_part(self) -> AuditHeader:
        """The header that goes on with this segment as its next part."""
        header = self.header
        return make_header(header.segment, header.part + 1, header.witness, closes=True)

    def _go_on_at_path(self, fd: int) -> int:
        """Go on in a file at the path (claimed, created if need be) under the next
        part's header, and close ``fd``. A failure raises with the sink still writing
        to ``fd``."""
        header = self._next_part()
        new_fd, size = self._open(header)
        os.close(fd)
        self.fd, self.size, self.header = new_fd, size, header
        self.in_file = 0
        return new_fd

    def _moved_away(self, fd: int) -> bool:
        """Whether the file open was removed, or the path names another file (or none),
        looked at once every ``PATH_CHECK_S`` (the two ``stat`` calls cost ten times the
        ``lseek`` of every write; what is written meanwhile went to the file moved away:
        read with the rest after a rename)."""
        now = time.monotonic()
        if now < self.look_at:
            return False
        self.look_at = now + PATH_CHECK_S
        if os.fstat(fd).st_nlink == 0:
            return True
        try:
            at_path = os.stat(self.where)
        except FileNotFoundError:
            return True
        return (at_path.st_dev, at_path.st_ino) != self.ident

    def _moved(self, fd: int) -> int:
        """Another process removed the file (``rm``) or renamed it (logrotate without
        ``copytruncate``, which may create a new one): go on in a file at the path again,
        as the segment's next part, so that what is written from now on is where readers
        look (not in a file nobody can open, filling the disk). A failure leaves the sink
        writing where it was, to try again at the next write."""
        if self.sync:
            with contextlib.suppress(OSError):
                os.fsync(fd)
        new_fd = self._go_on_at_path(fd)
        self.reopened += 1
        _log.warning(
            "audit log %s was removed or renamed by another process; it goes on in a new "
            "file at that path, as part %d of its segment",
            self.path,
            self.header.part,
        )
        return new_fd

    def _cut_short(self, fd: int, size: int) -> None:
        """Another process cut the file short in place (logrotate's ``copytruncate``,
        which copied it to ``PATH.1`` first): go on in it as the segment's next part,
        under a header of its own, so that it reads as a log again and the copy and it
        read as one segment. ``size``: what the file holds now."""
        header = self._next_part()
        self.size = size + self._write_all(fd, size, encode_lines((header,)))
        self.header = header
        self.in_file = 0
        self.truncations += 1
        _log.warning(
            "audit log %s was cut short by another process (logrotate's copytruncate?); "
            "it goes on as part %d of its segment. Lines written between the copy and the "
            "cut are lost; kvlife's own rotation (max_bytes) loses none",
            self.path,
            header.part,
        )

    def flush(self, sync: bool = True) -> None:
        buffer = self.buffer
        if not buffer:
            if sync and self.unsynced and self.fd is not None:
                os.fsync(self.fd)
                self.unsynced = False
            return
        self.write(encode_lines(buffer), sync)  # raises before the buffer is touched
        self.records_written += len(buffer)
        self.in_file += len(buffer)
        buffer.clear()

    def write_closing(self, how: ClosingHow) -> None:
        """Write what is buffered, then the closing record (no fsync for a signal: the
        process is about to be killed, and the kernel has the lines)."""
        self.flush(sync=how != "signal")
        counted = self.state() if self.state is not None else None
        state = counted() if counted is not None else None
        self.write(
            encode_lines((make_closing(how, self.records_written, state),)), sync=how != "signal"
        )

    def close(self, how: ClosingHow = "close") -> None:
        with self.lock:
            if self.fd is None:
                return
            self.write_closing(how)
            os.close(self.fd)
            self.fd = None
            _OPEN_FILES.discard(self)
            if self.marker is not None:
                with contextlib.suppress(OSError):
                    self.marker.unlink()

    def close_at_exit(self, stop: threading.Event | None = None) -> None:
        """Interpreter exit or the sink was collected: write what is buffered. A failure
        cannot be raised to anyone now, so it is logged with what was lost."""
        if stop is not None:
            stop.set()
        if self.fd is None:
            return
        try:
            self.close("exit")
        except Exception as exc:
            seqs = [item.seq for item in self.buffer if isinstance(item, AuditRecord)]
            _log.error(
                "audit log %s: %d buffered records (%s) could not be written at exit: %s",
                self.path,
                len(seqs),
                format_ranges(seq_ranges(seqs)),
                exc,
            )
            fd, self.fd = self.fd, None
            if fd is not None:
                os.close(fd)


_OPEN_FILES: Final[weakref.WeakSet[_JsonFile]] = weakref.WeakSet()
"""The JSON-lines files open in this process, which a child forked from it lets go of."""


def _let_go_after_fork() -> None:
    """A child was forked while files were open: left alone, its sinks would write the
    records the parent had buffered (the parent writes them too: every checker reads the
    second copy as serials reused), a closing record at its exit or collection (the
    parent's records go on after it), remove the parent's ``.open`` marker, and hold the
    parent's lock until the child exits (a restarted server is refused its log)."""
    for file in list(_OPEN_FILES):
        file.forked()
    _OPEN_FILES.clear()


os.register_at_fork(after_in_child=_let_go_after_fork)


def _flush_every(file: _JsonFile, stop: threading.Event, interval: float) -> None:
    """A [`JsonLinesSink`][kvlife.fsm.audit.sinks.JsonLinesSink]'s flush thread: write the
    buffer every ``interval`` seconds until the sink is closed. A failed write leaves
    the records buffered for the next try (or for the writer's own flush, which raises
    it); it is logged once per run of failures."""
    failing = False
    while not stop.wait(interval):
        with file.lock:
            if file.fd is None:
                return
            try:
                file.flush(sync=False)  # the records reach the file under the lock ...
                synced = (file.size, file.fd) if file.unsynced else None
                dup = os.dup(file.fd) if synced is not None else None
            except OSError as exc:
                if not failing:
                    _log.error("audit log %s: a timed flush failed: %s", file.path, exc)
                failing = True
                continue
        if dup is None:
            failing = False
            continue
        try:  # ... and the disk outside it: the writer never waits for an fsync
            os.fsync(dup)
        except OSError as exc:
            if not failing:
                _log.error("audit log %s: a timed fsync failed: %s", file.path, exc)
            failing = True
            continue
        finally:
            os.close(dup)
        failing = False
        with file.lock:
            if (file.size, file.fd) == synced:  # nothing written meanwhile
                file.unsynced = False


class JsonLinesSink:
    """Append records to a JSON-lines file, one record per line.

    On open, a torn tail left by a crash is trimmed first (``trimmed_bytes`` says how
    much), then a header is appended: a file may hold several segments, each starting
    with its header. A new file is created owner-only (mode 0600).

    fsync policy:
        ``"never"``: records are buffered and written in batches of ``WRITE_CHUNK`` (256,
            or ``batch_records`` when fewer); the OS decides when they reach the disk.
        ``"batch"``: records are buffered and written every ``WRITE_CHUNK`` (256) records
            (or every ``batch_records`` when fewer), with an ``fsync`` once at least
            ``batch_records`` records were written since the last one, and on
            [`flush()`][kvlife.fsm.audit.sinks.JsonLinesSink.flush].
        ``"record"``: every record is written and fsynced before `write()` returns.

    Rotation: with ``max_bytes``, a write that would take the file past it first renames
    the file to ``PATH.1`` (``PATH.1`` to ``PATH.2`` ..., keeping ``backups`` old files)
    and continues the segment in a new ``PATH`` (its header has the same ``segment`` and
    the next ``part``). The reader takes ``PATH.N ... PATH.1 PATH`` in that order.

    Buffered records are written by [`flush()`][kvlife.fsm.audit.sinks.JsonLinesSink.flush],
    [`close()`][kvlife.fsm.audit.sinks.JsonLinesSink.close] (or the ``with`` block),
    at interpreter exit, and when the sink is garbage collected.

    Time bound: with ``flush_interval_s``, a background thread also writes the buffer
    every ``flush_interval_s`` seconds, so no record waits longer than that for the file,
    however little traffic there is (a server between requests). A process killed
    outright loses at most the records of its last interval.

    Unclean stops: with ``open_marker``, the sink keeps a file ``PATH.open`` (its pid and
    the time it opened) while it is open and removes it on close or at interpreter exit.
    A sink that finds one on open logs a warning that the previous writer stopped without
    closing the log, and says so in ``previous_unclean``.

    Watching: ``witness`` names a component whose lifecycles this log records from the
    outside (a wrapped vLLM connector); it goes into every header (see
    [`AuditHeader`][kvlife.fsm.audit.records.AuditHeader]).

    Rotation by another process: when the file was cut short in place (logrotate's
    ``copytruncate``), the next write first puts a header of the segment's next part in
    it, so that it reads as a log again (``truncations`` counts it, and it is logged);
    when it was removed (``rm``) or renamed (logrotate's default), a write goes to a file
    at the path again, under such a header (``reopened``): the first write at least
    ``PATH_CHECK_S`` (1 s) after the sink last looked.

    One writer per file: the sink holds a lock on its file (``flock``) while it is open,
    and a second sink opened on it, in this process or another, waits up to
    ``lock_wait_s`` seconds (0: not at all; a restarted server whose old process is still
    stopping) for the holder to close (a sink nobody holds any more is collected first),
    then raises
    [`AuditLogBusyError`][kvlife.fsm.audit.sinks.AuditLogBusyError] and changes nothing
    (two writers would interleave their records). The lock goes with the writer: a
    writer that was killed leaves none. A child process forked while the sink is open
    lets go of the file: it writes nothing to it (its sink is closed: a record given to it
    raises [`AuditSinkClosedError`][kvlife.fsm.audit.sinks.AuditSinkClosedError]), holds
    no lock on it, and leaves the ``.open`` marker and the records buffered to the parent.

    Errors: a write that fails (disk full, file size limit, I/O error) raises
    [`AuditSinkError`][kvlife.fsm.audit.sinks.AuditSinkError] or ``OSError`` and leaves the file
    ending at a complete line; the record given to that `write()` was not taken (the
    registry keeps it and offers it again) and records buffered before it stay buffered.
    `write()` after [`close()`][kvlife.fsm.audit.sinks.JsonLinesSink.close] raises
    [`AuditSinkClosedError`][kvlife.fsm.audit.sinks.AuditSinkClosedError]. A sink that
    cannot open (its marker or its header cannot be written) raises ``OSError`` and holds
    nothing: no header written, the file unlocked, the marker as it was.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy = "batch",
        batch_records: int = 4096,
        max_bytes: int | None = None,
        backups: int = 5,
        flush_interval_s: float | None = None,
        open_marker: bool = False,
        witness: str = "",
        lock_wait_s: float = 0.0,
    ) -> None:
        if not isinstance(witness, str):
            raise TypeError(f"witness must be a str, got {type(witness).__name__}")
        if flush_interval_s is not None and (
            not isinstance(flush_interval_s, (int, float))
            or isinstance(flush_interval_s, bool)
            or not 0 < flush_interval_s < float("inf")
        ):
            raise ValueError(
                f"flush_interval_s must be a positive number or None, got {flush_interval_s!r}"
            )
        if (
            not isinstance(lock_wait_s, (int, float))
            or isinstance(lock_wait_s, bool)
            or not 0 <= lock_wait_s < float("inf")
        ):
            raise ValueError(f"lock_wait_s must be a number >= 0, got {lock_wait_s!r}")
        if fsync not in ("never", "batch", "record"):
            raise ValueError(f"fsync must be 'never', 'batch' or 'record', got {fsync!r}")
        if not _is_int(batch_records) or batch_records <= 0:
            raise ValueError(f"batch_records must be a positive int, got {batch_records!r}")
        if max_bytes is not None and (not _is_int(max_bytes) or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        if not _is_int(backups) or backups < 0:
            raise ValueError(f"backups must be an int >= 0, got {backups!r}")
        self.path = Path(path)
        self.fsync: FsyncPolicy = fsync
        self.batch_records = batch_records
        self._chunk = min(batch_records, WRITE_CHUNK)  # records buffered before a write
        self._synced_at = 0  # records_written at the last fsync of a batch
        self.max_bytes = max_bytes
        self.backups = backups
        self.flush_interval_s = flush_interval_s
        #: What the ``PATH.open`` marker of a writer that did not close the log said
        #: (its pid and opening time), or ``None``.
        self.previous_unclean: str | None = None
        # every file operation from now on by the absolute path: the process may change
        # its working directory while the sink is open
        where = Path(os.path.abspath(self.path))
        marker = Path(f"{where}.open") if open_marker else None
        fd = _claim(where, lock_wait_s)  # first: the marker and torn tail are its
        previous: str | None = None  # what the marker said before this writer's
        try:
            if marker is not None and marker.exists():
                previous = marker.read_text(errors="replace")
                self.previous_unclean = previous.strip() or "unknown"
                _log.warning(
                    "audit log %s: its previous writer (%s) stopped without closing it; "
                    "the records of its last flush interval may be missing",
                    self.path,
                    self.previous_unclean,
                )
            self.trimmed_bytes = trim_torn_tail(where)
            if marker is not None:  # before the header: a failure leaves no segment begun
                marker.write_text(
                    f"pid {os.getpid()}, opened {time.strftime('%Y-%m-%dT%H:%M:%S%z')}"
                )
        except BaseException:
            os.close(fd)
            raise
        try:  # closes fd itself when the header cannot be written
            self._file = _JsonFile(where, fsync, max_bytes, backups, marker, witness, fd)
        except BaseException:
            if marker is not None:  # as it was
                with contextlib.suppress(OSError):
                    if previous is None:
                        marker.unlink()
                    else:
                        marker.write_text(previous)
            raise
        self._stop = threading.Event()
        self._finalizer = weakref.finalize(self, self._file.close_at_exit, self._stop)
        if fsync == "record":
            self.write = self._write_record
            self.write_many = self._write_records
        elif flush_interval_s is None:
            self.write = self._buffer_record
            self.write_many = self._buffer_records
        else:
            self.write = self._buffer_record_locked
            self.write_many = self._buffer_records_locked
            threading.Thread(
                target=_flush_every,
                args=(self._file, self._stop, float(flush_interval_s)),
                name=f"kvlife-audit-flush:{self.path.name}",
                daemon=True,
            ).start()

    @property
    def records_written(self) -> int:
        """Records (and lost markers) written since the sink was opened."""
        return self._file.records_written

    @property
    def rotations(self) -> int:
        """How many times the file was rotated."""
        return self._file.rotations

    @property
    def reopened(self) -> int:
        """How many times another process removed or renamed the file (``rm``, logrotate
        without ``copytruncate``) and the sink went on in a new file at its path."""
        return self._file.reopened

    @property
    def truncations(self) -> int:
        """How many times another process cut the file short in place (logrotate's
        ``copytruncate``); each time the sink went on in it under a new part's header."""
        return self._file.truncations

    @property
    def segment(self) -> str:
        """This writer's segment id (in every header it writes)."""
        return self._file.header.segment

    @property
    def closed(self) -> bool:
        """Whether [`close()`][kvlife.fsm.audit.sinks.JsonLinesSink.close] completed."""
        return self._file.fd is None

    @property
    def waiting(self) -> bool:
        """Whether anything waits in the buffer for the file: a check cheap enough for
        every call of a hot path (no lock, no count), before a
        [`write_out()`][kvlife.fsm.audit.sinks.JsonLinesSink.write_out]."""
        return bool(self._file.buffer)

    @property
    def buffered(self) -> int:
        """Records taken and not written to the file yet (lost markers not counted)."""
        file = self._file
        with file.lock:
            return sum(type(item) is AuditRecord for item in file.buffer)

    def discard_buffered(self) -> list[int]:
        """Drop the records taken and not written (the writer is giving up on a sink
        whose writes fail) and return their ``seq`` values; lost markers buffered are
        dropped too. The sink stays open."""
        file = self._file
        with file.lock:
            seqs = [item.seq for item in file.buffer if type(item) is AuditRecord]
            file.buffer.clear()
        return seqs

    def _write_record(self, item: _Item) -> None:
        file = self._file
        if file.fd is None:
            raise file.closed_error()
        file.write(encode_lines((item,)))
        file.records_written += 1
        file.in_file += 1

    def _buffer_record(self, item: _Item) -> None:
        file = self._file
        if file.fd is None:
            raise file.closed_error()
        buffer = file.buffer
        buffer.append(item)  # encoded in batches: one msgspec call per write
        if len(buffer) >= self._chunk:
            self._write_chunk(file, 1)

    def _write_chunk(self, file: _JsonFile, taken: int) -> None:
        """Write the full buffer, fsynced once ``batch_records`` were written since the
        last fsync (per the policy). On failure the ``taken`` records just added are not
        taken (the ones before stay buffered) and the error is raised."""
        buffer = file.buffer
        sync = file.records_written + len(buffer) - self._synced_at >= self.batch_records
        try:
            file.flush(sync)
        except BaseException:
            del buffer[len(buffer) - taken :]
            raise
        if sync:
            self._synced_at = file.records_written

    def _write_records(self, items: list[AuditRecord]) -> None:
        file = self._file
        if file.fd is None:
            raise file.closed_error()
        file.write(encode_lines(items))  # one write: all of them or none
        file.records_written += len(items)
        file.in_file += len(items)

    def _buffer_records(self, items: list[AuditRecord]) -> None:
        file = self._file
        if file.fd is None:
            raise file.closed_error()
        buffer = file.buffer
        buffer.extend(items)
        if len(buffer) >= self._chunk:
            self._write_chunk(file, len(items))  # all of them taken, or none

    def _buffer_records_locked(self, items: list[AuditRecord]) -> None:
        file = self._file
        with file.lock:  # the flush thread writes the same buffer
            self._buffer_records(items)

    def _buffer_record_locked(self, item: _Item) -> None:
        file = self._file
        with file.lock:  # the flush thread writes the same buffer
            self._buffer_record(item)

    def write_out(self) -> None:
        """Write buffered records to the file now, without ``fsync`` (the flush thread
        or the next flush syncs them, per the fsync policy): once this returns, a
        process that is killed loses none of them (the kernel has them), though a
        machine that loses power may. For writers that may be killed at any moment
        between calls, such as a server's engine process.

        Raises ``OSError`` when the write fails; the records stay buffered.
        """
        file = self._file
        with file.lock:
            file.flush(sync=False)

    def settle(self) -> bool:
        """Write buffered records out and a closing record (``signal``; no ``fsync``) and
        remove the ``PATH.open`` marker, leaving the sink open: the writer is about to be
        stopped (a termination signal) and the log is whole up to now. Records written
        after this are written as before (and make the segment open again: a later
        ``close()`` writes another closing record); the marker does not come back.

        Safe to call from a signal handler in a sink with ``flush_interval_s``, where every
        write holds the sink's lock: it never waits for it. Returns ``False`` (nothing
        done) when the lock is held now (the signal interrupted a write), when the sink
        has no flush thread (its writes do not take the lock), or when the write fails;
        ``True`` when the log was settled (or is closed).
        """
        if self.write != self._buffer_record_locked:
            return False
        file = self._file
        if not file.lock.acquire(blocking=False):
            return False
        try:
            if file.fd is None:
                return True
            file.write_closing("signal")
            if file.marker is not None:
                with contextlib.suppress(OSError):
                    file.marker.unlink()
                file.marker = None
            return True
        except OSError:
            return False
        finally:
            file.lock.release()

    def write_lost(self, marker: LostRecords) -> None:
        """Write a marker of records the registry had to drop (same rules as write)."""
        self.write(marker)

    def flush(self) -> None:
        """Write buffered records (and fsync unless the policy is ``"never"``).

        Raises ``OSError`` when the write fails; the records stay buffered.
        """
        with self._file.lock:
            self._file.flush()

    def bind_state(self, state: Callable[[], tuple[int, int]]) -> None:
        """Count, in the closing record, what ``state()`` returns when the segment is
        closed: ``(live lifecycles, copies in flight)``. A registry binds this when the
        sink is attached (a bound method, held weakly)."""
        self._file.state = weakref.WeakMethod(state)

    def close(self) -> None:
        """Flush, end the segment with a closing record, and close the file. Closing
        twice is harmless.

        Raises ``OSError`` when the final write fails; the sink then stays open with its
        records buffered, so a later [`close()`][kvlife.fsm.audit.sinks.JsonLinesSink.close]
        can still write them.
        """
        self._stop.set()
        self._file.close()
        self._finalizer.detach()

    def __enter__(self) -> JsonLinesSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<JsonLinesSink {str(self.path)!r} fsync={self.fsync}>"


class LoggingSink:
    """Send each record to a stdlib logger as one JSON line.

    While the logger is not enabled for the sink's level, a registry builds no record for
    it: the registry asks ``active()`` (whether the logger is enabled for the sink's level)
    once per registration (so enabling the logger takes effect from the next registered
    request on), not once per record.

    Raises:
        TypeError: ``logger`` is neither a ``logging.Logger`` nor a name.
        ValueError: ``level`` is not a logging level (an int >= 0).
    """

    def __init__(self, logger: logging.Logger | str = "kvlife.audit", level: int = logging.INFO):
        if not isinstance(logger, (str, logging.Logger)):
            raise TypeError(f"logger must be a logging.Logger or its name, got {logger!r}")
        if not isinstance(level, int) or isinstance(level, bool) or level < 0:
            raise ValueError(f"level must be a logging level (an int >= 0), got {level!r}")
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.level = level
        # asked once per registration: a partial saves a Python-level call each time
        self.active: Callable[[], bool] = functools.partial(self.logger.isEnabledFor, level)

    def write(self, record: AuditRecord) -> None:
        """Log the record if the logger is enabled for the sink's level."""
        if self.logger.isEnabledFor(self.level):
            self.logger.log(self.level, "%s", encode_record(record))

    def write_lost(self, marker: LostRecords) -> None:
        """Log a range of records the registry had to drop, as a warning."""
        self.logger.warning(
            "kvlife audit: %d records lost (sink error), seq %d-%d: %s",
            marker.kvlife_lost,
            marker.first_seq,
            marker.last_seq,
            marker.error,
        )

    def flush(self) -> None:
        """Flush the logger's handlers."""
        for handler in self.logger.handlers:
            handler.flush()

    def close(self) -> None:
        """Flush; the logger itself belongs to the application."""
        self.flush()


__all__ = [
    "WRITE_CHUNK",
    "AuditSinkClosedError",
    "AuditSinkError",
    "FsyncPolicy",
    "JsonLinesSink",
    "LoggingSink",
    "MemorySink",
    "rotated_name",
    "trim_torn_tail",
]

"""What kvlife's own vLLM connector and the audit wrapper around another connector both
need in an engine core: the audit log and its registry (``CoreLog``), settled by vLLM's
termination signals before vLLM's own handlers run, written out at the end of every
half-step, closed at shutdown; and the warning line for overdue tickets.

Both products import it; it imports neither (the wrapper never imports kvlife's own
connector, and a change to that connector cannot break the audit of anyone else's).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlife.fsm import JsonLinesSink, LifecycleRegistry, OverdueWatch
from kvlife.fsm.audit.sinks import SERVER_LOCK_WAIT_S
from kvlife.offload.engines.vllm_common.config import ConnectorConfig

logger = logging.getLogger("vllm.kvlife")


def settle_on_signals(settle: Callable[[], object]) -> dict[int, tuple[Any, Any]]:
    """In vLLM's engine-core process, call ``settle`` (which settles a sink: records out, a
    closing record, ``.open`` marker gone; it must never wait) as soon as SIGINT or
    SIGTERM arrives, then run vLLM's own handler. vLLM's server signals its engine core
    and kills it moments later (``mode=abort timeout=0s``), before any shutdown call
    reaches the connector.

    Only where vLLM handles SIGTERM itself (its engine-core process) and from the main
    thread; elsewhere (an engine core in the caller's own process) nothing changes.
    Returns, per signal, (kvlife's handler, the one before it) for
    [`restore_signals()`][kvlife.offload.engines.vllm_common.core_log.restore_signals].
    """
    handlers: dict[int, tuple[Any, Any]] = {}
    if threading.current_thread() is not threading.main_thread():
        return handlers
    if not callable(signal.getsignal(signal.SIGTERM)):
        return handlers
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)

        def settle_first(number: int, frame: Any, previous: Any = previous) -> None:
            settle()  # never waits, never logs: safe in a signal handler
            if callable(previous):
                previous(number, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(number, signal.SIG_DFL)
                os.kill(os.getpid(), number)

        signal.signal(signum, settle_first)
        handlers[signum] = (settle_first, previous)
    return handlers


def restore_signals(handlers: dict[int, tuple[Any, Any]]) -> None:
    """Put back the handlers kvlife's settle handlers were put before (those still in
    place), and forget them."""
    for signum, (ours, previous) in handlers.items():
        if signal.getsignal(signum) is ours and previous is not None:
            with contextlib.suppress(ValueError):  # not the main thread now
                signal.signal(signum, previous)
    handlers.clear()


class CoreLog:
    """One engine core's audit log and the registry that writes it: the sink (none
    without ``path``), settled by SIGINT and SIGTERM before vLLM's own handlers run,
    written out at the end of every connector call, closed at shutdown. ``witness``
    names the connector a wrapper watches (see ``JsonLinesSink``)."""

    def __init__(self, path: str | None, config: ConnectorConfig, witness: str = "") -> None:
        self.sink: JsonLinesSink | None = None
        if path:
            # as SGLang's adapters do: a fresh host's /var/log/kvlife/ need not exist yet
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.sink = JsonLinesSink(
                path,
                fsync=config.audit_fsync,  # type: ignore[arg-type]  # checked by parse
                max_bytes=config.audit_max_bytes,
                backups=config.audit_backups,
                flush_interval_s=config.audit_flush_s,
                open_marker=True,
                witness=witness,
                lock_wait_s=SERVER_LOCK_WAIT_S,
            )
        #: A termination signal came: vLLM is stopping this engine core (see ``written``).
        self.stopping = False
        #: The log ends with a closing record since the signal (``written`` keeps it so).
        self.settled = False
        # signal -> (kvlife's handler, vLLM's before it)
        self.handlers = settle_on_signals(self.settle) if self.sink is not None else {}
        self.registry = LifecycleRegistry(sinks=[self.sink] if self.sink else [])
        #: Between the end of ``schedule()`` (``build_connector_meta``) and the end of
        #: ``update_from_output()`` (``get_kv_connector_stats``): the calls made then are
        #: written out with the step's; calls between steps are written out at once.
        self.in_step = False

    def stop_hint(self, vllm_config: Any) -> str | None:
        """Log (and return) the start-up line that tells the operator how a stop will end
        this log, when vLLM will kill the engine core at once at a stop (its
        ``shutdown_timeout`` 0, vLLM's default) and only kvlife's signal handler settles
        the log before that kill, which a busy machine can let the kill win; ``None``
        otherwise (no log, no handler: an engine core in the caller's own process; a
        timeout that lets the handler run first; a vLLM without the setting)."""
        if not self.handlers or getattr(vllm_config, "shutdown_timeout", None) != 0:
            return None
        hint = (
            "kvlife: vLLM's shutdown timeout is 0 s: at a stop vLLM kills this engine core "
            "at once, and its audit log reads as cut short (nothing in flight) whenever the "
            "kill comes before kvlife's signal handler has run; a few seconds "
            "(--shutdown-timeout 10) let the handler close the log first"
        )
        logger.info(hint)
        return hint

    def settle(self) -> None:
        """A termination signal (called in its handler): settle the log now (see
        ``JsonLinesSink.settle``; nothing is done when the signal interrupted a write of
        this log: the next write-out settles it), and from now on end every write-out with
        a closing record too."""
        self.stopping = True
        if self.sink is not None:
            self.settled = self.sink.settle()

    def written(self) -> None:
        """Write the records out now (no fsync), so that an engine core killed after this
        loses none of them. Called at the end of each half of an engine step
        (``schedule()``: ``build_connector_meta``; ``update_from_output()``: after
        ``update_connector_output``, before vLLM reads the workers' reports, which it may
        die on, and at ``get_kv_connector_stats``, vLLM's last connector call there), and
        after the calls vLLM makes between steps (a request added, an abort): a kill
        between steps loses nothing, and one within a step at most that half's records.
        One write a half-step, not one a call: each costs a system call and a lock (about
        5 us alone, 14 us inside a step here). vLLM kills its engine core at every stop of
        a server, before any shutdown call reaches the connector; SIGTERM and SIGINT
        settle the log first. After such a signal each write-out also ends with a closing
        record: vLLM aborts or drains the running requests after the signal, and its
        kill, whenever it comes between two write-outs, leaves the log closed."""
        sink = self.sink
        if sink is None:
            return
        wrote = sink.waiting
        if wrote:
            sink.write_out()
        if self.stopping and (wrote or not self.settled):  # (not settled: a write was on)
            self.settled = sink.settle()

    def step_ended(self, half: str) -> None:
        """The end of ``schedule()`` (``half`` ``"schedule"``) or of
        ``update_from_output()`` (``"output"``): the records go out (see ``written``)."""
        self.written()
        self.in_step = half == "schedule"

    def between_steps(self) -> None:
        """A call vLLM also makes between steps (a request added, an abort): written out
        at once then, for an engine that sits idle or paused after it; within a step its
        records go with the step's."""
        if not self.in_step:
            self.written()

    def close(self) -> None:
        """Write every record and close the log (the engine is stopping)."""
        restore_signals(self.handlers)
        try:
            self.registry.flush()
        except Exception:  # another thread: the sink is flushed by its close below
            logger.debug("kvlife: registry flush at shutdown", exc_info=True)
        if self.sink is not None:
            self.sink.close()


def overdue_line(watch: OverdueWatch) -> str:
    """The warning vLLM's log gets when tickets cross the limit."""
    return (
        f"{watch.open_overdue()} ticket(s) open longer than {watch.limit_s:g} s "
        f"(audit_overdue_s), the oldest {watch.oldest_age():.1f} s; their rids are in the "
        "audit log (kvlife audit check)"
    )

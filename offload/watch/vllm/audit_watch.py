"""The audit wrapper's watch: kvlife's lifecycles kept beside the calls of a vLLM
connector kvlife did not write (see
[`KVLifeAuditConnector`][kvlife.offload.watch.vllm.audit.KVLifeAuditConnector], which relays
each call and tells the watch what it saw): one lifecycle per vLLM request object,
tickets for the asynchronous loads and delayed frees the connector announced and, through
its lens, for the copies it keeps in private metadata; the reports they explain, the
stray ones they do not, exceptions written on the rids they name, KV events checked
against vLLM's block hashes, and tickets open too long.

It is one piece because every check reads the same per-rid state (open tickets by kind,
released lifecycles remembered, the lensed jobs, the block index): split, each part would
reach into the others'.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from kvlife.fsm import Lifecycle, LifecycleError, OverdueWatch, Ticket, Trigger
from kvlife.fsm.audit.records import DetailValue
from kvlife.offload.engines.vllm_common.core_log import CoreLog, overdue_line
from kvlife.offload.engines.vllm_common.stats import (
    audit_growth,
    overdue_gauges,
    verdict_growth,
)
from kvlife.offload.watch.vllm.lenses import Lens

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvlife.offload.watch.vllm.audit import AuditConfig

logger = logging.getLogger("vllm.kvlife")

INDEXED_BLOCKS = 1 << 18
"""Block hashes kept to check KV events against (the newest; older ones are forgotten,
and an event naming a forgotten hash is a mismatch only if it contradicts a kept one)."""
_RECENT = 4096  # released lifecycles and completed tickets remembered per rid, to tell stories

# the trigger a call's exception is written under: the transition the call was part of
_CALL_TRIGGER = {
    "request_finished": Trigger.FINISH,
    "request_finished_all_groups": Trigger.FINISH,
    "shutdown": Trigger.FINISH,
    "update_connector_output": Trigger.ACK,
    "take_events": Trigger.ACK,
}


def _number(job: Hashable) -> int:
    """A lens's job key as the connector numbers it: the key, or its first item (a
    store event that copies for several requests is one key per request)."""
    return job if isinstance(job, int) else int(job[0])  # type: ignore[index]


def _rids(args: Iterable[Any]) -> list[str]:
    """The request ids a call was given (requests, a scheduler output, a worker output)."""
    rids: list[str] = []
    for arg in args:
        rid = getattr(arg, "request_id", None)
        if isinstance(rid, str):
            rids.append(rid)
            continue
        for new in getattr(arg, "scheduled_new_reqs", None) or ():
            rids.append(new.req_id)
        cached = getattr(arg, "scheduled_cached_reqs", None)
        if cached is not None:
            rids.extend(cached.req_ids)
        for name in ("finished_sending", "finished_recving", "failed_recving"):
            rids.extend(sorted(getattr(arg, name, None) or ()))
    return list(dict.fromkeys(rids))


def _named_in(exc: BaseException, rids: Iterable[str]) -> list[str]:
    """The ids of ``rids`` that ``exc`` names: one of its arguments (``KeyError('r1')``)
    or a whole word of its message (``r1`` is not named by ``r10``)."""
    args = {a for a in exc.args if isinstance(a, str)}
    text = str(exc)
    return [
        rid
        for rid in dict.fromkeys(rids)
        if rid in args or re.search(rf"(?<![\w-]){re.escape(rid)}(?![\w-])", text)
    ]


class Watch:
    """The scheduler side's lifecycles: one per vLLM request object, tickets for the
    asynchronous loads and delayed frees the wrapped connector announced."""

    def __init__(
        self, config: AuditConfig, path: str | None, witness: str, events: bool, block_size: int
    ) -> None:
        self.block_size = block_size
        self.log = CoreLog(path, config.audit, witness)
        #: Write the records out now: see ``CoreLog.written``.
        self.written = self.log.written
        #: See ``CoreLog.step_ended`` and ``CoreLog.between_steps``.
        self.step_ended = self.log.step_ended
        self.between_steps = self.log.between_steps
        self.registry = self.log.registry
        self.registry.on_release(self._released)
        #: Tickets open longer than ``audit_overdue_s``, told at each step.
        self.overdue = OverdueWatch(self.registry, config.audit.audit_overdue_s)
        self.stats_interval_s = config.audit.stats_interval_s
        self._stats_at = -float("inf")
        self._overdue_reported = 0
        self._verdicts_reported: dict[str, int] = {}
        self._audit_reported = [0, 0]
        self._gauges: dict[str, float] = {}
        self.refuse = config.mode == "refuse"
        self.witness = witness
        self.events = events
        # per rid, the open tickets of each kind, oldest first
        self.loads: dict[str, list[Ticket]] = {}
        self.frees: dict[str, list[Ticket]] = {}
        self.load_blocks: dict[int, set[int]] = {}  # ticket op -> device blocks it fills
        self.failed: set[int] = set()  # ops of open loads reported failed
        self.claims: set[int] = set()  # id() of requests whose last answer was load_async
        # rid -> the serial of the lifecycle that released last under it (a number: a
        # remembered lifecycle is not kept alive)
        self.recent: OrderedDict[str, int] = OrderedDict()
        self.reported: OrderedDict[tuple[str, str], None] = OrderedDict()  # (report, rid) done
        # (report, rid) of tickets cut short when vLLM freed their request at another report
        self.cut: set[tuple[str, str]] = set()
        # KV event checks: external block hash -> (rid, parent hash, digest of its tokens)
        self.index: OrderedDict[Any, tuple[str, Any, int]] = OrderedDict()
        self.indexed: dict[int, int] = {}  # lifecycle serial -> its block hashes indexed
        # (medium, hash) -> stores not removed yet: vLLM's block pool (and a connector
        # storing one prefix for two requests) may hold one hash several times
        self.held: dict[tuple[str | None, Any], int] = {}
        #: The wrapped connector's lens (its private copies seen as tickets), if it has one.
        self.lens: Lens | None = None
        self.jobs: dict[Hashable, Ticket] = {}  # a lensed copy's job -> the ticket it counts on
        self.job_counts: dict[int, int] = {}  # ticket op -> its jobs not over yet
        self.flushes: dict[int, Ticket] = {}  # lifecycle serial -> its final-copies ticket
        self.new_flushes: list[Ticket] = []  # opened since the last step's metadata
        # finished since the last step's metadata, their state kept for its pass: by rid,
        # the lifecycle and the request object (held until that pass: one step)
        self.finishing: dict[str, tuple[Lifecycle, Any]] = {}
        self.completing: list[str] = []  # rids of the lensed jobs the last output completes

    # ------------------------------------------------------------------ lifecycles

    def lifecycle(self, request: Request) -> Lifecycle | None:
        """``request``'s lifecycle, registered now if vLLM shows it for the first time;
        ``None`` when an unfinished lifecycle holds its id (refused, audited)."""
        registry = self.registry
        if request in registry:
            return registry.lifecycle(request)
        try:
            return registry.register(request, rid=request.request_id)
        except LifecycleError:
            return None

    def _released(self, lc: Lifecycle, request: Any) -> None:
        self.recent[lc.rid] = lc.serial
        self.recent.move_to_end(lc.rid)
        if len(self.recent) > _RECENT:
            self.recent.popitem(last=False)
        self.indexed.pop(lc.serial, None)

    def known(self, rid: str) -> bool:
        """Whether a lifecycle holds ``rid`` now or released under it lately."""
        return rid in self.recent or self.registry.live(rid) is not None

    def told_on(self, rid: str | None) -> dict[str, Any]:
        """``record_violation``'s arguments naming the lifecycle a report about ``rid`` is
        told in: the live one holding it, or the one that released last (by serial)."""
        if rid is None:
            return {"rid": None}
        lc = self.registry.live(rid)
        if lc is not None:
            return {"rid": rid, "lifecycle": lc}
        serial = self.recent.get(rid)
        return {"rid": rid} if serial is None else {"rid": rid, "serial": serial}

    def open_ticket(self, request: Request, kind: str, **detail: Any) -> Ticket | None:
        """A ticket of ``kind`` on ``request``'s lifecycle (``load`` and ``delayed_free``
        kept under its rid for the report that completes it; a lens's ``store`` and
        ``flush`` by job); ``None`` when refused."""
        lc = self.lifecycle(request)
        if lc is None:
            return None
        try:
            ticket = self.registry.start_offload(lc, kind=kind, **detail)
        except LifecycleError:  # refused (a second finish, say): audited, nothing opened
            return None
        if kind in ("load", "delayed_free"):  # those a report by request id completes
            (self.loads if kind == "load" else self.frees).setdefault(lc.rid, []).append(ticket)
        self.overdue.opened(ticket, kind)
        return ticket

    def check_overdue(self) -> None:
        """Write down the tickets that crossed ``audit_overdue_s`` (once each) and warn."""
        if self.overdue.check():
            logger.warning("kvlife: %s: %s", self.witness, overdue_line(self.overdue))
            self.written()

    def stats(self) -> dict[str, Any] | None:
        """The counters' growth since they were last handed over (overdue tickets, each
        verdict by reason, the audit sinks' losses and errors), and the gauges now;
        ``None`` within ``stats_interval_s`` of the last hand-over, or when nothing
        changed."""
        now = time.monotonic()
        if now - self._stats_at < self.stats_interval_s:
            return None
        self._stats_at = now
        watch = self.overdue
        grown = watch.overdue_total - self._overdue_reported
        verdicts = verdict_growth(self.registry.refusals, self._verdicts_reported)
        verdicts |= audit_growth(self.registry, self._audit_reported)
        gauges = overdue_gauges(watch)
        if not grown and not verdicts and gauges == self._gauges:
            return None
        self._overdue_reported, self._gauges = watch.overdue_total, gauges
        return {"overdue_tickets": grown, **verdicts, **gauges}

    def end(self, request: Request, **detail: DetailValue) -> None:
        self.claims.discard(id(request))  # claimed a load, but never allocated
        lc = self.lifecycle(request)
        if lc is None:
            return
        self.index_blocks(lc)
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        with contextlib.suppress(LifecycleError):  # vLLM finished it twice: refused, audited
            (self.registry.abort if aborted else self.registry.finish)(lc, **detail)

    # ------------------------------------------------------------------ reports

    def report(self, output: KVConnectorOutput) -> None:
        """Complete the tickets the worker output reports; write down (and in refuse
        mode, remove) the reports no open ticket explains."""
        failed_ops = self.failed
        for rid in sorted(getattr(output, "failed_recving", None) or ()):
            tickets = self.loads.get(rid)
            if tickets:
                failed_ops.add(tickets[0].op)
            else:
                self.stray(output, "failed_recving", rid)
        invalid = getattr(output, "invalid_block_ids", None)
        if invalid:
            for op, blocks in self.load_blocks.items():
                if blocks & invalid:
                    failed_ops.add(op)
        for name, tickets_of in self._kinds():
            for rid in sorted(getattr(output, name, None) or ()):
                tickets = tickets_of.get(rid)
                if not tickets:
                    self.stray(output, name, rid)
                    continue
                ticket = tickets.pop(0)
                if not tickets:
                    del tickets_of[rid]
                ok = ticket.op not in failed_ops
                failed_ops.discard(ticket.op)
                self.load_blocks.pop(ticket.op, None)
                lc = ticket.lifecycle
                finished = lc.outcome is not None
                self.registry.complete(ticket, ok, report=name)
                self._remember(name, rid)
                if finished:
                    self._freed(lc, rid, name)

    def _kinds(self) -> tuple[tuple[str, dict[str, list[Ticket]]], ...]:
        """The report that completes each kind of ticket, in the order vLLM handles them."""
        return (("finished_recving", self.loads), ("finished_sending", self.frees))

    def _remember(self, name: str, rid: str) -> None:
        self.reported[(name, rid)] = None
        self.reported.move_to_end((name, rid))
        if len(self.reported) > _RECENT:
            self.reported.popitem(last=False)

    def _freed(self, lc: Lifecycle, rid: str, name: str) -> None:
        """vLLM frees a finished request (blocks and id) at its first completion report:
        every other ticket it has is cut short (failed), and a later report of it is
        stray, as vLLM's scheduler will find no request under the id."""
        for report, tickets_of in self._kinds():
            tickets = tickets_of.get(rid)
            if not tickets:
                continue
            for ticket in [t for t in tickets if t.lifecycle is lc]:
                tickets.remove(ticket)
                self.failed.discard(ticket.op)
                self.load_blocks.pop(ticket.op, None)
                self.registry.complete(ticket, False, cut_by=name)
                self.cut.add((report, rid))
            if not tickets:
                del tickets_of[rid]

    def stray(self, output: KVConnectorOutput, name: str, rid: str) -> None:
        told_on = self.told_on(rid)
        if (name, rid) in self.cut:
            self.cut.discard((name, rid))
            why = "already_freed"
        elif (name, rid) in self.reported:
            why = "repeated"
        elif told_on.keys() == {"rid"}:  # no lifecycle holds it or released under it lately
            why = "unknown_request"
        elif name == "finished_sending":
            why = "free_not_delayed"
        else:
            why = "no_load_pending"
        self.registry.record_violation(
            "stray_report",
            Trigger.FAIL if name == "failed_recving" else Trigger.ACK,
            f"{self.witness} reported {name} for {rid!r} ({why})",
            **told_on,
            report=name,
            why=why,
            refused=self.refuse,
        )
        logger.warning(
            "kvlife: %s reported %s for request %r, which no open transfer explains (%s)%s",
            self.witness,
            name,
            rid,
            why,
            "; removed before vLLM sees it" if self.refuse else "",
        )
        if self.refuse:
            kept = set(getattr(output, name) or ())
            kept.discard(rid)
            setattr(output, name, kept)

    def raised(self, call: str, args: tuple[Any, ...], exc: BaseException) -> None:
        """Write the exception down on the requests it concerns: those it names (an
        argument that is a request id, or an id of the call in its message), else every
        request of the call."""
        trigger = _CALL_TRIGGER.get(call, Trigger.START_OFFLOAD)
        error = f"{type(exc).__name__}: {exc}"[:300]
        named = _rids(args)
        if call == "update_connector_output":  # the lensed jobs it was completing
            named = list(dict.fromkeys([*named, *self.completing]))
        known = [a for a in exc.args if isinstance(a, str) and self.known(a)]
        concerned = _named_in(exc, [*known, *named])
        rids: list[str | None] = list(concerned or named) or [None]
        for rid in rids[:64]:
            self.registry.record_violation(
                "connector_raised",
                trigger,
                f"{self.witness}.{call} raised {error}",
                **self.told_on(rid),
                call=call,
                error=error,
            )
        self.written()

    # ------------------------------------------------------------------ lensed copies

    def flush(self, request: Request) -> None:
        """vLLM finished ``request`` and the lensed connector may still order its final
        copies at the next step: a ``flush`` ticket, opened before the finish, counts
        them (a final flush is ``start_offload`` then ``finish``)."""
        ticket = self.open_ticket(request, "flush")
        if ticket is not None:
            self.flushes[ticket.serial] = ticket
            self.job_counts[ticket.op] = 0
            self.new_flushes.append(ticket)

    def issued(self, lens: Lens, meta: Any, out: SchedulerOutput) -> None:
        """The copies the lensed connector's metadata orders this step become tickets on
        the request objects it issued them for; flush tickets that got none complete."""
        registry, counts, opened = self.registry, self.job_counts, self.overdue.opened
        for job, kind, request in lens.issued(meta):
            if request is None or request not in registry:
                continue  # for a request the wrapper never saw: nothing to count it on
            lc = registry.lifecycle(request)
            if lc.outcome is None:
                ticket = registry.start_offload(lc, kind=kind, job=_number(job))
                opened(ticket, kind)
                counts[ticket.op] = 1
            else:
                flush = self.flushes.get(lc.serial)
                if flush is None or flush.done:
                    continue
                counts[flush.op] += 1
                ticket = flush
            self.jobs[job] = ticket
        for ticket in self.new_flushes:
            if not self.job_counts.get(ticket.op):
                self._over(ticket, jobs=0)
        self.new_flushes.clear()
        self.finishing.clear()
        # a request's state under its id is another's: met when the request is new, or
        # when another request of its id finished (its clean-up may drop the state)
        finished = out.finished_req_ids
        suspects = [new.req_id for new in out.scheduled_new_reqs]
        self.check_owners(lens, dict.fromkeys((*suspects, *finished)) if finished else suspects)

    def replaced(self, lens: Lens, request: Request) -> None:
        """A new request took an id whose finished request's state the connector keeps
        for its next step's pass: if that state is the new request's now, the pass
        (and the old request's final copies) will use the wrong state."""
        rid = request.request_id
        lc, old = self.finishing.get(rid, (None, None))
        if lc is not None and old is not request and lens.owner(rid) is not old:
            new = self.registry.lifecycle(request) if request in self.registry else None
            self._inherited(lens, lc, new, needed=True)

    def check_owners(self, lens: Lens, rids: Iterable[str]) -> None:
        """Write down each running request of ``rids`` (vLLM scheduled it) whose state in
        the lensed connector belongs to another request object with its id, or is gone."""
        registry = self.registry
        for rid in rids:
            holder = registry.live(rid)
            if holder is None or holder.outcome is not None:
                continue
            if holder.req.status != RequestStatus.RUNNING:
                continue  # waiting (for a load, say): the connector sets its state up again
            owner = lens.owner(rid)
            if owner is holder.req or (owner is None and not lens.keeps_every_request):
                continue
            other = registry.lifecycle(owner) if owner is not None and owner in registry else None
            self._inherited(lens, holder, other, dropped=owner is None)

    def completed(self, lens: Lens, output: KVConnectorOutput) -> None:
        """The lensed copies this worker output completes, before the connector takes it:
        each completes its ticket on the request object it was issued for, and a
        completion the connector will credit to another object is written down."""
        registry = self.registry
        self.completing.clear()
        for job, ok, credited in lens.completions(output):
            ticket = self.jobs.pop(job, None)
            if ticket is None or ticket.done:
                continue
            lc = ticket.lifecycle
            self.completing.append(lc.rid)
            if credited is not lc.req:
                other = registry.lifecycle(credited) if credited in registry else None
                where = "no request" if credited is None else "another request object"
                if other is not None:
                    where += f" (lifecycle #{other.serial})"
                registry.record_violation(
                    "credited_elsewhere",
                    Trigger.ACK,
                    f"{lens.name} credits the completion of job {_number(job)}, issued for "
                    f"lifecycle #{lc.serial} of {lc.rid!r}, to {where}",
                    lifecycle=lc,
                    op=ticket.op,
                    job=_number(job),
                    credited="none" if other is None else f"serial {other.serial}",
                )
                logger.warning(
                    "kvlife: %s credits job %s of request %r (lifecycle #%s) to %s",
                    lens.name,
                    _number(job),
                    lc.rid,
                    lc.serial,
                    where,
                )
            left = self.job_counts[ticket.op] - 1
            self.job_counts[ticket.op] = left
            if not left:
                self._over(ticket, ok=ok, job=_number(job))

    def _over(self, ticket: Ticket, ok: bool = True, **detail: Any) -> None:
        del self.job_counts[ticket.op]
        flush = self.flushes.get(ticket.serial)
        if flush is ticket:
            del self.flushes[ticket.serial]
        self.registry.complete(ticket, ok, **detail)

    def _inherited(
        self,
        lens: Lens,
        lc: Lifecycle,
        other: Lifecycle | None,
        *,
        dropped: bool = False,
        needed: bool = False,
    ) -> None:
        if dropped:
            owner, said = "none", "is gone while it runs (dropped with another request of its id)"
        elif needed:
            owner = "unknown" if other is None else f"serial {other.serial}"
            said = "(which its next step's pass still needs) was taken by " + (
                "another request object" if other is None else f"lifecycle #{other.serial}"
            )
        else:
            owner = "unknown" if other is None else f"serial {other.serial}"
            said = "belongs to " + (
                "an unknown request object" if other is None else f"lifecycle #{other.serial}"
            )
        self.registry.record_violation(
            "inherited_state",
            Trigger.START_OFFLOAD,
            f"{lens.name}'s state for {lc.rid!r} (lifecycle #{lc.serial}) {said}",
            lifecycle=lc,
            owner=owner,
        )
        logger.warning("kvlife: %s's state for request %r %s", lens.name, lc.rid, said)

    # ------------------------------------------------------------------ KV events

    def index_blocks(self, lc: Lifecycle) -> None:
        """Remember the block hashes vLLM computed for ``lc``'s request (those not yet
        remembered), with each block's parent and tokens."""
        if not self.events:
            return
        request = lc.req
        hashes = request.block_hashes
        done = self.indexed.get(lc.serial, 0)
        if done >= len(hashes):
            return
        size, tokens, index = self.block_size, request.all_token_ids, self.index
        parent = maybe_convert_block_hash(hashes[done - 1]) if done else None
        for j in range(done, len(hashes)):
            key = maybe_convert_block_hash(hashes[j])
            index[key] = (lc.rid, parent, hash(tuple(tokens[j * size : (j + 1) * size])))
            parent = key
        self.indexed[lc.serial] = len(hashes)
        while len(index) > INDEXED_BLOCKS:
            index.popitem(last=False)

    def check_events(self, events: list[Any]) -> None:
        for lc in self.registry.lifecycles():
            self.index_blocks(lc)
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                held = self.held
                for key in event.block_hashes:
                    count = held.get((event.medium, key), 0)
                    if count > 1:
                        held[(event.medium, key)] = count - 1
                    elif count == 1:
                        del held[(event.medium, key)]
                    else:  # no store of this hash on this medium is left to remove
                        known = self.index.get(key)  # whose block it is, if any
                        rid = known[0] if known is not None else None
                        self._mismatch(rid, "BlockRemoved", key, "never_stored")
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()

    def _stored(self, event: BlockStored) -> None:
        size, parent = event.block_size, event.parent_block_hash
        # An event of hashes alone (no tokens, block size 0: what vLLM 0.33's
        # OffloadingConnector publishes) says nothing of parents or tokens to check.
        whole = bool(event.token_ids) and size > 0
        for i, key in enumerate(event.block_hashes):
            digest = hash(tuple(event.token_ids[i * size : (i + 1) * size])) if whole else 0
            known = self.index.get(key)
            if known is None:
                self._mismatch(None, "BlockStored", key, "unknown_hash")
            elif whole and known[1] != parent:
                self._mismatch(known[0], "BlockStored", key, "parent")
            elif whole and known[2] != digest:
                self._mismatch(known[0], "BlockStored", key, "tokens")
            else:
                held = self.held
                held[(event.medium, key)] = held.get((event.medium, key), 0) + 1
            parent = key

    def _mismatch(self, rid: str | None, event: str, key: Any, why: str) -> None:
        self.registry.record_violation(
            "event_mismatch",
            Trigger.ACK,
            f"{self.witness} published {event} for block hash {key} ({why})",
            **self.told_on(rid),
            event=event,
            why=why,
            block_hash=str(key)[:40],
        )

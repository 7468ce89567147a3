"""Prometheus alerting and recording rules for kvlife's metrics: ``kvlife metrics rules``.

Two sets, by who exposes the metrics:

* ``library``: [`PrometheusMetrics`][kvlife.fsm.audit.metrics.PrometheusMetrics] on a
  registry of yours (metric names ``NAMESPACE_...``, ``kvlife_`` by default). Every verdict
  kvlife writes down on a watched component is a refusal with its reason
  (``NAMESPACE_refusals_total{reason="stray_report"}``), and so is every overdue ticket
  (``reason="overdue"``), so each rule reads a labelled counter, never a log.
* ``vllm``: kvlife's vLLM connector and the audit wrapper, in vLLM's ``/metrics`` (names
  ``vllm:kvlife_...`` and ``vllm:kvlife_audit_...``, labels ``engine`` and ``model_name``):
  each verdict (``verdicts_total{verdict=...}``), the audit sinks' losses and errors, the
  overdue tickets open and the oldest open ticket's age; each rule reads both the
  connector's and the wrapper's.
* ``watch``: ``kvlife audit watch`` (names ``NAMESPACE_watch_...``, label ``log``), which
  follows the logs of several servers at once and counts what only their join shows: a
  prefill/decode hand-over freed before its read, or read from other blocks than were
  handed over; and any violation of the transition table a log shows.

Each alert says how many (its value), where (the labels that name the engine), and the
first commands to run. Severities: ``page`` (someone should look now: the engine is losing
memory or serving wrong data), ``ticket`` (look today: a component broke its protocol and
kvlife kept it harmless, or the audit log is incomplete). The ``for:`` durations and
bounds are the defaults an on-call engineer would start from; ``docs/alerts.md`` explains
each. [`rules_yaml()`][kvlife.fsm.audit.alerts.rules_yaml] writes a rules file Prometheus
loads (``rule_files:``); ``promtool check rules`` and ``promtool test rules`` accept it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Final, Literal

Flavour = Literal["library", "vllm", "watch"]
FLAVOURS: Final[tuple[Flavour, ...]] = ("library", "vllm", "watch")

#: Verdicts that mean memory is being lost or wrong data served: page.
PAGE_VERDICTS: Final = ("connector_raised", "host_freed_in_flight", "failed_write_backed")
#: Verdicts kvlife keeps harmless (or that leak slowly): a ticket.
TICKET_VERDICTS: Final = (
    "stray_report",
    "credited_elsewhere",
    "inherited_state",
    "unbalanced_lock",
    "pending_overwritten",
)
#: A component's late or repeated completions that kvlife's registry refused.
LATE_REFUSALS: Final = ("stale_instance", "duplicate_ack", "unknown_request")

_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class Alert:
    """One alerting rule."""

    name: str
    expr: str
    for_: str
    severity: Literal["page", "ticket"]
    summary: str
    description: str


@dataclass(frozen=True)
class Recording:
    """One recording rule."""

    record: str
    expr: str


@dataclass
class RuleSet:
    """The rules of one flavour and prefix, and the names of the metrics they read."""

    flavour: Flavour
    prefix: str
    alerts: list[Alert] = field(default_factory=list)
    recordings: list[Recording] = field(default_factory=list)


def _one_of(names: tuple[str, ...]) -> str:
    return "|".join(names)


_WHY = (
    "First: `kvlife audit check LOG` on the engine's audit log (KVLIFE_AUDIT_DIR, one log "
    "per rank), then `kvlife audit why LOG --rid RID` for a rid it names."
)


def _duration(seconds: float) -> str:
    """A Prometheus duration: whole minutes as ``Nm``, else seconds (at least 1 s), or
    ``0m``."""
    if seconds <= 0:
        return "0m"
    whole = max(1, round(seconds))
    return f"{whole // 60}m" if whole % 60 == 0 else f"{whole}s"


def _plus(a: str, b: str) -> str:
    """``a + b`` where both have a series, else the one that has (PromQL's ``+`` keeps
    only label sets both sides have)."""
    return f"(({a} + {b}) or {a} or {b})"


def _greater(a: str, b: str) -> str:
    """The larger of ``a`` and ``b`` per label set, or the one that has a series."""
    return f"(({a} >= {b}) or {b} or {a})"


@dataclass(frozen=True)
class _Names:
    """Where one flavour's series are: the counters' names (one, or the connector's and
    the wrapper's), the label that names a verdict, the labels that name an engine."""

    by: str
    label: str
    recording: str
    verdicts: tuple[str, ...]  # the verdict counters' names
    age: tuple[str, ...]  # the age of the oldest thing held
    age_bound_s: int
    lost: tuple[str, ...]
    errors: tuple[str, ...]
    scale: float = 1.0

    def d(self, minutes: float) -> str:
        """``minutes`` as a Prometheus duration, on this rule set's time scale."""
        return _duration(minutes * 60 * self.scale)

    def sums(self, names: tuple[str, ...], matcher: str = "", by: str = "") -> str:
        """``sum by (...) (increase(NAME{matcher}[10m]))``, summed over ``names``."""
        inner = f"{{{matcher}}}" if matcher else ""
        window = self.d(10)
        parts = [f"sum by ({by or self.by}) (increase({n}{inner}[{window}]))" for n in names]
        return parts[0] if len(parts) == 1 else _plus(parts[0], parts[1])

    def largest(self, names: tuple[str, ...], of: str = "{}") -> str:
        """``max by (...) (...)`` of ``of`` (``{}``: the series), over ``names``."""
        parts = [f"max by ({self.by}) ({of.format(n)})" for n in names]
        return parts[0] if len(parts) == 1 else _greater(parts[0], parts[1])


def _recorded(names: _Names) -> Recording:
    """The verdicts over 10 minutes by engine and verdict: what the verdict alerts read."""
    return Recording(names.recording, names.sums(names.verdicts, by=f"{names.by}, {names.label}"))


def _verdicts(names: _Names, reasons: tuple[str, ...] | str, by: str = "") -> str:
    """The verdicts of ``reasons`` over 10 minutes (the recording rule), summed by
    ``by``."""
    match = reasons if isinstance(reasons, str) else _one_of(reasons)
    return f'sum by ({by or names.by}) ({names.recording}{{{names.label}=~"{match}"}})'


def _shared(names: _Names, flavour: Flavour) -> list[Alert]:
    """The alerts both flavours have: one per kind of verdict, and the audit's health."""
    by, label = names.by, names.label
    where = "{{ $labels.instance }}" + (
        " (engine {{ $labels.engine }})" if flavour == "vllm" else ""
    )
    return [
        Alert(
            "KvlifeDataAtRisk",
            f"{_verdicts(names, PAGE_VERDICTS, f'{by}, {label}')} > 0",
            "0m",
            "page",
            "{{ $value | humanize }} {{ $labels." + label + " }} verdict(s) on " + where + " "
            "in the last 10 minutes",
            "The watched component raised (the engine's scheduler may have died), or host "
            "memory was freed under a copy, or a failed write was taken as backed: a "
            f"request can be served KV that was never written. {_WHY}",
        ),
        Alert(
            "KvlifeProtocolBroken",
            f"{_verdicts(names, TICKET_VERDICTS, f'{by}, {label}')} > 0",
            "0m",
            "ticket",
            "{{ $value | humanize }} {{ $labels." + label + " }} verdict(s) on " + where + " "
            "in the last 10 minutes",
            "The watched component reported a completion no copy explains, credited a copy "
            "to another request, released a lock it never took or overwrote a pending "
            f"entry. kvlife wrote it down; the engine serves on. {_WHY}",
        ),
        Alert(
            "KvlifeLateReportsRefused",
            f"{_verdicts(names, LATE_REFUSALS, f'{by}, {label}')} > 0",
            "0m",
            "ticket",
            "{{ $value | humanize }} late or repeated reports refused on " + where + " "
            "({{ $labels." + label + " }})",
            "A completion came for a request that was already released (or twice): "
            "kvlife refused it, so it changed nothing, but the component that sent it keeps "
            f"ids too long. {_WHY}",
        ),
        Alert(
            "KvlifeKvEventWrong",
            f"{_verdicts(names, 'event_mismatch')} > 0",
            "0m",
            "ticket",
            "{{ $value | humanize }} KV events on " + where + " contradict what the engine holds",
            "A KV-aware router fed these events routes requests to blocks that are not "
            f"there (or away from blocks that are). {_WHY}",
        ),
        Alert(
            "KvlifeAuditIncomplete",
            f"{names.sums(names.lost)} > 0 or {names.sums(names.errors)} > 0",
            names.d(5),
            "ticket",
            "The audit log on " + where + " is failing or losing records",
            "An audit sink keeps failing (a full disk, a closed file): records are held in "
            "a bounded backlog, then dropped, and `kvlife audit check` reports the lost "
            "range. Free the disk or fix the path; the verdicts above may be incomplete.",
        ),
    ]


def _library(ns: str, scale: float) -> RuleSet:
    names = _Names(
        by="job, instance",
        label="reason",
        recording=f"{ns}:verdicts:increase10m",
        verdicts=(f"{ns}_refusals_total",),
        age=(f"{ns}_oldest_live_age_seconds",),
        age_bound_s=round(1800 * scale),
        lost=(f"{ns}_sink_dropped_total",),
        errors=(f"{ns}_sink_errors_total",),
        scale=scale,
    )
    rules = RuleSet("library", ns)
    rules.recordings = [_recorded(names)]
    rules.alerts = [
        *_shared(names, "library"),
        Alert(
            "KvlifeCopiesOverdue",
            f"{_verdicts(names, 'overdue')} > 0",
            "0m",
            "ticket",
            "{{ $value | humanize }} copies on {{ $labels.instance }} stayed open past their "
            "limit in the last 10 minutes",
            "A copy (or a delayed free, or a cache's write or load) was not reported done "
            "within its limit: blocks or pages are held meanwhile, and one never reported "
            f"is a leak. {_WHY} `kvlife audit check LOG --overdue-fails` lists them.",
        ),
        Alert(
            "KvlifeLifecycleLeakGrowing",
            f"{names.age[0]} > {names.age_bound_s} and deriv({names.age[0]}[{names.d(10)}]) > 0.5",
            names.d(10),
            "page",
            "A request's lifecycle on {{ $labels.instance }} has been live for "
            "{{ $value | humanizeDuration }} and keeps ageing",
            "The oldest unreleased lifecycle is older than 30 minutes and still the same "
            "one: its host memory (and the engine's blocks, if a free waits on it) is never "
            f"given back. {_WHY} `kvlife audit stats LOG` shows the live lifecycles.",
        ),
    ]
    return rules


def _vllm(prefix: str, scale: float) -> RuleSet:
    """kvlife's connector (``PREFIX...``) and the audit wrapper (``PREFIXaudit_...``): each
    rule reads both, summed (or the larger) per engine."""

    def both(name: str) -> tuple[str, ...]:
        return (f"{prefix}{name}", f"{prefix}audit_{name}")

    names = _Names(
        by="instance, engine, model_name",
        label="verdict",
        recording=f"{prefix.rstrip('_:')}:verdicts:increase10m",
        verdicts=both("verdicts_total"),
        age=both("oldest_open_ticket_seconds"),
        age_bound_s=round(600 * scale),
        lost=both("records_lost_total"),
        errors=both("sink_errors_total"),
        scale=scale,
    )
    rules = RuleSet("vllm", prefix)
    rules.recordings = [_recorded(names)]
    rules.alerts = [
        *_shared(names, "vllm"),
        Alert(
            "KvlifeBlocksHeldPastLimit",
            f"{names.largest(both('tickets_overdue_open'))} > 0",
            names.d(2),
            "ticket",
            "{{ $value | humanize }} request(s) on {{ $labels.instance }} (engine "
            "{{ $labels.engine }}) hold blocks past the audit limit",
            "A store, a load or a delayed free of the KV connector was not reported done "
            "within audit_overdue_s: vLLM keeps those requests' blocks meanwhile. "
            f"{_WHY} `kvlife audit check LOG --overdue-fails` names the rids.",
        ),
        Alert(
            "KvlifeBlocksLeaking",
            f"{names.largest(names.age)} > {names.age_bound_s} and "
            f"{names.largest(names.age, 'deriv({}[' + names.d(5) + '])')} > 0.5",
            names.d(5),
            "page",
            "A request's blocks on {{ $labels.instance }} (engine {{ $labels.engine }}) have "
            "been held {{ $value | humanizeDuration }} and counting",
            "The oldest open ticket is older than 10 minutes and still the same one: the "
            "connector will never report it (LMCache 0.5.6's reused-id leak looks like "
            "this), and vLLM holds its blocks for ever; the free pool shrinks with each. "
            f"{_WHY}",
        ),
    ]
    return rules


#: What the watch counts that its own hand-over alerts, or the engines' own counters (the
#: vLLM and library sets' alerts), already page on: left out of ``KvlifeLogViolation``.
_ALERTED_ELSEWHERE: Final = (
    "freed_before_read",
    "handover_mismatch",
    *PAGE_VERDICTS,
    *TICKET_VERDICTS,
    "event_mismatch",
    "overdue",
    "unreported",
    "leaked",
)


def _watch(ns: str, scale: float) -> RuleSet:
    """``kvlife audit watch``'s counters (``NS_watch_...``, by ``log`` and ``kind``)."""
    names = _Names(
        by="instance, log",
        label="kind",
        recording=f"{ns}:watch_violations:increase10m",
        verdicts=(f"{ns}_watch_violations_total",),
        age=(),
        age_bound_s=0,
        lost=(f"{ns}_watch_records_lost_total",),
        errors=(f"{ns}_watch_unreadable_lines_total",),
        scale=scale,
    )
    why = (
        "The watch's output names the rid (VIOLATION KIND in LOG rid=...). First: `kvlife "
        "audit check PREFILL_LOG DECODE_LOG` (both servers' logs, or the directory that "
        "holds them), then `kvlife audit why LOGS --rid RID`, which tells the request on "
        "both servers."
    )
    elsewhere = _one_of(_ALERTED_ELSEWHERE)
    rules = RuleSet("watch", ns)
    rules.recordings = [_recorded(names)]
    rules.alerts = [
        Alert(
            "KvlifeHandoverFreedBeforeRead",
            f"{_verdicts(names, 'freed_before_read')} > 0",
            "0m",
            "page",
            "{{ $value | humanize }} request(s) read by the decode server of "
            "{{ $labels.log }} from blocks the prefill server had freed",
            "A prefill server freed a handed-over request's blocks (its lease or timeout "
            "ended) before the decode server began to read them: the decode server read "
            "blocks that may hold another request's KV by then, and its answer may be "
            "wrong. Lengthen the prefill side's lease (NixlConnector's kv_lease_duration) "
            f"or find why the decode side came late. {why}",
        ),
        Alert(
            "KvlifeHandoverMismatch",
            f"{_verdicts(names, 'handover_mismatch')} > 0",
            "0m",
            "page",
            "{{ $value | humanize }} request(s) on {{ $labels.log }} read other blocks than "
            "were handed over",
            "The decode server read other blocks than the prefill server handed over under "
            "that request's identity (a proxy that mixed up two requests' kv_transfer_params): "
            f"its answer is built on another request's KV. {why}",
        ),
        Alert(
            "KvlifeLogViolation",
            f'sum by (instance, log, kind) ({names.recording}{{kind!~"{elsewhere}"}}) > 0',
            "0m",
            "ticket",
            "{{ $value | humanize }} {{ $labels.kind }} violation(s) in {{ $labels.log }}",
            "The log shows a transition the lifecycle table does not allow, or records "
            "missing that no sink reported lost: kvlife's own bookkeeping or the log itself "
            "is wrong (report it to kvlife's developers with the log). " + why,
        ),
        Alert(
            "KvlifeWatchIncomplete",
            f"{names.sums(names.lost)} > 0 or {names.sums(names.errors)} > 0 or "
            f"max by ({names.by}) ({ns}_watch_log_failed) > 0",
            names.d(5),
            "ticket",
            "The watch cannot read all of {{ $labels.log }}",
            "The log's writer reported records lost, or lines are not records, or the file "
            "is not a kvlife audit log (or was written with another transition table, or "
            "cannot be read: a directory at its path, a file the watch may not read): the "
            "watch's verdicts on it may be incomplete. `kvlife audit check LOG` says which.",
        ),
        Alert(
            "KvlifeWatchStalled",
            f"time() - max by (instance) ({ns}_watch_last_poll_timestamp_seconds) > "
            f"{round(300 * scale)}",
            names.d(2),
            "ticket",
            "kvlife audit watch on {{ $labels.instance }} has not read its logs for "
            "{{ $value | humanizeDuration }}",
            "The watch's loop has not finished a read of its logs for over 5 minutes (a "
            "read that does not return: a network file system that hangs): no verdict on "
            "any log it follows is counted meanwhile, though it still answers scrapes. "
            "Restart it once the file system answers: it reads every log again from its "
            "oldest file, and what it counts then does not page.",
        ),
    ]
    return rules


def rule_set(
    flavour: Flavour = "library", prefix: str | None = None, *, timescale: float = 1.0
) -> RuleSet:
    """The rules of ``flavour`` for metric names starting with ``prefix`` (``library``: the
    namespace given to ``PrometheusMetrics``, default ``kvlife``; ``vllm``: the connector's
    metric prefix, default ``vllm:kvlife_``; ``watch``: ``kvlife audit watch``'s
    namespace, default ``kvlife``). ``timescale`` multiplies every duration and
    age bound (the ``for:`` times, the windows, the leak's age): 1 in production; a test
    or a demo runs the same rules on a faster clock.

    Raises:
        ValueError: an unknown flavour, a prefix Prometheus would not take as the start
            of a metric name, or a time scale that is not a positive number.
    """
    if not (isinstance(timescale, (int, float)) and 0 < timescale <= 100):
        raise ValueError(f"kvlife: the time scale must be in (0, 100], got {timescale!r}")
    if flavour not in FLAVOURS:
        raise ValueError(f"kvlife: rules are for {FLAVOURS}, got {flavour!r}")
    if prefix is None:
        prefix = "vllm:kvlife_" if flavour == "vllm" else "kvlife"
    if not _METRIC_PREFIX.fullmatch(prefix):
        raise ValueError(
            f"kvlife: {prefix!r} cannot begin a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)"
        )
    if flavour == "library":
        return _library(prefix, float(timescale))
    if flavour == "watch":
        return _watch(prefix, float(timescale))
    return _vllm(prefix, float(timescale))


def _scalar(text: str) -> str:
    """A YAML scalar: JSON's double-quoted string is one."""
    return json.dumps(text)


def rules_yaml(rules: RuleSet) -> str:
    """A Prometheus rules file (YAML) holding ``rules`` as one group."""
    out = [
        "# kvlife's alerting rules: kvlife metrics rules "
        f"--for {rules.flavour} --prefix {rules.prefix}",
        "groups:",
        f"  - name: {_scalar('kvlife-' + rules.flavour)}",
        "    rules:",
    ]
    for recording in rules.recordings:
        out += [
            f"      - record: {_scalar(recording.record)}",
            f"        expr: {_scalar(recording.expr)}",
        ]
    for alert in rules.alerts:
        out += [
            f"      - alert: {alert.name}",
            f"        expr: {_scalar(alert.expr)}",
            f"        for: {alert.for_}",
            "        labels:",
            f"          severity: {alert.severity}",
            f"          flavour: {rules.flavour}",
            "        annotations:",
            f"          summary: {_scalar(alert.summary)}",
            f"          description: {_scalar(alert.description)}",
        ]
    return "\n".join(out) + "\n"


__all__ = [
    "FLAVOURS",
    "LATE_REFUSALS",
    "PAGE_VERDICTS",
    "TICKET_VERDICTS",
    "Alert",
    "Flavour",
    "Recording",
    "RuleSet",
    "rule_set",
    "rules_yaml",
]

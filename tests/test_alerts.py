"""kvlife's Prometheus rules (``kvlife.fsm.audit.alerts``, ``kvlife metrics rules``): each
alert fires on a series that should page, stays quiet on a clean one and on a short blip
or a restart, as ``promtool test rules`` (Debian's ``prometheus`` package, installed by
``make prometheus``) evaluates them; the library's metrics carry the series the rules
read."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvlife.diagrams.cli import main
from kvlife.fsm import LifecycleRegistry, OverdueWatch, Trigger
from kvlife.fsm.audit.alerts import FLAVOURS, rule_set, rules_yaml
from kvlife.fsm.audit.metrics import PrometheusMetrics
from tests.strategies import Req
from tests.tools import needs

PROMTOOL = shutil.which("promtool")
needs_promtool = needs(PROMTOOL is not None, "promtool", "make prometheus")

LIB = {"job": "engine", "instance": "10.0.0.7:8000"}
VLLM = {"instance": "10.0.0.7:8000", "engine": "0", "model_name": "llama"}


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def _fired(
    flavour: str, alert: str, labels: dict[str, str], value: str, duration: str = ""
) -> dict[str, Any]:
    """An expected alert: its labels and its annotations rendered as Prometheus renders
    them (``value``: ``$value | humanize``; ``duration``: ``| humanizeDuration``)."""
    (rule,) = [a for a in rule_set(flavour).alerts if a.name == alert]  # type: ignore[arg-type]

    def render(template: str) -> str:
        text = template.replace("{{ $value | humanize }}", value)
        text = text.replace("{{ $value | humanizeDuration }}", duration)
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], text)

    return {
        "exp_labels": {**labels, "severity": rule.severity, "flavour": flavour},
        "exp_annotations": {
            "summary": render(rule.summary),
            "description": render(rule.description),
        },
    }


def _case(
    series: list[dict[str, str]], checks: list[tuple[str, str, list[dict[str, Any]]]]
) -> dict[str, Any]:
    return {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": at, "alertname": alert, "exp_alerts": expected}
            for at, alert, expected in checks
        ],
    }


def _promtool(tmp_path: Path, flavour: str, cases: list[dict[str, Any]]) -> None:
    rules = tmp_path / f"{flavour}.rules.yml"
    rules.write_text(rules_yaml(rule_set(flavour)))  # type: ignore[arg-type]
    test = tmp_path / f"{flavour}.test.yml"
    body = {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": cases}
    test.write_text(json.dumps(body, indent=1))  # JSON is YAML
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "test", "rules", str(test)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


REF = "kvlife_refusals_total"


def _library_counter_cases(alert: str, reason: str) -> list[dict[str, Any]]:
    """A verdict counter alert: one or two verdicts fire it; a flat counter, and an engine
    restart (the counter back to 0), do not."""
    labels = {**LIB, "reason": reason}
    expected = {**LIB} if alert in ("KvlifeCopiesOverdue", "KvlifeKvEventWrong") else labels
    return [
        _case(
            [_series(REF, labels, "0 0 2 2 2 2")],
            [("4m", alert, [_fired("library", alert, expected, "2")]), ("1m", alert, [])],
        ),
        _case([_series(REF, labels, "3x10")], [("8m", alert, [])]),  # clean: no new verdict
        _case([_series(REF, labels, "3 3 0 0 0 0")], [("5m", alert, [])]),  # a restart
    ]


@needs_promtool
def test_the_library_rules_fire_on_what_should_page_and_stay_quiet_otherwise(
    tmp_path: Path,
) -> None:
    cases: list[dict[str, Any]] = []
    for alert, reason in (
        ("KvlifeCopiesOverdue", "overdue"),
        ("KvlifeDataAtRisk", "connector_raised"),
        ("KvlifeDataAtRisk", "host_freed_in_flight"),
        ("KvlifeProtocolBroken", "stray_report"),
        ("KvlifeProtocolBroken", "unbalanced_lock"),
        ("KvlifeLateReportsRefused", "stale_instance"),
        ("KvlifeKvEventWrong", "event_mismatch"),
    ):
        cases += _library_counter_cases(alert, reason)
    # a stray report is not data at risk, an overdue copy not a protocol break
    cases.append(
        _case(
            [_series(REF, {**LIB, "reason": "stray_report"}, "0 0 2 2 2")],
            [("4m", "KvlifeDataAtRisk", []), ("4m", "KvlifeCopiesOverdue", [])],
        )
    )
    age = "kvlife_oldest_live_age_seconds"
    leak = "KvlifeLifecycleLeakGrowing"
    cases += [
        # one lifecycle never released: its age grows a minute a minute past 30 minutes
        _case(
            [_series(age, LIB, "1500+60x30")],
            [
                ("12m", leak, []),  # over 1800 s since 5m: not yet for 10 minutes
                ("17m", leak, [_fired("library", leak, LIB, "", "42m 0s")]),
            ],
        ),
        # requests come and go: the oldest is always young
        _case(
            [_series(age, LIB, "30 90 150 40 100 160 20 80 140 35 95 155 45 105")],
            [("13m", leak, [])],
        ),
        # a long request, released after 40 minutes: quiet once it is gone
        _case(
            [_series(age, LIB, "1500+60x14 60 120 180 240 300 360 420 480 540 600 660 720")],
            [("26m", leak, [])],
        ),
    ]
    dropped = "kvlife_sink_dropped_total"
    errors = "kvlife_sink_errors_total"
    sink = {**LIB, "sink": "0:JsonLinesSink"}
    incomplete = "KvlifeAuditIncomplete"
    cases += [
        _case(
            [_series(dropped, sink, "0 0 3 3 3 3 3 3 3 3"), _series(errors, sink, "0x9")],
            [("4m", incomplete, []), ("8m", incomplete, [_fired("library", incomplete, LIB, "3")])],
        ),
        _case(
            [_series(dropped, sink, "0x9"), _series(errors, sink, "0 0 1 2 3 4 5 6 7 8")],
            [("9m", incomplete, [_fired("library", incomplete, LIB, "7")])],
        ),
        _case(
            [_series(dropped, sink, "0x9"), _series(errors, sink, "0x9")], [("9m", incomplete, [])]
        ),
    ]
    _promtool(tmp_path, "library", cases)


@needs_promtool
def test_the_vllm_rules_read_the_connector_and_the_wrapper_and_not_a_blip(
    tmp_path: Path,
) -> None:
    """kvlife's connector (``vllm:kvlife_...``) and the audit wrapper
    (``vllm:kvlife_audit_...``): each alone fires a rule, both on one engine are summed
    (counters) or the larger taken (gauges)."""
    held = "KvlifeBlocksHeldPastLimit"
    leaking = "KvlifeBlocksLeaking"
    late = "KvlifeLateReportsRefused"
    risk = "KvlifeDataAtRisk"
    incomplete = "KvlifeAuditIncomplete"
    mine, wrapper = "vllm:kvlife_", "vllm:kvlife_audit_"
    stale = {**VLLM, "verdict": "stale_instance"}
    raised = {**VLLM, "verdict": "connector_raised"}
    cases = [
        _case(
            [_series(f"{wrapper}tickets_overdue_open", VLLM, "0 2 2 2 2 2")],
            [("2m", held, []), ("4m", held, [_fired("vllm", held, VLLM, "2")])],
        ),
        _case(  # both on one engine: the larger
            [
                _series(f"{wrapper}tickets_overdue_open", VLLM, "0 2 2 2 2 2"),
                _series(f"{mine}tickets_overdue_open", VLLM, "0 3 3 3 3 3"),
            ],
            [("4m", held, [_fired("vllm", held, VLLM, "3")])],
        ),
        _case([_series(f"{mine}tickets_overdue_open", VLLM, "0 1 0 0 0 0")], [("4m", held, [])]),
        _case([_series(f"{wrapper}tickets_overdue_open", VLLM, "0x9")], [("9m", held, [])]),
        _case(
            [_series(f"{wrapper}oldest_open_ticket_seconds", VLLM, "400+60x20")],
            [("8m", leaking, []), ("10m", leaking, [_fired("vllm", leaking, VLLM, "", "16m 40s")])],
        ),
        # tickets that complete: the oldest open one stays young
        _case(
            [_series(f"{mine}oldest_open_ticket_seconds", VLLM, "0 30 60 5 35 65 10 40 70 3 33")],
            [("10m", leaking, [])],
        ),
        _case(
            [_series(f"{mine}verdicts_total", stale, "0 0 1 1 1")],
            [("4m", late, [_fired("vllm", late, stale, "1")]), ("4m", risk, [])],
        ),
        _case(  # the wrapper's and the connector's verdicts on one engine add up
            [
                _series(f"{wrapper}verdicts_total", raised, "0 0 2 2 2"),
                _series(f"{mine}verdicts_total", raised, "0 0 1 1 1"),
            ],
            [("4m", risk, [_fired("vllm", risk, raised, "3")])],
        ),
        _case([_series(f"{mine}verdicts_total", stale, "4 4 0 0 0")], [("4m", late, [])]),
        _case(
            [_series(f"{wrapper}records_lost_total", VLLM, "0 0 5 5 5 5 5 5 5")],
            [("8m", incomplete, [_fired("vllm", incomplete, VLLM, "5")])],
        ),
    ]
    _promtool(tmp_path, "vllm", cases)


@needs_promtool
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_promtool_checks_the_rules_the_command_prints(
    flavour: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = "myengine_kv" if flavour == "library" else "sglang:kvlife_"
    assert main(["metrics", "rules", "--for", flavour, "--prefix", prefix]) == 0
    printed = capsys.readouterr().out
    assert f"{prefix}" in printed and "kvlife audit why" in printed
    path = tmp_path / "rules.yml"
    path.write_text(printed)
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_a_prefix_prometheus_would_not_take_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="cannot begin a Prometheus metric name"):
        rule_set("library", "9kvlife")
    with pytest.raises(ValueError, match="rules are for"):
        rule_set("sglang")  # type: ignore[arg-type]
    assert main(["metrics", "rules", "--prefix", "kv-life"]) == 2
    assert "cannot begin a Prometheus metric name" in capsys.readouterr().err


def test_the_library_metrics_carry_the_series_the_rules_read() -> None:
    """An overdue ticket and a verdict on a watched component, through PrometheusMetrics:
    the counters the library rules read, with the reasons they match."""
    clock = [0.0]
    registry = LifecycleRegistry()
    prom = CollectorRegistry()
    PrometheusMetrics(registry, prom)
    watch = OverdueWatch(registry, 5.0, clock=lambda: clock[0])
    req = Req("chat-1")
    registry.register(req)
    watch.opened(registry.start_offload(req), "store")
    clock[0] = 6.0
    watch.check()
    registry.record_violation("stray_report", Trigger.ACK, "a report no ticket explains")
    text = generate_latest(prom).decode()
    assert 'kvlife_refusals_total{reason="overdue"} 1.0' in text
    assert 'kvlife_refusals_total{reason="stray_report"} 1.0' in text
    rules = rules_yaml(rule_set("library"))
    for metric in ("kvlife_refusals_total", "kvlife_oldest_live_age_seconds"):
        assert metric in rules and metric in text
    for metric in ("kvlife_sink_dropped_total", "kvlife_sink_errors_total"):
        assert metric in rules  # a family with one series per sink: none attached here


@needs_promtool
def test_a_time_scale_runs_the_same_rules_on_a_faster_clock(tmp_path: Path) -> None:
    """``--timescale 0.02``: 2 minutes are 2 s, 10 minutes 12 s, the leak's bound 12 s
    (what the end-to-end test runs, with a scrape a second)."""
    rules = rule_set("vllm", timescale=0.02)
    fors = {a.name: a.for_ for a in rules.alerts}
    assert fors["KvlifeBlocksHeldPastLimit"] == "2s" and fors["KvlifeBlocksLeaking"] == "6s"
    assert "> 12 and" in next(a.expr for a in rules.alerts if a.name == "KvlifeBlocksLeaking")
    assert "[12s]" in rules.recordings[0].expr
    path = tmp_path / "fast.yml"
    path.write_text(rules_yaml(rules))
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, check=False)
    assert done.returncode == 0, done.stdout
    with pytest.raises(ValueError, match="time scale"):
        rule_set("vllm", timescale=0)
    assert main(["metrics", "rules", "--timescale", "-1"]) == 2


WATCH = {"instance": "127.0.0.1:9400", "log": "/var/log/kvlife/decode.jsonl"}
WATCHED = "kvlife_watch_violations_total"
POLLED = "kvlife_watch_last_poll_timestamp_seconds"


@needs_promtool
def test_the_watch_rules_page_on_a_hand_over_and_leave_the_engines_verdicts_alone(
    tmp_path: Path,
) -> None:
    """``kvlife audit watch``'s counters: a hand-over freed before its read or mismatched
    pages; a table violation only the log shows is a ticket; a verdict the engine's own
    counters page on (``stray_report``) or a hand-over verdict is not counted twice; a
    log the watch cannot read is a ticket after 5 minutes, and so is a watch stuck in a
    read for over 5 minutes (2 more)."""
    freed, mismatch = "KvlifeHandoverFreedBeforeRead", "KvlifeHandoverMismatch"
    table, incomplete = "KvlifeLogViolation", "KvlifeWatchIncomplete"
    stalled, at = "KvlifeWatchStalled", {"instance": WATCH["instance"]}
    early = {**WATCH, "kind": "freed_before_read"}
    mixed = {**WATCH, "kind": "handover_mismatch"}
    gap = {**WATCH, "kind": "seq_gap"}
    stray = {**WATCH, "kind": "stray_report"}
    cases = [
        _case(
            [_series(WATCHED, early, "0 0 1 1 1"), _series(WATCHED, gap, "0x4")],
            [
                ("1m", freed, []),
                ("3m", freed, [_fired("watch", freed, WATCH, "1")]),
                ("3m", table, []),
                ("3m", mismatch, []),
            ],
        ),
        _case([_series(WATCHED, early, "2x10")], [("9m", freed, [])]),  # history: no page
        _case(
            [_series(WATCHED, mixed, "0 2 2 2")],
            [("2m", mismatch, [_fired("watch", mismatch, WATCH, "2")])],
        ),
        _case(
            [_series(WATCHED, gap, "0 0 1 1"), _series(WATCHED, stray, "0 0 3 3")],
            [("3m", table, [_fired("watch", table, gap, "1")])],
        ),
        _case(
            [_series("kvlife_watch_log_failed", WATCH, "1x9")],
            [("3m", incomplete, []), ("6m", incomplete, [_fired("watch", incomplete, WATCH, "")])],
        ),
        _case(  # a watch reading every minute, then stuck in a read from minute 3 on
            [_series(POLLED, {"instance": WATCH["instance"]}, "0+60x3 180x12")],
            [("9m", stalled, []), ("11m", stalled, [_fired("watch", stalled, at, "", "8m 0s")])],
        ),
        _case(
            [_series(POLLED, {"instance": WATCH["instance"]}, "0+60x15")], [("14m", stalled, [])]
        ),
    ]
    _promtool(tmp_path, "watch", cases)

"""The ``kvlife`` command's log tools (see ``kvlife.diagrams.cli``):
``audit check``, ``stats``, ``why``, ``report``, ``timeline``, ``ranks`` and ``watch``, and
``diagram`` (with ``--from-log``): each reads a log, runs the checker over it, states the
verdict ``audit check`` would give and exits as it does."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvlife.diagrams.cli_common import (
    UsageError,
    _check,
    _checker,
    _count,
    _problems_line,
    _reader,
    _reading,
    _say_verdict,
    _verdict,
    _write_file,
    log_files,
)
from kvlife.diagrams.dot import render
from kvlife.diagrams.lifecycle import lifecycle_dot, lifecycle_mermaid
from kvlife.diagrams.log_graph import log_graph
from kvlife.diagrams.story import Story, plot_story, story_of
from kvlife.fsm.audit import (
    AuditChecker,
    AuditReader,
    AuditReport,
    Segment,
    ending_lines,
    segment_records,
)
from kvlife.fsm.audit.explain import (
    collect_partners,
    find_rid,
    handovers_of,
    read_story,
    tell,
)
from kvlife.fsm.audit.ranks import compare_ranks


def _diagram(args: argparse.Namespace) -> int:
    reader: AuditReader | None = None
    if args.from_log:
        if args.format == "mermaid":
            raise UsageError("kvlife diagram: --from-log draws dot, svg or png, not mermaid")
        log = reader = _reader(args.from_log)  # a second name mypy keeps non-optional
        checker = _checker(args)
        graph = _reading(
            args.from_log,
            lambda: log_graph(
                log, title=Path(args.from_log).name, checker=checker, all_edges=args.all_edges
            ),
        )
        dot = str(graph.source)
    else:
        dot = lifecycle_dot()
    if args.format in ("dot", "mermaid"):
        text = dot if args.format == "dot" else lifecycle_mermaid()
        data = text.encode()
    else:
        data = render(dot, args.format)
    if args.output:
        _write_file(args.output, data)
        what = (
            f"the lifecycle diagram with {args.from_log}'s counts"
            if args.from_log
            else "the lifecycle diagram"
        )
        print(f"{args.output}: {what} ({args.format}, {len(data)} bytes)")
    elif args.format == "png":
        raise UsageError("kvlife diagram: PNG needs -o FILE")
    else:
        sys.stdout.write(data.decode())
    if reader is None:
        return 0
    return _say_verdict(args, args.from_log, checker.report, reader)


def _segment_index(path: str, logs: Sequence[str], segment: int | str) -> int:
    """The index of the segment named by ``--segment``: the segment with that id, else
    (digits) the segment with that index."""
    if isinstance(segment, int):
        return segment
    ids: list[str] = []

    def find() -> int | None:
        for event in _reader(logs):
            if type(event) is Segment:
                if event.header.segment == segment:
                    return event.index
                ids.append(event.header.segment)
        return None

    index = _reading(path, find)
    if index is not None:
        return index
    if segment.isdigit():
        return int(segment)
    raise UsageError(
        f"kvlife audit why: {path} has no segment {segment!r}; its segments: "
        + ", ".join(f"{i}={sid}" for i, sid in enumerate(ids))
    )


def _why(args: argparse.Namespace) -> int:
    if args.output is not None:
        _picture_name("why", args.output)
    args.segment = _segment_index(args.log, args.logs, args.segment)
    rid = args.rid
    if rid is None:
        rid = _reading(args.log, lambda: find_rid(_reader(args.logs), args.serial, args.segment))
        if rid is None:
            raise UsageError(
                f"kvlife audit why: {args.log} has no lifecycle #{args.serial} in segment "
                f"{args.segment}"
            )
    reader = _reader(args.logs)
    checker = _checker(args)
    # one pass: the words and the picture tell the same records
    history, marks = _reading(args.log, lambda: read_story(reader, rid, checker=checker))
    handovers = handovers_of(checker, rid)
    if handovers:  # prefill/decode: the other side's lifecycles, from a second pass
        _reading(args.log, lambda: collect_partners(_reader(args.logs), history, handovers))
    try:
        text = tell(
            history,
            marks,
            serial=args.serial,
            segment=args.segment,
            checker=checker,
            unreadable_lines=reader.problem_count,
            allow_lost=args.allow_lost,
        )
    except LookupError as exc:
        raise UsageError(f"kvlife audit why: {args.log}: {exc}") from None
    print(text)
    if args.output is not None and not history.lifecycles:
        print(f"\n{args.output}: not written: rid {rid!r} has no lifecycle in the log to draw")
    elif args.output is not None:
        around = None if args.serial is None else (args.segment, args.serial)
        _draw_story(args.output, args.log, story_of(history, marks, around=around))
    return _verdict(args, checker.report, reader).exit_status


def _picture_name(view: str, output: str) -> None:
    """Refuse (exit 2) an output that is not a .png or .svg file name."""
    suffix = Path(output).suffix
    if suffix not in (".png", ".svg"):
        raise UsageError(f"kvlife audit {view}: -o needs a .png or .svg name, got {suffix!r}")
    if Path(output).is_dir():
        raise UsageError(f"kvlife: {output} is a directory; give a file name")


def _draw_story(output: str, log: str, story: Story) -> None:
    try:
        _reading(log, lambda: plot_story(story, Path(output)), writes=output)
    except ModuleNotFoundError as exc:
        raise UsageError(f"kvlife: {exc}") from None
    copies = sum(len(lane.copies) for lane in story.lanes)
    lanes = _count(len(story.lanes), "lifecycle")
    if story.total > len(story.lanes):
        lanes += f" of {story.total}"
    print(
        f"\n{output}: the story of rid {story.rid!r}: {lanes}, "
        f"{copies} cop{'y' if copies == 1 else 'ies'}, {_count(len(story.reuses), 'reuse')}, "
        f"{_count(len(story.late), 'late completion')}"
    )


def _known_rids(args: argparse.Namespace, view: str) -> None:
    """Refuse (exit 2, naming them) the ``--rid`` values the log holds no record of."""
    wanted = set(args.rid)

    def find() -> set[str]:
        seen: set[str] = set()
        for _, record in segment_records(_reader(args.logs)):
            rid = record.rid
            if rid is not None and rid in wanted:
                seen.add(rid)
                if seen == wanted:
                    break
        return seen

    missing = sorted(wanted - _reading(args.log, find))
    if missing:
        names = ", ".join(repr(rid) for rid in missing)
        raise UsageError(f"kvlife audit {view}: {args.log} has no record of rid {names}")


def _timeline(args: argparse.Namespace) -> int:
    from kvlife.diagrams.timeline import plot_timeline

    _picture_name("timeline", args.output)
    if args.rid:
        _known_rids(args, "timeline")
    reader = _reader(args.logs)
    checker = _checker(args)
    try:
        rows = _reading(
            args.log,
            lambda: plot_timeline(
                reader,
                Path(args.output),
                title=Path(args.log).name,
                max_rows=args.max_rows,
                rids=args.rid,
                checker=checker,
            ),
            writes=args.output,
        )
    except ModuleNotFoundError as exc:
        raise UsageError(f"kvlife: {exc}") from None
    report = checker.report
    print(
        f"{args.output}: {_count(rows, 'lifecycle row')}, "
        f"{_count(report.violation_count, 'violation')}, "
        f"{_count(report.reused_while_unreleased, 'rid reuse')} while unreleased"
    )
    return _say_verdict(args, args.log, report, reader)


def _report(args: argparse.Namespace) -> int:
    from kvlife.diagrams.report import build_report

    if Path(args.output).is_dir():
        raise UsageError(f"kvlife: {args.output} is a directory; give a file name")
    _reader(args.logs)  # a missing or foreign path is a usage error before any work
    readers: list[AuditReader] = []

    def events() -> AuditReader:
        readers.append(_reader(args.logs))
        return readers[-1]

    page, data = _reading(
        args.log,
        lambda: build_report(
            events,
            title=Path(args.log).name,
            checker=lambda: _checker(args),
            allow_lost=args.allow_lost,
        ),
    )
    _write_file(args.output, page.encode("utf-8"))
    listed = len(data.lifecycles)
    print(
        f"{args.output}: {data.records} records, {listed} of {data.total} lifecycles listed "
        f"({len(page.encode()) / 1024:.0f} KiB)"
    )
    return _say_verdict(args, args.log, data.report, readers[-1])


def _watch(args: argparse.Namespace) -> int:
    """``kvlife audit watch``: follow the logs, print each verdict, serve the counts."""
    from kvlife.fsm.audit.watch import SETTLE_S, AuditWatch, WatchCollector

    for path in map(Path, args.logs):
        if not path.exists() and not path.parent.is_dir():
            raise UsageError(f"kvlife audit watch: {path}: no such file or directory")
    settle = args.settle if args.settle is not None else (0.0 if args.once else SETTLE_S)
    watch = AuditWatch(
        args.logs,
        overdue_fails=args.overdue_fails,
        accept_tables=args.accept_table,
        settle_s=settle,
    )
    collector = WatchCollector(watch, args.namespace)
    found = 0

    def poll() -> None:
        nonlocal found
        for verdict in watch.poll():
            found += 1
            print(f"kvlife audit watch: {verdict.line()}", flush=True)
        for log in watch.logs.values():
            for line in log.incomplete():  # audit check fails a log for these too
                found += 1
                print(f"kvlife audit watch: {line}", flush=True)
            if log.failed is not None and log.label not in failed:
                failed.add(log.label)
                print(f"kvlife audit watch: not following {log.label}: {log.failed}", flush=True)
        collector.publish()

    failed: set[str] = set()
    try:
        poll()
        if args.once:
            return 1 if found or failed else 0
        if args.port is not None:
            try:
                from prometheus_client import CollectorRegistry, start_http_server
            except ImportError as exc:
                raise UsageError(
                    "kvlife audit watch --port: needs prometheus_client "
                    f"(pip install 'kvlife[metrics]'): {exc}"
                ) from exc
            registry = CollectorRegistry(auto_describe=False)
            registry.register(collector)
            try:
                server, _ = start_http_server(args.port, args.host, registry)
            except OSError as exc:  # before: "standard output: Address already in use"
                raise UsageError(
                    f"kvlife audit watch: cannot serve /metrics on {args.host}:{args.port}: "
                    f"{exc.strerror or exc}"
                ) from exc
            port = server.server_address[1]
            print(
                f"kvlife audit watch: {len(watch.logs)} log(s) followed; metrics on "
                f"http://{args.host}:{port}/metrics",
                flush=True,
            )
        while True:
            time.sleep(args.interval)
            poll()
    finally:
        watch.close()


def _audit(args: argparse.Namespace) -> int:
    if args.audit_command == "ranks":
        return _ranks(args)
    if args.audit_command == "watch":
        return _watch(args)
    if args.audit_command == "why":
        return _why(args)
    if args.audit_command == "report":
        return _report(args)
    if args.audit_command == "timeline":
        return _timeline(args)
    reader = _reader(args.logs)
    checker = AuditChecker(
        expect_released=args.audit_command == "check" and args.expect_released,
        accept_tables=getattr(args, "accept_table", ()),
        overdue_fails=args.audit_command == "check" and args.overdue_fails,
    )
    report = _check(args.log, reader, checker)
    if args.audit_command == "check":
        return _print_check(args, reader, report)
    rows = {
        "records": report.records,
        "segments": report.segments,
        "files": len(reader.files),
        "lifecycles": report.lifecycles,
        "released": report.released,
        "live_at_end": len(report.live),
        "max_live": report.max_live,
        "reused_while_unreleased": report.reused_while_unreleased,
        "transitions": dict(sorted(report.transitions.items())),
        "refusals": dict(sorted(report.refusals.items())),
        "lost_records": report.lost_records,
        "unreadable_lines": reader.problem_count,
        "torn_tail_bytes": reader.torn_tail,
        "segments_closed": sum(e.status == "closed" for e in report.endings),
        "segments_cut_short": len(report.cut_short),
        "segments_open": sum(e.status == "open" for e in report.endings),
        "in_flight_at_end": sum(
            e.open_tickets for e in report.endings if e.status in ("cut", "open")
        ),
    }
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for line in ending_lines(report):
            print(line)
        for key, value in rows.items():
            if isinstance(value, dict):
                for k, v in value.items():
                    print(f"{key + ' ' + k:<36} {v}")
            else:
                print(f"{key:<36} {value}")
    if reader.problem_count:
        print(_problems_line(args.log, reader), file=sys.stderr)
        return 1
    return 0


def _print_check(args: argparse.Namespace, reader: AuditReader, report: AuditReport) -> int:
    result = _verdict(args, report, reader)
    ok = result.ok
    verdict = "FAILED" if not ok else "CUT SHORT" if result.cut_short else "OK"
    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "verdict": verdict,
                    "records": report.records,
                    "segments": report.segments,
                    "files": [str(f) for f in reader.files],
                    "lifecycles": report.lifecycles,
                    "torn_tail_bytes": reader.torn_tail,
                    "problem_count": reader.problem_count,
                    "problems": [vars(p) for p in reader.problems],
                    "lost_records": report.lost_records,
                    "lost": [
                        {"first_seq": m.first_seq, "last_seq": m.last_seq, "error": m.error}
                        for m in report.lost
                    ],
                    "violation_count": report.violation_count,
                    "overdue": report.overdue,
                    "overdue_completed": report.overdue_completed,
                    "violations": [vars(v) | {"meaning": v.meaning} for v in report.violations],
                    "live": [vars(i) for i in report.live[:1000]],
                    "live_count": len(report.live),
                    "endings": [
                        {k: v for k, v in vars(e).items() if k != "closing"}
                        for e in report.endings[:1000]
                    ],
                    "cut_short": len(report.cut_short),
                    "open_at_end": [vars(o) for o in report.open_at_end],
                    "exit_status": result.exit_status,
                },
                indent=2,
            )
        )
        return result.exit_status
    files = f" ({len(reader.files)} files)" if len(reader.files) > 1 else ""
    print(
        f"{args.log}{files}: {report.records} records in {report.segments} segment(s), "
        f"{report.lifecycles} lifecycles, {len(report.live)} live at the end"
    )
    for line in ending_lines(report):
        print(line)
    if reader.torn_tail:
        print(f"torn last line skipped ({reader.torn_tail} bytes): a crash mid-write")
    for marker in report.lost[:20]:
        print(
            f"records lost (sink error): seq {marker.first_seq}-{marker.last_seq} "
            f"({marker.kvlife_lost} records): {marker.error}"
        )
    if len(report.lost) > 20:
        print(f"... {len(report.lost) - 20} more lost ranges")
    for problem in reader.problems:
        print(f"unreadable line {Path(problem.file).name}:{problem.line}: {problem.message}")
    if reader.problem_count > len(reader.problems):
        print(f"... {reader.problem_count - len(reader.problems)} more unreadable lines")
    for v in report.violations[:50]:
        print(v.line())
    if report.violation_count > 50:
        print(f"... {report.violation_count - 50} more violations")
    if report.overdue:
        late = report.overdue_completed
        counted = "" if not late or args.overdue_fails else " (not violations: --overdue-fails)"
        print(
            f"overdue: {report.overdue} ticket(s) open longer than their limit while the log "
            f"was written, {late} of them completed later{counted}"
        )
    if result.cut_short and ok:
        print(
            "the log was cut short: its writer stopped (a crash, a kill, a full disk) with "
            "the copies above in flight; they are not the watched component's fault"
            if result.open_at_cut
            else "the log was cut short: its writer stopped (a crash, a kill, a full disk) "
            "with no copy in flight"
        )
    print(verdict)
    return result.exit_status


def _ranks(args: argparse.Namespace) -> int:
    """``kvlife audit ranks``: one log per rank, compared."""
    logs: list[str] = args.rank_logs
    if len(logs) < 2:
        raise UsageError("kvlife audit ranks: give one log per rank, two or more")
    files = [[str(f) for f in log_files([log])] for log in logs]
    result = _reading(logs[0], lambda: compare_ranks(files))
    result.ranks = tuple(logs)
    if args.json:
        print(
            json.dumps(
                {
                    "ranks": list(result.ranks),
                    "copies": list(result.copies),
                    "agree": result.agree,
                    "disagreeing": result.disagreeing,
                    "disagreements": [
                        {
                            "rid": d.rid,
                            "kind": d.kind,
                            "started": [c.started for c in d.counts],
                            "completed": [c.completed for c in d.counts],
                        }
                        for d in result.disagreements
                    ],
                    "order": [
                        {"kind": o.kind, "index": o.index, "rids": list(o.rids)}
                        for o in result.order
                    ],
                    "unreadable_lines": result.unreadable,
                },
                indent=2,
            )
        )
    else:
        for line in result.lines():
            print(line)
        if result.unreadable:
            print(f"kvlife: {result.unreadable} unreadable line(s) skipped", file=sys.stderr)
    return 0 if result.agree and not result.unreadable else 1

"""The ``kvlife`` command. It sits on top of the library: nothing imports it.

Subcommands::

    kvlife demo [--seed N] [--requests N] [--device cpu|cuda] [--out DIR]
    kvlife diagram [--format dot|svg|png|mermaid] [--from-log LOG] [-o FILE]
    kvlife audit check LOG [--json] [--expect-released]
    kvlife audit stats LOG [--json]
    kvlife bench fsm [...] | kvlife bench offload [...]

Usage errors print one line and exit 2; ``audit check`` exits 1 when it finds violations.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from kvlife.diagrams.dot import DotNotFoundError, render
from kvlife.diagrams.lifecycle import lifecycle_dot, lifecycle_mermaid
from kvlife.diagrams.log_graph import log_graph
from kvlife.fsm.audit import AuditLog, check_audit, read_audit


class UsageError(Exception):
    """A bad command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> _Parser:
    parser = _Parser(prog="kvlife", description="kvlife: request lifecycles for KV offload")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser(
        "demo",
        help="run the decode workload and draw its diagrams",
        description="Run a realistic decode workload through kvlife; write "
        "out/audit.jsonl, the count-annotated diagram and the timeline.",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--requests", type=int, default=300, help="requests (default 300)")
    demo.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    demo.add_argument("--out", default="out", help="output directory (default out)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")

    diagram = sub.add_parser(
        "diagram",
        help="draw the lifecycle diagram (or one of a log)",
        description="Draw the lifecycle table, or with --from-log the "
        "table annotated with a log's counts and refusals.",
    )
    diagram.add_argument("--format", choices=["dot", "svg", "png", "mermaid"], default="svg")
    diagram.add_argument("--from-log", metavar="LOG", help="annotate with this audit log")
    diagram.add_argument("-o", "--output", metavar="FILE", help="write here (default stdout)")

    audit = sub.add_parser(
        "audit",
        help="check or summarize an audit log",
        description="Tools for kvlife audit logs (JSON lines).",
    )
    audit_sub = audit.add_subparsers(dest="audit_command", required=True, parser_class=_Parser)
    check = audit_sub.add_parser(
        "check",
        help="replay a log against the table (exit 1 on violations)",
        description="Replay LOG against the transition table; exit 1 when it finds violations.",
    )
    check.add_argument("log")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument(
        "--expect-released",
        action="store_true",
        help="lifecycles still live at the end are violations (leaks)",
    )
    stats = audit_sub.add_parser(
        "stats", help="counts per trigger, reason and instance", description="Summarize LOG."
    )
    stats.add_argument("log")
    stats.add_argument("--json", action="store_true", help="machine-readable output")

    bench = sub.add_parser("bench", help="benchmarks", description="Run a benchmark.")
    bench.add_argument("which", choices=["fsm", "offload"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvlife`` console script."""
    try:
        args = _parser().parse_args(argv)
        if args.command == "demo":
            return _demo(args)
        if args.command == "diagram":
            return _diagram(args)
        if args.command == "audit":
            return _audit(args)
        return _bench(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except DotNotFoundError as exc:
        print(f"kvlife: {exc}", file=sys.stderr)
        return 2


def _load(path: str) -> AuditLog:
    try:
        log = read_audit(path)
    except FileNotFoundError:
        raise UsageError(f"kvlife: no such audit log: {path}") from None
    except IsADirectoryError:
        raise UsageError(f"kvlife: {path} is a directory, not an audit log") from None
    if not log.segments and log.problems:
        raise UsageError(f"kvlife: {path} is not a kvlife audit log ({log.problems[0].message})")
    return log


def _diagram(args: argparse.Namespace) -> int:
    if args.from_log:
        if args.format == "mermaid":
            raise UsageError("kvlife diagram: --from-log draws dot, svg or png, not mermaid")
        dot = str(log_graph(_load(args.from_log), title=Path(args.from_log).name).source)
    else:
        dot = lifecycle_dot()
    if args.format in ("dot", "mermaid"):
        text = dot if args.format == "dot" else lifecycle_mermaid()
        data = text.encode()
    else:
        data = render(dot, args.format)
    if args.output:
        Path(args.output).write_bytes(data)
    elif args.format == "png":
        raise UsageError("kvlife diagram: PNG needs -o FILE")
    else:
        sys.stdout.write(data.decode())
    return 0


def _audit(args: argparse.Namespace) -> int:
    log = _load(args.log)
    if args.audit_command == "check":
        report = check_audit(log, expect_released=args.expect_released)
        if args.json:
            print(
                json.dumps(
                    {
                        "ok": report.ok,
                        "records": report.records,
                        "segments": report.segments,
                        "torn_tail_bytes": log.torn_tail,
                        "problems": [vars(p) for p in log.problems],
                        "violations": [vars(v) for v in report.violations],
                        "live": [vars(i) for i in report.live],
                    },
                    indent=2,
                )
            )
        else:
            print(
                f"{args.log}: {report.records} records in {report.segments} segment(s), "
                f"{len(report.instances)} lifecycles, {len(report.live)} live at the end"
            )
            if log.torn_tail:
                print(f"torn last line skipped ({log.torn_tail} bytes): a crash mid-write")
            for problem in log.problems:
                print(f"unreadable line {problem.line}: {problem.message}")
            for v in report.violations[:50]:
                print(f"VIOLATION {v.kind} seq={v.seq} serial={v.serial}: {v.message}")
            if len(report.violations) > 50:
                print(f"... {len(report.violations) - 50} more violations")
            print("OK" if report.ok and not log.problems else "FAILED")
        return 0 if report.ok and not log.problems else 1
    report = check_audit(log)
    rows = {
        "records": report.records,
        "lifecycles": len(report.instances),
        "live_at_end": len(report.live),
        "transitions": dict(sorted(report.transitions.items())),
        "refusals": dict(sorted(report.refusals.items())),
        "rids": len({i.rid for i in report.instances.values()}),
    }
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for key, value in rows.items():
            if isinstance(value, dict):
                for k, v in value.items():
                    print(f"{key + ' ' + k:<36} {v}")
            else:
                print(f"{key:<36} {value}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.which == "fsm":
        from kvlife.fsm.bench import main as bench_main
    else:
        from kvlife.offload.bench import main as bench_main
    try:
        return bench_main(args.args)
    except SystemExit as exc:
        return int(exc.code or 0)


def _demo(args: argparse.Namespace) -> int:
    import torch

    from kvlife.diagrams.timeline import plot_timeline
    from kvlife.offload.demo import DemoConfig, open_audit, run_workload, text_progress

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("kvlife demo: --device cuda, but CUDA is not available")
    if args.requests <= 0:
        raise UsageError("kvlife demo: --requests must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    audit_path = out / "audit.jsonl"
    audit_path.unlink(missing_ok=True)
    config = DemoConfig(requests=args.requests, seed=args.seed, device=device)
    with open_audit(str(audit_path)) as sink:
        summary = run_workload(
            config, sinks=[sink], progress=None if args.no_progress else text_progress()
        )
    print(summary.table())
    log = read_audit(audit_path)
    report = check_audit(log, expect_released=True)
    print(
        f"\naudit log: {audit_path} ({report.records} records): "
        f"{'check passed' if report.ok else f'{len(report.violations)} VIOLATIONS'}"
    )
    dot = str(log_graph(log, title=f"kvlife demo, seed {args.seed}").source)
    (out / "lifecycle-audit.dot").write_text(dot, encoding="utf-8")
    written = [out / "lifecycle-audit.dot"]
    try:
        (out / "lifecycle-audit.svg").write_bytes(render(dot, "svg"))
        (out / "lifecycle-audit.png").write_bytes(render(dot, "png"))
        written += [out / "lifecycle-audit.svg", out / "lifecycle-audit.png"]
    except DotNotFoundError as exc:
        print(f"kvlife: {exc}", file=sys.stderr)
    try:
        rows = plot_timeline(log, out / "timeline.png", title=f"kvlife demo, seed {args.seed}")
        written.append(out / "timeline.png")
        print(f"timeline: {rows} lifecycle rows")
    except ModuleNotFoundError as exc:
        print(f"kvlife: {exc}", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The ``kvlife`` command. It sits on top of the library: nothing imports it.

Subcommands::

    kvlife demo [--seed N] [--requests N] [--device cpu|cuda] [--out DIR]
    kvlife diagram [--format dot|svg|png|mermaid] [--from-log LOG] [-o FILE]
    kvlife audit check LOG [--json] [--expect-released] [--allow-lost] [--overdue-fails]
                       [--accept-table D]
    kvlife audit stats LOG [--json]
    kvlife audit why LOG (--rid RID | --serial N [--segment INDEX|ID]) [-o STORY.svg|.png]
    kvlife audit report LOG -o FILE.html [--accept-table D]
    kvlife audit timeline LOG -o FILE.png|svg [--rid RID ...] [--max-rows N]
    kvlife audit ranks LOG LOG [LOG ...] [--json]
    kvlife audit watch LOG [LOG ...] [--port P] [--host H] [--interval S] [--settle S] [--once]
    kvlife bench fsm [...]   kvlife bench offload [...]   kvlife bench audit [...]
    kvlife vllm exercise CONFIG [...]   (in vLLM's environment)
    kvlife sglang exercise [...]        (in SGLang's environment)
    kvlife metrics rules [--for library|vllm] [--prefix PREFIX] [--timescale FACTOR]

Bare ``kvlife``, ``kvlife audit`` and ``kvlife bench`` print their usage (exit 2);
``kvlife --version`` prints the version. Usage errors print one line and exit 2, and so do
a file that is not a kvlife audit log (or was written with another transition table,
unless accepted), a path that cannot be read or written and a full disk. Ctrl-C exits 130
with one line; a closed standard output (``| head``) exits 141 quietly. ``audit check``
exits 1 when the log has violations, unreadable lines or lost records (unless
``--allow-lost``), and its ``--json`` verdict always agrees with its exit status.
``audit stats`` and ``diagram --from-log`` exit 1 when they met unreadable lines.
``audit ranks`` (one log per TP rank) exits 1 when the ranks disagree or a line was
unreadable.
LOG is read with its rotated backups (``LOG.N ... LOG.1 LOG``), in one streaming pass.

This module is the command's argument tree and its dispatch, with the commands that only
hand over to a tool (``demo``, ``bench``, ``metrics rules``, the exercises); the log tools
(``audit ...``, ``diagram``) are in ``kvlife.diagrams.cli_audit``, and what they share
(reading a log, stating the checker's verdict, writing a file) in
``kvlife.diagrams.cli_common``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from kvlife.diagrams.cli_audit import _audit, _diagram
from kvlife.diagrams.cli_common import (
    _LOG_HELP,
    UsageError,
    _check,
    _label,
)
from kvlife.diagrams.dot import DotNotFoundError, render
from kvlife.diagrams.log_graph import log_graph
from kvlife.fsm import __version__, native
from kvlife.fsm.audit import (
    AuditChecker,
    AuditReader,
)
from kvlife.fsm.cli_args import int_in


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> _Parser:
    parser = _Parser(prog="kvlife", description="kvlife: request lifecycles for KV offload")
    parser.add_argument(
        "--version", action="version", version=f"kvlife {__version__}, {native.describe()}"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser(
        "demo",
        help="run the decode workload and draw its diagrams",
        description="Run a realistic decode workload through kvlife; write "
        "out/audit.jsonl, the count-annotated diagram and the timeline.",
    )
    demo.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    demo.add_argument("--requests", type=_positive, default=300, help="requests (default 300)")
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
    diagram.add_argument(
        "--all-edges",
        action="store_true",
        help="with --from-log: also draw the table's edges the log never took (grey, x0)",
    )
    diagram.add_argument("-o", "--output", metavar="FILE", help="write here (default stdout)")
    _accept_table(diagram, "draw a log written")
    _verdict_options(diagram)

    audit = sub.add_parser(
        "audit",
        help="check or summarize an audit log",
        description="Tools for kvlife audit logs (JSON lines).",
    )
    audit_sub = audit.add_subparsers(dest="audit_command", metavar="COMMAND", parser_class=_Parser)
    check = audit_sub.add_parser(
        "check",
        help="replay a log against the table (exit 1 on violations)",
        description="Replay LOG against the transition table; exit 1 when it finds violations.",
    )
    check.add_argument("log", nargs="+", metavar="LOG", help=_LOG_HELP)
    check.add_argument("--json", action="store_true", help="machine-readable output")
    _verdict_options(check)
    _accept_table(check, "replay segments written")
    stats = audit_sub.add_parser(
        "stats", help="counts per trigger, reason and instance", description="Summarize LOG."
    )
    stats.add_argument("log", nargs="+", metavar="LOG", help=_LOG_HELP)
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    why = audit_sub.add_parser(
        "why",
        help="tell one rid's (or lifecycle's) history",
        description="Tell the history of every lifecycle of a rid, or of one lifecycle: "
        "each transition and refusal, the other lifecycles that held the rid meanwhile, and "
        "which lifecycle a late completion belonged to.",
    )
    why.add_argument("log", nargs="+", metavar="LOG", help=_LOG_HELP)
    which = why.add_mutually_exclusive_group(required=True)
    which.add_argument("--rid", help="every lifecycle of this rid")
    which.add_argument("--serial", type=_natural, help="the lifecycle with this serial")
    why.add_argument(
        "--segment",
        type=_segment,
        default=0,
        help="the segment of --serial: its index or its id (default 0)",
    )
    why.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="also draw the rid's story to FILE (.svg or .png): a lane per lifecycle, its "
        "copies, refusals, reuses and late completions",
    )
    _verdict_options(why)
    report = audit_sub.add_parser(
        "report",
        help="write one self-contained HTML page about a log",
        description="Write a self-contained HTML page: the log-annotated diagram, the "
        "timeline, and a sortable, filterable table of lifecycles with each one's history.",
    )
    report.add_argument("log", nargs="+", metavar="LOG", help=_LOG_HELP)
    report.add_argument("-o", "--output", required=True, metavar="FILE", help="the .html page")
    _accept_table(report, "include segments written")
    _verdict_options(report)
    timeline = audit_sub.add_parser(
        "timeline",
        help="draw a log's timeline (PNG or SVG)",
        description="Draw one row per lifecycle instance, coloured by state over time.",
    )
    timeline.add_argument("log", nargs="+", metavar="LOG", help=_LOG_HELP)
    timeline.add_argument("-o", "--output", required=True, metavar="FILE", help=".png or .svg")
    timeline.add_argument(
        "--rid", action="append", metavar="RID", help="draw only this rid (repeatable)"
    )
    timeline.add_argument(
        "--max-rows", type=_positive, default=80, help="rows at most (default 80, up to 200)"
    )
    _accept_table(timeline, "draw segments written")
    _verdict_options(timeline)

    ranks = audit_sub.add_parser(
        "ranks",
        help="compare the logs of a TP group's ranks (exit 1 when they disagree)",
        description="Compare one log per tensor-parallel rank: the rids whose copies "
        "differ between ranks (started, completed, left open), and the first completion "
        "where the ranks' order differs. Exit 1 when they disagree.",
    )
    ranks.add_argument(
        "rank_logs", nargs="+", metavar="LOG", help="rank 0's log, rank 1's, ... (two or more)"
    )
    ranks.add_argument("--json", action="store_true", help="machine-readable output")
    watch = audit_sub.add_parser(
        "watch",
        help="check logs while they are written; serve the verdicts to Prometheus",
        description="Follow LOG(s) as their writers append to them and rotate them (a "
        "directory: every *.jsonl log in it, those that appear later too), check them as "
        "audit check does, join the prefill/decode hand-overs of all of them, print each "
        "verdict (and each unreadable line and lost record) as it is found and, with "
        "--port, serve the counts by log and kind on /metrics (kvlife metrics rules --for "
        "watch pages on them). Runs until stopped.",
    )
    watch.add_argument("log", nargs="+", metavar="LOG", help=_LOG_HELP)
    watch.add_argument(
        "--port", type=int_in(0, 65535, "a port (0-65535)"), help="serve /metrics on this port"
    )
    watch.add_argument("--host", default="127.0.0.1", help="address to serve on (127.0.0.1)")
    watch.add_argument(
        "--interval",
        type=_seconds(0.01, 3600),
        default=1.0,
        metavar="S",
        help="read the logs every S seconds (default 1)",
    )
    watch.add_argument(
        "--settle",
        type=_seconds(0, 3600),
        default=None,
        metavar="S",
        help="a hand-over verdict must hold S seconds before it counts (default 2)",
    )
    watch.add_argument(
        "--namespace", default="kvlife", help="metric names start NAMESPACE_watch_ (kvlife)"
    )
    watch.add_argument(
        "--once",
        action="store_true",
        help="read what the logs hold, print the verdicts, unreadable lines and lost "
        "records and exit (1 when any, as audit check)",
    )
    watch.add_argument(
        "--overdue-fails",
        action="store_true",
        help="every ticket written as overdue is a violation, even one that completed later",
    )
    _accept_table(watch, "replay segments written")

    bench = sub.add_parser(
        "bench",
        help="benchmarks",
        description="Run a benchmark: fsm (the core against the dictionaries it replaces), "
        "offload (copies against a contiguous copy), audit (the log checker at scale). "
        "Options after the name go to the benchmark: kvlife bench fsm --help.",
    )
    bench.add_argument("which", nargs="?", choices=["fsm", "offload", "audit"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    vllm = sub.add_parser(
        "vllm",
        help="vLLM tools (run in vLLM's environment)",
        description="vLLM tools: exercise (drive a KV connector through the schedules that "
        "break connectors, in vLLM's real scheduler). Options after the name go to the tool: "
        "kvlife vllm exercise --help.",
    )
    vllm.add_argument("which", nargs="?", choices=["exercise"])
    vllm.add_argument("args", nargs=argparse.REMAINDER, help="passed to the tool")
    metrics = sub.add_parser(
        "metrics",
        help="Prometheus rules for kvlife's metrics",
        description="rules: print Prometheus alerting and recording rules for kvlife's "
        "metrics (load the file with rule_files:).",
    )
    metrics_sub = metrics.add_subparsers(
        dest="metrics_command", metavar="COMMAND", parser_class=_Parser
    )
    rules = metrics_sub.add_parser(
        "rules",
        help="print the alerting and recording rules (YAML)",
        description="Print kvlife's Prometheus rules: --for library (PrometheusMetrics on "
        "your registry; --prefix is its namespace, default kvlife), --for vllm (kvlife's "
        "connector and the audit wrapper in vLLM's /metrics; --prefix default vllm:kvlife_) "
        "or --for watch (kvlife audit watch; --prefix is its --namespace, default kvlife).",
    )
    rules.add_argument(
        "--for", dest="flavour", choices=["library", "vllm", "watch"], default="library"
    )
    rules.add_argument("--prefix", help="the metric name prefix (see above)")
    rules.add_argument(
        "--timescale",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="multiply every for: time, window and age bound (a test or a demo; default 1)",
    )
    sglang = sub.add_parser(
        "sglang",
        help="SGLang tools (run in SGLang's environment)",
        description="SGLang tools: exercise (drive SGLang's hierarchical cache through the "
        "schedules that break caches, with kvlife's lens on it). Options after the name go "
        "to the tool: kvlife sglang exercise --help.",
    )
    sglang.add_argument("which", nargs="?", choices=["exercise"])
    sglang.add_argument("args", nargs=argparse.REMAINDER, help="passed to the tool")
    parser.set_defaults(usage_of=parser)
    commands = (demo, diagram, audit, bench, vllm, sglang, check, stats, why, report, timeline)
    for command in (*commands, ranks, watch, metrics, rules):
        command.set_defaults(usage_of=command)
    return parser


def _accept_table(parser: argparse.ArgumentParser, what: str) -> None:
    """``--accept-table DIGEST`` (repeatable): take segments of another table too."""
    parser.add_argument(
        "--accept-table",
        action="append",
        default=[],
        type=_digest,
        metavar="DIGEST",
        help=f"{what} with this transition table digest too",
    )


def _verdict_options(parser: argparse.ArgumentParser) -> None:
    """``audit check``'s verdict options (every tool that shows a log shows its verdict)."""
    parser.add_argument(
        "--expect-released",
        action="store_true",
        help="lifecycles still live at the end are violations (leaks)",
    )
    parser.add_argument(
        "--allow-lost",
        action="store_true",
        help="records a failing sink reported as lost do not fail the verdict",
    )
    parser.add_argument(
        "--overdue-fails",
        action="store_true",
        help="every ticket written as overdue is a violation, even one that completed later",
    )


def _digest(text: str) -> str:
    """An argparse ``type``: a transition table digest (16 hex digits, as in a log's
    header and ``audit check``'s message)."""
    if not re.fullmatch(r"[0-9a-f]{16}", text):
        raise argparse.ArgumentTypeError(
            f"expected a table digest (16 hex digits, as in the log's header), got {text!r}"
        )
    return text


def _segment(text: str) -> str:
    """An argparse ``type``: a segment's index (0, 1, ...) or its id (from its header),
    told apart by ``_segment_index`` once the log is read (an id can be all digits)."""
    if not re.fullmatch(r"[0-9a-f]+", text):
        raise argparse.ArgumentTypeError(
            f"expected a segment index (0, 1, ...) or a segment id (hex), got {text!r}"
        )
    return text


def _seconds(low: float, high: float) -> Callable[[str], float]:
    """An argparse ``type``: seconds in [low, high]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected seconds between {low:g} and {high:g}, got {text!r}"
            )
        return value

    return parse


_seed = int_in(0, 2**63 - 1, "a seed between 0 and 2**63 - 1")  # what torch takes
_natural = int_in(0, None, "an integer >= 0")
_positive = int_in(1, None, "a positive integer")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvlife`` console script.

    Exit status: 0 done; 1 a failed check (or unreadable lines met); 2 a usage error,
    an input that is not a kvlife audit log, or a file that cannot be read or written,
    each said in one line on stderr; 130 interrupted (Ctrl-C); 141 standard output was
    closed early (``| head``), which is not reported.
    """
    try:
        status = _run(argv)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not at exit
        return status
    except UsageError as exc:
        return _fail(str(exc))
    except DotNotFoundError as exc:
        return _fail(f"kvlife: {exc}")
    except KeyboardInterrupt:
        return _fail("kvlife: interrupted", 130)
    except BrokenPipeError:
        # The reader went away (``| head``): say nothing. Python would complain when it
        # flushes stdout at exit, so point stdout at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except OSError as exc:
        return _fail(f"kvlife: {_os_error(exc)}")


def _fail(message: str, status: int = 2) -> int:
    print(message, file=sys.stderr)
    return status


def _os_error(exc: OSError) -> str:
    where = exc.filename if exc.filename is not None else "standard output"
    return f"{where}: {exc.strerror or exc}"


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if isinstance(getattr(args, "log", None), list):  # the audit subcommands
        args.logs, args.log = args.log, _label(args.log)
    usage_of: argparse.ArgumentParser = args.usage_of
    if (
        args.command is None
        or (args.command == "audit" and args.audit_command is None)
        or (args.command == "metrics" and args.metrics_command is None)
    ):
        sys.stderr.write(usage_of.format_help())
        return 2
    if args.command == "demo":
        return _demo(args)
    if args.command == "diagram":
        return _diagram(args)
    if args.command == "audit":
        return _audit(args)
    if args.command == "metrics":
        return _rules(args)
    if args.which is None:
        sys.stderr.write(usage_of.format_help())
        return 2
    if args.command in ("vllm", "sglang"):
        needs, module = {
            "vllm": ("vLLM", "kvlife.offload.watch.vllm.exercise"),
            "sglang": ("SGLang", "kvlife.offload.watch.sglang.exercise"),
        }[args.command]
        return _exercise(args, args.command, needs, module)
    return _bench(args)


def _exercise(args: argparse.Namespace, engine: str, needs: str, module: str) -> int:
    """``kvlife ENGINE exercise ...``: the tool in ``module``, in the environment the
    engine runs in (the package ``engine`` must import; ``needs`` names it when not)."""
    try:
        importlib.import_module(engine)
        tool = importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(
            f"kvlife {engine} {args.which}: needs {needs} in this environment "
            f"(pip install 'kvlife[{engine}]'): {exc}"
        ) from exc
    try:
        status: int = tool.main(args.args)
    except ModuleNotFoundError as exc:  # the engine is there, a module it imports is not
        raise UsageError(
            f"kvlife {engine} {args.which}: {needs} does not import in this environment: "
            f"module {exc.name!r} is missing ({exc})"
        ) from exc
    return status


def _rules(args: argparse.Namespace) -> int:
    """``kvlife metrics rules``: the Prometheus rules for a flavour and prefix."""
    from kvlife.fsm.audit.alerts import rule_set, rules_yaml

    try:
        rules = rule_set(args.flavour, args.prefix, timescale=args.timescale)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    sys.stdout.write(rules_yaml(rules))
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.which == "fsm":
        from kvlife.fsm.bench import main as bench_main
    elif args.which == "audit":
        from kvlife.diagrams.audit_bench import main as bench_main
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
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"kvlife demo: --out {args.out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kvlife-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"kvlife demo: cannot write to --out {args.out}: {exc.strerror or exc}"
        ) from None
    audit_path = out / "audit.jsonl"
    audit_path.unlink(missing_ok=True)
    config = DemoConfig(requests=args.requests, seed=args.seed, device=device)
    with open_audit(str(audit_path)) as sink:
        summary = run_workload(
            config, sinks=[sink], progress=None if args.no_progress else text_progress()
        )
    print(summary.table())
    print()
    print(summary.explanation(str(audit_path), str(out)))
    report = _check(str(audit_path), AuditReader(audit_path), AuditChecker(expect_released=True))
    print(
        f"\naudit log: {audit_path} ({report.records} records): "
        f"{'check passed' if report.ok else f'{len(report.violations)} VIOLATIONS'}"
    )
    dot = str(log_graph(AuditReader(audit_path), title=f"kvlife demo, seed {args.seed}").source)
    (out / "lifecycle-audit.dot").write_text(dot, encoding="utf-8")
    written = [out / "lifecycle-audit.dot"]
    try:
        (out / "lifecycle-audit.svg").write_bytes(render(dot, "svg"))
        (out / "lifecycle-audit.png").write_bytes(render(dot, "png"))
        written += [out / "lifecycle-audit.svg", out / "lifecycle-audit.png"]
    except DotNotFoundError as exc:
        print(f"kvlife: {exc}", file=sys.stderr)
    try:
        rows = plot_timeline(
            AuditReader(audit_path), out / "timeline.png", title=f"kvlife demo, seed {args.seed}"
        )
        written.append(out / "timeline.png")
        print(f"timeline: {rows} lifecycle rows")
    except ModuleNotFoundError as exc:
        print(f"kvlife: {exc}", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

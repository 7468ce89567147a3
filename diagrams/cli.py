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
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from kvlife.diagrams.dot import DotNotFoundError, render
from kvlife.diagrams.lifecycle import lifecycle_dot, lifecycle_mermaid
from kvlife.diagrams.log_graph import log_graph
from kvlife.diagrams.story import Story, plot_story, story_of
from kvlife.fsm import __version__
from kvlife.fsm.audit import (
    AuditChecker,
    AuditFormatError,
    AuditReader,
    AuditReport,
    Segment,
    Verdict,
    audit_files,
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
from kvlife.fsm.cli_args import int_in


class UsageError(Exception):
    """A bad command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> _Parser:
    parser = _Parser(prog="kvlife", description="kvlife: request lifecycles for KV offload")
    parser.add_argument("--version", action="version", version=f"kvlife {__version__}")
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
        "verdict as it is found and, with --port, serve the counts by log and kind on "
        "/metrics (kvlife metrics rules --for watch pages on them). Runs until stopped.",
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
        help="read what the logs hold, print the verdicts and exit (1 when any)",
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


def _checker(args: argparse.Namespace) -> AuditChecker:
    """The checker ``audit check`` would run with these options."""
    return AuditChecker(
        expect_released=getattr(args, "expect_released", False),
        accept_tables=getattr(args, "accept_table", ()),
        overdue_fails=getattr(args, "overdue_fails", False),
    )


def _verdict(args: argparse.Namespace, report: AuditReport, reader: AuditReader) -> Verdict:
    return Verdict.of(report, reader.problem_count, allow_lost=getattr(args, "allow_lost", False))


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


def _count(n: int, noun: str) -> str:
    """``1 violation``, ``2 violations``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


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


def _write_file(path: str, data: bytes) -> None:
    """Write an output file; a path that cannot be written is a usage error."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"kvlife: {path} is a directory; give a file name")
    try:
        target.write_bytes(data)
    except OSError as exc:
        raise UsageError(f"kvlife: cannot write {path}: {exc.strerror or exc}") from None


_PROGRESS_MIN_BYTES = 16 << 20


def _progress_bar(label: str) -> Callable[[int, int], None]:
    """A one-line progress bar on stderr (a terminal only)."""
    shown = [-1]

    def show(done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        if percent != shown[0]:
            shown[0] = percent
            end = "\n" if done >= total else ""
            print(f"\r{label}: {percent:3d}% of {total / 2**20:.0f} MiB", end=end, file=sys.stderr)

    return show


_LOG_HELP = (
    "an audit log (with its rotated files), several, or a directory of them: one per "
    "writer (each engine core under data parallelism), each checked as its own sequence"
)


def _label(logs: Sequence[str]) -> str:
    """How messages name the logs given."""
    return logs[0] if len(logs) == 1 else f"{logs[0]} (and {len(logs) - 1} more)"


def log_files(logs: Sequence[str]) -> list[Path]:
    """The files of the logs given, in reading order: each log's rotated files oldest
    first; a directory stands for every ``*.jsonl`` log in it (by name). Each writer's
    log begins with its own header, so the reader sees it as a segment of its own.

    Raises:
        UsageError: a path is empty, names no audit log, or is a directory without one.
    """
    files: list[Path] = []
    for path in logs:
        if not path:
            raise UsageError("kvlife: the audit log path is empty")
        base = Path(path)
        if base.is_dir():
            writers = sorted(p for p in base.iterdir() if p.name.endswith(".jsonl") and p.is_file())
            if not writers:
                raise UsageError(f"kvlife: {path} is a directory with no audit log (*.jsonl)")
            for writer in writers:
                files += audit_files(writer)
            continue
        found = audit_files(base)
        if not found[-1].exists():
            raise UsageError(f"kvlife: no such audit log: {path}")
        files += found
    return files


def _reader(logs: str | Sequence[str]) -> AuditReader:
    """A streaming reader of the logs given (see ``log_files``); usage errors for bad
    paths."""
    paths = [logs] if isinstance(logs, str) else list(logs)
    reader = AuditReader(log_files(paths))
    if sys.stderr.isatty() and reader.total_bytes() >= _PROGRESS_MIN_BYTES:
        reader.progress = _progress_bar(f"reading {Path(paths[0]).name}")
    return reader


_T = TypeVar("_T")


def _reading(path: str, work: Callable[[], _T], writes: str | None = None) -> _T:
    """Run ``work`` (which reads the log, and may write the file ``writes``); unreadable
    input, or an output that cannot be written, becomes a usage error (one line, exit 2)."""
    try:
        return work()
    except AuditFormatError as exc:
        raise UsageError(f"kvlife: {exc}") from None
    except OSError as exc:
        name = exc.filename or path
        if writes is not None and str(name) == str(writes):
            raise UsageError(f"kvlife: cannot write {name}: {exc.strerror or exc}") from None
        raise UsageError(f"kvlife: cannot read {name}: {exc.strerror}") from None


def _check(path: str, reader: AuditReader, checker: AuditChecker) -> AuditReport:
    def run() -> AuditReport:
        feed = checker.feed
        for event in reader:
            feed(event)
        return checker.finish()

    return _reading(path, run)


def _problems_line(path: str, reader: AuditReader) -> str:
    first = reader.problems[0]
    return (
        f"kvlife: {reader.problem_count} unreadable line(s) in {path}; first: "
        f"{Path(first.file).name}:{first.line}: {first.message}"
    )


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


def _say_verdict(
    args: argparse.Namespace, path: str, report: AuditReport, reader: AuditReader
) -> int:
    """Tell ``audit check``'s verdict on stderr (with the first unreadable line, if any)
    and return its exit status."""
    verdict = _verdict(args, report, reader)
    for line in ending_lines(report):
        print(f"{path}: {line}", file=sys.stderr)
    print(f"{path}: {verdict}", file=sys.stderr)
    if reader.problem_count:
        print(_problems_line(path, reader), file=sys.stderr)
    return verdict.exit_status


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
            server, _ = start_http_server(args.port, args.host, registry)
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
        )
    print(verdict)
    return result.exit_status


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

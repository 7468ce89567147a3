"""The kvlife command: help everywhere, one-line usage errors, audit tools, diagrams."""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import re
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kvlife.diagrams.audit_bench import write_workload
from kvlife.diagrams.cli import main
from kvlife.fsm import JsonLinesSink, LifecycleRegistry, MemorySink, OverdueWatch, native
from kvlife.fsm._version import __version__
from kvlife.fsm.audit import encode_lines, make_header
from kvlife.offload.bench import token_count
from tests.strategies import Req
from tests.violations import EDITS, UNRECORDED, clean_log, edited_log, reuse_log

SUBCOMMANDS = [
    [],
    ["demo"],
    ["diagram"],
    ["audit"],
    ["audit", "check"],
    ["audit", "stats"],
    ["audit", "why"],
    ["audit", "timeline"],
    ["audit", "ranks"],
    ["metrics"],
    ["metrics", "rules"],
    ["sglang"],
    ["bench"],
    ["vllm"],
]


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=lambda w: " ".join(w) or "kvlife")
def test_help_on_every_subcommand(words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*words, "--help"])
    assert info.value.code == 0
    assert "usage: kvlife" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["nonsense"],
        ["diagram", "--format", "gif"],
        ["audit", "check"],
        ["demo", "--requests", "0"],
        ["demo", "--seed", "x"],
        ["demo", "--seed", "99999999999999999999"],
        ["demo", "--seed", "-1"],
        ["bench", "gpu"],
        ["audit", "check", ""],
        ["diagram", "-o", "/nonexistent/x.svg"],
        ["diagram", "-o", "/tmp"],
        ["diagram", "-o", "/dev/full"],
        ["demo", "--out", "/sys/kvlife-cannot-be-made"],
        ["demo", "--out", "/proc"],
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvlife"), err


def _log(path: Path, *, bad: bool = False) -> Path:
    with JsonLinesSink(path, fsync="never") as sink:
        registry = LifecycleRegistry(sinks=[sink])
        req = Req("a")
        ticket = registry.start_offload(registry.register(req))
        registry.finish(req)
        registry.complete(ticket)
        registry.deliver(ticket)
    if bad:  # plant an illegal transition: finish straight to released from offloading
        lines = path.read_text().splitlines()
        lines[3] = lines[3].replace('"dst":"finished_pending"', '"dst":"released"')
        path.write_text("\n".join(lines) + "\n")
    return path


def test_audit_check_passes_a_clean_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "check", str(_log(tmp_path / "a.jsonl")), "--expect-released"]) == 0
    out = capsys.readouterr().out
    assert "1 lifecycles, 0 live" in out and out.rstrip().endswith("OK")


def test_audit_check_exits_1_on_violations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _log(tmp_path / "a.jsonl", bad=True)
    assert main(["audit", "check", str(path)]) == 1
    assert "VIOLATION illegal_transition" in capsys.readouterr().out
    assert main(["audit", "check", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["violations"][0]["kind"] == "illegal_transition"


def test_audit_check_on_missing_or_foreign_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "check", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such audit log" in capsys.readouterr().err
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    assert main(["audit", "stats", str(junk)]) == 2
    assert "not a kvlife audit log" in capsys.readouterr().err


def test_audit_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "stats", str(_log(tmp_path / "a.jsonl")), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["refusals"] == {"stale_instance": 1} and stats["lifecycles"] == 1
    assert main(["audit", "stats", str(_log(tmp_path / "b.jsonl"))]) == 0
    assert "refusals stale_instance" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["dot", "mermaid", "svg", "png"])
def test_diagram_formats(fmt: str, tmp_path: Path) -> None:
    out = tmp_path / f"d.{fmt}"
    assert main(["diagram", "--format", fmt, "-o", str(out)]) == 0
    data = out.read_bytes()
    assert {"dot": b"digraph", "mermaid": b"stateDiagram-v2", "svg": b"<svg", "png": b"\x89PNG"}[
        fmt
    ] in data[:400]


def test_diagram_from_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = str(_log(tmp_path / "a.jsonl"))
    assert main(["diagram", "--format", "dot", "--from-log", log]) == 0
    assert "ack refused ×1" in capsys.readouterr().out
    assert main(["diagram", "--format", "mermaid", "--from-log", log]) == 2


def test_without_dot_dot_and_mermaid_work_and_svg_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("kvlife.diagrams.dot.shutil.which", lambda name: None)
    assert main(["diagram", "--format", "dot"]) == 0
    assert main(["diagram", "--format", "mermaid"]) == 0
    capsys.readouterr()
    assert main(["diagram", "--format", "svg"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt-get install graphviz" in err


def test_demo_writes_a_checked_log_and_two_pictures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "demo",
                "--requests",
                "40",
                "--seed",
                "3",
                "--out",
                str(tmp_path),
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "check passed" in out and "lifecycles (registered / released / live)" in out
    assert main(["audit", "check", str(tmp_path / "audit.jsonl"), "--expect-released"]) == 0
    for name in ("lifecycle-audit.svg", "lifecycle-audit.png", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 1000, name


def test_bench_fsm_through_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fsm", "--rounds", "1", "--batch", "10", "--memory-live", "500"]) == 0
    assert "rid-keyed" in capsys.readouterr().out
    assert main(["bench", "fsm", "--rounds", "0"]) == 2


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "kvlife"
    result = subprocess.run(
        [str(script), "diagram", "--format", "mermaid"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0 and "stateDiagram-v2" in result.stdout


# --- audit tools that say what they met ---------------------------------------------------


@pytest.mark.parametrize("content", ["hello\n", "", '["a", "json", "array"]\n', "{}\n"])
def test_audit_check_refuses_what_is_not_an_audit_log(
    content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(content)
    for words in (["audit", "check"], ["audit", "check", "--json"], ["audit", "stats"]):
        assert main([*words, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not a kvlife audit log" in err, err


def test_audit_check_refuses_dev_null(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "check", "/dev/null"]) == 2
    assert "not a kvlife audit log" in capsys.readouterr().err


def _with_junk_line(path: Path) -> Path:
    _log(path)
    with path.open("a") as f:
        f.write("not json\n")
    return path


def test_check_json_verdict_always_agrees_with_the_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = {
        "clean": _log(tmp_path / "clean.jsonl"),
        "violation": _log(tmp_path / "bad.jsonl", bad=True),
        "unreadable": _with_junk_line(tmp_path / "junk.jsonl"),
    }
    for name, path in cases.items():
        status = main(["audit", "check", "--json", str(path)])
        verdict = json.loads(capsys.readouterr().out)
        assert verdict["ok"] is (status == 0), name
        assert status == (0 if name == "clean" else 1), name


def test_stats_and_diagram_report_unreadable_lines_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _with_junk_line(tmp_path / "junk.jsonl")
    assert main(["audit", "stats", str(path)]) == 1
    captured = capsys.readouterr()
    assert "records                              5" in captured.out
    assert "1 unreadable line(s)" in captured.err and "junk.jsonl:8" in captured.err
    assert main(["diagram", "--format", "dot", "--from-log", str(path)]) == 1
    captured = capsys.readouterr()
    assert "digraph" in captured.out and "1 unreadable line(s)" in captured.err


def test_a_log_of_another_table_is_refused_unless_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _log(tmp_path / "a.jsonl")
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["table"] = "0123456789abcdef"
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert main(["audit", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--accept-table 0123456789abcdef" in err
    assert main(["audit", "check", str(path), "--accept-table", "0123456789abcdef"]) == 0
    capsys.readouterr()
    assert main(["diagram", "--format", "dot", "--from-log", str(path)]) == 2
    capsys.readouterr()


def test_lost_records_fail_the_check_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _log(tmp_path / "a.jsonl")
    lines = path.read_text().splitlines()
    marker = {"kvlife_lost": 1, "first_seq": 1, "last_seq": 1, "error": "OSError: full"}
    path.write_text("\n".join([lines[0], lines[1], json.dumps(marker), *lines[3:]]) + "\n")
    assert main(["audit", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "records lost (sink error): seq 1-1 (1 records): OSError: full" in out
    assert "VIOLATION" not in out
    assert main(["audit", "check", str(path), "--allow-lost", "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["ok"] is True and verdict["lost_records"] == 1


def test_a_restarted_writer_is_its_own_segment_in_check_and_diagram(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "a.jsonl"
    for rid in ("first", "second"):  # each run: serial 0, seq 0 again
        sink = JsonLinesSink(path, fsync="never")
        LifecycleRegistry(sinks=[sink]).register(Req(rid))
        sink.close()
    assert main(["audit", "check", str(path)]) == 0
    assert "2 records in 2 segment(s), 2 lifecycles, 2 live" in capsys.readouterr().out
    assert main(["diagram", "--format", "dot", "--from-log", str(path)]) == 0
    dot = capsys.readouterr().out
    assert "first #0 (segment 0)" in dot and "second #0 (segment 1)" in dot


def test_a_rotated_log_is_checked_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "a.jsonl"
    sink = JsonLinesSink(path, fsync="never", batch_records=4, max_bytes=3000, backups=50)
    registry = LifecycleRegistry(sinks=[sink])
    for i in range(40):
        req = Req(f"r{i}")
        ticket = registry.start_offload(registry.register(req))
        registry.finish(req)
        registry.complete(ticket)
    sink.close()
    assert main(["audit", "check", str(path), "--expect-released"]) == 0
    out = capsys.readouterr().out
    assert f"({sink.rotations + 1} files): 160 records in 1 segment(s), 40 lifecycles" in out


def test_a_big_log_shows_progress_on_a_terminal_only(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    write_workload(path, 90_000)
    assert path.stat().st_size >= 16 << 20  # over the progress threshold
    kvlife = str(Path(sys.executable).parent / "kvlife")
    leader, follower = pty.openpty()
    done = subprocess.run(
        [kvlife, "audit", "check", str(path)],
        stdout=subprocess.PIPE, stderr=follower, timeout=120, check=False,
    )  # fmt: skip
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: all read
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert done.returncode == 0 and b"reading big.jsonl: 100% of" in shown
    piped = subprocess.run(
        [kvlife, "audit", "check", str(path)], capture_output=True, timeout=120, check=False
    )
    assert piped.returncode == 0 and piped.stderr == b""  # no progress into a pipe


@pytest.mark.parametrize(
    "words", [[], ["audit"], ["bench"], ["vllm"]], ids=lambda w: " ".join(w) or "kvlife"
)
def test_a_bare_command_prints_its_usage(
    words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(words) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvlife") and "options:" in err, err
    if words == ["bench"]:
        assert "fsm" in err and "offload" in err and "audit" in err
    if words == ["vllm"]:
        assert "exercise" in err


@pytest.mark.parametrize(("engine", "name"), [("vllm", "vLLM"), ("sglang", "SGLang")])
def test_an_exercise_without_its_engine_says_so_in_one_line(
    engine: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In an environment without the engine (this one: their tests run in the engines'
    own, make test-vllm, make test-sglang) the command names what it needs."""
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{name} is installed here: its exercise's tests run it")
    assert main([engine, "exercise", "{}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"needs {name} in this environment" in err, err


@pytest.mark.parametrize(("engine", "name"), [("vllm", "vLLM"), ("sglang", "SGLang")])
def test_an_engine_that_does_not_import_is_named_in_one_line_with_the_missing_module(
    engine: str, name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's package imports, but a module its exercise needs does not (SGLang's
    environment here lacks torchvision): one line naming the module, exit 2."""

    def tool_main(argv: list[str]) -> int:
        raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")

    real = importlib.import_module
    fake = types.SimpleNamespace(main=tool_main)
    monkeypatch.setattr(
        importlib,
        "import_module",
        lambda module: (
            fake if module.startswith(("vllm", "sglang", "kvlife.offload.watch")) else real(module)
        ),
    )
    assert main([engine, "exercise", "{}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{name} does not import in this environment: module 'torchvision' is missing" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    # the version and the build that runs (compiled or pure Python: kvlife.fsm.native)
    assert capsys.readouterr().out == f"kvlife {__version__}, {native.describe()}\n"


def test_demo_out_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "FILE"
    target.write_text("mine")
    assert main(["demo", "--requests", "2", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is not a directory" in err, err
    assert target.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode 555 directory anyway")
def test_demo_out_read_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp_path.chmod(0o555)
    try:
        assert main(["demo", "--requests", "2", "--out", str(tmp_path)]) == 2
    finally:
        tmp_path.chmod(0o755)
    assert "cannot write to --out" in capsys.readouterr().err


def test_unreadable_log_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _log(tmp_path / "a.jsonl")
    real_open = open

    def refusing(file: object, *args: object, **kwargs: object) -> object:
        if str(file) == str(log):
            raise PermissionError(13, "Permission denied", str(log))
        return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", refusing)
    assert main(["audit", "check", str(log)]) == 2
    err = capsys.readouterr().err
    assert err == f"kvlife: cannot read {log}: Permission denied\n", err


#: The command, run as a separate process.
CLI = (sys.executable, "-m", "kvlife.diagrams.cli")


def test_stdout_on_a_full_disk_is_one_line() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [*CLI, "diagram", "--format", "dot"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 2
    assert proc.stderr == "kvlife: standard output: No space left on device\n", proc.stderr


@pytest.mark.parametrize(
    "words",
    [["diagram", "--format", "dot"], ["audit", "stats", "--json", "LOG"]],
    ids=["diagram", "audit stats --json"],
)
def test_a_closed_pipe_is_quiet(words: list[str], tmp_path: Path) -> None:
    log = _log(tmp_path / "a.jsonl")
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head` does once it has its lines
    try:
        proc = subprocess.run(
            [*CLI, *(str(log) if w == "LOG" else w for w in words)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert proc.stderr == "", proc.stderr


def test_a_json_line_nested_200000_deep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = "[" * 200_000 + "]" * 200_000 + "\n"
    first = tmp_path / "first.jsonl"
    first.write_text(deep)
    assert main(["audit", "check", str(first)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a kvlife audit log" in err, err
    log = _log(tmp_path / "a.jsonl")
    lines = log.read_text().splitlines(keepends=True)
    later = tmp_path / "later.jsonl"
    later.write_text("".join(lines[:2]) + '{"a":' + deep[:-1] + "}\n" + "".join(lines[2:]))
    assert main(["audit", "check", str(later)]) == 1
    assert "unreadable line later.jsonl:3: not JSON: nested too deep" in capsys.readouterr().out


def test_ctrl_c_during_demo_exits_130_without_a_traceback(tmp_path: Path) -> None:
    # A shell's background job (``make test &``) ignores SIGINT, and a child inherits an
    # ignored signal through exec (Python then installs no handler for it): the child
    # gets SIGINT's default disposition back, as a terminal's Ctrl-C would find it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [*CLI, "demo", "--requests", "100000", "--out", str(tmp_path / "out")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    with proc:  # a failed test leaves no workload running and no pipe open
        assert proc.stderr is not None
        try:
            seen = ""
            while "requests admitted" not in seen:  # the workload is running
                char = proc.stderr.read(1)
                assert char, f"demo ended before its progress bar: {seen!r}"
                seen += char
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err and err.endswith("kvlife: interrupted\n"), err[-500:]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "offload", "--device", "banana"], "expected cpu or cuda[:N], got 'banana'"),
        (["bench", "offload", "--tokens", "lots"], "expected a token count"),
        (["bench", "fsm", "--rounds", "0"], "--rounds and --batch must be positive"),
        (["bench", "audit", "--records", "x"], "expected comma-separated integers"),
    ],
)
def test_bench_argument_errors_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_bench_offload_takes_1k() -> None:
    assert token_count("1k") == 1024 and token_count("4K") == 4096 and token_count("64") == 64


def test_audit_why_tells_a_rid_and_a_serial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _log(tmp_path / "a.jsonl")
    assert main(["audit", "why", str(log), "--rid", "a"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rid 'a': ") and "register: -> allocated" in out
    assert main(["audit", "why", str(log), "--serial", "0"]) == 0
    assert "lifecycle #0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rid", "nope"], "no record of rid 'nope'"),
        (["--serial", "99"], "has no lifecycle #99 in segment 0"),
        (["--serial", "-1"], "expected an integer >= 0"),
        ([], "one of the arguments --rid --serial is required"),
    ],
)
def test_audit_why_errors_are_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _log(tmp_path / "a.jsonl")
    assert main(["audit", "why", str(log), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_audit_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _log(tmp_path / "a.jsonl")
    out = tmp_path / "t.svg"
    assert main(["audit", "timeline", str(log), "-o", str(out), "--rid", "a"]) == 0
    assert out.read_text().startswith("<?xml") and "1 lifecycle row," in capsys.readouterr().out
    assert main(["audit", "timeline", str(log), "-o", str(tmp_path / "t.gif")]) == 2
    assert "needs a .png or .svg name" in capsys.readouterr().err


# ------------------------------------------------ one verdict in every tool that shows a log

VERDICT_TOOLS = {
    "check": lambda log, out: ["audit", "check", str(log)],
    "why": lambda log, out: ["audit", "why", str(log), "--rid", "r"],
    "report": lambda log, out: ["audit", "report", str(log), "-o", str(out / "page.html")],
    "diagram": lambda log, out: ["diagram", "--from-log", str(log), "--format", "dot"],
    "timeline": lambda log, out: ["audit", "timeline", str(log), "-o", str(out / "t.svg")],
}


def _shown(tool: str, out: Path, stdout: str) -> str:
    """What the tool showed the user: its output, or the file it wrote."""
    if tool == "report":
        return (out / "page.html").read_text()
    if tool == "timeline":
        return (out / "t.svg").read_text()
    return stdout


@pytest.mark.parametrize("tool", VERDICT_TOOLS)
@pytest.mark.parametrize("kind", sorted(EDITS))
def test_every_tool_shows_each_violation_kind_and_exits_as_check_does(
    tool: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = edited_log(clean_log(tmp_path / "clean.jsonl"), kind, tmp_path / "edited.jsonl")
    argv = [*VERDICT_TOOLS[tool](log, tmp_path), "--expect-released"]
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 1, captured
    shown = _shown(tool, tmp_path, captured.out)
    if tool in ("check", "why", "report"):
        assert kind in shown  # by name, in the text or the page's data
    else:  # the pictures count them in their title (in red)
        assert re.search(r"\d+ violations?", shown), shown[:2000]
    if tool not in ("check", "why"):
        assert "FAILED" in captured.err  # the verdict, on stderr beside the file
    if tool == "why":
        assert "verdict on the whole log (kvlife audit check): FAILED" in captured.out
        if kind not in UNRECORDED:  # a leak is about no record: in the verdict's list only
            assert f"!! VIOLATION {kind}" in captured.out


@pytest.mark.parametrize("tool", VERDICT_TOOLS)
def test_a_clean_log_is_ok_in_every_tool(
    tool: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = clean_log(tmp_path / "clean.jsonl")
    assert main([*VERDICT_TOOLS[tool](log, tmp_path), "--expect-released"]) == 0
    captured = capsys.readouterr()
    shown = _shown(tool, tmp_path, captured.out)
    assert "FAILED" not in captured.out + captured.err
    assert ('"violations": []' in shown) if tool == "report" else ("VIOLATION" not in shown)
    if tool == "check":
        assert captured.out.rstrip().endswith("OK")
    elif tool == "why":
        assert "verdict on the whole log (kvlife audit check): OK" in captured.out
    elif tool == "report":
        assert "Verdict (kvlife audit check): OK" in shown
    elif tool == "diagram":
        assert "check OK" in shown
    else:
        assert "0 violations" in shown


def test_why_marks_the_violating_record_where_it_is_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = edited_log(clean_log(tmp_path / "clean.jsonl"), "wrong_instance", tmp_path / "e.jsonl")
    assert main(["audit", "why", str(log), "--serial", "1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    ack = next(i for i, line in enumerate(lines) if "ack copy 0" in line)
    marks = [line.strip() for line in lines[ack + 1 : ack + 3]]  # the record's own marks
    assert "!! VIOLATION wrong_instance: copy 0 was started by lifecycle 0, completed on " in (
        "\n".join(marks)
    )
    assert any("VIOLATION wrong_instance seq=5 rid='r' serial=1" in line for line in lines)


def test_check_names_the_rid_of_each_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = edited_log(clean_log(tmp_path / "clean.jsonl"), "unknown_op", tmp_path / "e.jsonl")
    assert main(["audit", "check", str(log)]) == 1
    assert "VIOLATION unknown_op seq=6 rid='r' serial=1: ack of copy 99 never started" in (
        capsys.readouterr().out
    )
    assert main(["audit", "check", str(log), "--json"]) == 1
    (violation,) = json.loads(capsys.readouterr().out)["violations"]
    assert violation["rid"] == "r" and violation["meaning"].startswith("a completion names")


def test_stats_names_what_it_counts_as_a_reuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log, reused = reuse_log(tmp_path / "reuse.jsonl")
    assert main(["audit", "stats", str(log), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["reused_while_unreleased"] == len(reused) == 9  # "later" is not counted
    assert "rid_reuses" not in stats  # one name for one count


def test_the_demo_names_reused_rids_that_why_then_finds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--requests", "80", "--out", str(tmp_path), "--no-progress"]
    assert main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    command = next(line.strip() for line in out.splitlines() if "kvlife audit why" in line)
    words = command.split()
    assert words[:3] == ["kvlife", "audit", "why"] and words[3] == str(tmp_path / "audit.jsonl")
    assert words[-2:] == ["-o", str(tmp_path / f"story-{words[5]}.svg")]
    assert main(words[1:]) == 0  # runs as printed (the log is clean)
    story = capsys.readouterr().out
    assert "the rid was reused" in story
    assert "verdict on the whole log (kvlife audit check): OK" in story
    assert story.rstrip().endswith("1 late completion") or "late completions" in story
    svg = (tmp_path / f"story-{words[5]}.svg").read_text()
    assert 'id="reuse-0"' in svg and 'id="late-' in svg


def test_why_takes_a_segment_by_its_id_or_its_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "two.jsonl"
    ids = []
    for rid in ("first", "second"):  # two writers, one segment each
        sink = JsonLinesSink(log)
        registry = LifecycleRegistry(sinks=[sink])
        registry.finish(registry.register(Req(rid)))
        registry.flush()
        sink.close()
        ids.append(sink.segment)
    for segment in ("1", ids[1]):
        assert main(["audit", "why", str(log), "--serial", "0", "--segment", segment]) == 0
        assert "rid 'second' lifecycle #0 (segment 1)" in capsys.readouterr().out
    assert main(["audit", "why", str(log), "--serial", "0", "--segment", "abc123"]) == 2
    err = capsys.readouterr().err
    assert f"has no segment 'abc123'; its segments: 0={ids[0]}, 1={ids[1]}" in err
    assert main(["audit", "why", str(log), "--serial", "0", "--segment", "one"]) == 2
    assert "expected a segment index (0, 1, ...) or a segment id" in capsys.readouterr().err


def test_a_segment_id_of_digits_only_is_taken_as_the_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "digits.jsonl"
    items: list[Any] = []
    for segment, rid in (("1", "first"), ("0", "second")):  # ids that read as indexes
        memory = MemorySink()
        registry = LifecycleRegistry(sinks=[memory])
        registry.finish(registry.register(Req(rid)))
        items += [make_header(segment), *memory.records()]
    log.write_bytes(encode_lines(items))
    for segment, rid in (("1", "first"), ("0", "second")):
        assert main(["audit", "why", str(log), "--serial", "0", "--segment", segment]) == 0
        assert f"rid {rid!r} lifecycle #0" in capsys.readouterr().out


def test_accept_table_takes_only_a_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = clean_log(tmp_path / "clean.jsonl")
    assert main(["audit", "check", str(log), "--accept-table", "yes please"]) == 2
    assert "expected a table digest (16 hex digits" in capsys.readouterr().err
    assert main(["audit", "check", str(log), "--accept-table", "0123456789abcdef"]) == 0


def test_an_unreadable_line_is_named_by_line_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = clean_log(tmp_path / "clean.jsonl")
    with log.open("a") as f:
        f.write('{"seq": 8, oops}\n')
    assert main(["audit", "check", str(log)]) == 1
    out = capsys.readouterr().out
    assert "unreadable line clean.jsonl:11: not JSON: " in out  # after the closing record
    assert "object keys must be strings at column 12" in out and "(byte" not in out


# ------------------------------------------------------------ one log per writer


def _two_writers(directory: Path) -> tuple[Path, Path]:
    """Two engine cores' logs, as data parallelism writes them: each a clean story of its
    own, with the same serials and sequence numbers."""
    directory.mkdir()
    return clean_log(directory / "kvlife.dp0.jsonl"), clean_log(directory / "kvlife.dp1.jsonl")


@pytest.mark.parametrize("given", ["directory", "files"])
def test_every_audit_tool_takes_a_directory_or_several_logs(
    given: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dp0, dp1 = _two_writers(tmp_path / "logs")
    logs = [str(tmp_path / "logs")] if given == "directory" else [str(dp0), str(dp1)]
    assert main(["audit", "check", *logs, "--expect-released"]) == 0
    out = capsys.readouterr().out
    assert "16 records in 2 segment(s), 4 lifecycles, 0 live" in out and "OK" in out
    assert main(["audit", "stats", *logs, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lifecycles"] == 4
    assert main(["audit", "why", *logs, "--serial", "1", "--segment", "1"]) == 0
    assert "registered" in capsys.readouterr().out
    assert main(["audit", "report", *logs, "-o", str(tmp_path / "r.html")]) == 0
    assert main(["audit", "timeline", *logs, "-o", str(tmp_path / "t.svg")]) == 0
    assert (tmp_path / "r.html").stat().st_size and (tmp_path / "t.svg").stat().st_size


def test_two_writers_in_one_file_is_what_the_checker_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dp0, dp1 = _two_writers(tmp_path / "logs")
    lines0, lines1 = dp0.read_text().splitlines(), dp1.read_text().splitlines()
    mixed = [lines0[0], lines1[0]]  # both headers, then the records interleaved
    for a, b in zip(lines0[1:], lines1[1:], strict=True):
        mixed += [a, b]
    (tmp_path / "mixed.jsonl").write_text("\n".join(mixed) + "\n")
    assert main(["audit", "check", str(tmp_path / "mixed.jsonl")]) == 1
    assert "VIOLATION" in capsys.readouterr().out


def test_a_directory_without_logs_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "check", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"kvlife: {tmp_path} is a directory with no audit log (*.jsonl)\n"
    )


def test_an_output_that_cannot_be_written_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = clean_log(tmp_path / "clean.jsonl")
    target = tmp_path / "no-such-dir" / "t.png"
    assert main(["audit", "timeline", str(log), "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {target}" in err and "cannot read" not in err


def test_an_unknown_rid_is_exit_2_naming_it_in_every_view(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = clean_log(tmp_path / "clean.jsonl")
    out = tmp_path / "t.png"
    argv = ["audit", "timeline", str(log), "--rid", "nope", "--rid", "r", "-o", str(out)]
    assert main(argv) == 2
    assert "has no record of rid 'nope'" in capsys.readouterr().err
    assert not out.exists()
    assert main(["audit", "why", str(log), "--rid", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["audit", "timeline", str(log), "--rid", "r", "-o", str(out)]) == 0
    assert "2 lifecycle rows, 0 violations, 1 rid reuse while unreleased" in capsys.readouterr().out


def test_every_command_that_writes_a_file_says_what_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = clean_log(tmp_path / "clean.jsonl")
    for argv, said in (
        (["diagram", "-o", str(tmp_path / "d.svg")], "the lifecycle diagram (svg, "),
        (
            ["diagram", "--from-log", str(log), "-o", str(tmp_path / "e.dot"), "--format", "dot"],
            f"the lifecycle diagram with {log}'s counts (dot, ",
        ),
    ):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert said in out, out


# --- why -o: the story picture ------------------------------------------------------------


def test_why_draws_the_story_and_says_what_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = clean_log(tmp_path / "a.jsonl")
    out = tmp_path / "story.png"
    assert main(["audit", "why", str(log), "--rid", "r", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "late: the rid was reused by #1" in text  # the words, as before
    assert text.rstrip().endswith(
        f"{out}: the story of rid 'r': 2 lifecycles, 2 copies, 1 reuse, 1 late completion"
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("story.txt", "-o needs a .png or .svg name, got '.txt'"),
        ("missing-dir/story.svg", "cannot write"),
    ],
)
def test_why_refuses_an_output_it_cannot_write(
    output: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = clean_log(tmp_path / "a.jsonl")
    assert main(["audit", "why", str(log), "--rid", "r", "-o", str(tmp_path / output)]) == 2
    assert message in capsys.readouterr().err


def test_why_draws_nothing_for_a_rid_with_no_lifecycle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "ghost.jsonl"
    sink = JsonLinesSink(log, fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    with pytest.raises(LookupError):
        registry.finish(Req("ghost"))  # refused: no lifecycle, audited under its rid
    sink.close()
    out = tmp_path / "ghost.svg"
    assert main(["audit", "why", str(log), "--rid", "ghost", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 call(s) that found none" in text
    assert f"{out}: not written: rid 'ghost' has no lifecycle in the log to draw" in text
    assert not out.exists()


def test_check_counts_an_overdue_ticket_that_completed_and_fails_it_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "a.jsonl"
    sink = JsonLinesSink(log, fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    now = [0.0]
    watch = OverdueWatch(registry, 10, clock=lambda: now[0])
    req = Req("slow")
    registry.register(req)
    ticket = registry.start_offload(req)
    watch.opened(ticket, "store")
    now[0] = 11.0
    watch.check()
    registry.complete(ticket)
    registry.finish(req)
    sink.close()
    assert main(["audit", "check", str(log)]) == 0
    out = capsys.readouterr().out
    assert "overdue: 1 ticket(s)" in out and "1 of them completed later" in out
    assert main(["audit", "check", str(log), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (said["overdue"], said["overdue_completed"]) == (1, 1)
    assert main(["audit", "check", str(log), "--overdue-fails"]) == 1
    assert "VIOLATION overdue" in capsys.readouterr().out


# ------------------------------------------------------------ a log cut short

_DYING_WRITER = """
import sys, time
from kvlife.fsm import JsonLinesSink, LifecycleRegistry
class Req:
    def __init__(self, rid): self.rid = rid
sink = JsonLinesSink(sys.argv[1], witness="LMCacheMPConnector", open_marker=True,
                     flush_interval_s=60)
registry = LifecycleRegistry(sinks=[sink])
done, held = Req("done-1"), Req("bystander-1")
for req in (done, held):
    registry.register(req)
ticket = registry.start_offload(done, kind="delayed_free")
registry.finish(done)
registry.complete(ticket)
registry.start_offload(held, kind="delayed_free")
registry.finish(held)
sink.write_out()  # what an engine does after each step
print("ready", flush=True)
time.sleep(600)
"""


def _killed_writer(path: Path) -> int:
    """A writer (a watched connector's log, one delayed free still open) killed with
    SIGKILL after writing its records out: the log of an engine that died. Returns its
    pid."""
    process = subprocess.Popen(
        [sys.executable, "-c", _DYING_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    process.kill()
    process.wait(timeout=30)
    process.stdout.close()
    return process.pid


def test_a_log_cut_short_by_a_kill_says_so_and_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "audit.jsonl"
    pid = _killed_writer(path)
    assert Path(f"{path}.open").exists()
    assert main(["audit", "check", str(path)]) == 3
    out = capsys.readouterr().out
    assert "unreported" not in out and "VIOLATION" not in out
    assert f"segment 0 (pid {pid}, LMCacheMPConnector): CUT SHORT" in out
    assert "1 copy in flight at the cut" in out and f"its .open marker says: pid {pid}" in out
    assert "in flight at the cut: rid 'bystander-1' lifecycle 1 copy 1 (delayed_free)" in out
    assert out.rstrip().endswith("CUT SHORT")
    assert main(["audit", "check", "--json", str(path)]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "CUT SHORT" and data["ok"] and data["exit_status"] == 3
    assert data["cut_short"] == 1 and data["endings"][0]["status"] == "cut"
    assert [o["rid"] for o in data["open_at_end"]] == ["bystander-1"]


def test_a_log_cut_short_with_no_copy_in_flight_does_not_speak_of_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "with the copies above in flight", of a cut with none."""
    path = _log(tmp_path / "audit.jsonl")
    lines = path.read_text().splitlines(keepends=True)[:-1]  # no closing record
    with subprocess.Popen([sys.executable, "-c", ""]) as gone:  # a writer that stopped
        gone.wait(timeout=60)
    header = json.loads(lines[0]) | {"pid": gone.pid}
    path.write_text("".join([json.dumps(header) + "\n", *lines[1:]]))
    assert main(["audit", "check", str(path)]) == 3
    out = capsys.readouterr().out
    assert "no copy in flight at the cut" in out and "copies above" not in out
    assert out.splitlines()[-2:] == [
        "the log was cut short: its writer stopped (a crash, a kill, a full disk) with no "
        "copy in flight",
        "CUT SHORT",
    ]


@pytest.mark.parametrize("view", ["why", "report", "timeline", "diagram", "stats"])
def test_every_view_says_first_that_the_log_was_cut_short(
    view: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "audit.jsonl"
    pid = _killed_writer(path)
    argv = {
        "why": ["audit", "why", str(path), "--rid", "bystander-1"],
        "report": ["audit", "report", str(path), "-o", str(tmp_path / "r.html")],
        "timeline": ["audit", "timeline", str(path), "-o", str(tmp_path / "t.png")],
        "diagram": ["diagram", "--format", "dot", "--from-log", str(path)],
        "stats": ["audit", "stats", str(path)],
    }[view]
    status = main(argv)
    captured = capsys.readouterr()
    said = f"segment 0 (pid {pid}, LMCacheMPConnector): CUT SHORT"
    if view == "why":
        assert status == 3 and captured.out.splitlines()[0].startswith(said)
        assert "verdict on the whole log (kvlife audit check): CUT SHORT" in captured.out
    elif view == "stats":
        assert status == 0 and captured.out.splitlines()[0].startswith(said)
        assert "segments_cut_short                   1" in captured.out
    else:
        assert status == 3 and said in captured.err and "CUT SHORT: 1 writer" in captured.err
    if view == "report":
        page = (tmp_path / "r.html").read_text()
        assert 'class="cut"' in page and "CUT SHORT" in page and "bystander-1" in page


def test_a_directory_of_logs_says_which_writers_closed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _killed_writer(tmp_path / "core1.jsonl")
    with JsonLinesSink(tmp_path / "core0.jsonl") as sink:
        registry = LifecycleRegistry(sinks=[sink])
        registry.finish(registry.register(Req("a")).req)
        registry.flush()
    assert main(["audit", "check", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert "2 writers: 1 closed their log, 1 stopped without closing it (cut short)" in out
    assert "segment 1 (pid" in out  # core1, read after core0


def test_a_live_writers_log_is_open_not_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "audit.jsonl"
    sink = JsonLinesSink(path, witness="C", open_marker=True)
    registry = LifecycleRegistry(sinks=[sink])
    req = Req("in-flight")
    registry.register(req)
    registry.start_offload(req, kind="store")
    registry.flush()
    try:
        assert main(["audit", "check", str(path)]) == 0  # this process writes it: open
        out = capsys.readouterr().out
        assert "OPEN, its writer is running on this machine" in out and "unreported" not in out
    finally:
        sink.close()
    assert main(["audit", "check", str(path)]) == 1  # closed with the ticket open
    assert "VIOLATION unreported" in capsys.readouterr().out

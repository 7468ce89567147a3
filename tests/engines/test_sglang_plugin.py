"""kvlife's SGLang plugin (``kvlife.offload.engines.sglang_plugin``) in SGLang 0.5.23's
real plugin loader, in processes started the way SGLang starts its schedulers (run in
``.venv-sglang`` by ``make test-sglang``, where kvlife is installed and its entry point is
discovered; in the main environment this module skips).

What runs in each spawned process: SGLang's ``load_plugins()`` (every installed plugin,
kvlife's among them), SGLang's server-args publication, and the branch of SGLang's own
``Scheduler.__init__`` that builds the decode offload manager, with SGLang's real pools on
CPU (the rest of that constructor needs a model runner on a GPU).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engines import require_sglang

require_sglang("0.5.23", "test-sglang")

import sglang.version
from sglang.srt.plugins.hook_registry import HookRegistry

from kvlife.fsm import __version__, check_audit, read_audit
from kvlife.offload.engines import sglang_plugin
from kvlife.offload.engines.sglang_plugin import (
    PluginSettings,
    PluginSettingsError,
    UnsupportedSGLangError,
    rank_name,
    register,
)
from tests.engines.sglang_harness import scheduler_offload_branch, scheduler_process_main

KVLIFE_CLASS = "kvlife.offload.engines.sglang.ServerDecodeOffloadManager"
SGLANG_CLASS = (
    "sglang.srt.disaggregation.decode_kvcache_offload_manager.DecodeKVCacheOffloadManager"
)


def spawn_scheduler(out: Path, mode: str, env: dict[str, str]) -> Any:
    """Start ``scheduler_process_main`` in a spawned process with ``env`` added to (or,
    for empty values, taken out of) this process's environment."""
    saved = {key: os.environ.get(key) for key in env}
    for key, value in env.items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    try:
        process = multiprocessing.get_context("spawn").Process(
            target=scheduler_process_main, args=(str(out), mode)
        )
        process.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return process


def wait_ready(process: Any, out: Path) -> None:
    """Wait until a ``"killed"`` mode scheduler wrote ``out/ready`` (it runs, its log open)."""
    deadline = time.monotonic() + 240
    while not (out / "ready").exists():
        assert process.is_alive() and time.monotonic() < deadline
        time.sleep(0.1)


def run_scheduler(out: Path, mode: str, env: dict[str, str]) -> dict[str, Any]:
    process = spawn_scheduler(out, mode, env)
    process.join(timeout=240)
    log = Path(out, "process.log").read_text() if Path(out, "process.log").exists() else ""
    assert process.exitcode == 0, log
    result: dict[str, Any] = json.loads(Path(out, "result.json").read_text())
    result["log"] = log
    return result


def switched_on(tmp_path: Path) -> dict[str, str]:
    return {
        "KVLIFE_SGLANG_OFFLOAD": "1",
        "KVLIFE_AUDIT_DIR": str(tmp_path / "audit"),
        "KVLIFE_AUDIT_FLUSH_S": "0.2",
        "SGLANG_PLUGINS": "",
    }


def test_the_switch_makes_sglangs_scheduler_build_kvlifes_manager(tmp_path: Path) -> None:
    result = run_scheduler(tmp_path, "scenario", switched_on(tmp_path))
    assert result["class"] == KVLIFE_CLASS and result["kvlife"]
    assert result["scenario"] == "passed"  # the late completion went through it
    log = result["log"]
    assert "Executed general plugin: kvlife" in log
    assert f"kvlife {__version__} is SGLang 0.5.23's decode KV offload manager on rank tp0" in log
    path = Path(result["audit_log"])
    assert path == tmp_path / "audit" / "sglang-tp0.jsonl"
    assert str(path) in log  # the start-up line names the log
    # after SGLang's graceful shutdown the log is complete and closed
    assert not Path(f"{path}.open").exists()
    log = read_audit(path)
    report = check_audit(log, expect_released=True)
    assert report.ok, report
    assert [(e.status, e.how) for e in report.endings] == [("closed", "close")]
    assert (report.lifecycles, report.released, report.reused_while_unreleased) == (2, 2, 1)
    assert {r.rid for r in log.records} == {"r"}  # one rid, two lifecycles, both released


def test_a_killed_scheduler_leaves_every_record_of_the_calls_that_returned(
    tmp_path: Path,
) -> None:
    env = switched_on(tmp_path) | {"KVLIFE_AUDIT_FLUSH_S": "3600"}  # no timed flush here
    process = spawn_scheduler(tmp_path, "killed", env)
    try:
        wait_ready(process, tmp_path)
        path = tmp_path / "audit" / "sglang-tp0.jsonl"
        assert Path(f"{path}.open").exists()  # open while the scheduler runs
        while_running = read_audit(path).records  # no shutdown, no flush: written per call
    finally:
        os.kill(process.pid, signal.SIGKILL)  # what SGLang's launcher does at a stop
        process.join(timeout=30)
    assert process.exitcode == -signal.SIGKILL
    after = read_audit(path)
    assert [r.seq for r in after.records] == [r.seq for r in while_running]
    report = check_audit(after, expect_released=True)
    assert report.ok, report  # both lifecycles released, nothing missing
    assert (report.lifecycles, report.released) == (2, 2)
    assert Path(f"{path}.open").exists()  # the unclean stop is visible to the next opener
    # and every view says the log was cut short, naming the scheduler's pid
    assert [(e.status, e.pid) for e in report.endings] == [("cut", process.pid)]
    cli = subprocess.run(
        [sys.executable, "-m", "kvlife.diagrams.cli", "audit", "check", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 3, cli.stdout + cli.stderr
    assert f"(pid {process.pid}): CUT SHORT" in cli.stdout and "no copy in flight" in cli.stdout


def test_a_second_scheduler_given_the_first_ones_audit_log_refuses_to_start(
    tmp_path: Path,
) -> None:
    """Two servers given one ``KVLIFE_AUDIT_DIR`` on one machine: the second waits
    ``SERVER_LOCK_WAIT_S`` for the first to close the rank's log, then refuses to start
    (``AuditLogBusyError``) and writes nothing to it; before, both wrote one file."""
    env = switched_on(tmp_path) | {"KVLIFE_AUDIT_FLUSH_S": "3600"}
    first = spawn_scheduler(tmp_path, "killed", env)
    second_out = tmp_path / "second"
    second_out.mkdir()
    try:
        wait_ready(first, tmp_path)
        path = tmp_path / "audit" / "sglang-tp0.jsonl"
        written = path.read_bytes()
        second = spawn_scheduler(second_out, "scenario", env)
        second.join(timeout=240)
        assert second.exitcode == 1
        log = (second_out / "process.log").read_text()
        assert f"audit log {path} is held by another writer (its marker" in log
        assert not (second_out / "result.json").exists()  # no manager was built
        assert path.read_bytes() == written
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.join(timeout=30)
    assert check_audit(read_audit(path), expect_released=True).ok


def test_without_the_switch_the_scheduler_builds_sglangs_own_manager(tmp_path: Path) -> None:
    env = switched_on(tmp_path) | {"KVLIFE_SGLANG_OFFLOAD": ""}
    result = run_scheduler(tmp_path, "scenario", env)
    assert result["class"] == SGLANG_CLASS and not result["kvlife"]
    assert "Executed general plugin: kvlife" in result["log"]  # loaded, and did nothing
    assert not (tmp_path / "audit").exists()


def test_an_sglang_version_not_tested_is_refused_by_name(tmp_path: Path) -> None:
    result = run_scheduler(tmp_path, "version", switched_on(tmp_path))
    assert result["class"] == SGLANG_CLASS  # SGLang's manager stays
    log = result["log"]
    assert "Failed to execute general plugin: kvlife" in log
    assert "tested on SGLang 0.5.23, and this is SGLang 0.5.99" in log
    assert not (tmp_path / "audit").exists()


def test_register_refuses_an_untested_version_and_registers_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVLIFE_SGLANG_OFFLOAD", "1")
    monkeypatch.setattr(sglang.version, "__version__", "0.5.24")
    before = dict(HookRegistry._hooks)
    with pytest.raises(UnsupportedSGLangError, match=r"SGLang 0\.5\.24.*sglang==0\.5\.23"):
        register()
    assert dict(HookRegistry._hooks) == before
    monkeypatch.setenv("KVLIFE_SGLANG_OFFLOAD", "0")
    assert register() is False


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVLIFE_SGLANG_OFFLOAD": "maybe"}, "KVLIFE_SGLANG_OFFLOAD='maybe'"),
        ({"KVLIFE_SGLANG_OFFLOAD": "1", "KVLIFE_AUDIT_FLUSH_S": "0"}, "KVLIFE_AUDIT_FLUSH_S='0'"),
        ({"KVLIFE_AUDIT_FLUSH_S": "soon"}, "KVLIFE_AUDIT_FLUSH_S='soon'"),
        ({"KVLIFE_AUDIT_FLUSH_S": "inf"}, "KVLIFE_AUDIT_FLUSH_S='inf'"),
        ({"KVLIFE_SGLANG_HICACHE": "fix"}, "KVLIFE_SGLANG_HICACHE='fix'"),
        ({"KVLIFE_AUDIT_OVERDUE_S": "-1"}, "KVLIFE_AUDIT_OVERDUE_S='-1'"),
    ],
)
def test_settings_it_cannot_use_are_refused_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(PluginSettingsError, match=message.replace(".", r"\.")):
        PluginSettings.from_env(env)


def test_settings_defaults_and_rank_names() -> None:
    settings = PluginSettings.from_env({"KVLIFE_SGLANG_OFFLOAD": "On"})
    assert settings == PluginSettings(True, Path("kvlife-audit"), 1.0)
    assert not PluginSettings.from_env({}).enabled
    lens = PluginSettings.from_env(
        {"KVLIFE_SGLANG_HICACHE": "Refuse", "KVLIFE_AUDIT_OVERDUE_S": "5"}
    )
    assert not lens.enabled and lens.hicache == "refuse" and lens.overdue_s == 5.0
    assert PluginSettings.from_env({"KVLIFE_SGLANG_HICACHE": "off"}).hicache is None
    names = [rank_name(0), rank_name(1, 1, 2), rank_name(1, 0, 1, 2)]
    assert names == ["tp0", "pp1-tp1", "dp2-tp1"]


def test_the_scheduler_branch_is_sglangs_construction_call() -> None:
    branch = scheduler_offload_branch()
    assert branch.startswith("if (") and branch.rstrip().endswith("= None")
    assert "DecodeKVCacheOffloadManager(" in branch
    assert "tp_group=self.dp_tp_cpu_group" in branch
    assert sglang_plugin.TARGET.rsplit(".", 1)[1] == "DecodeKVCacheOffloadManager"

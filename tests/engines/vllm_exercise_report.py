"""The field report of ``kvlife vllm exercise`` (``make exercise-report``): every connector
installed in the vLLM test environment this runs in (in LMCache's environment, LMCache's
connector against a real ``lmcache server`` it starts), every family, the same seeds;
writes this environment's section of ``docs/exercise-report.md`` (the others' sections are
kept) and keeps the failing runs' logs under ``build/exercise/``.

    python -m tests.engines.vllm_exercise_report [--seeds 20] [--steps 120]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvlife.offload.watch.vllm.exercise import FAMILIES, RUNNERS, FamilyReport, exercise
from kvlife.offload.watch.vllm.exercise_multi import multi_config

REPORT = Path("docs/exercise-report.md")

CONNECTORS: list[tuple[str, dict[str, Any]]] = [
    (
        "kvlife `KVLifeConnector`",
        {
            "kv_connector": "KVLifeConnector",
            "kv_connector_module_path": "kvlife.offload.engines.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_pages": 32},
        },
    ),
    (
        "vLLM `ExampleConnector`",
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": "build/exercise/example"},
        },
    ),
    (
        "vLLM `OffloadingConnector`",
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20},
        },
    ),
    (
        "vLLM `SimpleCPUOffloadConnector`, eager",
        {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": "kv_both",
            # 64 blocks on vLLM 0.33; 0.32 knows only a byte budget (1 MiB: 512 blocks here)
            "kv_connector_extra_config": {"num_cpu_blocks": 64, "cpu_bytes_to_use": 1 << 20},
        },
    ),
    (
        "vLLM `SimpleCPUOffloadConnector`, lazy",
        {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "num_cpu_blocks": 64,
                "cpu_bytes_to_use": 1 << 20,
                "lazy_offload": True,
            },
        },
    ),
    (
        "vLLM `NixlConnector` (pull), both roles, the other engine played",
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    ),
    (
        "vLLM `NixlPushConnector`, both roles, the other engine played",
        {"kv_connector": "NixlPushConnector", "kv_role": "kv_both"},
    ),
    (
        "vLLM `MooncakeConnector` (P/D), both roles, the other engine played",
        {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"},
    ),
    (
        "vLLM `MooncakeStoreConnector`, its workers and store played",
        {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
    ),
    (
        "vLLM `ExampleHiddenStatesConnector`, `extract_hidden_states` speculation",
        {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": "build/exercise/hidden"},
        },
    ),
]


def _config(label: str) -> dict[str, Any]:
    return next(config for name, config in CONNECTORS if name == label)


CONNECTORS.append(
    (
        "vLLM `MultiConnector`: kvlife's, then `OffloadingConnector`",
        multi_config(_config("kvlife `KVLifeConnector`"), _config("vLLM `OffloadingConnector`")),
    )
)
CONNECTORS.append(
    (
        "vLLM `MultiConnector`: `NixlConnector`, then `OffloadingConnector`",
        multi_config(
            _config("vLLM `NixlConnector` (pull), both roles, the other engine played"),
            _config("vLLM `OffloadingConnector`"),
        ),
    )
)


#: LMCache's in-process connector, configured by the LMCACHE_* settings the exercise sets
#: where the environment has none (kvlife.offload.watch.vllm.exercise_lmcache_inprocess)
LMCACHE_IN_PROCESS: dict[str, Any] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def _cell(report: FamilyReport) -> str:
    if not report.failed:
        return "ok"
    kinds = [where.split(" at ", 1)[0] for where in report.raises]
    kinds += list(report.verdicts)
    if report.undrained:
        kinds.append("undrained")
    if report.leaks:
        kinds.append("leak")
    return f"**{report.failed}/{report.runs}**: " + ", ".join(dict.fromkeys(kinds))


def _details(name: str, report: FamilyReport) -> list[str]:
    lines = []
    for where, (count, seed, text) in report.raises.items():
        lines.append(
            f"- {name}, `{report.family}`: raised in {count} run(s) (seed {seed}): `{text}`, "
            f"at `{where.split(' at ', 1)[1]}`"
        )
    if report.undrained:
        count, seed, rids = report.undrained
        lines.append(
            f"- {name}, `{report.family}`: never drained in {count} run(s) (seed {seed}): "
            f"vLLM held {', '.join(rids[:4])}"
        )
    if report.leaks:
        count, seed, blocks = report.leaks
        lines.append(f"- {name}, `{report.family}`: {blocks} block(s) leaked (seed {seed})")
    for kind, (count, seed, rid, why) in report.verdicts.items():
        lines.append(
            f"- {name}, `{report.family}`: `{kind}` in {count} run(s) (seed {seed}, rid "
            f"`{rid}`): `{why}`"
        )
    return lines


def section(seeds: int, steps: int, connectors: list[tuple[str, dict[str, Any]]]) -> str:
    """This environment's section of the report: vLLM's version (and LMCache's, where it
    is installed: then its connector alone, against a server this starts)."""
    import vllm  # noqa: PLC0415

    version = vllm.__version__
    if any(config["kv_connector"].startswith("LMCache") for _, config in connectors):
        from importlib.metadata import version as installed  # noqa: PLC0415

        version += f", lmcache {installed('lmcache')}"
    rows, details = [], []
    spent: dict[str, float] = dict.fromkeys(FAMILIES, 0.0)
    for name, config in connectors:
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        out = Path("build/exercise") / re.sub(r"[^a-z0-9.]+", "-", f"vllm {version}") / slug
        exercise(config, ["basic"], [seeds], 10, out)  # imports and first builds, not timed
        cells = []
        for family in FAMILIES:
            start = time.perf_counter()
            reports, _ = exercise(config, [family], range(seeds), steps, out)  # each runner
            spent[family] += time.perf_counter() - start
            cell = " / ".join(_cell(report) for report in reports)
            cells.append(cell)
            for report in reports:
                details += _details(f"{name} (runner {report.runner.upper()})", report)
            print(f"{name} {family}: {cell}", file=sys.stderr)
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    per_100 = ", ".join(
        f"{family} {spent[family] / (len(RUNNERS) * seeds * len(connectors)) * 100:.1f} s"
        for family in FAMILIES
    )
    command = f"kvlife vllm exercise CONFIG --seeds {seeds} --steps {steps}"
    lines = [
        f"<!-- exercise-report: vllm {version} -->",
        f"### vLLM {version}",
        "",
        f"{seeds} seeds (0-{seeds - 1}) of each family, {steps} steps a run, each cell "
        f"`{command} --families FAMILY`, under the runners {' / '.join(RUNNERS)}; "
        f"`make exercise-report` made it on "
        f"{time.strftime('%Y-%m-%d')}. Time of 100 runs, by family: {per_100}.",
        "",
        "| connector | " + " | ".join(FAMILIES) + " |",
        "|---|" + "---|" * len(FAMILIES),
        *rows,
        "",
        *(details or ["Every run clean."]),
        f"<!-- end: vllm {version} -->",
    ]
    return "\n".join(lines)


def write(text: str) -> None:
    """Put ``text`` (one version's section) into the report, replacing that version's
    section if it is there."""
    version = re.search(r"exercise-report: vllm (.+?) -->", text)
    assert version is not None
    old = REPORT.read_text() if REPORT.exists() else ""
    pattern = re.compile(
        rf"<!-- exercise-report: vllm {re.escape(version[1])} -->.*?"
        rf"<!-- end: vllm {re.escape(version[1])} -->",
        re.S,
    )
    if pattern.search(old):
        new = pattern.sub(lambda _: text, old)
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n" if old else text + "\n"
    REPORT.write_text(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("lmcache") is None:
        text = section(args.seeds, args.steps, CONNECTORS)
    else:  # LMCache's environment: its two connectors (the MP one against a real server)
        from tests.engines.lmcache_server import lmcache_config, lmcache_server  # noqa: PLC0415

        logs = Path("build/exercise")
        logs.mkdir(parents=True, exist_ok=True)
        with lmcache_server(logs / "lmcache-server.log") as server:
            connectors = [
                ("LMCache `LMCacheMPConnector`, real server", lmcache_config(server)),
                ("LMCache `LMCacheConnectorV1`, local CPU backend", LMCACHE_IN_PROCESS),
            ]
            text = section(args.seeds, args.steps, connectors)
    write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The audit log: encoding, sinks, crash-tolerant reading and the replay checker."""

from __future__ import annotations

import ast
import importlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given

import kvlife.fsm
from kvlife.fsm import LIFECYCLE, LifecycleRegistry, MemorySink, __version__
from kvlife.fsm.audit import (
    RECORD_FIELDS,
    AuditFormatError,
    AuditRecord,
    AuditSchemaError,
    JsonLinesSink,
    LoggingSink,
    check_audit,
    encode_record,
    read_audit,
    record_from_dict,
    trim_torn_tail,
)
from tests.strategies import HOSTILE_RIDS, Req, hostile_rids


def _workload(registry: LifecycleRegistry, n: int, rid: str = "r") -> None:
    """A small mixed workload: rid reuse, a late ack, a refusal."""
    for i in range(n):
        req = Req(f"{rid}{i % 2}")
        ticket = registry.start_offload(registry.register(req), tokens=16)
        registry.finish(req)
        registry.complete(ticket)
        registry.deliver(ticket)  # a duplicate: refused, audited


def _write_log(path: Path, records: int) -> list[AuditRecord]:
    memory = MemorySink()
    with JsonLinesSink(path, fsync="never") as sink:
        registry = LifecycleRegistry(sinks=[sink, memory])
        while len(memory) < records:
            _workload(registry, 1)
    return memory.records()


# --- encoding ----------------------------------------------------------------------------


def test_encoding_is_json_with_the_schema_fields() -> None:
    record = AuditRecord(
        3, 99, "a", 1, "ack", "offloading", "allocated", True, None, 7, 0, {"tokens": 16}
    )
    obj = json.loads(encode_record(record))
    assert list(obj) == list(RECORD_FIELDS)
    assert record_from_dict(obj) == record


@pytest.mark.parametrize("rid", HOSTILE_RIDS)
def test_hostile_rid_stays_in_one_record(rid: str, tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with JsonLinesSink(path, fsync="never") as sink:
        registry = LifecycleRegistry(sinks=[sink])
        req = Req(rid)
        registry.complete(registry.start_offload(registry.register(req)))
        registry.finish(req)
    raw = path.read_bytes()
    assert raw.count(b"\n") == 6  # header, 4 records, closing: no line broken by the rid
    assert b"\xe2\x80\xa8" not in raw and b"\x00" not in raw
    log = read_audit(path)
    assert not log.problems and log.torn_tail == 0
    assert [r.rid for r in log.records] == [rid] * 4
    assert check_audit(log, expect_released=True).ok


@given(rid=hostile_rids)
def test_any_rid_round_trips(rid: str) -> None:
    record = AuditRecord(0, 1, rid, 0, "register", None, "allocated", True, None, None, 0, {})
    line = encode_record(record)
    assert "\n" not in line and "\u2028" not in line
    assert record_from_dict(json.loads(line)) == record
    assert len(line.splitlines()) == 1


# --- sinks -------------------------------------------------------------------------------


def test_jsonl_header(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    JsonLinesSink(path).close()
    header = json.loads(path.read_text().splitlines()[0])
    assert header["kvlife_audit"] == 1
    assert header["library_version"] == __version__
    assert header["table"] == LIFECYCLE.digest
    assert isinstance(header["pid"], int) and isinstance(header["wall_start"], float)


@pytest.mark.parametrize("policy", ["never", "batch", "record"])
def test_every_fsync_policy_writes_every_record(policy: str, tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    memory = MemorySink()
    sink = JsonLinesSink(path, fsync=policy, batch_records=7)  # type: ignore[arg-type]
    registry = LifecycleRegistry(sinks=[sink, memory])
    _workload(registry, 10)
    if policy == "record":  # written before write() returned
        assert len(read_audit(path).records) == len(memory)
    sink.close()
    sink.close()
    assert read_audit(path).records == memory.records()
    with pytest.raises(ValueError, match="closed"):  # at once, or at the next flush
        sink.write(memory.records()[0])
        sink.flush()


def test_sink_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync"):
        JsonLinesSink(tmp_path / "a", fsync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_records"):
        JsonLinesSink(tmp_path / "a", batch_records=0)
    with pytest.raises(ValueError, match="capacity"):
        MemorySink(capacity=0)
    assert not (tmp_path / "a").exists()


def test_memory_ring_keeps_the_newest() -> None:
    ring = MemorySink(capacity=5)
    registry = LifecycleRegistry(sinks=[ring])
    _workload(registry, 5)
    records = ring.records()
    assert len(records) == 5 == ring.capacity
    assert [r.seq for r in records] == list(range(records[0].seq, records[0].seq + 5))
    ring.clear()
    assert len(ring) == 0


def logged_by(logger: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What ``logger`` logged (not what a registry from an earlier test, finalized by
    the garbage collector meanwhile, logged about its sinks)."""
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_logging_sink(caplog: pytest.LogCaptureFixture) -> None:
    registry = LifecycleRegistry(sinks=[LoggingSink("kvlife.test")])
    with caplog.at_level(logging.INFO, logger="kvlife.test"):
        registry.register(Req("a\nb"))
    (record,) = logged_by("kvlife.test", caplog)
    assert json.loads(record)["rid"] == "a\nb"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvlife.test"):
        registry.register(Req("c"))
    assert logged_by("kvlife.test", caplog) == []


# --- crash-tolerant reading --------------------------------------------------------------


def test_truncation_at_every_byte_reads_back_exactly_the_complete_records(
    tmp_path: Path,
) -> None:
    full = tmp_path / "full.jsonl"
    records = _write_log(full, 50)
    data = full.read_bytes()
    lines = data.split(b"\n")[:-1]
    assert len(lines) >= 51  # header + at least 50 records
    ends = []  # byte offset just after each line's newline
    offset = 0
    for line in lines:
        offset += len(line) + 1
        ends.append(offset)
    cut = tmp_path / "cut.jsonl"
    for size in range(len(data) + 1):
        cut.write_bytes(data[:size])
        if size < ends[0]:  # not even the header is complete: not an audit log
            with pytest.raises(AuditFormatError, match="no complete line"):
                read_audit(cut)
            continue
        log = read_audit(cut)
        complete = sum(1 for end in ends if end <= size)
        assert log.records == records[: max(0, complete - 1)], size
        assert not log.problems, (size, log.problems)
        assert log.torn_tail == size - (ends[complete - 1] if complete else 0)


def test_append_after_a_torn_tail_trims_it_first(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    first = _write_log(path, 10)
    torn = b'{"seq":99,"t_ns":1,"rid":"tor'
    with path.open("ab") as f:
        f.write(torn)
    assert read_audit(path).torn_tail == len(torn)
    sink = JsonLinesSink(path, fsync="record")
    assert sink.trimmed_bytes == len(torn)
    registry = LifecycleRegistry(sinks=[sink])
    registry.register(Req("after"))
    sink.close()
    log = read_audit(path)
    assert not log.problems and log.torn_tail == 0
    assert len(log.segments) == 2
    assert log.segments[0].records == first
    assert [r.rid for r in log.segments[1].records] == ["after"]
    assert check_audit(log).ok


def test_trim_torn_tail_on_missing_and_clean_files(tmp_path: Path) -> None:
    assert trim_torn_tail(tmp_path / "missing") == 0
    clean = tmp_path / "clean"
    clean.write_bytes(b"a\nb\n")
    assert trim_torn_tail(clean) == 0 and clean.read_bytes() == b"a\nb\n"
    no_newline = tmp_path / "nonl"
    no_newline.write_bytes(b"x" * 200_000)
    assert trim_torn_tail(no_newline) == 200_000 and no_newline.read_bytes() == b""


def test_corruption_in_the_middle_is_reported_not_joined(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    records = _write_log(path, 10)
    lines = path.read_bytes().split(b"\n")
    lines[4] = lines[4][:20]  # a torn line in the middle, followed by complete ones
    lines[6] = b'{"seq": 1}'  # valid JSON, wrong schema
    path.write_bytes(b"\n".join(lines))
    log = read_audit(path)
    assert [p.line for p in log.problems] == [5, 7]
    assert "schema" in log.problems[1].message
    kept = [r for i, r in enumerate(records) if i not in (3, 5)]
    assert log.records == kept
    report = check_audit(log)
    assert any(v.kind == "seq_gap" for v in report.violations)
    with pytest.raises(AuditFormatError, match=":5:"):
        read_audit(path, strict=True)


def test_a_file_that_is_not_an_audit_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    record = AuditRecord(0, 1, "a", 0, "register", None, "allocated", True, None, None, 0, {})
    for text in ["hello\n", "", '["not", "an", "object"]\n', '{"kvlife_audit": 2}\n',
                 encode_record(record) + "\n", '{"a": 1}\n']:  # fmt: skip
        path.write_text(text)
        with pytest.raises(AuditFormatError):
            read_audit(path)
    with pytest.raises(AuditFormatError):
        read_audit("/dev/null")


def test_lines_that_are_not_records_after_the_header_are_problems(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    records = _write_log(path, 3)
    with path.open("a") as f:
        f.write('["not", "an", "object"]\n{"kvlife_audit": 2}\n')
    log = read_audit(path)
    after = len(records) + 2  # the header, the records, the closing record
    assert [p.line for p in log.problems] == [after + 1, after + 2] and log.problem_count == 2
    assert log.records == records
    assert "unsupported audit schema version 2" in log.problems[1].message


@pytest.mark.parametrize(
    "change",
    [
        {"seq": -1},
        {"ok": "yes"},
        {"trigger": "explode"},
        {"src": "limbo"},
        {"reason": "because"},
        {"ok": False},  # ok false needs a reason and no dst
        {"extra": 1},
        {"detail": []},
        {"serial": True},
    ],
)
def test_schema_violations_are_typed(change: dict[str, object]) -> None:
    good = json.loads(
        encode_record(
            AuditRecord(0, 1, "a", 0, "ack", "offloading", "allocated", True, None, 0, 0, {})
        )
    )
    with pytest.raises(AuditSchemaError):
        record_from_dict({**good, **change})


# --- the checker -------------------------------------------------------------------------


def _clean_records() -> list[AuditRecord]:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    old, new = Req("a"), Req("a")
    t_old = registry.start_offload(registry.register(old))
    registry.finish(old)
    t_new = registry.start_offload(registry.register(new))
    registry.complete(t_old)
    registry.deliver(t_old)
    registry.complete(t_new)
    registry.abort(new)
    return sink.records()


def _renumber(records: list[AuditRecord]) -> list[AuditRecord]:
    return [r.replace(seq=i) for i, r in enumerate(records)]


def test_checker_passes_a_clean_log_and_replays_final_states() -> None:
    report = check_audit(_clean_records(), expect_released=True, keep_instances=True)
    assert report.ok, report.violations
    assert {s.serial: s.state for s in report.instances.values()} == {0: "released", 1: "released"}
    assert report.refusals == {"stale_instance": 1}
    assert report.live == []


def test_checker_flags_a_planted_illegal_transition() -> None:
    records = _clean_records()
    # finish straight from offloading to released skips finished_pending
    i = next(i for i, r in enumerate(records) if r.trigger == "finish")
    records[i] = records[i].replace(dst="released")
    kinds = {v.kind for v in check_audit(records).violations}
    assert "illegal_transition" in kinds


def test_checker_flags_a_seq_gap() -> None:
    records = _clean_records()
    del records[3]
    violations = check_audit(records).violations
    assert [v.kind for v in violations if v.kind == "seq_gap"] == ["seq_gap"]


def test_checker_flags_an_ack_applied_to_the_wrong_instance() -> None:
    records = _clean_records()
    # the old copy's ack (serial 0) rewritten as if it completed the new instance (serial 1)
    i = next(i for i, r in enumerate(records) if r.trigger == "ack" and r.serial == 0 and r.ok)
    j = next(i for i, r in enumerate(records) if r.trigger == "ack" and r.serial == 1 and r.ok)
    records[i] = records[i].replace(serial=1, src="offloading", dst="allocated")
    del records[j]
    kinds = {v.kind for v in check_audit(_renumber(records)).violations}
    assert "wrong_instance" in kinds


def test_checker_lists_live_lifecycles_and_flags_leaks_on_request() -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    registry.start_offload(registry.register(Req("stuck")))
    report = check_audit(sink.records())
    assert report.ok and [i.rid for i in report.live] == ["stuck"]
    leaked = check_audit(sink.records(), expect_released=True)
    assert [v.kind for v in leaked.violations] == ["leaked"]


def test_checker_flags_a_refusal_that_reports_a_changed_state() -> None:
    records = _clean_records()
    i = next(i for i, r in enumerate(records) if not r.ok)
    records[i] = records[i].replace(src="offloading")
    assert "state_mismatch" in {v.kind for v in check_audit(records).violations}


def test_a_disabled_logging_sink_gets_no_record_built(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kvlife.test.quiet")
    logger.setLevel(logging.WARNING)
    registry = LifecycleRegistry(sinks=[LoggingSink(logger)])
    req = Req("a")
    registry.start_offload(registry.register(req))
    assert registry.statistics().records == 0 and not registry.audited  # nothing is built
    with caplog.at_level(logging.INFO, logger="kvlife.test.quiet"):
        registry.finish(req)  # enabling takes effect at the next registration ...
        assert logged_by("kvlife.test.quiet", caplog) == []
        registry.register(Req("b"))  # ... this one
        assert registry.audited
    (record,) = logged_by("kvlife.test.quiet", caplog)
    assert json.loads(record)["rid"] == "b"
    assert json.loads(record)["seq"] == 0  # nothing was skipped


# --- the package's boundaries ------------------------------------------------------------

CORE = ("table", "registry", "errors")
OLD_PATHS = ("records", "sinks", "sink_guard", "reader", "checker", "explain", "metrics")


def test_the_core_takes_only_the_record_type_and_the_guard_from_the_audit_package() -> None:
    root = Path(kvlife.fsm.__file__).parent
    for name in CORE:
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module is not None
        }
        audit = {m for m in imported if m.startswith("kvlife.fsm.audit")}
        assert audit <= {"kvlife.fsm.audit.records", "kvlife.fsm.audit.guard"}, (name, audit)


AFTER_THE_FACT = {
    "kvlife.fsm.audit.checker",
    "kvlife.fsm.audit.reader",
    "kvlife.fsm.audit.explain",
    "kvlife.fsm.audit.metrics",
}


def _loaded_by(statement: str) -> set[str]:
    """The kvlife modules a fresh interpreter holds after ``statement``."""
    code = f"import sys; {statement}; print(sorted(m for m in sys.modules if 'kvlife' in m))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return set(ast.literal_eval(out))


@pytest.mark.parametrize("module", ["kvlife.fsm.registry", "kvlife.fsm", "kvlife.fsm.audit"])
def test_importing_the_core_loads_no_reader_checker_explain_or_metrics(module: str) -> None:
    loaded = _loaded_by(f"import {module}")
    assert not loaded & AFTER_THE_FACT, sorted(loaded & AFTER_THE_FACT)
    assert "kvlife.fsm.audit.checker" in _loaded_by(
        f"from {module.split('.registry', maxsplit=1)[0]} import check_audit"
    )  # on first use


def test_the_lazy_names_are_the_modules_own_objects() -> None:
    from kvlife.fsm.audit import checker, reader  # noqa: PLC0415

    assert kvlife.fsm.AuditChecker is checker.AuditChecker
    assert kvlife.fsm.read_audit is reader.read_audit
    assert kvlife.fsm.audit.Violation is checker.Violation
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        kvlife.fsm.audit.Nope  # noqa: B018


def _imports(root: Path) -> dict[str, set[str]]:
    """Per module file under ``root``, the kvlife modules it imports (anywhere in it)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[str(path.relative_to(root.parent))] = {m for m in found if m.startswith("kvlife")}
    return graph


def test_the_import_graph_is_the_one_the_architecture_page_draws() -> None:
    """``kvlife.fsm`` imports neither ``kvlife.offload`` nor ``kvlife.diagrams``;
    ``kvlife.offload`` imports nothing from ``kvlife.diagrams``."""
    root = Path(kvlife.fsm.__file__).resolve().parent.parent  # the installed kvlife
    edges: dict[str, set[str]] = {}
    for package in ("fsm", "offload", "diagrams"):
        for imported in _imports(root / package).values():
            edges.setdefault(package, set()).update(m.split(".")[1] for m in imported)
    print({package: sorted(used - {package}) for package, used in edges.items()})
    assert edges["fsm"] <= {"fsm"}
    assert edges["offload"] <= {"fsm", "offload"}
    assert edges["diagrams"] <= {"fsm", "offload", "diagrams"}


ENTRY_POINTS = {
    "engines/vllm/__init__.py",  # KVLifeAuditConnector under kv_connector_module_path
    "engines/vllm/testing.py",  # the exercise's pytest entry under its first path
    "engines/hicache.py",  # the HiCache lens under its first path
    "engines/sglang_plugin.py",  # SGLang's plugin turns the HiCache lens on
}
"""Where kvlife's own package names a watcher: the names users type, imported on demand."""


def test_the_two_products_share_only_what_both_need() -> None:
    """kvlife's own offload for the engines (``kvlife.offload.engines``) and the watchers
    of offload it did not write (``kvlife.offload.watch``) meet only in
    ``engines.vllm_common`` (config, each engine core's log, stats), which imports
    neither: no watcher imports kvlife's own connector (a change to it cannot break the
    audit of anyone else's), and kvlife's connector imports no watcher but where a user's
    configuration names one."""
    root = Path(kvlife.fsm.__file__).resolve().parent.parent / "offload"
    common = "kvlife.offload.engines.vllm_common"
    for path, imported in _imports(root / "watch").items():
        own = {m for m in imported if m.startswith("kvlife.offload.engines")}
        assert {m for m in own if not m.startswith(common)} == set(), path
    for path, imported in _imports(root / "engines").items():
        watchers = {m for m in imported if m.startswith("kvlife.offload.watch")}
        if path.startswith("engines/vllm_common/"):
            assert not watchers and not {
                m for m in imported if m.startswith("kvlife.offload.engines.vllm.")
            }, path
        elif path not in ENTRY_POINTS:
            assert not watchers, (path, watchers)


ROOM = 650
"""Lines a module may grow to before its docstring must say why it is one piece."""


def test_a_large_module_says_why_it_is_one_piece() -> None:
    """One idea a room: a module past about 600 lines is split, or its docstring says
    why it is one piece ("Why one module: ...")."""
    root = Path(kvlife.fsm.__file__).resolve().parent.parent
    unexplained = []
    for package in ("fsm", "offload", "diagrams"):
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            if text.count("\n") > ROOM:
                doc = ast.get_docstring(ast.parse(text)) or ""
                if "Why one module:" not in doc:
                    unexplained.append(f"{path.relative_to(root)} ({text.count(chr(10))} lines)")
    assert unexplained == []


@pytest.mark.parametrize("old", OLD_PATHS)
def test_the_audit_modules_have_one_path(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"kvlife.fsm.{old}")

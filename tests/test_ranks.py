"""``kvlife audit ranks``: one log per TP rank, compared (what the ranks copied and
completed, and in which order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlife.diagrams.cli import main
from kvlife.fsm import JsonLinesSink, LifecycleRegistry
from kvlife.fsm.audit.ranks import MAX_NAMED, compare_ranks
from tests.strategies import Req


def _rank(path: Path, acks: list[str], *, open_: tuple[str, ...] = (), kind: str = "store") -> str:
    """A rank's log: one lifecycle per rid in ``acks`` (then ``open_``), one copy each,
    completed in ``acks``' order; the copies of ``open_`` never complete."""
    sink = JsonLinesSink(str(path), witness="a cache (test)")
    registry = LifecycleRegistry(sinks=[sink])
    tickets = {}
    for rid in [*acks, *open_]:
        tickets[rid] = registry.start_offload(registry.register(Req(rid)), kind=kind)
    for rid in acks:
        registry.complete(tickets[rid])
    sink.close()
    return str(path)


def test_ranks_that_copied_the_same_in_the_same_order_agree(tmp_path: Path) -> None:
    logs = [_rank(tmp_path / f"r{i}.jsonl", ["a", "b", "c"]) for i in range(3)]
    result = compare_ranks(logs)
    assert result.agree and result.copies == (3, 3, 3)
    assert result.lines()[-1].startswith("the ranks agree")


def test_ranks_that_completed_different_copies_are_named_with_the_open_ones_first(
    tmp_path: Path,
) -> None:
    """Rank 0 completed a then left b open; rank 1 never started a and completed b: the
    same ack count, different copies (SGLang HiCache's all-reduced count)."""
    logs = [
        _rank(tmp_path / "r0.jsonl", ["a"], open_=("b",)),
        _rank(tmp_path / "r1.jsonl", ["b"]),
    ]
    result = compare_ranks(logs)
    assert not result.agree and result.disagreeing == 2
    assert [(o.kind, o.index, o.rids) for o in result.order] == [("store", 0, ("a", "b"))]
    first, second = result.disagreements
    assert first.rid == "b" and [c.open for c in first.counts] == [1, 0]
    assert second.rid == "a" and [(c.started, c.completed) for c in second.counts] == [
        (1, 1),
        (0, 0),
    ]
    text = "\n".join(result.lines())
    assert "store completions differ from number 1: rank 0 a; rank 1 b" in text
    assert "  b store: rank 0: 1 started, 0 completed, 1 open; rank 1: 1 started, 1 completed" in (
        text
    )
    assert text.endswith(
        "copies left open on some ranks only (their pages and locks held there): b"
    )


def test_the_same_copies_in_another_order_disagree(tmp_path: Path) -> None:
    result = compare_ranks(
        [_rank(tmp_path / "r0.jsonl", ["a", "b"]), _rank(tmp_path / "r1.jsonl", ["b", "a"])]
    )
    assert result.disagreeing == 0 and not result.agree
    assert result.order[0].rids == ("a", "b")


def test_a_rank_with_fewer_completions_differs_where_its_list_ends(tmp_path: Path) -> None:
    result = compare_ranks(
        [_rank(tmp_path / "r0.jsonl", ["a", "b"]), _rank(tmp_path / "r1.jsonl", ["a"])]
    )
    assert result.order[0].index == 1 and result.order[0].rids == ("b", None)
    assert "rank 1 nothing" in "\n".join(result.lines())


def test_kinds_are_compared_apart(tmp_path: Path) -> None:
    result = compare_ranks(
        [
            _rank(tmp_path / "r0.jsonl", ["a"], kind="load"),
            _rank(tmp_path / "r1.jsonl", ["a"], kind="store"),
        ]
    )
    assert {(d.rid, d.kind) for d in result.disagreements} == {("a", "load"), ("a", "store")}


def test_many_disagreements_are_counted_whole_and_named_in_part(tmp_path: Path) -> None:
    many = [f"r{i}" for i in range(MAX_NAMED + 5)]
    result = compare_ranks([_rank(tmp_path / "r0.jsonl", many), _rank(tmp_path / "r1.jsonl", [])])
    assert result.disagreeing == MAX_NAMED + 5 and len(result.disagreements) == MAX_NAMED
    assert f"(the first {MAX_NAMED} below)" in "\n".join(result.lines())


def test_one_log_is_not_a_comparison(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two logs or more"):
        compare_ranks([_rank(tmp_path / "r0.jsonl", ["a"])])


def test_the_command_exits_1_when_ranks_disagree_and_0_when_they_agree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    same = [_rank(tmp_path / f"s{i}.jsonl", ["a"]) for i in range(2)]
    assert main(["audit", "ranks", *same]) == 0
    assert "the ranks agree" in capsys.readouterr().out
    apart = [_rank(tmp_path / "d0.jsonl", ["a"], open_=("b",)), _rank(tmp_path / "d1.jsonl", ["b"])]
    assert main(["audit", "ranks", *apart, "--json"]) == 1
    said = json.loads(capsys.readouterr().out)
    assert said["agree"] is False and said["disagreeing"] == 2
    assert said["disagreements"][0] == {
        "rid": "b",
        "kind": "store",
        "started": [1, 1],
        "completed": [0, 1],
    }
    assert said["order"] == [{"kind": "store", "index": 0, "rids": ["a", "b"]}]


def test_the_command_refuses_one_log_and_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _rank(tmp_path / "r0.jsonl", ["a"])
    assert main(["audit", "ranks", log]) == 2
    assert "two or more" in capsys.readouterr().err
    assert main(["audit", "ranks", log, str(tmp_path / "nope.jsonl")]) == 2
    assert "no such audit log" in capsys.readouterr().err


def test_a_file_that_is_not_a_log_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "junk.jsonl"
    junk.write_text("hello\n")
    assert main(["audit", "ranks", _rank(tmp_path / "r0.jsonl", ["a"]), str(junk)]) == 2
    assert "junk.jsonl" in capsys.readouterr().err

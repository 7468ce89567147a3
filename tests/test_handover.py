"""Prefill/decode hand-overs joined across two servers' logs (``kvlife.fsm.audit.handover``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvlife.diagrams.cli import main
from kvlife.fsm import JsonLinesSink, LifecycleRegistry
from kvlife.fsm.audit import AuditReader, check_audit
from kvlife.fsm.audit.handover import block_digest, clock
from tests.strategies import Req

ENGINE = "prefill-engine-1"
BLOCKS = [3, 4, 5]


def _identity(side: str, rid: str, blocks: list[int] = BLOCKS) -> dict[str, str | int]:
    """A transfer identity as the wrapper writes it: ``handoff_*`` on the prefill side,
    ``peer_*`` on the decode side."""
    return {
        f"{side}_engine": ENGINE,
        f"{side}_rid": rid,
        f"{side}_blocks": len(blocks),
        f"{side}_digest": block_digest(blocks),
    }


def _handoff(rid: str) -> dict[str, str | int]:
    return _identity("handoff", rid)


def _peer(rid: str, blocks: list[int] = BLOCKS) -> dict[str, str | int]:
    return _identity("peer", rid, blocks)


def _pd_logs(
    tmp_path: Path, *, freed_early: bool = False, decode_blocks: list[int] = BLOCKS
) -> Path:
    """Two servers' logs in one directory, written as the audit wrapper writes them: the
    prefill side's request ``p-1`` finishes and delays its free; the decode side's
    ``d-1`` loads it and finishes; the prefill side's free is reported after the read
    (or, with ``freed_early``, before the decode side's load began: a lease expired)."""
    prefill = LifecycleRegistry(sinks=[JsonLinesSink(tmp_path / "prefill.jsonl", witness="Nixl")])
    decode = LifecycleRegistry(sinks=[JsonLinesSink(tmp_path / "decode.jsonl", witness="Nixl")])
    p_req, d_req, other = Req("p-1"), Req("d-1"), Req("p-2")
    prefill.register(p_req)
    prefill.register(other)
    prefill.finish(other)  # no hand-over: a request the prefill server decoded itself
    free = prefill.start_offload(p_req, kind="delayed_free", **_handoff("p-1"))
    prefill.finish(p_req, **_handoff("p-1"))
    time.sleep(0.02)
    if freed_early:
        prefill.complete(free, report="finished_sending")
        time.sleep(0.02)
    decode.register(d_req)
    load = decode.start_offload(d_req, kind="load", tokens=48, **_peer("p-1", decode_blocks))
    time.sleep(0.01)
    decode.complete(load, report="finished_recving")
    if not freed_early:
        prefill.complete(free, report="finished_sending")
    decode.finish(d_req, **_peer("p-1", decode_blocks))
    for registry in (prefill, decode):
        for sink in registry.sinks:
            sink.close()
    return tmp_path


def test_a_clean_hand_over_is_joined_and_checks_clean(tmp_path: Path) -> None:
    logs = _pd_logs(tmp_path)
    report = check_audit(AuditReader([logs / "decode.jsonl", logs / "prefill.jsonl"]))
    assert report.ok, report.violations
    (handover,) = report.handovers
    assert handover.rid == "p-1" and handover.engine == ENGINE
    assert handover.prefill is not None and handover.prefill.rid == "p-1"
    assert handover.prefill.closed_by == "finished_sending" and handover.prefill.blocks == 3
    (decode,) = handover.decode
    assert decode.rid == "d-1" and decode.closed_by == "finished_recving"
    assert decode.opened is not None and handover.prefill.ended is not None
    assert decode.opened >= handover.prefill.ended
    held = handover.held_s
    assert held is not None and 0.02 <= held < 5
    assert not handover.verdicts


@pytest.mark.parametrize("rid", ["p-1", "d-1"])
def test_why_tells_both_sides_from_either_rid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rid: str
) -> None:
    logs = _pd_logs(tmp_path)
    assert main(["audit", "why", "--rid", rid, str(logs)]) == 0
    out = capsys.readouterr().out
    assert "the other side of the hand-over:" in out
    assert "rid 'p-1' lifecycle #0" in out and "rid 'd-1' lifecycle #0" in out
    assert f"hand-over of 'p-1' from prefill engine {ENGINE!r}" in out
    assert "prefill prefill.jsonl #0 rid 'p-1': finish at t0, 3 block(s) handed over" in out
    assert "delayed free (copy 0) ended +0.0" in out and "by finished_sending" in out
    assert "decode decode.jsonl #0 rid 'd-1':" in out
    assert "load (copy 0) began +0.0" in out and "(finished_recving)" in out
    assert "verdict on the whole log (kvlife audit check): OK" in out


def test_why_on_one_log_says_the_other_side_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = _pd_logs(tmp_path)
    assert main(["audit", "why", "--rid", "p-1", str(logs / "prefill.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "decode: no lifecycle read it in the logs given" in out
    assert "the other side of the hand-over" not in out


def test_blocks_freed_before_the_decode_side_read_them_are_a_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = _pd_logs(tmp_path, freed_early=True)
    # each log alone is clean: only the two together show it
    for name in ("prefill.jsonl", "decode.jsonl"):
        assert check_audit(AuditReader(logs / name)).ok
    assert main(["audit", "check", str(logs)]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION freed_before_read seq=1 rid='d-1' serial=0" in out
    assert "freed the blocks of 'p-1' (finished_sending)" in out
    assert main(["audit", "why", "--rid", "p-1", str(logs), "-o", str(tmp_path / "s.svg")]) == 1
    out = capsys.readouterr().out
    assert "!! VIOLATION freed_before_read (decode #0 rid 'd-1')" in out
    assert "!! VIOLATION freed_before_read:" in out  # marked on the load's record too
    svg = (tmp_path / "s.svg").read_text()
    assert 'id="handover-0"' in svg and 'id="violation-0"' in svg
    assert "handed over (prefill -&gt; decode)" in svg
    assert "handed over with &#x27;d-1&#x27;" in svg or "handed over with 'd-1'" in svg


def test_a_decode_side_that_reads_other_blocks_is_a_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = _pd_logs(tmp_path, decode_blocks=[3, 4, 6])
    assert main(["audit", "check", str(logs)]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION handover_mismatch" in out
    assert f"this load names blocks {block_digest([3, 4, 6])} (3) of 'p-1'" in out


def test_the_story_draws_both_lanes_and_the_hand_over(tmp_path: Path) -> None:
    logs = _pd_logs(tmp_path)
    out = tmp_path / "story.svg"
    assert main(["audit", "why", "--rid", "d-1", str(logs), "-o", str(out)]) == 0
    svg = out.read_text()
    assert 'id="handover-0"' in svg and 'id="handover-label-0"' in svg
    assert "delayed free 0 (finished_sending)" in svg and "load 0 (finished_recving)" in svg
    assert "&#x27;p-1&#x27;" in svg or "'p-1'" in svg  # the other side's lane names its rid


def test_digests_and_clock() -> None:
    assert block_digest([1, 2]) == block_digest((1, 2)) != block_digest([2, 1])
    assert len(block_digest([])) == 8
    assert clock(None) == "?" and clock(0.25) == "00:00:00.250"


def test_the_report_lists_the_hand_overs_with_their_verdicts(tmp_path: Path) -> None:
    logs = _pd_logs(tmp_path, freed_early=True)
    page = tmp_path / "report.html"
    assert main(["audit", "report", str(logs), "-o", str(page)]) == 1
    text = page.read_text()
    assert "<h2>Prefill/decode hand-overs</h2>" in text
    row = text.split("<table id='handovers'>")[1].split("</table>")[0]
    assert "<tr class='violation'><td class='text'>p-1</td>" in row
    assert "prefill.jsonl #0" in row and "decode.jsonl #0 &#x27;d-1&#x27;" in row
    assert "freed_before_read: the prefill side (prefill.jsonl #0) freed" in row
    (tmp_path / "clean").mkdir()
    clean = _pd_logs(tmp_path / "clean")
    assert main(["audit", "report", str(clean), "-o", str(tmp_path / "clean.html")]) == 0
    solo = tmp_path / "solo.html"
    assert main(["audit", "report", str(clean / "decode.jsonl"), "-o", str(solo)]) == 0
    assert "id='handovers'" in solo.read_text()  # the decode side alone: its prefill side absent

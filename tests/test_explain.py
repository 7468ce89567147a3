"""``kvlife audit why``: a lifecycle's history told in words."""

from __future__ import annotations

import pytest

from kvlife.fsm import AuditRecord, LifecycleRegistry, MemorySink, StaleInstanceError
from kvlife.fsm.audit.explain import MAX_STORIES, explain, find_rid
from tests.strategies import Req


def _rid_reuse() -> list[AuditRecord]:
    """#0 finishes with copy 0 in flight, #1 reuses the rid, copy 0 lands late, then is
    delivered again; a call for an unregistered object of the same rid finds nothing."""
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    old, new = Req("req-7"), Req("req-7")
    ticket = registry.start_offload(registry.register(old), tokens=16)
    registry.finish(old)
    registry.register(new)
    registry.complete(ticket)
    with pytest.raises(StaleInstanceError):
        registry.complete(ticket)
    registry.deliver(registry.start_offload(new))
    registry.abort(new)
    registry.register(Req("other"))
    with pytest.raises(LookupError):
        registry.finish(Req("req-7"))
    return sink.records()


def test_a_late_completion_is_named_as_the_old_lifecycles_copy() -> None:
    text = explain(_rid_reuse(), "req-7")
    assert text.startswith("rid 'req-7': 2 lifecycle(s) in the log, 1 call(s) that found none")
    old, new = text.split("\n\nrid 'req-7' lifecycle #1")[0], text.split("lifecycle #1")[1]
    assert "start_offload copy 0: allocated -> offloading, 1 in flight [tokens=16]" in old
    assert (
        "finish: offloading -> finished_pending, 1 in flight  (host copies kept; released "
        "when its 1 copy in flight ends)"
    ) in old
    assert (
        "ack copy 0: finished_pending -> released  (its last copy ended: released)  <- late: "
        "the rid was reused by "
        "#1 while copy 0 was in flight; its ticket named #0, so it completed #0 only"
    ) in old
    assert "REFUSED ack copy 0: stale_instance: a delivery of copy 0, which belonged to" in old
    assert "registered while #0 still held the rid (finished_pending, 1 in flight)" in new
    assert (
        "abort: allocated -> released  (host copies discarded; no copy in flight: released at once)"
    ) in new
    assert "REFUSED finish: the request object was not registered" in text
    assert "'other'" not in text


def test_one_serial_with_its_rid_as_context() -> None:
    records = _rid_reuse()
    assert find_rid(records, 1) == "req-7" and find_rid(records, 9) is None
    text = explain(records, "req-7", serial=1)
    assert text.startswith("\nrid 'req-7' lifecycle #1") and "lifecycle #0" not in text
    assert "registered while #0 still held the rid" in text


def test_unknown_rid_or_serial_is_a_lookup_error() -> None:
    with pytest.raises(LookupError, match="no record of rid 'nope'"):
        explain(_rid_reuse(), "nope")
    with pytest.raises(LookupError, match="no record of lifecycle #5 of rid 'req-7'"):
        explain(_rid_reuse(), "req-7", serial=5)


def test_a_hot_rid_is_told_in_part() -> None:
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    for _ in range(MAX_STORIES + 5):
        registry.finish(registry.register(Req("hot")))
    text = explain(sink.records(), "hot")
    assert text.count("lifecycle #") == MAX_STORIES and "... 5 more lifecycles" in text
    assert "not released" not in text


def test_a_verdict_on_a_watched_connector_is_told_in_its_lifecycles_story() -> None:
    from kvlife.fsm import Trigger  # noqa: PLC0415
    from kvlife.fsm.audit import AuditChecker  # noqa: PLC0415

    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    req = Req("b")
    registry.register(req)
    registry.finish(req)
    released = registry.live("b")
    assert released is None
    registry.record_violation(
        "stray_report", Trigger.ACK, "again", rid="b", report="finished_sending", why="repeated"
    )
    story = explain(sink.records(), "b", checker=AuditChecker())
    assert "reported a completion that no open ticket explains" in story
    assert "report=finished_sending why=repeated" in story
    assert "VIOLATION stray_report" in story or "FAILED" in story, story


def test_copies_are_named_in_the_writers_words_as_the_story_picture_names_them() -> None:
    """A ticket's ``kind`` names the copy on every line about it (start, completion,
    refusal), what ended it is said in words, and a finish says what finished it;
    a copy whose start said no kind stays ``copy N``."""
    sink = MemorySink()
    registry = LifecycleRegistry(sinks=[sink])
    req = Req("chat-7")
    registry.register(req)
    free = registry.start_offload(req, kind="delayed_free", blocks=3)
    plain = registry.start_offload(req)
    registry.complete(plain)
    registry.finish(req, by="host_eviction")
    registry.complete(free, cut_by="finished_recving")
    with pytest.raises(StaleInstanceError):
        registry.complete(free)
    text = explain(sink.records(), "chat-7")
    assert "start_offload delayed free 0: allocated -> offloading, 1 in flight [blocks=3]" in text
    assert "ack copy 1: offloading -> offloading, 1 in flight" in text
    assert "finish (host eviction): offloading -> finished_pending, 1 in flight  (host" in text
    assert (
        "ack delayed free 0 (cut by finished_recving): finished_pending -> released  (its "
        "last copy ended: released)"
    ) in text
    assert "REFUSED ack delayed free 0: stale_instance: a delivery of" in text
    assert "kind=" not in text and "cut_by=" not in text and "by=" not in text

"""``kvlife audit report``: the self-contained HTML page, checked as data and, when
Chromium is here (``make test`` installs Debian's as root), in a headless browser."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvlife.diagrams.cli import main
from kvlife.diagrams.report import build_report, gather
from kvlife.fsm import AuditRecord, JsonLinesSink, LifecycleRegistry, MemorySink, read_audit
from tests.strategies import Req
from tests.violations import clean_log, edited_log, reuse_log

HOSTILE = '</script><img src=x onerror="window.pwned=1">&amp;'


def _history(sink: object, *, end_new: bool = True) -> None:
    """req-1 reused with a copy in flight and a stale delivery; the new req-1 has a failed
    copy and is aborted (unless ``end_new`` is false: then it stays live); req-2 to
    req-11 and a hostile rid stay live."""
    registry = LifecycleRegistry(sinks=[sink])
    old, new = Req("req-1"), Req("req-1")
    ticket = registry.start_offload(registry.register(old), tokens=16)
    registry.finish(old)
    registry.register(new)
    registry.complete(ticket)
    registry.deliver(ticket)  # stale: refused on #0
    if end_new:
        registry.complete(registry.start_offload(new), ok=False)
        registry.abort(new)
    for i in range(2, 12):
        registry.register(Req(f"req-{i}"))
    registry.register(Req(HOSTILE))


def _records() -> list[AuditRecord]:
    sink = MemorySink()
    _history(sink)
    return sink.records()


def test_gather_tells_each_lifecycle() -> None:
    data = gather(_records())
    by_serial = {e.serial: e for e in data.lifecycles}
    assert data.total == len(data.lifecycles) == 13 and data.records == len(_records())
    old, new = by_serial[0], by_serial[1]
    assert (old.rid, old.outcome, old.copies, old.acks) == ("req-1", "finished", 1, 1)
    assert old.refusals == 1
    assert old.end is not None and old.state == ""
    assert old.time["finished_pending"] > 0 and old.time["offloading"] > 0
    assert (new.outcome, new.copies, new.fails, new.end is not None) == ("aborted", 1, 1, True)
    assert [h[1] for h in old.history] == ["register", "start_offload", "finish", "ack", "ack"]
    assert old.history[-1][4] is False and old.history[-1][5] == "stale_instance"
    live = by_serial[12]
    assert (live.rid, live.outcome, live.end) == (HOSTILE, "live", None)


def test_gather_caps_the_table_and_counts_the_rest() -> None:
    data = gather(_records(), max_lifecycles=5)
    assert len(data.lifecycles) == 5 and data.total == 13


def test_the_data_cannot_close_its_script_element() -> None:
    text = gather(_records()).to_json()
    assert "<" not in text and ">" not in text and "&" not in text
    assert HOSTILE in {row["rid"] for row in json.loads(text)["lifecycles"]}


def _page(tmp_path: Path) -> Path:
    log = tmp_path / "audit.jsonl"
    with JsonLinesSink(log, fsync="never") as sink:
        _history(sink, end_new=False)
    out = tmp_path / "report.html"
    assert main(["audit", "report", str(log), "-o", str(out)]) == 0
    return out


def test_the_page_is_self_contained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = _page(tmp_path).read_text(encoding="utf-8")
    assert "13 of 13 lifecycles listed" in capsys.readouterr().out
    assert "<svg" in page and page.count("<script") == 2  # the data and the code, inline
    assert not re.search(r"<(script|img|link|iframe)[^>]*\s(src|href)=", page)
    assert not re.search(r"url\(\s*['\"]?https?:", page)
    assert HOSTILE not in page  # only as escaped JSON


def test_report_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "report", str(tmp_path / "none.jsonl"), "-o", "x.html"]) == 2
    assert capsys.readouterr().err == f"kvlife: no such audit log: {tmp_path / 'none.jsonl'}\n"
    log = tmp_path / "a.jsonl"
    with JsonLinesSink(log, fsync="never"):
        pass
    assert main(["audit", "report", str(log), "-o", "/nonexistent/r.html"]) == 2
    assert "cannot write /nonexistent/r.html" in capsys.readouterr().err


def test_build_report_reads_each_pass_afresh() -> None:
    calls = []

    def events() -> list[AuditRecord]:
        calls.append(1)
        return _records()

    page, data = build_report(events, title="t")
    assert len(calls) == 3 and data.total == 13 and page.startswith("<!DOCTYPE html>")


def test_the_page_works_in_a_browser(browser: Any, tmp_path: Path) -> None:
    path = _page(tmp_path)
    page = browser.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    assert errors == [] and requests == [path.as_uri()]  # nothing fetched, nothing failed
    assert page.evaluate("window.pwned") is None  # the hostile rid ran nothing
    rows = page.locator("#lifecycles tbody tr")
    assert rows.count() == 13
    assert page.locator("#lifecycles tbody td", has_text=HOSTILE).count() == 1  # as text

    page.fill("#rid-filter", "req-1")  # req-1, req-10, req-11
    assert page.locator("#count").text_content() == "showing 4 of 13 lifecycles"
    assert {rows.nth(i).locator("td").first.text_content() for i in range(4)} == {
        "req-1",
        "req-10",
        "req-11",
    }
    page.select_option("#outcome-filter", "finished")
    assert rows.count() == 1
    page.select_option("#outcome-filter", "")
    page.check("#refused-filter")
    assert rows.count() == 1 and rows.first.locator("td").nth(1).text_content() == "0"
    page.uncheck("#refused-filter")
    page.fill("#rid-filter", "")

    def rids() -> list[str]:
        return [rows.nth(i).locator("td").first.text_content() for i in range(rows.count())]

    page.click("th[data-key=rid]")  # natural order: req-2 before req-10
    ascending = rids()
    ordered = ["req-1", "req-1", *(f"req-{i}" for i in range(2, 12))]
    assert [rid for rid in ascending if rid.startswith("req-")] == ordered
    page.click("th[data-key=rid]")  # and back
    assert rids() != ascending and next(r for r in rids() if r.startswith("req-")) == "req-11"

    page.fill("#rid-filter", "req-1")
    rows.filter(has_text="finished").first.click()
    history = page.locator("#history")
    assert history.locator("h2").text_content().startswith("History of req-1 #0: finished")
    steps = history.locator("tr")
    assert steps.count() == 1 + 5  # a header and five records
    assert "stale_instance" in steps.nth(5).text_content()
    assert errors == []
    page.close()


def test_the_reuse_column_lists_exactly_the_lifecycles_that_reused_a_held_rid(
    tmp_path: Path,
) -> None:
    log, reused = reuse_log(tmp_path / "reuse.jsonl")
    data = gather(read_audit(log).events())
    assert {e.serial for e in data.lifecycles if e.reused} == reused
    assert data.report.reused_while_unreleased == len(reused) and data.verdict.ok
    first = next(e for e in data.lifecycles if e.serial == 1)
    assert first.reused == "#0" and first.held == [0]  # the story's reuse line: #0 to #1
    notes = [h[9] for h in first.history if h[9]]
    assert notes[0] == (
        "registered while #0 still held the rid: the rid was reused; #0's copies stay theirs"
    )
    old = next(e for e in data.lifecycles if e.serial == 0)
    assert old.late == [[0, 1]]  # the story's arrow: copy 0, seen from #1, completed #0
    late = [h[9] for h in old.history if h[1] == "ack"]
    assert late == [
        "late: the rid was reused by #1 while copy 0 was in flight; its ticket named #0, so it "
        "completed #0 only"
    ]  # the sentence `kvlife audit why` prints for it


def test_the_page_opens_with_the_verdict_and_its_violations(browser: Any, tmp_path: Path) -> None:
    log = edited_log(clean_log(tmp_path / "clean.jsonl"), "wrong_instance", tmp_path / "e.jsonl")
    out = tmp_path / "page.html"
    assert main(["audit", "report", str(log), "-o", str(out)]) == 1
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(out.as_uri())
    verdict = page.locator("#verdict")
    assert verdict.is_visible()
    assert verdict.text_content() == "Verdict (kvlife audit check): FAILED: 2 violations"
    table = page.locator("#violation-table tr")
    assert table.count() == 1 + 2  # a header and the two violations of the edited ack
    kinds = {table.nth(i).locator("td").nth(3).text_content() for i in (1, 2)}
    assert kinds == {"inflight_mismatch", "wrong_instance"}
    assert table.nth(1).locator("td").first.text_content() == "r"  # the rid is named
    table.nth(2).click()
    history = page.locator("#history")
    assert history.locator("h2").text_content().startswith("History of r #1")
    marked = history.locator("tr.violation")
    assert marked.count() == 1 and "VIOLATION wrong_instance" in marked.text_content()
    page.check("#reused-filter")
    assert page.locator("#count").text_content() == "showing 1 of 2 lifecycles"
    page.uncheck("#reused-filter")
    page.check("#violation-filter")
    assert page.locator("#lifecycles tbody tr").count() == 1
    assert errors == []
    page.close()


def _open(browser: Any, path: Path, errors: list[str], address: str = "") -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri() + address)
    return page


def test_the_table_comes_before_the_pictures_and_every_column_is_explained(
    browser: Any, tmp_path: Path
) -> None:
    log, _ = reuse_log(tmp_path / "reuse.jsonl")
    out = tmp_path / "page.html"
    assert main(["audit", "report", str(log), "-o", str(out)]) == 0
    errors: list[str] = []
    page = _open(browser, out, errors)
    top = page.evaluate(
        "[...document.querySelectorAll('#verdict, #lifecycles, .pictures svg')]"
        ".map(e => e.getBoundingClientRect().top)"
    )
    verdict, table, *pictures = top
    assert verdict < table < min(pictures) and table < 400, top  # on the first screen
    headers = page.locator("#lifecycles th")
    explained = page.locator("#columns dt")
    assert explained.count() == headers.count() == 13
    for i in range(headers.count()):
        assert headers.nth(i).get_attribute("title"), headers.nth(i).text_content()
    assert "segment" in explained.all_text_contents()
    assert errors == []
    page.close()


def test_every_serial_is_a_link_to_its_lifecycle_with_its_story(
    browser: Any, tmp_path: Path
) -> None:
    """reuse_log: req-0's #1 took the rid while #0's copy was in flight, so the reuse
    column of #1 names #0, and #0's history tells of the late completion."""
    log, _ = reuse_log(tmp_path / "reuse.jsonl")
    out = tmp_path / "page.html"
    assert main(["audit", "report", str(log), "-o", str(out)]) == 0
    errors: list[str] = []
    page = _open(browser, out, errors)
    page.fill("#rid-filter", "req-0")
    row = page.locator("#lifecycles tbody tr", has=page.locator("td a", has_text="1")).first
    held_by = row.locator("td").last.locator("a")
    assert held_by.text_content() == "#0" and held_by.get_attribute("href") == "#lc-0-0"
    held_by.click()
    history = page.locator("#history h2")
    assert history.text_content().startswith("History of req-0 #0")
    assert page.evaluate("location.hash") == "#lc-0-0"
    why = page.locator("#history td.why a")
    assert {why.nth(i).text_content() for i in range(why.count())} >= {"#0", "#1"}
    # the story of the rid: its four lifecycles, the reuses and the late completions
    story = page.locator("#story svg")
    for serial in range(4):
        assert story.locator(f"g#lane-{serial}").count() == 1
    assert story.locator("g[id^=reuse-]").count() == 3
    late = story.locator("g#late-0 text")
    assert late.text_content() == "copy 0 completes #0 (its ticket), not #1"
    page.close()
    # an address names a lifecycle: the page opens on it
    page = _open(browser, out, errors, "#lc-0-2")
    assert page.locator("#history h2").text_content().startswith("History of req-0 #2")
    assert errors == []
    page.close()


def test_unreadable_lines_are_named_by_file_and_line(browser: Any, tmp_path: Path) -> None:
    log = clean_log(tmp_path / "clean.jsonl")
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join([*lines[:3], "not json\n", *lines[3:]]))
    out = tmp_path / "page.html"
    assert main(["audit", "report", str(log), "-o", str(out)]) == 1
    errors: list[str] = []
    page = _open(browser, out, errors)
    assert page.locator("#unreadable h2").text_content().startswith("Unreadable lines (1)")
    (item,) = page.locator("#unreadable li").all_text_contents()
    assert item.startswith("clean.jsonl:4: ")
    assert errors == []
    page.close()


def test_the_story_of_a_hot_rid_draws_the_lifecycles_around_the_selected_one(
    browser: Any, tmp_path: Path
) -> None:
    sink = JsonLinesSink(tmp_path / "hot.jsonl", fsync="never")
    registry = LifecycleRegistry(sinks=[sink])
    for _ in range(30):
        req = Req("hot")
        registry.complete(registry.start_offload(registry.register(req)))
        registry.finish(req)
    sink.close()
    out = tmp_path / "page.html"
    assert main(["audit", "report", str(tmp_path / "hot.jsonl"), "-o", str(out)]) == 0
    errors: list[str] = []
    page = _open(browser, out, errors, "#lc-0-25")
    story = page.locator("#story")
    assert story.locator("h2").text_content() == (
        "Story of rid hot: 20 lifecycles of its 30, around #25"
    )
    lanes = story.locator("svg g[id^=lane-]")
    assert lanes.count() == 20
    assert lanes.first.get_attribute("id") == "lane-10"  # 20 lanes that end at the last one
    assert errors == []
    page.close()

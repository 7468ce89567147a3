"""Take the report page's screenshot for the manual: ``make screenshots``.

Usage: ``python tests/screenshot.py REPORT.html OUT.png [RID]`` -- opens the page in
headless Chromium, filters the table to one rid (``req-7`` by default), selects its first
lifecycle and captures the table and the story of the rid under it. With ``--top`` for
``RID``: the page's first screen as it opens (the verdict and what it says first).
``python tests/screenshot.py --url URL OUT.png``: a served page (Prometheus's alerts
page, from the alerting test), every collapsed group opened.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import Page, sync_playwright


@contextmanager
def _page() -> Iterator[Page]:
    """A page of 1280x900 in headless Chromium (Debian's)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("screenshot.py: no Chromium (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900})
        finally:
            browser.close()


def main(report: Path, out: Path, rid: str = "req-7") -> None:
    with _page() as page:
        page.goto(report.resolve().as_uri())
        if rid == "--top":
            page.set_viewport_size({"width": 1280, "height": 560})
            page.screenshot(path=str(out))
            return
        page.fill("#rid-filter", rid)
        page.locator("#lifecycles tbody tr").first.click()
        page.evaluate("document.querySelector('#filters').scrollIntoView()")
        page.screenshot(path=str(out))


def served(url: str, out: Path) -> None:
    """A served page as it shows once loaded, its collapsed groups opened."""
    with _page() as page:
        page.goto(url)
        page.wait_for_load_state("networkidle")
        for toggle in page.locator(".alert-heading, .card-header, tr.alert-danger").all():
            toggle.click()
        page.wait_for_timeout(500)
        page.screenshot(path=str(out), full_page=True)


if __name__ == "__main__":
    if sys.argv[1] == "--url":
        served(sys.argv[2], Path(sys.argv[3]))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:4])

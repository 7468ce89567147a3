"""Programs the tests run that ``make test`` installs (Debian's Prometheus, promtool and
Alertmanager): a test that needs a missing one skips, saying how to install it, except
where ``make test`` was meant to install it (``KVLIFE_REQUIRE_TOOLS=1``, set by the
Makefile when it runs as root with apt-get): there a missing program fails the run at
collection, loudly, instead of a green run that tested less than it says."""

from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("KVLIFE_REQUIRE_TOOLS") == "1"


def needs(present: bool, what: str, how: str) -> pytest.MarkDecorator:
    """A skip marker for tests that need ``what`` (installed by ``how``); under
    ``KVLIFE_REQUIRE_TOOLS=1`` a missing program fails the collection instead.

    Raises:
        pytest.fail.Exception: ``what`` is missing where it is required.
    """
    if not present and REQUIRED:
        pytest.fail(
            f"{what} is missing, and `make test` was to install it ({how}): "
            "KVLIFE_REQUIRE_TOOLS=1 makes that an error, not a skip",
            pytrace=False,
        )
    return pytest.mark.skipif(not present, reason=f"{what} is missing ({how} installs it)")

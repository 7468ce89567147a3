"""The rid-reuse race on real code: SGLang 0.5.18's own decode offload manager keeps its
state by rid, and the race (an old request finishes with its last chunk in
flight, a new request reuses the rid) goes wrong on it; the same story passes on kvlife's
drop-in, built the way 0.5.18's scheduler builds its manager (with ``server_args``), in
the same run. Runs in ``.venv-sglang-0.5.18`` (``make test-sglang-0.5.18``); anywhere else
this module skips.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines import require_sglang

require_sglang("0.5.18", "test-sglang-0.5.18")

from tests.engines.sglang_harness import (
    Req,
    RequestsMixedUp,
    late_completion_scenario_on_kvlife,
    late_completion_scenario_on_sglang,
    make_pools,
)


@pytest.mark.xfail(strict=True, raises=RequestsMixedUp, reason="SGLang 0.5.18 keys state by rid")
def test_sglang_0_5_18s_own_manager_mixes_up_an_old_and_a_new_request(tmp_path: Path) -> None:
    # The new request finds the old one's offload state under the rid: its first chunk
    # counts as offloaded already and is never copied.
    late_completion_scenario_on_sglang(make_pools(), tmp_path, Req)


def test_the_drop_in_keeps_them_apart_on_sglang_0_5_18(tmp_path: Path) -> None:
    late_completion_scenario_on_kvlife(make_pools(), tmp_path, Req)

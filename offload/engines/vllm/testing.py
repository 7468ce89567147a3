"""The exercise's pytest entry under its first path (users' test suites import it from
here): [`kvlife.offload.watch.vllm.testing`][kvlife.offload.watch.vllm.testing] is where it
lives, with the other watchers."""

from __future__ import annotations

from kvlife.offload.watch.vllm.testing import ConnectorFailure, check_connector, exercise_cases

__all__ = ["ConnectorFailure", "check_connector", "exercise_cases"]

"""kvlife.diagrams: lifecycle diagrams rendered from the one table and from audit logs.

* [`lifecycle_dot()`][kvlife.diagrams.lifecycle.lifecycle_dot] /
  [`lifecycle_mermaid()`][kvlife.diagrams.lifecycle.lifecycle_mermaid]: the table through
  ``transitions``' GraphMachine (committed as ``lifecycle.dot``, ``.svg`` and ``.mmd``
  beside this module).
* [`log_graph()`][kvlife.diagrams.log_graph.log_graph]: the same diagram with each edge's count and
  the refusals of a log.
* [`plot_timeline()`][kvlife.diagrams.timeline.plot_timeline]: one row per lifecycle instance,
  coloured by state over time.
* [`plot_story()`][kvlife.diagrams.story.plot_story]: the story of one rid (what
  ``kvlife audit why`` tells), a lane per lifecycle with its copies, refusals, reuses and
  late completions.
"""

from __future__ import annotations

from kvlife.diagrams.dot import DotNotFoundError, dot_text, render
from kvlife.diagrams.lifecycle import (
    lifecycle_dot,
    lifecycle_graph,
    lifecycle_mermaid,
    write_lifecycle_diagrams,
)
from kvlife.diagrams.log_graph import log_graph
from kvlife.diagrams.story import Story, build_story, plot_story
from kvlife.diagrams.timeline import Timeline, build_timeline, plot_timeline, timeline_rows

__all__ = [
    "DotNotFoundError",
    "Story",
    "Timeline",
    "build_story",
    "build_timeline",
    "dot_text",
    "lifecycle_dot",
    "lifecycle_graph",
    "lifecycle_mermaid",
    "log_graph",
    "plot_story",
    "plot_timeline",
    "render",
    "timeline_rows",
    "write_lifecycle_diagrams",
]

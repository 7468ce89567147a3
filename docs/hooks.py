"""MkDocs hook: publish the committed diagrams from diagrams/ (one source, no copies)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

DIAGRAMS = Path(__file__).resolve().parent.parent / "diagrams"


def on_files(files: Files, config: Any) -> Files:
    for name in ("lifecycle.svg", "lifecycle.dot", "lifecycle.mmd"):
        files.append(
            File(
                name,
                src_dir=str(DIAGRAMS),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files

"""MkDocs hook: publish the committed diagrams from diagrams/ (one source, no copies), and
Mermaid from the bundle ``make mermaid`` fetched (the site loads nothing from a CDN)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
DIAGRAMS = ROOT / "diagrams"
MERMAID_JS = "assets/javascripts/mermaid.min.js"


def _mermaid_bundle() -> Path:
    bundles = sorted((ROOT / "build" / "docs").glob("mermaid-*.min.js"))
    if not bundles:
        raise FileNotFoundError(
            "Mermaid's bundle is missing from build/docs/: run 'make mermaid' (or 'make docs')"
        )
    return bundles[-1]


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
    files.append(File.generated(config, MERMAID_JS, abs_src_path=str(_mermaid_bundle())))
    return files

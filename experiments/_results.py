"""What the emulated-cluster drivers write: the versions a result was measured with, and the result
files ``results/<stem>.{json,md}`` (the markdown also printed).

Sibling module of the drivers (experiments/ is not a package): they put this folder on sys.path.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
from typing import Any

import torch

import zensync


def versions() -> dict[str, Any]:
    """torch, Python, CPU count and zensync, for a result's metadata."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "zensync": zensync.__version__,
    }


def write(results_dir: str, stem: str, meta: dict[str, Any], results: Any, markdown: str) -> None:
    """``<results_dir>/<stem>.json`` ({"meta", "results"}) and ``.md``; prints the markdown."""
    out_dir = pathlib.Path(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / stem
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    path.with_suffix(".md").write_text(markdown)
    print(markdown)

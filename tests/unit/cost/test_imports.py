"""zensync.cost stays below the transport, the planner and the hooks: importing it loads only its own
modules (no torch, so no torch.distributed), and ``zensync.cost.calibrate`` reaches the transport only
for type checking.

``zensync/__init__.py`` itself imports the whole library (hooks, transport), so each check runs in a fresh
interpreter with a bare ``zensync`` package object in place of the root ``__init__``: what gets loaded
is then what ``zensync.cost`` pulls in itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[3] / "zensync"
_BARE_PACKAGE = (
    "import json, sys, types; "
    "root = types.ModuleType('zensync'); root.__path__ = [{path!r}]; sys.modules['zensync'] = root; "
    "import {module}; "
    "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('zensync.', 'torch.')))))"
)


def _in_cost(module: str) -> bool:
    return module == "zensync.cost" or module.startswith("zensync.cost.")


def _loaded_by(module: str) -> list[str]:
    code = _BARE_PACKAGE.format(path=str(_PACKAGE_DIR), module=module)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_cost_loads_only_itself() -> None:
    loaded = _loaded_by("zensync.cost")
    assert "zensync.cost.sparse" in loaded and "zensync.cost.compressors" in loaded
    outside = [m for m in loaded if not _in_cost(m)]
    assert not outside, f"importing zensync.cost loads {outside}"
    assert "zensync.cost.calibrate" not in loaded, "calibrate runs collectives: callers import it explicitly"


def test_calibrate_reaches_the_transport_only_for_type_checking() -> None:
    loaded = _loaded_by("zensync.cost.calibrate")
    assert "torch" in loaded  # it times real allreduces
    zensync_modules = [m for m in loaded if m.startswith("zensync.")]
    assert all(_in_cost(m) for m in zensync_modules), zensync_modules

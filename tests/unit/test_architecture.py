"""Architecture rules from STYLE.md that import-linter cannot express, checked with ``ast``.

``lint-imports`` (contracts in pyproject.toml) checks the arrows between zensync's own packages, but it
sees an external package only at its top level (``torch``), so it cannot confine ``torch.distributed``
or ``torch.cuda``. This test walks zensync/**/*.py and checks:

1. only zensync/transport/ imports torch.distributed or mpi4py;
2. only zensync/kernels/ imports torch.cuda or cuda_ext;
3. only zensync/kernels/ and modules named ``_compiled_*`` (the compiled loop of the package that owns the
   algorithm, e.g. zensync/planner/_compiled_timeline.py) import numba;
4. nothing in zensync imports experiments/ (experiments import zensync, never the reverse);
5. zensync/cost/ imports zensync.transport only for type checking (under ``if TYPE_CHECKING:``): the cost
   model prices collectives, it never runs one (``calibrate`` times the transport it is handed). The
   layers contract allows the import, so lint-imports cannot tell the two apart.

"Imports" covers ``import a.b [as c]``, ``from a import b``, relative imports, ``importlib.import_module``
or ``__import__`` with a literal name, and attribute use such as ``torch.cuda.synchronize()`` after a
plain ``import torch``. It runs without any extra tool.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import tomllib

_REPO_ROOT = Path(__file__).resolve().parents[2]
_PACKAGE_DIR = _REPO_ROOT / "zensync"


@dataclasses.dataclass(frozen=True)
class _Rule:
    forbidden: tuple[str, ...]
    """Module names; a module matches one if it equals it or is inside it."""
    allowed_in: str | None
    """The one subpackage of zensync (a folder name) that may import them; None for nowhere."""
    fix: str
    allowed_prefix: str | None = None
    """Modules whose file name starts with this may import them too, in any subpackage."""
    only_in: str | None = None
    """The one subpackage of zensync the rule applies to; None for all of zensync."""
    type_checking_ok: bool = False
    """Imports under ``if TYPE_CHECKING:`` (annotations only, never executed) are allowed."""


_COMPILED_PREFIX = "_compiled_"
"""File-name prefix of a package's numba-compiled module (``zensync/planner/_compiled_timeline.py``)."""

_RULES = {
    "transport_only": _Rule(
        forbidden=("torch.distributed", "mpi4py"),
        allowed_in="transport",
        fix="Use the zensync.transport.Transport interface; only zensync/transport/ talks to the network.",
    ),
    "kernels_only": _Rule(
        forbidden=("torch.cuda", "cuda_ext"),
        allowed_in="kernels",
        fix="Call the kernel through zensync.kernels (dispatch.py picks reference/cpu/cuda by device).",
    ),
    "numba_kernels_or_compiled": _Rule(
        forbidden=("numba",),
        allowed_in="kernels",
        allowed_prefix=_COMPILED_PREFIX,
        fix=(
            "Put a tensor kernel in zensync/kernels/cpu*.py and call it through zensync.kernels; a compiled loop "
            "of another package's algorithm goes in that package's _compiled_<name>.py (and in pyproject.toml's "
            "numba contract)."
        ),
    ),
    "no_experiments": _Rule(
        forbidden=("experiments",),
        allowed_in=None,
        fix="experiments/ imports zensync, never the reverse: move the shared code into zensync.",
    ),
    "cost_never_runs_the_transport": _Rule(
        forbidden=("zensync.transport",),
        allowed_in=None,
        only_in="cost",
        type_checking_ok=True,
        fix=(
            "zensync.cost prices collectives and never runs one: take a Transport as an argument and import it "
            "under `if TYPE_CHECKING:` for its annotation (as zensync/cost/calibrate.py does)."
        ),
    ),
}


def _matches(module: str, forbidden: str) -> bool:
    if forbidden == "cuda_ext":  # the built extension may sit anywhere: zensync._cuda_ext, zensync_cuda_ext
        return any(part.lstrip("_").endswith("cuda_ext") for part in module.split("."))  # zensync_cuda_ext too
    return module == forbidden or module.startswith(forbidden + ".")


def _package_of(path: Path) -> list[str]:
    """Dotted package that relative imports in ``path`` resolve against, as parts."""
    parts = list(path.relative_to(_REPO_ROOT).with_suffix("").parts)
    return parts if path.name == "__init__.py" else parts[:-1]


def imported_modules(source: str, package: list[str]) -> list[tuple[int, str]]:
    """Every (line, dotted module name) that ``source`` imports or reaches as ``torch.<sub>``."""
    found: list[tuple[int, str]] = []
    torch_names: set[str] = set()  # local names bound to the torch module itself
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name))
                if alias.name == "torch" or (alias.asname is None and alias.name.startswith("torch.")):
                    torch_names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom):
            base_parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*base_parts, *([node.module] if node.module else [])])
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func_name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if func_name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in torch_names:
            found.append((node.lineno, f"torch.{node.attr}"))
    return found


def _type_checking_lines(source: str) -> set[int]:
    """Line numbers inside the body of ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _library_files() -> list[Path]:
    return sorted(_PACKAGE_DIR.rglob("*.py"))


def test_library_files_are_found() -> None:
    assert _library_files(), f"no Python files under {_PACKAGE_DIR}"


def test_detector_sees_every_import_form() -> None:
    source = "\n".join(
        [
            "import torch",
            "import torch.distributed as dist",
            "from torch import cuda",
            "from mpi4py import MPI",
            "import numba.cuda",
            "from .. import cuda_ext",
            "import importlib; importlib.import_module('experiments.bench')",
            "torch.cuda.synchronize()",
        ]
    )
    modules = {name for _, name in imported_modules(source, ["zensync", "sync"])}
    expected = {"torch.distributed", "torch.cuda", "mpi4py", "numba.cuda", "zensync.cuda_ext", "experiments.bench"}
    assert expected <= modules


def test_type_checking_blocks_are_told_apart() -> None:
    source = "\n".join(
        [
            "import typing",
            "from typing import TYPE_CHECKING",
            "if TYPE_CHECKING:",
            "    from zensync.transport import Transport",
            "if typing.TYPE_CHECKING:",
            "    import zensync.transport.base",
            "else:",
            "    import zensync.transport.simulated",
            "from ..transport import handle",
        ]
    )
    checked_only = _type_checking_lines(source)
    runtime = {name for line, name in imported_modules(source, ["zensync", "cost"]) if line not in checked_only}
    assert "zensync.transport.Transport" not in runtime and "zensync.transport.base" not in runtime
    assert {"zensync.transport.simulated", "zensync.transport.handle"} <= runtime


@pytest.mark.parametrize("rule_name", sorted(_RULES))
def test_import_rule(rule_name: str) -> None:
    rule = _RULES[rule_name]
    violations = []
    checked = 0
    for path in _library_files():
        rel = path.relative_to(_PACKAGE_DIR)
        if rule.only_in is not None and rel.parts[0] != rule.only_in:
            continue
        if rule.allowed_in is not None and rel.parts[0] == rule.allowed_in:
            continue
        if rule.allowed_prefix is not None and path.name.startswith(rule.allowed_prefix):
            continue
        checked += 1
        source = path.read_text(encoding="utf-8")
        exempt = _type_checking_lines(source) if rule.type_checking_ok else set()
        for line, module in imported_modules(source, _package_of(path)):
            if line not in exempt and any(_matches(module, forbidden) for forbidden in rule.forbidden):
                violations.append(f"zensync/{rel.as_posix()}:{line}: uses {module}")
    assert checked, f"rule {rule_name} checks no file"
    who = f"Only zensync/{rule.allowed_in}/" if rule.allowed_in else "Nothing in zensync"
    if rule.only_in:
        who = f"Nothing in zensync/{rule.only_in}/"
    if rule.allowed_prefix:
        who += f" and modules named {rule.allowed_prefix}*"
    when = " outside `if TYPE_CHECKING:`" if rule.type_checking_ok else ""
    header = f"{who} may import {', '.join(rule.forbidden)}{when}. {rule.fix}"
    assert not violations, "\n".join([header, *sorted(set(violations))])


def test_compiled_modules_match_the_import_contract() -> None:
    """Every ``_compiled_*`` module is listed in pyproject.toml's numba contract, and each one listed
    exists and imports numba: the two checks allow the same files."""
    contracts = tomllib.loads((_REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    (numba_contract,) = [c for c in contracts["contracts"] if c.get("forbidden_modules") == ["numba"]]
    listed = {
        entry.split(" -> ")[0] for entry in numba_contract["ignore_imports"] if not entry.startswith("zensync.kernels")
    }
    compiled = {
        ".".join(path.relative_to(_REPO_ROOT).with_suffix("").parts)
        for path in _library_files()
        if path.name.startswith(_COMPILED_PREFIX)
    }
    assert compiled, f"no {_COMPILED_PREFIX}*.py under {_PACKAGE_DIR} (the planner's event loop is one)"
    assert compiled == listed, (compiled, listed)
    for module in compiled:
        path = _REPO_ROOT / (module.replace(".", "/") + ".py")
        imported = {name for _, name in imported_modules(path.read_text(encoding="utf-8"), _package_of(path))}
        assert "numba" in imported, module

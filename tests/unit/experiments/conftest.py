"""The experiment drivers are scripts in experiments/ (not a package): tests import them with that
folder on sys.path for the test module's lifetime."""

from __future__ import annotations

import importlib
import pathlib
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[3] / "experiments"


@pytest.fixture(scope="module")
def experiment_module() -> Iterator[Callable[[str], ModuleType]]:
    """``importlib.import_module`` with experiments/ on sys.path (until the test module is done)."""
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(EXPERIMENTS))

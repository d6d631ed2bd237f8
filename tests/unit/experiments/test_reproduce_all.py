"""experiments/reproduce_all.py: steps run in order, a done step is skipped on the next run, a failed
one fails the run without stopping the others."""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[3] / "experiments"


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path):  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        module = importlib.import_module("reproduce_all")
    finally:
        sys.path.remove(str(EXPERIMENTS))
    log = tmp_path / "log"
    step = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n'); sys.exit(int(sys.argv[3]))"
    steps = {name: [sys.executable, "-c", step, str(log), name, code] for name, code in (("a", "0"), ("b", "3"))}
    monkeypatch.setattr(module, "STEPS", steps)
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    return module, log


def test_done_steps_are_skipped_and_failures_reported(driver) -> None:  # type: ignore[no-untyped-def]
    module, log = driver
    assert module.main([]) == 1
    assert log.read_text().split() == ["a", "b"]
    state = json.loads(module._state_path().read_text())
    assert (state["a"]["status"], state["b"]["status"], state["b"]["exit"]) == ("done", "failed", 3)
    assert module.main([]) == 1  # a is done: only b runs again
    assert log.read_text().split() == ["a", "b", "b"]
    assert module.main(["--only", "a", "--fresh"]) == 0
    assert log.read_text().split() == ["a", "b", "b", "a"]
    assert module.main(["--skip", "b"]) == 0  # a done today, b left out: nothing runs
    assert log.read_text().split() == ["a", "b", "b", "a"]


def test_the_real_steps_name_existing_drivers() -> None:
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        module = importlib.import_module("reproduce_all")
    finally:
        sys.path.remove(str(EXPERIMENTS))
    for command in module.STEPS.values():
        scripts = [pathlib.Path(part) for part in command if part.endswith(".py")]
        assert all(path.exists() for path in scripts), command
    assert set(module.STEPS) >= {"zen", "espresso", "cupcake", "volume", "validation"}

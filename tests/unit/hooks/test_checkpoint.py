"""Hook checkpoints: a malformed state dict is rejected whole (ValueError) and leaves the state unchanged."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zensync
from zensync.hooks import HookConfig, ZenSyncState
from zensync.hooks.checkpoint import parse_state_dict

_FIXED = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}


@contextlib.contextmanager
def _state() -> Iterator[ZenSyncState]:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 2), torch.nn.Linear(2, 2))
    world = zensync.SimulatedWorld(num_ranks=1)
    config = HookConfig(strategy="zen", **_FIXED)
    (state,) = world.run(lambda t: ZenSyncState(t, list(model.named_parameters()), config))
    try:
        yield state
    finally:
        state.close()  # waits for its lane's queued jobs


@functools.cache
def _saved_once() -> dict[str, Any]:
    with _state() as state:
        record = state.record("0.weight")
        record.scheme, record.gamma, record.predicted_s = "zen", 1.5, {"dense": 1e-3, "zen": math.inf}
        record.correction = {"zen": 1.2}
        state.scheme_correction = {"zen": 1.1}
        state.step = 7
        return state.state_dict()


def _saved() -> dict[str, Any]:
    return copy.deepcopy(_saved_once())


def test_round_trip() -> None:
    saved = _saved()
    with _state() as state:
        state.load_state_dict(copy.deepcopy(saved))
        assert state.state_dict() == saved


BAD = {
    "negative step": lambda d: d.update(step=-1),
    "float step": lambda d: d.update(step=1.5),
    "bool step": lambda d: d.update(step=True),
    "nan latency": lambda d: d["cost_model"].update(latency_s=float("nan")),
    "zero bandwidth": lambda d: d["cost_model"].update(bandwidth_bytes_per_s=0),
    "another model": lambda d: d["records"].update({"decoder.weight": d["records"]["0.weight"]}),
    "missing key": lambda d: d.pop("records"),
    "extra key": lambda d: d.update(extra=1),
    "record field missing": lambda d: d["records"]["0.weight"].pop("gamma"),
    "record not a dict": lambda d: d["records"].update({"0.weight": 3}),
    "negative density": lambda d: d["records"]["0.weight"].update(mean_density=-0.5),
    "inf correction": lambda d: d["scheme_correction"].update(zen=math.inf),
    "string bytes": lambda d: d["records"]["0.weight"].update(bytes_sent="9"),
    "version": lambda d: d.update(version=1),
    "compression not a dict": lambda d: d.update(compression=[1]),
    "compression key": lambda d: d.update(compression={"topk:0.1": {}}),
    "compression unknown spec": lambda d: d.update(compression={"nope:3|auto": {}}),
    "compression residual not a tensor": lambda d: d.update(compression={"topk:0.1|auto": {"worker": {"w": 3}}}),
    "version 2 with compression": lambda d: d.update(version=2),
    "buckets not lists": lambda d: d.update(buckets=["0.weight"]),
    "buckets of another model": lambda d: d.update(buckets=[["decoder.weight"]]),
    "a parameter in two buckets": lambda d: d.update(buckets=[["0.weight"], ["0.weight", "1.bias"]]),
    "negative seed": lambda d: d.update(seed=-3),
    "float seed": lambda d: d.update(seed=2.5),
}


def test_a_version_3_state_dict_without_layout_or_seed_loads() -> None:
    """Version 3 saved before the bucket layout and Zen's seed were: the registration's seed stays."""
    old = _saved()
    old.pop("buckets"), old.pop("seed")
    loaded = parse_state_dict(old, {"0.weight", "1.weight", "1.bias"})
    assert loaded.buckets is None and loaded.seed is None


def test_the_seed_and_the_layout_are_restored() -> None:
    saved = _saved()
    saved["seed"], saved["buckets"] = 12345, [["1.bias", "1.weight"], ["0.weight"]]
    with _state() as state:
        state.load_state_dict(copy.deepcopy(saved))
        assert state.runtime.h0_seed == 12345 and state.bucket_layout == saved["buckets"]
        # the first bucket after the load, holding every parameter, syncs as the saved buckets
        assert state.replay_groups(["0.weight", "1.weight", "1.bias"], is_last=True) == saved["buckets"]
        assert state.replay_groups(["0.weight", "1.weight", "1.bias"], is_last=True) is None  # once only


def test_a_version_2_state_dict_loads_without_compression() -> None:
    """Version 2 (before compression state was saved): its error feedback restarts from zero."""
    old = _saved()
    old.pop("compression")
    old["version"] = 2
    assert parse_state_dict(old, {"0.weight", "1.weight", "1.bias"}).compression == {}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_is_rejected_and_nothing_changes(case: str) -> None:
    bad = _saved()
    BAD[case](bad)
    with _state() as state:
        before = state.state_dict()
        with pytest.raises(ValueError, match="state_dict"):
            state.load_state_dict(bad)
        assert state.state_dict() == before


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(
    path=st.lists(st.sampled_from(["records", "0.weight", "cost_model", "step", "scheme_correction"]), max_size=3),
    value=_JSONISH,
)
def test_any_mutation_raises_only_value_error(path: list[str], value: object) -> None:
    saved = _saved()
    target: Any = saved
    for key in path[:-1]:
        if not isinstance(target, dict) or key not in target:
            break
        target = target[key]
    if isinstance(target, dict):
        target[path[-1] if path else "step"] = value
    try:
        loaded = parse_state_dict(saved, {"0.weight", "1.weight", "1.bias"})
    except ValueError:
        return
    assert loaded.step >= 0  # accepted: then every value is of the checked kind
    assert all(math.isfinite(v) and v > 0 for v in loaded.scheme_correction.values())


def test_every_hook_option_is_documented_in_help() -> None:
    import dataclasses

    doc = zensync.HookConfig.__doc__ or ""
    for field in dataclasses.fields(zensync.HookConfig):
        assert f"\n        {field.name}: " in doc, f"HookConfig field {field.name} has no line in the class docstring"


def test_step_counter_is_set_only_before_a_step_that_compares() -> None:
    """Between two comparisons a counter set on one rank would change what it syncs unchecked."""
    with _state() as state:
        state.step = 3  # before the first step: it compares
        state._opened = 1  # one step opened since registration; the next compares at check_every
        with pytest.raises(RuntimeError, match="only before a step that compares"):
            state.step = 5
        assert state.step == 3
        saved = state.state_dict()
        saved["step"] = 5
        state.load_state_dict(saved)  # staged for the next comparison instead
        assert state.load_pending and state.step == 3 and state.state_dict()["step"] == 5

"""Strategy "auto" with a step profile: the options' checks, the profile's digest, and the strategy it resolves to."""

from __future__ import annotations

import pathlib

import pytest

from tests.unit.planner.test_step import _step
from zensync.hooks import HookConfig
from zensync.hooks.strategy import AUTO_COMPRESSORS, auto_compression, read_step_profile, resolve_strategy


def test_profile_is_for_auto_only() -> None:
    with pytest.raises(ValueError, match="profile= is read by strategy='auto' only"):
        HookConfig(strategy="topk:0.01", profile=_step())


def test_profile_must_be_a_step_profile_or_a_path() -> None:
    with pytest.raises(ValueError, match=r"profile=dict must be a zensync\.planner\.StepProfile"):
        HookConfig(profile={"world_size": 4})


def test_auto_compressors_are_checked_specs() -> None:
    with pytest.raises(ValueError, match=r"auto_compressors: .topk:2\.0.: ratio=2\.0"):
        HookConfig(auto_compressors=("topk:2.0",))  # the ratio is out of range
    with pytest.raises(ValueError, match="must be a sequence of compressor specs"):
        HookConfig(auto_compressors="fp16")  # type: ignore[arg-type]
    assert HookConfig(auto_compressors=["fp16"]).auto_compressors == ("fp16",)  # type: ignore[arg-type]


def test_the_profile_stays_out_of_the_configs_repr() -> None:
    assert "StepProfile" not in repr(HookConfig(profile=_step()))


def test_read_step_profile_from_a_file_has_the_objects_digest(tmp_path: pathlib.Path) -> None:
    step = _step()
    path = tmp_path / "step.json"
    path.write_text(step.to_json())
    from_file, digest = read_step_profile(str(path))
    assert from_file == step
    assert read_step_profile(path) == (from_file, digest)  # a pathlib.Path as well
    assert HookConfig(profile=path).profile == path
    assert digest == read_step_profile(step)[1]
    other = _step(ready=(0.01, 0.05))
    assert read_step_profile(other)[1] != digest


def test_read_step_profile_names_a_bad_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="step profile file not found"):
        read_step_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1}')
    with pytest.raises(ValueError, match="not a step profile"):
        read_step_profile(str(bad))


def test_auto_compresses_with_the_choice_and_keeps_its_sparse_candidates() -> None:
    auto = resolve_strategy("auto")
    strategy, choice = auto_compression(auto, _step(), AUTO_COMPRESSORS, world_size=4, margin=0.1)
    assert choice.spec == "topk:0.01"  # the only lossy compressor measured in _step()
    assert (strategy.kind, strategy.compressor, strategy.candidates) == ("compress", "topk:0.01", auto.candidates)


def test_auto_without_a_paying_compressor_is_auto() -> None:
    auto = resolve_strategy("auto")
    strategy, choice = auto_compression(auto, _step(), ("fp16",), world_size=4, margin=10.0)
    assert choice.spec == "fp32" and strategy == auto


def test_auto_refuses_a_profile_of_another_world_or_without_its_compressors() -> None:
    auto = resolve_strategy("auto")
    with pytest.raises(ValueError, match="measured on 4 ranks, and this group has 2"):
        auto_compression(auto, _step(), AUTO_COMPRESSORS, world_size=2, margin=0.1)
    with pytest.raises(ValueError, match=r"none of auto_compressors=\['onebit'\] was measured"):
        auto_compression(auto, _step(), ("onebit",), world_size=4, margin=0.1)

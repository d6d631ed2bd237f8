"""Strategy "auto" with profile="warmup": the warm-up steps' marks give the compute profile exactly
(a scripted clock), the links and compressors are measured in the group, every rank gets the same
profile, and a rank that missed a mark fails every rank."""

from __future__ import annotations

import pytest

from zensync.hooks import HookConfig
from zensync.hooks.config import WARMUP_PROFILE_STEPS
from zensync.hooks.warmup import WarmupProfiler
from zensync.transport import SimulatedWorld

SHAPES = {"a.weight": (64, 32), "a.bias": (64,), "b.weight": (10, 64)}
BUCKETS = (("b.weight",), ("a.bias", "a.weight"))
"""Two buckets in the order they become ready."""


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _script(profiler: WarmupProfiler, clock: _Clock, rank: int, steps: int, skip_end_of: int | None = None) -> None:
    """Steps shaped as: forward 10 ms (+1 ms per rank), buckets at 3 and 7 ms after it, the step's
    end 2 ms after the last bucket, then 5 ms before the next forward (+2 ms on rank 1)."""
    for step in range(steps):
        profiler.forward_start(step)
        clock.now += 0.010 + 0.001 * rank
        profiler.forward_end(step)
        clock.now += 0.003
        profiler.bucket(step, BUCKETS[0])
        clock.now += 0.004
        profiler.bucket(step, BUCKETS[1])
        clock.now += 0.002
        if step != skip_end_of:
            profiler.step_end(step)
        clock.now += 0.005 + 0.002 * rank
    profiler.forward_start(steps)  # the measuring step's forward


def test_the_compute_profile_is_the_marks_slowest_rank_the_rest_the_least_and_mean_ready_times() -> None:
    def body(t):  # type: ignore[no-untyped-def]
        clock = _Clock()
        profiler = WarmupProfiler(8, SHAPES, 4, ("fp16", "topk:0.01"), clock=clock)
        _script(profiler, clock, t.rank, 8)
        assert profiler.due(8) and not profiler.due(7)
        step = profiler.profile(t, repeats=1)
        assert not profiler.due(9)  # once
        return step

    steps = SimulatedWorld(2).run(body)
    assert steps[0].to_json() == steps[1].to_json()  # every rank the same profile
    step = steps[0]
    model = step.profile
    assert step.world_size == 2
    assert step.buckets == BUCKETS
    assert model.forward_s == pytest.approx(0.011)  # the slowest rank's (rank 1's 10 + 1 ms)
    assert model.backward_s == pytest.approx(0.007)  # forward end to the last bucket
    # The last bucket's return to the next forward, the least rank's: rank 0's 5 ms (rank 1's 7 ms
    # may be a wait for rank 0 in the training loop, such as a barrier).
    assert step.other_s == pytest.approx(0.005)
    ready = {t.name: t.ready_s for t in model.tensors}
    assert ready == pytest.approx({"b.weight": 0.003, "a.bias": 0.007, "a.weight": 0.007})
    assert {t.name: t.shape for t in model.tensors} == SHAPES
    assert set(step.compressor_costs) >= {"fp16", "topk:0.01"}
    assert step.allreduce.bandwidth_bytes_per_s > 0 and step.allgather.bandwidth_bytes_per_s > 0


def test_a_rank_that_missed_a_mark_fails_every_rank() -> None:
    def body(t):  # type: ignore[no-untyped-def]
        clock = _Clock()
        profiler = WarmupProfiler(8, SHAPES, 4, ("fp16",), clock=clock)
        _script(profiler, clock, t.rank, 8, skip_end_of=5 if t.rank == 1 else None)
        try:
            profiler.profile(t, repeats=1)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    for message in SimulatedWorld(2).run(body):
        assert "rank(s) [1] did not see every forward" in message and "steps 4-7" in message


def test_warmup_profile_options() -> None:
    assert HookConfig(profile="warmup").warmup_steps == WARMUP_PROFILE_STEPS  # 0: the fewest that measure
    assert HookConfig(profile="warmup", warmup_steps=10).warmup_steps == 10
    with pytest.raises(ValueError, match="warmup_steps=4 must be >= 8"):
        HookConfig(profile="warmup", warmup_steps=4)
    with pytest.raises(ValueError, match="profile= is read by strategy='auto' only"):
        HookConfig(strategy="topk:0.01", profile="warmup")

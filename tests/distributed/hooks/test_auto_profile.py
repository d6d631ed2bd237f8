"""Strategy "auto" with a step profile on gloo: it compresses with the planner's choice where that pays, stays
dense where it does not, records its prediction beside the measured step, and refuses a profile that
does not fit the group, on every rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import zensync
from tests.distributed._launch import launch, pytest_generate_tests, world_size_fixture  # noqa: F401 - class data world_size
from tests.distributed.hooks.test_ddp_hook import STEPS, _batch, _Net
from zensync.planner import LinkFit, ModelProfile, StepProfile, TensorProfile

SLOW = LinkFit(latency_s=1e-3, bandwidth_bytes_per_s=1e6)
"""1 MB/s: any compressor that shrinks the gradient pays."""
FAST = LinkFit(latency_s=1e-6, bandwidth_bytes_per_s=1e13)
"""Nothing on the wire costs anything: compression only adds its own time."""
COSTS = {
    spec: {
        "gpu_compress": {"fixed_s": 1e-4, "per_element_s": 1e-8, "knee_elements": 0},
        "gpu_decompress": {"fixed_s": 1e-4, "per_element_s": 1e-8, "knee_elements": 0},
    }
    for spec in ("fp16", "topk:0.01")
}


def _profile(world_size: int, link: LinkFit) -> StepProfile:
    """A hand-made profile of ``_Net`` (one bucket), as ``profile_group`` would write it."""
    tensors = tuple(
        TensorProfile(name=name, shape=tuple(p.shape), ready_s=0.001 * i)
        for i, (name, p) in enumerate(reversed(list(_Net().named_parameters())))
    )
    return StepProfile(
        profile=ModelProfile(model="net", tensors=tensors, forward_s=0.01, backward_s=0.01),
        world_size=world_size,
        other_s=0.001,
        buckets=(tuple(t.name for t in tensors),),
        allreduce=link,
        allgather=link,
        round_s=1e-4,
        compressor_costs=COSTS,
    )


def _renamed(step: StepProfile) -> StepProfile:
    """The profile of a model whose parameters have other names."""
    tensors = tuple(dataclasses.replace(t, name="other." + t.name) for t in step.profile.tensors)
    return dataclasses.replace(
        step,
        profile=dataclasses.replace(step.profile, tensors=tensors),
        buckets=(tuple(t.name for t in tensors),),
    )


def _train(rank: int, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=25)
    state = zensync.register(ddp, strategy="auto", latency_s=1e-5, bandwidth_bytes_per_s=1e8, adapt=False, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(STEPS):
        optimizer.zero_grad()
        ids, target = _batch(rank, step)
        nn.functional.cross_entropy(ddp(ids), target).backward()
        optimizer.step()
    out = {
        "choice": state.auto_choice.spec if state.auto_choice else None,
        "predicted": dict(state.auto_choice.predicted_s) if state.auto_choice else None,
        "fc1": [h["params"]["fc1.weight"]["scheme"] for h in state.history],
        "emb": [h["params"]["emb.weight"]["scheme"] for h in state.history],
        "records": [(h.get("step_interval_s"), h.get("predicted_step_s")) for h in state.history],
        "final": [p.detach().clone() for p in ddp.parameters()],
    }
    state.close()
    return out


def _first_step_where(
    ddp: nn.parallel.DistributedDataParallel, rank: int, steps: int, done: Callable[[], bool]
) -> int | None:
    """Train ``steps`` steps; the first after which ``done()`` holds (None: never)."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    first = None
    for step in range(steps):
        optimizer.zero_grad()
        ids, target = _batch(rank, step)
        nn.functional.cross_entropy(ddp(ids), target).backward()
        optimizer.step()
        if first is None and done():
            first = step
    return first


def _warmup_train(rank: int, steps: int) -> dict[str, Any]:
    """Auto measuring its own profile in the warm-up steps (8), then training on."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=0.01)  # several buckets
    state = zensync.register(ddp, strategy="auto", profile="warmup", adapt=False)
    chosen_at = _first_step_where(ddp, rank, steps, lambda: state.auto_choice is not None)
    assert state.auto_choice is not None
    out = {
        "choice": state.auto_choice.spec,
        "predicted": dict(state.auto_choice.predicted_s),
        "chosen_at": chosen_at,
        "fc1": [h["params"]["fc1.weight"]["scheme"] for h in state.history],
        "records": [(h.get("step_interval_s"), h.get("predicted_step_s")) for h in state.history],
        "final": [p.detach().clone() for p in ddp.parameters()],
    }
    state.close()
    return out


def _verify_train(rank: int, world_size: int, compressed_dt: float, warmup_steps: int = 4) -> dict[str, Any]:
    """Auto compressing from a profile after ``warmup_steps`` dense steps, on a scripted clock: a dense
    step lasts 10 ms, a compressed one ``compressed_dt`` (negative: that many times the profile's
    predicted dense step); verified after 2 compressed steps."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=25)
    state = zensync.register(
        ddp,
        strategy="auto",
        profile=_profile(world_size, SLOW),
        warmup_steps=warmup_steps,
        verify_steps=2,
        latency_s=1e-5,
        bandwidth_bytes_per_s=1e8,
        adapt=False,
    )
    now = [0.0]
    assert state.auto_choice is not None
    if compressed_dt < 0:
        compressed_dt *= -state.auto_choice.predicted_s["fp32"]

    def clock() -> float:  # called as a step opens: the time the step before it took
        now[0] += compressed_dt if state.decider.compresses(state.step - 1) else 0.010
        return now[0]

    state._clock = clock
    verdict_at = _first_step_where(ddp, rank, 9, lambda: state.auto_verdict is not None)
    out = {
        "verdict": state.auto_verdict,
        "verdict_at": verdict_at,
        "fc1": [h["params"]["fc1.weight"]["scheme"] for h in state.history],
        "predicted": [h.get("predicted_step_s") for h in state.history],
        "choice": dict(state.auto_choice.predicted_s) if state.auto_choice else None,
        "memory": state.compression_memory_bytes,
    }
    state.close()
    return out


def _worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    slow_file = f"{tmp}/slow.json"
    if rank == 0:
        with open(slow_file, "w") as f:
            f.write(_profile(world_size, SLOW).to_json())
    torch.distributed.barrier()
    out = {
        "slow": _train(rank, profile=_profile(world_size, SLOW)),
        "slow_file": _train(rank, profile=slow_file),
        "fast": _train(rank, profile=_profile(world_size, FAST)),
        "warm": _train(rank, profile=_profile(world_size, SLOW), warmup_steps=2),
        "warmup_profile": _warmup_train(rank, 12),
        "verified_slower": _verify_train(rank, world_size, 0.020),
        "verified_faster": _verify_train(rank, world_size, 0.005),
        "verified_predicted": _verify_train(rank, world_size, -2.0, warmup_steps=0),
    }
    for case, options in {
        "other_world": {"profile": _profile(world_size + 1, SLOW)},
        "one_rank_differs": {"profile": _profile(world_size, SLOW if rank == 0 else FAST)},
        "other_model": {"profile": _renamed(_profile(world_size, SLOW))},
    }.items():
        try:
            _train(rank, **options)
        except ValueError as err:
            out[case] = str(err)
    return out


class TestAutoWithProfile:
    world_size = [2]

    @pytest.fixture(scope="class")
    @classmethod
    def results(cls, world_size: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        tmp = tmp_path_factory.mktemp(f"auto_profile{world_size}")
        return launch(_worker, world_size, (str(tmp),), tmp)

    def test_slow_links_compress_with_the_fastest_prediction(self, results: list[dict[str, Any]]) -> None:
        for r in results:
            slow = r["slow"]
            assert slow["choice"] == min(slow["predicted"], key=slow["predicted"].__getitem__) == "topk:0.01"
            assert all(s.startswith("compress:topk:0.01|") for s in slow["fc1"]), slow["fc1"]
            # The embedding's natural sparsity stays auto's: a lossless sparse scheme, not compression.
            assert all(s in zensync.SCHEMES and s != "dense" for s in slow["emb"]), slow["emb"]

    def test_a_profile_file_chooses_as_the_object(self, results: list[dict[str, Any]]) -> None:
        for r in results:
            assert r["slow_file"]["choice"] == r["slow"]["choice"]
            assert all(torch.equal(a, b) for a, b in zip(r["slow_file"]["final"], r["slow"]["final"], strict=True))

    def test_fast_links_stay_dense(self, results: list[dict[str, Any]]) -> None:
        for r in results:
            fast = r["fast"]
            assert fast["choice"] == "fp32"
            assert all(s == "dense" for s in fast["fc1"]), fast["fc1"]

    def test_prediction_beside_the_measured_step(self, results: list[dict[str, Any]]) -> None:
        for r in results:
            slow, warm = r["slow"], r["warm"]
            assert slow["records"][0][0] is None  # no step before the first
            for interval, predicted in slow["records"][1:]:
                assert interval > 0 and predicted == slow["predicted"]["topk:0.01"]
            # In warm-up the step is dense, and so is its prediction.
            assert [p for _, p in warm["records"][1:]] == [
                warm["predicted"]["fp32"],
                warm["predicted"]["fp32"],
                warm["predicted"]["topk:0.01"],
            ]

    def test_warmup_profile_chooses_once_alike_on_every_rank(self, results: list[dict[str, Any]]) -> None:
        """profile="warmup": dense for the 8 warm-up steps, the planner's choice (whatever this
        machine measured) from step 8 on, the same on every rank, its prediction beside each step."""
        first = results[0]["warmup_profile"]
        predicted = first["predicted"]
        assert "fp32" in predicted and len(predicted) > 1
        best = min(predicted, key=predicted.__getitem__)
        assert first["choice"] in (best, "fp32")  # fp32 unless another is faster by the margin
        assert first["chosen_at"] == 8
        assert all(s == "dense" for s in first["fc1"][:8]), first["fc1"]
        if first["choice"] == "fp32":
            assert all(not s.startswith("compress:") for s in first["fc1"][8:]), first["fc1"]
        else:
            assert all(s.startswith(f"compress:{first['choice']}|") for s in first["fc1"][8:]), first["fc1"]
        # Record k holds step k-1's interval. No prediction beside the warm-up's steps nor beside
        # step 8, which measured (it paid for that); each later step has it beside its interval.
        assert [expected for _, expected in first["records"][:10]] == [None] * 10
        assert len(first["records"]) == 12
        for interval, expected in first["records"][10:]:
            assert interval > 0 and expected == predicted[first["choice"]]
        for other in results[1:]:
            mine = other["warmup_profile"]
            assert (mine["choice"], mine["predicted"], mine["fc1"]) == (first["choice"], predicted, first["fc1"])
            assert all(torch.equal(a, b) for a, b in zip(mine["final"], first["final"], strict=True))

    def test_compression_measured_slower_than_dense_goes_back_to_dense(self, results: list[dict[str, Any]]) -> None:
        """Steps 0-3 dense (warm-up), 4 and 5 compressed at 20 ms against dense's 10 ms: at step 6's
        first bucket every rank compares the measured medians and syncs densely from there on."""
        for r in results:
            slow = r["verified_slower"]
            verdict = slow["verdict"]
            assert verdict is not None and not verdict.kept and verdict.spec == "topk:0.01"
            assert (verdict.dense_step_s, verdict.compressed_step_s) == pytest.approx((0.010, 0.020))
            assert slow["verdict_at"] == 6
            assert [s.startswith("compress:") for s in slow["fc1"]] == [False] * 4 + [True] * 2 + [False] * 3
            assert slow["memory"] == 0  # the residuals went with the compression
            # Record k holds step k-1's prediction: compressed for steps 4-5, dense again after.
            fp32, topk = slow["choice"]["fp32"], slow["choice"]["topk:0.01"]
            assert slow["predicted"][1:] == [fp32] * 4 + [topk] * 2 + [fp32] * 2
        assert str(results[0]["verified_slower"]["verdict"]) == str(results[1]["verified_slower"]["verdict"])

    def test_compression_measured_faster_stays(self, results: list[dict[str, Any]]) -> None:
        for r in results:
            fast = r["verified_faster"]
            verdict = fast["verdict"]
            assert verdict is not None and verdict.kept
            assert (verdict.dense_step_s, verdict.compressed_step_s) == pytest.approx((0.010, 0.005))
            assert [s.startswith("compress:") for s in fast["fc1"]] == [False] * 4 + [True] * 5

    def test_without_dense_steps_the_predicted_dense_step_is_the_baseline(self, results: list[dict[str, Any]]) -> None:
        """No warm-up: steps 0-1 compressed and not counted (the training's first), steps 2-3 at twice
        the profile's predicted dense step; at step 4's first bucket auto goes back to dense."""
        for r in results:
            run = r["verified_predicted"]
            verdict, fp32 = run["verdict"], run["choice"]["fp32"]
            assert verdict is not None and not verdict.kept and not verdict.dense_measured
            assert (verdict.dense_step_s, verdict.compressed_step_s) == pytest.approx((fp32, 2 * fp32))
            assert run["verdict_at"] == 4
            assert [s.startswith("compress:") for s in run["fc1"]] == [True] * 4 + [False] * 5
            assert "predicted by the profile" in str(verdict)

    def test_ranks_stay_identical(self, results: list[dict[str, Any]]) -> None:
        for a, b in zip(results[0]["slow"]["final"], results[1]["slow"]["final"], strict=True):
            assert torch.equal(a, b)

    def test_a_profile_that_does_not_fit_fails_every_rank(self, results: list[dict[str, Any]]) -> None:
        for r in results:
            assert "measured on 3 ranks, and this group has 2" in r.get("other_world", ""), r.get("other_world")
            assert r.get("one_rank_differs"), "ranks with different profiles must not train"
            assert "are not parameters of this model" in r.get("other_model", ""), r.get("other_model")

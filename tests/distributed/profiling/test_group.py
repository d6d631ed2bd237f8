"""``profile_group`` on real gloo ranks: one agreed ``StepProfile`` everywhere, DDP's own buckets, and a
bad spec refused on every rank before anything is timed."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed._launch import launch, pytest_generate_tests, world_size_fixture  # noqa: F401 - class data world_size
from zensync.planner import StepProfile, predict_step
from zensync.profiling import profile_group

SPECS = ("fp16", "topk:0.01", "efsignsgd")
RANK = 4
"""PowerSGD's rank: the first two weights are smaller as rank-4 factors, the last (4 x 128) is not."""
BUCKET_CAP_MB = 0.05
"""Smaller than the two larger layers: DDP makes several buckets."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    before = [p.detach().clone() for p in ddp.parameters()]
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 4, (16,), generator=gen)
    measured = profile_group(
        ddp,
        lambda: (x, y),
        nn.functional.cross_entropy,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        specs=(*SPECS, f"powersgd:{RANK}"),
        iterations=2,
        warmup=1,
        repeats=2,
    )
    out: dict[str, Any] = {
        "json": measured.to_json(),
        "names": sorted(n for n, _ in ddp.module.named_parameters()),
        "shapes": {n: tuple(p.shape) for n, p in ddp.module.named_parameters()},
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, ddp.parameters(), strict=True)),
    }
    try:
        profile_group(ddp, lambda: (x, y), nn.functional.cross_entropy, specs=("topk:2.0",), iterations=1)
    except ValueError as err:
        out["bad_spec"] = str(err)
    return out


class TestProfileGroup:
    world_size = [2]

    @pytest.fixture(scope="class")
    @classmethod
    def results(cls, world_size: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        return launch(_worker, world_size, (), tmp_path_factory.mktemp(f"profile_group{world_size}"))

    def test_every_rank_holds_the_same_profile(self, results: list[dict[str, Any]]) -> None:
        assert all(r["json"] == results[0]["json"] for r in results)

    def test_buckets_are_ddps_and_cover_every_parameter(self, results: list[dict[str, Any]]) -> None:
        measured = StepProfile.from_json(results[0]["json"])
        assert sorted(n for b in measured.buckets for n in b) == results[0]["names"]
        assert len(measured.buckets) >= 2  # the cap splits the model
        ready = [t.ready_s for t in measured.profile.tensors]
        assert ready == sorted(ready) and ready[-1] <= measured.profile.backward_s

    def test_links_and_costs_are_measured(self, results: list[dict[str, Any]]) -> None:
        measured = StepProfile.from_json(results[0]["json"])
        for link in (measured.allreduce, measured.allgather):
            assert link.bandwidth_bytes_per_s > 0 and link.latency_s >= 0
            assert len(link.seconds) == len(link.sizes) >= 3 and min(link.seconds) > 0
        assert measured.round_s > 0 and measured.other_s > 0 and measured.profile.forward_s > 0
        for spec in SPECS:
            costs = measured.compressor(spec)
            assert costs.gpu_compress(1e6) > 0 and costs.gpu_decompress(1e6) > 0
            assert predict_step(measured, spec).step_s > measured.profile.forward_s + measured.other_s

    def test_powersgd_is_timed_on_each_bucket_with_its_rounds(self, results: list[dict[str, Any]]) -> None:
        """One cost per bucket, its rounds the bytes of what it sends as is (the biases, a weight whose
        factors are not smaller), of its P factors and of its Q factors."""
        measured = StepProfile.from_json(results[0]["json"])
        costs = measured.bucket_costs[f"powersgd:{RANK}"]
        shapes = results[0]["shapes"]
        assert len(costs) == len(measured.buckets)
        for bucket, cost in zip(measured.buckets, costs, strict=True):
            factored = [n for n in bucket if len(shapes[n]) == 2 and sum(shapes[n]) * RANK < math.prod(shapes[n])]
            plain = [math.prod(shapes[n]) for n in bucket if n not in factored]
            weights = [shapes[n] for n in factored]
            expected = [("allreduce", 4 * sum(plain))] if plain else []
            if weights:
                expected += [("allreduce", 4 * RANK * sum(n for n, _ in weights))]
                expected += [("allreduce", 4 * RANK * sum(m for _, m in weights))]
            assert list(cost.rounds) == expected, bucket
            assert cost.before_s > 0 and cost.after_s > 0
        step_s = predict_step(measured, f"powersgd:{RANK}").step_s
        assert step_s > measured.profile.forward_s + measured.profile.backward_s + measured.other_s

    def test_the_models_parameters_are_not_touched(self, results: list[dict[str, Any]]) -> None:
        assert all(r["unchanged"] for r in results)

    def test_bad_spec_raises_on_every_rank(self, results: list[dict[str, Any]]) -> None:
        for r in results:
            assert "topk" in r.get("bad_spec", ""), r.get("bad_spec")

"""GradScaler over the hook's compressed path: a NaN in one rank's gradient skips that step only (gloo).

Issue 11, item 5. Each worker trains a small MLP with ``torch.amp.GradScaler("cpu")`` (float32
gradients; growth off, so the scale changes only when a step is skipped) under DDP with zensync's
hook, once densely and once per compressor with error feedback, and puts a NaN into one element of
rank 0's ``fc1.weight`` gradient at ``NAN_STEP``. As under dense DDP, the scaler must skip exactly
that step: the scale backs off once, the parameters do not move at that step and move at every
other one, and they stay finite and identical on every rank. Before the fix the NaN stayed in the
residual (or PowerSGD's Q), so every later step was skipped too; random-k, which did not draw it,
let the NaN step itself through.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zensync
from tests.distributed._launch import launch, pytest_generate_tests, world_size_fixture  # noqa: F401 - class data world_size

STEPS, NAN_STEP = 6, 2
INIT_SCALE, BACKOFF = 2.0**10, 0.5
FIXED_MODEL = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e8, "adapt": False}
"""A fixed cost model: no calibration at registration."""
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("dense", {}),
    "topk": ("topk:0.1", {}),
    "topk-alltoall": ("topk:0.1", {"compressed_scheme": "alltoall_allgather"}),
    "dgc": ("dgc:0.1", {}),
    "randomk": ("randomk:0.1", {}),
    "efsignsgd-gather": ("efsignsgd", {"compressed_scheme": "gather_broadcast"}),
    "onebit": ("onebit", {}),
    "powersgd": ("powersgd:1", {}),
}
"""Every error-feedback compressor (EF_SPECS of tests/unit/compress/test_nonfinite_feedback.py), plus dense DDP."""


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # identical initial parameters on every rank and in every case
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _train(rank: int, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = zensync.register(ddp, strategy=strategy, **{**FIXED_MODEL, **options})
    step_now = [0]

    def inject(grad: torch.Tensor) -> torch.Tensor:
        if rank == 0 and step_now[0] == NAN_STEP:
            grad = grad.clone()
            grad[0, 0] = float("nan")
        return grad

    model[0].weight.register_hook(inject)  # runs before DDP's hook sees the gradient
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, backoff_factor=BACKOFF, growth_interval=10**6)
    scales, moved = [], []
    for step in range(STEPS):
        step_now[0] = step
        optimizer.zero_grad()
        inputs, target = _batch(rank, step)
        scaler.scale(nn.functional.mse_loss(ddp(inputs), target)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        moved.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)))
    schemes = {n: p["scheme"] for n, p in state.history[-1]["params"].items()}
    state.close()
    return {
        "scales": scales,
        "moved": moved,
        "final": [p.detach().clone() for p in model.parameters()],
        "schemes": schemes,
    }


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {case: _train(rank, strategy, options) for case, (strategy, options) in CASES.items()}


class TestGradScalerSkipsOnlyTheNanStep:
    world_size = [2]

    @pytest.fixture(scope="class")
    @classmethod
    def results(cls, world_size: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        return launch(_worker, world_size, (), tmp_path_factory.mktemp(f"nonfinite{world_size}"))

    @pytest.mark.parametrize("case", CASES)
    def test_scaler_skips_exactly_the_nan_step(self, results: list[dict[str, Any]], case: str) -> None:
        expected_scales = [INIT_SCALE if step < NAN_STEP else INIT_SCALE * BACKOFF for step in range(STEPS)]
        expected_moved = [step != NAN_STEP for step in range(STEPS)]
        for rank, per_rank in enumerate(results):
            record = per_rank[case]
            assert record["scales"] == expected_scales, (rank, record["scales"])
            assert record["moved"] == expected_moved, (rank, record["moved"])
            assert all(torch.isfinite(p).all() for p in record["final"]), rank

    @pytest.mark.parametrize("case", [c for c in CASES if c != "dense"])
    def test_compressed_and_identical_on_every_rank(self, results: list[dict[str, Any]], case: str) -> None:
        spec = CASES[case][0]
        for per_rank in results:
            assert per_rank[case]["schemes"]["0.weight"].startswith(f"compress:{spec}|"), per_rank[case]["schemes"]
            for a, b in zip(per_rank[case]["final"], results[0][case]["final"], strict=True):
                assert torch.equal(a, b), case

"""A plan's fusion group keeps each parameter's error-feedback residual on its own elements when DDP
lists the bucket's parameters in another order (it does after its bucket rebuild)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

import zensync
from tests.unit.hooks.test_order import _Bucket
from zensync.hooks import HookConfig, ZenSyncState, zensync_hook
from zensync.planner import ClusterSpec, Plan, PlanTensor, Predictions, TensorOption

WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))  # 30 + 5 + 15 + 3


def _write_plan(path: Path) -> None:
    """Every parameter in one top-k (allgather) fusion group."""
    shapes = {n: tuple(p.shape) for n, p in _model().named_parameters()}
    option = TensorOption(kind="comp", scheme="ag")
    tensors = tuple(PlanTensor(name=n, numel=math.prod(s), option=option, group=0) for n, s in shapes.items())
    plan = Plan(
        model="two-linear",
        cluster=ClusterSpec.from_strings(nodes=WORLD, gpus_per_node=1, inter="1Gbit"),
        compressor="topk:0.2",
        tensors=tensors,
        predicted=Predictions(plan_s=1.0, fp32_s=1.0, fp16_s=1.0, upper_bound_s=1.0),
        selection_s=0.0,
    )
    path.write_text(plan.to_json())


def _run(plan: Path, orders: list[list[int]]) -> list[list[dict[str, torch.Tensor]]]:
    """Per rank, per step: each parameter's synchronized gradient, the bucket listed in ``orders[step]``."""
    model = _model()
    named = list(model.named_parameters())

    def body(transport: zensync.Transport) -> list[dict[str, torch.Tensor]]:
        config = HookConfig(strategy=str(plan), latency_s=1e-5, bandwidth_bytes_per_s=1e9)
        state = ZenSyncState(transport, named, config)
        state.setup()
        out = []
        try:
            for step, order in enumerate(orders):
                gen = torch.Generator().manual_seed(100 * step + transport.rank)
                grads = {n: torch.randn(p.shape, generator=gen) for n, p in named}
                members = [named[i] for i in order]
                bucket = _Bucket([p for _, p in members], [grads[n] for n, _ in members], last=True)
                flat = zensync_hook(state, bucket).wait()
                parts = flat.split([p.numel() for _, p in members])
                out.append({n: part.view(p.shape).clone() for (n, p), part in zip(members, parts, strict=True)})
        finally:
            state.close()
        return out

    return zensync.SimulatedWorld(WORLD, timeout_s=30).run(body)


def test_fused_residuals_follow_their_parameters_across_a_reordered_bucket(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    _write_plan(plan)
    same = _run(plan, [[0, 1, 2, 3]] * 3)
    reordered = _run(plan, [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]])
    for rank in range(WORLD):
        for step in range(3):
            for name, grad in same[rank][step].items():
                assert torch.equal(reordered[rank][step][name], grad), (rank, step, name)

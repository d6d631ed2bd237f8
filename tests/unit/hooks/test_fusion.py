"""A plan's fusion group keeps each parameter's error-feedback residual on its own elements when DDP
lists the bucket's parameters in another order (it does after its bucket rebuild)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

import zensync
from tests.unit.hooks.test_order import _Bucket
from zensync.hooks import HookConfig, ZenSyncState, zensync_hook
from zensync.hooks.executor import contiguous_span
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


def test_contiguous_span_is_the_bucket_memory_of_back_to_back_views() -> None:
    """A group's views that tile one stretch of the bucket give that stretch (the sum lands in it with
    no copy); in name order only unless the compressor is order-free; gaps, strides and other
    storages give None (the executor then concatenates)."""
    buffer = torch.arange(20.0)
    a, b, c = buffer[2:8].view(2, 3), buffer[8:10], buffer[10:16].view(3, 2)
    span = contiguous_span([a, b, c], any_order=False)
    assert span is not None and span.data_ptr() == buffer[2:].data_ptr()
    assert torch.equal(span, buffer[2:16])
    assert contiguous_span([c, a, b], any_order=False) is None
    shuffled = contiguous_span([c, a, b], any_order=True)
    assert shuffled is not None and torch.equal(shuffled, buffer[2:16])
    assert contiguous_span([a, c], any_order=True) is None  # b's gap
    assert contiguous_span([a, torch.arange(20.0)[8:10]], any_order=True) is None  # another storage
    assert contiguous_span([buffer[2:8].view(2, 3).t(), b], any_order=True) is None  # not contiguous
    assert contiguous_span([], any_order=True) is None
    span[:] = -1.0
    assert torch.equal(buffer[2:16], torch.full((14,), -1.0)) and buffer[16] == 16.0

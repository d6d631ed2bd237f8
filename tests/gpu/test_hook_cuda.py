"""The DDP hook on a CUDA model: the same parameters as DDP's own reduction, with gradients made late.

The hook's step jobs run on a lane thread of their own on a GPU (``HookRuntime.lane``), and their
kernels go back onto the stream DDP called the hook on (``kernels.caller_stream``). That ordering is
what these tests check: the whole step runs on a side stream, and an autograd function sleeps on the
GPU inside the backward (``torch.cuda._sleep``) before the embedding's and the first layer's
gradients exist, so the host, and the lane thread, run well ahead of the data. A kernel of the hook
that was not ordered after the gradients would read stale or half-written memory, and the
parameters would differ from the reference's.

- NCCL, one rank (one GPU here: NCCL refuses two ranks on one device): zen, auto, sparcml, dense and
  fp16 against DDP's default allreduce (fp16: against torch's own fp16_compress_hook), several
  buckets, on the threaded lane.
- gloo, two ranks sharing the GPU (gloo moves CUDA tensors through host memory): the same strategies
  against DDP's default allreduce over the same group, so sums across ranks are checked too.

Run by ``cuda_ext/gpu_check.sh``; skipped without a CUDA device.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import zensync
from tests.distributed._launch import launch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"
)

STEPS = 4
VOCAB, DIM, HIDDEN = 4000, 32, 512
SLEEP_CYCLES = 20_000_000
"""About 10 ms of GPU time per sleep at ~2 GHz: far longer than the host needs to reach the hook."""
FLOAT32_ATOL = 1e-5
"""float32 sums of at most two addends per element in another order, times lr, over STEPS steps."""
FP16_ATOL = 2e-3
"""As the gloo tests' fp16 tolerance: half-precision rounding of gradients ~1e-2 over a few steps."""
STRATEGIES = ["zen", "auto", "sparcml", "dense", "fp16"]


class _LateGrad(torch.autograd.Function):
    """Identity forward; the backward sleeps on the GPU before it passes the gradient on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SLEEP_CYCLES)
        return grad


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = _LateGrad.apply(self.emb(ids).mean(1))  # the embedding's gradient comes after a sleep
        x = _LateGrad.apply(torch.relu(self.fc1(x)))  # fc1's too
        return self.fc3(torch.relu(self.fc2(x)))


def _batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank)
    ids = (torch.rand(16, 8, generator=gen) ** 3 * VOCAB).long()  # ~2 % of the rows, skewed
    return ids.to(device), torch.randint(0, 10, (16,), generator=gen).to(device)


def _train(rank: int, group: Any, strategy: str | None) -> tuple[list[list[torch.Tensor]], dict[str, str]]:
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = _Net().to(device)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[0], process_group=group, bucket_cap_mb=0.25
    )  # several buckets: fc2 alone is 1 MiB
    state = None
    if strategy == "torch-fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif strategy is not None:
        state = zensync.register(ddp, strategy=strategy, latency_s=1e-5, bandwidth_bytes_per_s=1e8, adapt=False)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    side = torch.cuda.Stream(device)
    snapshots = []
    with torch.cuda.stream(side):
        for step in range(STEPS):
            optimizer.zero_grad()
            ids, target = _batch(rank, step, device)
            nn.functional.cross_entropy(ddp(ids), target).backward()
            optimizer.step()
            snapshots.append([p.detach().to("cpu", copy=True) for p in model.parameters()])
    torch.cuda.synchronize(device)
    schemes = {name: rec.scheme for name, rec in state.records.items()} if state is not None else {}
    if state is not None:
        state.close()
    return snapshots, schemes


def _max_diff(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> list[float]:
    return [max(float((x - y).abs().max()) for x, y in zip(ra, rb, strict=True)) for ra, rb in zip(a, b, strict=True)]


def _worker(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    torch.cuda.set_device(0)
    group = dist.new_group(backend=backend) if backend == "nccl" else dist.group.WORLD
    reference, _ = _train(rank, group, None)
    torch_fp16, _ = _train(rank, group, "torch-fp16")
    results: dict[str, Any] = {}
    for strategy in STRATEGIES:
        hooked, schemes = _train(rank, group, strategy)
        against = torch_fp16 if strategy == "fp16" else reference
        results[strategy] = {"diffs": _max_diff(against, hooked), "schemes": schemes}
    results["moved"] = _max_diff(reference[:1], reference[-1:])[0]  # training changed the parameters
    with contextlib.suppress(Exception):
        if backend == "nccl":
            dist.destroy_process_group(group)
    return results


@pytest.mark.parametrize(("backend", "world_size"), [("nccl", 1), ("gloo", 2)])
def test_hook_on_cuda_equals_ddp_with_late_gradients(backend: str, world_size: int, tmp_path: Path) -> None:
    results = launch(_worker, world_size=world_size, args=(backend,), tmp_dir=tmp_path, timeout_s=300)
    for rank, result in enumerate(results):
        assert result["moved"] > 1e-3, f"rank {rank}: training did not move the parameters"
        for strategy in STRATEGIES:
            atol = FP16_ATOL if strategy == "fp16" else FLOAT32_ATOL
            diffs = result[strategy]["diffs"]
            assert max(diffs) <= atol, f"{backend} rank {rank} {strategy}: per-step max diffs {diffs}"
        assert result["zen"]["schemes"].get("emb.weight") == "zen", result["zen"]["schemes"]

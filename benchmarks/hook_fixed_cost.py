"""The hook's fixed cost per step: several DDP models stepped in turn in one job, paired per round.

On loopback (no link to wait for), what a comm hook adds to a step is its own work: the agreement
check, the lane, the passes over the bucket. Timed one model per job, the machine's noise between
jobs (+-5 % here) hides a 2 % difference; here every model of the list steps once per round, in a
rotating order, in the same processes, and each model's step is divided by the first model's step of
the same round (the paired ratio, median over rounds).

Models (the benchmark MLP 1024-2048-2048-1024-10, one bucket, batch 64, SGD momentum 0.9):
``ddp`` (DDP's built-in allreduce), ``torch:allreduce`` and ``torch:fp16`` (torch's Python hooks),
and any zensync strategy (``dense``, ``fp16``, ...), optionally with ``/check_every=N`` (N=1: the
ranks compare their engine states at every step, the behaviour before ``check_every``).

Run: ``python benchmarks/hook_fixed_cost.py --rounds 150 ddp dense dense/check_every=1 torch:fp16 fp16
fp16/check_every=1 [--out experiments/results/hook_fixed_cost.json]`` (2 ranks, one thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(),
        nn.Linear(1024, 10),
    )  # fmt: skip


def _model(variant: str) -> nn.parallel.DistributedDataParallel:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import zensync

    ddp = nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=64)
    if variant == "torch:allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif variant == "torch:fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif variant != "ddp":
        strategy, _, option = variant.partition("/")
        options: dict[str, Any] = {}
        if option:
            key, _, value = option.partition("=")
            options[key] = int(value)
        zensync.register(ddp, strategy=strategy, **options)
    return ddp


def _worker(rank: int, world: int, variants: list[str], rounds: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    models = {v: _model(v) for v in variants}
    optimizers = {v: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for v, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 1024, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    times: dict[str, list[float]] = {v: [] for v in variants}
    warmup = 5
    for r in range(warmup + rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            dist.barrier()
            start = time.perf_counter()
            optimizers[v].zero_grad(set_to_none=False)
            nn.functional.cross_entropy(models[v](x), y).backward()
            optimizers[v].step()
            if r >= warmup:
                times[v].append(time.perf_counter() - start)
    slowest = {}
    for v in variants:  # the slowest rank's step, per round
        t = torch.tensor(times[v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[v] = t.tolist()
    if rank == 0:
        base = slowest[variants[0]]
        report = {
            "command": " ".join(sys.argv),
            "torch": torch.__version__,
            "ranks": world,
            "rounds": rounds,
            "median_ms": {v: statistics.median(s) * 1e3 for v, s in slowest.items()},
            "paired_ratio": {
                v: statistics.median(a / b for a, b in zip(s, base, strict=True)) for v, s in slowest.items()
            },
        }
        pathlib.Path(out).write_text(json.dumps(report, indent=1))
        for v in variants:
            print(f"{v:28s} {report['median_ms'][v]:7.1f} ms  x{report['paired_ratio'][v]:.3f} of {variants[0]}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--port", type=int, default=29621)
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parents[1] / "experiments/results/hook_fixed_cost.json")
    )
    args = parser.parse_args()
    mp.spawn(_worker, args=(args.ranks, args.variants, args.rounds, args.port, args.out), nprocs=args.ranks)


if __name__ == "__main__":
    main()

"""The hook's fixed cost per step: several DDP models stepped in turn in one job, paired per round.

On loopback (no link to wait for), what a comm hook adds to a step is its own work: the agreement
check, the lane, the passes over the bucket. Timed one model per job, the machine's noise between
jobs (+-5 % here) hides a 2 % difference; here every model of the list steps once per round, in a
rotating order, in the same processes, and each model's step is divided by the first model's step of
the same round (the paired ratio, median over rounds).

Models (the benchmark MLP 1024-2048-2048-1024-10, one bucket, batch 64, SGD momentum 0.9):
``ddp`` (DDP's built-in allreduce), ``torch:allreduce`` and ``torch:fp16`` (torch's Python hooks),
and any zensync strategy (``dense``, ``fp16``, ...), optionally with ``/key=value`` options of
``zensync.register`` (``dense/check_every=1``: the ranks compare their engine states at every step,
the behaviour before ``check_every``; ``auto/profile=warmup``) and ``/pieces=N``, the elements per
allreduce of the CPU cast pipeline while that model steps (``zensync.compress.cast``; 2^40: one
allreduce of the whole bucket, as before the pipeline).

Run: ``python benchmarks/hook_fixed_cost.py --rounds 150 ddp dense dense/check_every=1 torch:fp16 fp16
fp16/check_every=1 [--out experiments/results/hook_fixed_cost.json]`` (2 ranks on loopback, one
thread each), or with ``--hosts 4 --rate 1gbit`` on the emulated cluster (``zensync.testbed``: one
process per host, root; there the fixed costs meet the wire, e.g. ``torch:fp16 fp16
fp16/pieces=1048576 fp16/pieces=1099511627776``).

On a GPU, ``--device cuda`` runs ``--ranks`` NCCL ranks, rank r on GPU r (one GPU: ``--ranks 1``, where
the allreduce moves nothing and what is left is the hook's own work, host and device); each step is
timed to ``torch.cuda.synchronize()``. ``torch:powersgd`` is torch's PowerSGD hook at rank 4 (from
step 2; zensync's ``powersgd:4`` is its counterpart).
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


def _options(variant: str) -> tuple[str, dict[str, Any]]:
    """``"fp16/pieces=4,check_every=1"`` -> ("fp16", {"pieces": 4, "check_every": 1}); values int where they parse."""
    strategy, _, spec = variant.partition("/")
    options: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return strategy, options


def _model(variant: str, device: torch.device) -> nn.parallel.DistributedDataParallel:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import zensync

    device_ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(_mlp().to(device), device_ids=device_ids, bucket_cap_mb=64)
    if variant == "torch:allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif variant == "torch:fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif variant == "torch:powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    elif variant != "ddp":
        strategy, options = _options(variant)
        options.pop("pieces", None)
        zensync.register(ddp, strategy=strategy, **options)
    return ddp


def _worker(
    rank: int, world: int, variants: list[str], rounds: int, port: int | None, out: str, device_type: str = "cpu"
) -> None:
    from zensync.compress import cast
    from zensync.kernels import synchronize

    if port is not None:  # loopback: spawned here; on the emulated cluster the launcher sets the env
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    models = {v: _model(v, device) for v in variants}
    default_piece = cast._PIPELINE_PIECE
    pieces = {v: _options(v)[1].get("pieces", default_piece) for v in variants}
    optimizers = {v: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for v, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 1024, generator=gen).to(device), torch.randint(0, 10, (64,), generator=gen).to(device)

    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}  # this process's CPU time (all threads) per step
    warmup = 5
    for r in range(warmup + rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            cast._PIPELINE_PIECE = pieces[v]
            synchronize(device)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            optimizers[v].zero_grad(set_to_none=False)
            nn.functional.cross_entropy(models[v](x), y).backward()
            optimizers[v].step()
            synchronize(device)
            if r >= warmup:
                times[v].append(time.perf_counter() - start)
                cpu[v].append(time.process_time() - start_cpu)
    slowest, cpu_ms = {}, {}
    for v in variants:  # the slowest rank's step, per round; the mean over ranks of the median CPU time
        t = torch.tensor(times[v], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[v] = t.tolist()
        c = torch.tensor([statistics.median(cpu[v])], dtype=torch.float64, device=device)
        dist.all_reduce(c)
        cpu_ms[v] = float(c) / world * 1e3
    if rank == 0:
        base = slowest[variants[0]]
        report = {
            "command": " ".join(sys.argv),
            "torch": torch.__version__,
            "ranks": world,
            "cluster": "loopback" if port is not None else "emulated",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "rounds": rounds,
            "median_ms": {v: statistics.median(s) * 1e3 for v, s in slowest.items()},
            "cpu_ms_per_rank": cpu_ms,
            "paired_ratio": {
                v: statistics.median(a / b for a, b in zip(s, base, strict=True)) for v, s in slowest.items()
            },
        }
        pathlib.Path(out).write_text(json.dumps(report, indent=1))
        for v in variants:
            print(_line(report, v, variants[0]))
    dist.barrier()
    dist.destroy_process_group()


def _line(report: dict[str, Any], variant: str, base: str) -> str:
    return (
        f"{variant:28s} {report['median_ms'][variant]:7.1f} ms  x{report['paired_ratio'][variant]:.3f} of {base}  "
        f"CPU {report['cpu_ms_per_rank'][variant]:6.1f} ms/step/rank"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--ranks", type=int, default=2, help="loopback ranks (without --rate)")
    parser.add_argument("--port", type=int, default=29621)
    parser.add_argument("--hosts", type=int, default=4, help="emulated hosts (with --rate)")
    parser.add_argument("--rate", help="run on the emulated cluster with links of this rate (e.g. 1gbit; root)")
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parents[1] / "experiments/results/hook_fixed_cost.json")
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, rank r on GPU r")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and args.rate is not None:
        parser.error("--device cuda runs on this machine's GPUs (no --rate)")
    if args.worker:  # one host of the emulated cluster
        _worker(0, 0, args.variants, args.rounds, None, args.out)
    elif args.rate is None:
        worker_args = (args.ranks, args.variants, args.rounds, args.port, args.out, args.device)
        mp.spawn(_worker, args=worker_args, nprocs=args.ranks)
    else:
        from zensync.testbed import make_cluster

        with make_cluster(args.hosts, rate=args.rate) as cluster:
            cluster.run_workers(
                lambda r: [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker"],
                lambda r: {**cluster.env_for_torch(r, args.port), "OMP_NUM_THREADS": "1"},
                timeout_s=1800,
            )
        report = json.loads(pathlib.Path(args.out).read_text())
        for v in args.variants:
            print(_line(report, v, args.variants[0]))


if __name__ == "__main__":
    main()

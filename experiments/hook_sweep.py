"""DDP hook on emulated hosts: auto vs dense vs zen across gradient densities, and hook overhead on a dense model.

Launch (as root for the emulated cluster; otherwise it falls back to loopback and says so)::

    python experiments/hook_sweep.py                    # 4 hosts at 1gbit, ~5 min on 2 cores
    python experiments/hook_sweep.py --hosts 2 --rate 100mbit --densities 0.01 0.5

Sweep: one parameter of ``--rows`` x ``--dim`` float32 (an embedding table); each rank's batch
touches ``density * rows`` random rows, so the gradient's row density is exactly ``density``. For
each density, DDP runs ``--steps`` timed steps (after warm-up) with zensync's hook and strategies
dense, zen and auto, in interleaved rounds so that machine noise hits all three alike. The
communication time per step is the hook's own (``state.history[i]["comm_time_s"]``). Expected: auto
within 5 % of min(dense, zen) at every density (it picks one of them, or sparcml/agsparse when the
model predicts those faster), zen far below dense at low density, dense best near 100 %.

Overhead: a dense MLP (``--mlp-width``), DDP default (no hook) vs ``zensync.register(strategy="auto")``;
step time (forward + backward + optimizer) median over the timed steps. Target: < 5 % increase.

Results: ``experiments/results/hook_sweep_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zensync
from zensync.testbed import make_cluster

RESULTS = pathlib.Path(__file__).parent / "results"
STRATEGIES = ("dense", "zen", "auto")


class _Table(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, dim) * 0.01)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].square().sum()


class _SumLoss(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().mean()


def _batch(rows: int, density: float, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randperm(rows, generator=gen)[: max(1, int(density * rows))]


def _timed_steps(
    ddp: nn.Module, optimizer: torch.optim.Optimizer, make_input: Any, steps: int, warmup: int
) -> list[float]:
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        ddp(make_input(step)).backward()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _sweep(args: argparse.Namespace, rank: int) -> list[dict[str, Any]]:
    rows = []
    for density in args.densities:
        comm: dict[str, list[float]] = {s: [] for s in STRATEGIES}
        step_s: dict[str, list[float]] = {s: [] for s in STRATEGIES}
        choice = ""
        auto_steps: list[tuple[str, float]] = []
        for _ in range(args.rounds):
            for strategy in STRATEGIES:
                torch.manual_seed(0)
                model = _Table(args.rows, args.dim)
                ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1000)
                state = zensync.register(ddp, strategy=strategy)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                step_s[strategy] += _timed_steps(
                    ddp, optimizer, lambda s, d=density: _batch(args.rows, d, rank, s), args.steps, args.warmup
                )
                comm[strategy] += [h["comm_time_s"] for h in list(state.history)[args.warmup :]]
                if strategy == "auto":
                    choice = state.records["weight"].scheme
                    auto_steps += [(h["params"]["weight"]["scheme"], round(h["comm_time_s"], 4)) for h in state.history]
                state.close()
        medians = {s: statistics.median(v) for s, v in comm.items()}
        rows.append(
            {
                "density": density,
                "comm_s": medians,
                "step_s": {s: statistics.median(v) for s, v in step_s.items()},
                "auto_choice": choice,
                "auto_steps": auto_steps,
                "auto_over_best": medians["auto"] / min(medians["dense"], medians["zen"]),
            }
        )
    return rows


def _overhead(args: argparse.Namespace) -> dict[str, Any]:
    width = args.mlp_width

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)], _SumLoss())

    times: dict[str, list[float]] = {"ddp": [], "auto": []}
    gen = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randn(32, width, generator=gen)
    for _ in range(args.rounds):
        for name in times:
            model = make_model()
            ddp = nn.parallel.DistributedDataParallel(model)
            state = zensync.register(ddp, strategy="auto") if name == "auto" else None
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            times[name] += _timed_steps(ddp, optimizer, lambda s: data, args.steps, args.warmup)
            if state is not None:
                state.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"step_s": medians, "auto_over_ddp": medians["auto"] / medians["ddp"]}


def _worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    result = {
        "sweep": _sweep(args, rank) if args.only != "overhead" else [],
        "overhead": _overhead(args) if args.only != "sweep" else None,
    }
    if rank == 0:
        pathlib.Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _report(args: argparse.Namespace, result: dict[str, Any], emulated: bool, wall_s: float) -> str:
    date = datetime.date.today().isoformat()
    lines = [
        f"# DDP hook sweep ({date})",
        "",
        f"Command: `python experiments/hook_sweep.py {' '.join(sys.argv[1:])}`; {args.hosts} hosts, "
        f"{'emulated ' + args.rate + ' links' if emulated else 'loopback (no shaping)'}; table {args.rows}x{args.dim} "
        f"float32; {args.rounds} rounds x {args.steps} steps; torch {torch.__version__}; total {wall_s:.0f} s.",
        "",
        "| density | dense comm ms | zen comm ms | auto comm ms | auto chose | auto / min(dense, zen) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["sweep"]:
        c = row["comm_s"]
        lines.append(
            f"| {row['density']:.1%} | {c['dense'] * 1e3:.1f} | {c['zen'] * 1e3:.1f} | {c['auto'] * 1e3:.1f} | "
            f"{row['auto_choice']} | {row['auto_over_best']:.3f} |"
        )
    over = result["overhead"]
    if over is None:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"Hook overhead on a dense MLP (4 x Linear({args.mlp_width}, {args.mlp_width})): DDP default "
        f"{over['step_s']['ddp'] * 1e3:.1f} ms/step, auto hook {over['step_s']['auto'] * 1e3:.1f} ms/step, "
        f"ratio {over['auto_over_ddp']:.3f}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.05, 0.2, 0.5, 1.0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mlp-width", type=int, default=1024)
    parser.add_argument("--only", choices=("sweep", "overhead"), help="run one of the two parts")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, make_cluster(args.hosts, rate=args.rate) as cluster:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, __file__, "--worker", "--out", out, *sys.argv[1:]]
        # One thread per worker: the hosts share this machine's cores (as torchrun sets OMP_NUM_THREADS=1).
        env = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
        cluster.run_workers(lambda r: argv, lambda r: {**cluster.env_for_torch(r, 29731), **env}, timeout_s=1800)
        result = json.loads(pathlib.Path(out).read_text())
        emulated = cluster.counters() is not None
    report = _report(args, result, emulated, time.perf_counter() - start)
    print(report)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"hook_sweep_{datetime.date.today().isoformat()}"
    meta = {"args": vars(args), "python": platform.python_version(), "torch": torch.__version__}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, **result}, indent=2))
    stem.with_suffix(".md").write_text(report)


if __name__ == "__main__":
    main()

"""Compression in training against torch's own hooks: DDP on a dense MLP over shaped links.

Launch (from the repository root, as root; without root it falls back to loopback and says so)::

    python experiments/compression_bench.py                          # 4 hosts, 1gbit, ~6 min on 2 cores
    python experiments/compression_bench.py --rate 100mbit --strategies ddp torch:fp16 fp16
    python experiments/compression_bench.py --buckets default        # DDP's default 25 MB buckets

Workload (issue 14): DDP on an MLP 1024-2048-2048-1024-10 (8.4M parameters, 34 MB fp32), batch
64 of fixed synthetic data per rank (a fixed random teacher's labels), SGD lr 0.01 momentum 0.9,
one DDP bucket (``bucket_cap_mb=64``) unless ``--buckets default``; ``--warmup`` untimed steps,
then ``--steps`` timed ones, one fresh process group per strategy, one process per emulated host.

Strategies: ``ddp`` (no hook), ``torch:fp16`` / ``torch:bf16`` (torch's fp16/bf16_compress_hook),
``torch:powersgd:R`` (torch's powerSGD_hook, rank R, start_powerSGD_iter=2 so the warm-up covers
its dense start; with several buckets on gloo it can fail, which the report says), ``nosync``
(DDP's ``no_sync``: backward and the optimizer with no communication at all, the compute floor),
and any zensync strategy (``zensync.register(ddp, strategy=...)``: "fp16", "powersgd:4",
"topk:0.01", "dgc:0.01", "onebit", "efsignsgd", "qsgd", "auto", ...).

Per strategy: the median over timed steps of the slowest rank's step time (forward, backward with
the hook, optimizer), CPU time per step (user + system of the rank's process, all threads), bytes on
the wire per step (eth0 tx of each host over the timed steps), the wire time of those bytes at the
link rate, the final loss (mean over ranks of the last step's loss), and, for zensync, its per-step
comm time and bytes from the hook's step log. Results:
``experiments/results/compression_<cluster>_<buckets>_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zensync.testbed import EmulatedCluster, make_cluster, parse_rate

# Sibling modules of this driver (experiments/ is not a package).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _counters import cpu_seconds, tx_bytes

_PORT = 29641
_WIDTHS = (1024, 2048, 2048, 1024, 10)
DEFAULT_STRATEGIES = (
    "nosync",
    "ddp",
    "torch:fp16",
    "fp16",
    "torch:bf16",
    "bf16",
    "torch:powersgd:4",
    "powersgd:4",
    "topk:0.01",
    "dgc:0.01",
    "onebit",
    "efsignsgd",
    "qsgd",
    "auto",
)


def mlp() -> nn.Module:
    """The issue's MLP, seeded: every rank and every strategy starts from the same weights."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(_WIDTHS)):
        layers.append(nn.Linear(a, b))
        if i < len(_WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's batch at ``step``: Gaussian inputs labelled by a fixed random linear teacher."""
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randn(size, _WIDTHS[0], generator=g)
    teacher = torch.randn(_WIDTHS[0], _WIDTHS[-1], generator=torch.Generator().manual_seed(7))
    return x, (x @ teacher).argmax(1)


def _register(ddp: nn.parallel.DistributedDataParallel, strategy: str) -> Any:
    """Install the strategy's hook; the zensync state (or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if strategy in ("ddp", "nosync"):
        return None
    if strategy == "torch:fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if strategy == "torch:bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return None
    if strategy.startswith("torch:powersgd:"):
        rank = int(strategy.rsplit(":", 1)[1])
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2, use_error_feedback=True
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return None
    import zensync

    return zensync.register(ddp, strategy=strategy)


def worker(args: argparse.Namespace) -> None:
    """One rank of one strategy: writes <strategy>_rank<r>.json."""
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    report: dict[str, Any] = {"rank": rank}
    try:
        model = mlp()
        cap = 64 if args.buckets == "one" else 25
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        state = _register(ddp, args.strategy)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        times, cpu, losses, split = [], [], [], []
        tx0 = 0
        for step in range(args.warmup + args.steps):
            x, y = batch(rank, step, args.batch)
            if step == args.warmup:
                dist.barrier()
                tx0 = tx_bytes(args.iface)
            dist.barrier()
            start, start_cpu = time.perf_counter(), cpu_seconds()
            opt.zero_grad(set_to_none=False)
            with ddp.no_sync() if args.strategy == "nosync" else contextlib.nullcontext():
                loss = loss_fn(ddp(x), y)
                forward_end = time.perf_counter()
                loss.backward()
            backward_end = time.perf_counter()
            opt.step()
            if step >= args.warmup:
                end = time.perf_counter()
                times.append(end - start)
                cpu.append(cpu_seconds() - start_cpu)
                split.append([forward_end - start, backward_end - forward_end, end - backward_end])
            losses.append(float(loss))
        dist.barrier()
        barrier_tx = tx_bytes(args.iface)
        dist.barrier()
        barrier_tx = tx_bytes(args.iface) - barrier_tx  # one barrier's bytes, to subtract
        tx = tx_bytes(args.iface) - tx0 - barrier_tx * (2 * args.steps + 3)
        report.update(times=times, cpu=cpu, losses=losses, split=split, tx_per_step=max(0.0, tx / args.steps))
        if state is not None:
            history = state.history[-args.steps :]
            report["zensync"] = {
                "comm_time_s": [h["comm_time_s"] for h in history],
                "bytes_sent": [h["bytes_sent"] for h in history],
                "schemes": sorted({p["scheme"] for h in history for p in h["params"].values()}),
                "phases_s": [h["phases_s"] for h in history],
            }
    except Exception as exc:  # noqa: BLE001 - reported per strategy (torch's PowerSGD hook can fail on gloo)
        report["error"] = f"{type(exc).__name__}: {exc}"
    pathlib.Path(args.out, f"{args.strategy.replace(':', '_')}_rank{rank}.json").write_text(json.dumps(report))
    with contextlib.suppress(Exception):  # a failed strategy may leave the group broken
        dist.destroy_process_group()


def _summary(strategy: str, ranks: list[dict[str, Any]], rate_bits: int | None) -> dict[str, Any]:
    errors = sorted({r["error"] for r in ranks if "error" in r})
    if errors or any("times" not in r for r in ranks):
        return {"strategy": strategy, "error": "; ".join(errors) or "a rank wrote no result"}
    steps = len(ranks[0]["times"])
    step_s = statistics.median(max(r["times"][i] for r in ranks) for i in range(steps))
    tx = statistics.mean(r["tx_per_step"] for r in ranks)
    out: dict[str, Any] = {
        "strategy": strategy,
        "step_s": step_s,
        "cpu_s_per_rank": statistics.mean(statistics.median(r["cpu"]) for r in ranks),
        "wire_bytes_per_step": tx,
        "wire_s_at_rate": tx * 8 / rate_bits if rate_bits else None,
        "final_loss": statistics.mean(r["losses"][-1] for r in ranks),
        # Forward, backward (with the hook: DDP waits for its buckets there) and optimizer, each
        # the median over steps of the mean over ranks.
        "split_s": [
            statistics.median(statistics.mean(r["split"][i][k] for r in ranks) for i in range(steps)) for k in range(3)
        ],
    }
    z = ranks[0].get("zensync")
    if z:
        out["zensync_comm_s"] = statistics.median(z["comm_time_s"]) if z["comm_time_s"] else None
        out["zensync_bytes_sent"] = statistics.median(z["bytes_sent"]) if z["bytes_sent"] else None
        out["zensync_schemes"] = z["schemes"]
        per_rank = [r["zensync"]["phases_s"] for r in ranks]
        names = sorted({k for steps_of in per_rank for h in steps_of for k in h})
        out["zensync_phases_s"] = {
            k: statistics.median(statistics.mean(p[i].get(k, 0.0) for p in per_rank) for i in range(steps))
            for k in names
        }
    return out


def _markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    base = next((r["step_s"] for r in rows if r["strategy"] == "ddp" and "step_s" in r), None)
    lines = [
        f"# Compression in training vs torch's hooks ({meta['label']}, {meta['buckets']} bucket(s), {meta['date']})",
        "",
        f"Command: `{meta['command']}`; torch {meta['torch']}, {meta['cpus']} CPUs; MLP "
        f"{'-'.join(map(str, _WIDTHS))}, batch {meta['batch']}, SGD momentum 0.9; median over "
        f"{meta['steps']} steps (after {meta['warmup']}) of the slowest rank's step.",
        "",
        "| strategy | ms/step | vs ddp | CPU ms/step/rank | wire MB/step/host | wire ms at link rate "
        "| zensync comm ms | final loss | schemes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['strategy']} | failed: {r['error'][:160]} | | | | | | | |")
            continue
        wire_ms = f"{r['wire_s_at_rate'] * 1e3:.1f}" if r["wire_s_at_rate"] is not None else "n/a"
        comm = r.get("zensync_comm_s")
        lines.append(
            f"| {r['strategy']} | {r['step_s'] * 1e3:.1f} | "
            f"{'' if base is None else format(base / r['step_s'], '.2f') + 'x'} | {r['cpu_s_per_rank'] * 1e3:.1f} | "
            f"{r['wire_bytes_per_step'] / 1e6:.2f} | {wire_ms} | {'' if comm is None else format(comm * 1e3, '.1f')} | "
            f"{r['final_loss']:.4f} | {', '.join(r.get('zensync_schemes', []))} |"
        )
    lines += [
        "",
        "nosync: DDP's no_sync (no communication): the compute floor of the step. CPU ms: user + system "
        f"time of one rank's process per step (all threads); {meta['hosts']} ranks share {meta['cpus']} cores.",
        "",
        *_phase_table(rows),
    ]
    return "\n".join(lines) + "\n"


_PHASE_ORDER = ("queued", "detect", "divide", "error_feedback", "compress", "codec", "decompress", "finite_check")


def _phase_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where each strategy's step went: forward / backward (with the hook) / optimizer for every
    strategy, and, for zensync's, the hook's sections and its waits in each collective phase."""
    ok = [r for r in rows if "error" not in r]
    waits = sorted({k for r in ok for k in r.get("zensync_phases_s", {}) if k.startswith("wait:")})
    columns = [*_PHASE_ORDER, *waits]
    lines = [
        "## Where the step goes (ms, median over steps of the mean over ranks)",
        "",
        "forward, backward (DDP waits for the hook's buckets at its end) and optimizer for every strategy; "
        "for zensync's, the hook's own sections (the local passes over the bucket) and `wait:<phase>`, the "
        "time inside the collectives of each phase from call to completion (the wire, the rounds and the "
        "slower ranks: on 2 shared cores, also the other ranks' CPU). Blank: the section did not run.",
        "",
        "| strategy | forward | backward | optimizer | " + " | ".join(columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for r in ok:
        phases = r.get("zensync_phases_s", {})
        cells = [f"{phases[c] * 1e3:.1f}" if c in phases else "" for c in columns]
        fwd, bwd, opt = (f"{v * 1e3:.1f}" for v in r["split_s"])
        lines.append(f"| {r['strategy']} | {fwd} | {bwd} | {opt} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--buckets", choices=["one", "default"], default="one")
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES))
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--iface", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory() as tmp, make_cluster(args.hosts, rate=args.rate) as cluster:
        emulated = isinstance(cluster, EmulatedCluster)
        iface = "eth0" if emulated else ""
        for index, strategy in enumerate(args.strategies):
            cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", "--strategy", strategy]
            cmd += ["--out", tmp, "--iface", iface]
            port = _PORT + index

            def env_for(rank: int, port: int = port) -> dict[str, str]:
                return {**cluster.env_for_torch(rank, port), "OMP_NUM_THREADS": "1"}

            try:
                cluster.run_workers(lambda r, cmd=cmd: cmd, env_for, timeout_s=args.timeout_s + 60)
            except Exception as exc:  # noqa: BLE001 - a crashed strategy is reported, the others still run
                print(f"{strategy}: workers failed: {exc}", file=sys.stderr)
            ranks = []
            for r in range(args.hosts):
                path = pathlib.Path(tmp, f"{strategy.replace(':', '_')}_rank{r}.json")
                ranks.append(json.loads(path.read_text()) if path.exists() else {"error": "no result (worker died)"})
            rows.append(_summary(strategy, ranks, parse_rate(args.rate) if emulated else None))
            print(json.dumps(rows[-1]), flush=True)
        label = f"netns{args.hosts}x{args.rate}" if emulated else f"loopback{args.hosts}"
    date = datetime.date.today().isoformat()
    meta = {
        "label": label,
        "date": date,
        "buckets": args.buckets,
        "command": " ".join(["python", "experiments/compression_bench.py", *forwarded]),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "hosts": args.hosts,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": args.batch,
    }
    out_dir = pathlib.Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"compression_{label}_{args.buckets}_{date}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    stem.with_suffix(".md").write_text(_markdown(meta, rows))
    print(_markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

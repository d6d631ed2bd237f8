"""Reduce-scatter on the wire: torch's gloo reduce_scatter_tensor against zensync's ring and halving.

Launch (from the repository root, as root: emulated hosts with shaped links)::

    python experiments/reduce_scatter_bench.py                  # 4 hosts, 1gbit, about 1 min
    python experiments/reduce_scatter_bench.py --loopback       # 4 local processes (time only, no wire)

gloo has no real reduce-scatter: torch's ``reduce_scatter_tensor`` on gloo all-reduces and keeps a
chunk, so a rank sends 2 (n-1)/n N bytes of an N-byte tensor. ``Transport.reduce_scatter`` sends
(n-1)/n N (ring, halving: zensync/transport/reduce_scatter.py). Per tensor size and method, every
rank reads its interface's tx counter before and after ``--reps`` calls (fenced by barriers) and
times each call after a barrier; reported: time (median over calls of the slowest rank), bytes on
the wire per rank per call against the closed form (n-1)/n N and against what zensync's byte
accounting (TrafficLog) reported, and Eq. 1's wire time at the link rate, (n-1)/n N / rate.
Results: experiments/results/reduce_scatter_<cluster>_<date>.{json,md}.

Expected: ring and halving put (n-1)/n N (+ a few hundred bytes of headers and size prefixes) on
the wire, torch's twice that, and take about half its time where the link, not the CPU, limits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _counters import fenced_tx

from zensync.testbed import EmulatedCluster, LoopbackCluster, make_cluster
from zensync.transport import TrafficLog, transport_for_group

_PORT = 29561
_SIZES = (1 << 20, 1 << 22, 1 << 24)
METHODS = ("torch reduce_scatter_tensor", "zensync ring", "zensync halving")


def _call(method: str, x: torch.Tensor, out: torch.Tensor, log: TrafficLog) -> None:
    transport = transport_for_group(None)
    if method == "torch reduce_scatter_tensor":
        dist.reduce_scatter_tensor(out, x)
        return
    with transport.recording(log):
        transport.reduce_scatter(x, algorithm=method.split()[1])


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    n, iface = dist.get_world_size(), os.environ.get("GLOO_SOCKET_IFNAME") if args.wire else None
    results: dict[str, dict[str, dict[str, object]]] = {}
    for nbytes in _SIZES:
        x = torch.ones(nbytes // 4) * (dist.get_rank() + 1)
        out = torch.empty(x.numel() // n)
        results[str(nbytes)] = {}
        for method in METHODS:
            _call(method, x, out, TrafficLog())  # warm-up
            log, times = TrafficLog(), []
            tx0 = fenced_tx(iface)
            for _ in range(args.reps):
                dist.barrier()
                start = time.perf_counter()
                _call(method, x, out, log)
                times.append(time.perf_counter() - start)
            tx = fenced_tx(iface) - tx0
            barrier_tx = fenced_tx(iface)
            barrier_tx = fenced_tx(iface) - barrier_tx  # one barrier: reps + 1 of them ran above
            accounted = sum(p.bytes_sent + p.control_bytes_sent for p in log.phases.values())
            results[str(nbytes)][method] = {
                "times": times,
                "wire_bytes_per_call": (tx - barrier_tx * (args.reps + 1)) / args.reps if iface else None,
                "accounted_bytes_per_call": accounted / args.reps,
            }
    pathlib.Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _report(ranks: list[dict], args: argparse.Namespace, label: str, command: str) -> tuple[list[str], dict]:
    n, rate = args.hosts, args.rate_bits
    lines = [
        f"# Reduce-scatter on the wire, {label} ({datetime.date.today().isoformat()})",
        "",
        f"Command: `{command}`; {n} ranks, {args.reps} calls per cell; time: median over calls of the "
        "slowest rank; bytes: per rank per call, mean over ranks (interface tx counter, barriers subtracted).",
        "",
        "| tensor bytes | method | ms | wire bytes / rank | / ((n-1)/n N) | accounted bytes | Eq. 1 wire ms |",
        "|---|---|---|---|---|---|---|",
    ]
    table: dict[str, dict[str, dict[str, float | None]]] = {}
    for size, methods in ranks[0].items():
        ideal = (n - 1) / n * int(size)
        for method in methods:
            cells = [r[size][method] for r in ranks]
            ms = statistics.median(max(c["times"][i] for c in cells) for i in range(args.reps)) * 1e3
            on_wire = cells[0]["wire_bytes_per_call"] is not None
            wire = statistics.mean(c["wire_bytes_per_call"] for c in cells) if on_wire else None
            acc = statistics.mean(c["accounted_bytes_per_call"] for c in cells)
            eq1 = ideal * 8 / rate * 1e3 if rate else None
            table.setdefault(size, {})[method] = {"ms": ms, "wire_bytes": wire, "accounted_bytes": acc, "eq1_ms": eq1}
            lines.append(
                f"| {int(size):,} | {method} | {ms:.2f} | {'-' if wire is None else f'{wire:,.0f}'} | "
                f"{'-' if wire is None else f'{wire / ideal:.3f}'} | {acc:,.0f} | "
                f"{'-' if eq1 is None else f'{eq1:.2f}'} |"
            )
    return lines, table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--loopback", action="store_true", help="local processes on 127.0.0.1, no shaping")
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--wire", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    cluster = LoopbackCluster(args.hosts) if args.loopback else make_cluster(args.hosts, rate=args.rate)
    wire = isinstance(cluster, EmulatedCluster)
    with tempfile.TemporaryDirectory() as tmp, cluster:
        cluster.run_workers(
            lambda r: (
                [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", "--out", tmp]
                + (["--wire"] if wire else [])
            ),
            lambda r: {**cluster.env_for_torch(r, _PORT), "OMP_NUM_THREADS": "1"},
            timeout_s=900,
        )
        ranks = [json.loads(pathlib.Path(tmp, f"rank{r}.json").read_text()) for r in range(args.hosts)]
    label = f"netns{args.hosts}x{args.rate}" if wire else f"loopback{args.hosts}"
    args.rate_bits = cluster.rate_bits  # None on loopback
    command = " ".join(["python", "experiments/reduce_scatter_bench.py", *forwarded])
    lines, table = _report(ranks, args, label, command)
    out_dir = pathlib.Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"reduce_scatter_{label}_{datetime.date.today().isoformat()}"
    meta = {"command": command, "label": label, "hosts": args.hosts, "reps": args.reps, "torch": torch.__version__}
    stem.with_suffix(".json").write_text(json.dumps({**meta, "cells": table}, indent=2))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

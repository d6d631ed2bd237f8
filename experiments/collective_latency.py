"""gloo collective latency and throughput by message size: ring all_gather vs all_to_all_single.

Launch (from the repository root; as root the hosts are emulated with shaped links, else loopback)::

    python experiments/collective_latency.py                  # 4 hosts, 1gbit, ~1 min
    python experiments/collective_latency.py --loopback       # 4 local processes, no shaping

Per message size (bytes per rank), each timed ``--reps`` times after a barrier (median, max over
ranks of each rep): gloo ``all_gather_into_tensor`` (a ring), ``all_to_all_single`` carrying the same
bytes (each rank's tensor repeated once per peer), zensync's ``TorchTransport.all_gather`` (which picks
between the two), and ``all_reduce``. It is the measurement behind ``SMALL_GATHER_BYTES`` in
zensync/transport/torch_dist.py. Results: experiments/results/collective_latency_<cluster>_<date>.{json,md}.
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
from collections.abc import Callable

import torch
import torch.distributed as dist

from zensync.testbed import EmulatedCluster, LoopbackCluster, make_cluster
from zensync.transport import transport_for_group

_PORT = 29541
_SIZES = (8, 1024, 16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def _time(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
    n = dist.get_world_size()
    transport = transport_for_group(None)
    results: dict[str, dict[str, list[float]]] = {}
    for nbytes in _SIZES:
        x = torch.ones(max(1, nbytes // 4))
        out = torch.empty(x.numel() * n)
        reps = args.reps if nbytes <= 1024 * 1024 else max(3, args.reps // 4)
        ops = {
            "ring all_gather": lambda out=out, x=x: dist.all_gather_into_tensor(out, x),
            "all_to_all_single": lambda out=out, x=x: dist.all_to_all_single(out, x.repeat(n)),
            "zensync all_gather": lambda x=x: transport.all_gather(x),
            "all_reduce": lambda x=x: dist.all_reduce(x.clone()),
        }
        results[str(nbytes)] = {name: _time(fn, reps) for name, fn in ops.items()}
    pathlib.Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--loopback", action="store_true", help="local processes on 127.0.0.1, no shaping")
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    cluster = LoopbackCluster(args.hosts) if args.loopback else make_cluster(args.hosts, rate=args.rate)
    with tempfile.TemporaryDirectory() as tmp, cluster:
        cluster.run_workers(
            lambda r: [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", "--out", tmp],
            lambda r: {**cluster.env_for_torch(r, _PORT), "OMP_NUM_THREADS": "1"},
            timeout_s=600,
        )
        ranks = [json.loads(pathlib.Path(tmp, f"rank{r}.json").read_text()) for r in range(args.hosts)]
    label = f"netns{args.hosts}x{args.rate}" if isinstance(cluster, EmulatedCluster) else f"loopback{args.hosts}"
    table: dict[str, dict[str, float]] = {}
    for size, ops in ranks[0].items():
        table[size] = {
            op: statistics.median(max(r[size][op][i] for r in ranks) for i in range(len(times)))
            for op, times in ops.items()
        }
    date = datetime.date.today().isoformat()
    command = " ".join(["python", "experiments/collective_latency.py", *forwarded])
    ops_names = list(next(iter(table.values())))
    lines = [
        f"# gloo collective time by size, {label} ({date})",
        "",
        f"Command: `{command}`; {args.hosts} ranks, median over reps of the max over ranks, milliseconds.",
        "",
        "| bytes per rank | " + " | ".join(ops_names) + " |",
        "|---|" + "---|" * len(ops_names),
    ]
    for size, row in table.items():
        lines.append(f"| {int(size):,} | " + " | ".join(f"{row[op] * 1e3:.2f}" for op in ops_names) + " |")
    out_dir = pathlib.Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"collective_latency_{label}_{date}"
    stem.with_suffix(".json").write_text(json.dumps({"command": command, "label": label, "ms": table}, indent=2))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

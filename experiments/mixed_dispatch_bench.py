"""gloo, MPI and the mixed dispatch side by side: every (op, size) on each, the tuned table's choice.

Launch (from the repository root; the MPI ranks are local processes)::

    mpiexec -n 2 python -m mpi4py experiments/mixed_dispatch_bench.py    # about 1 min
    mpiexec -n 4 python -m mpi4py experiments/mixed_dispatch_bench.py --reps 11

Every rank joins torch.distributed from MPI (``init_torch_distributed``), builds the gloo and MPI
transports, measures the tuning table (``zensync.transport.tune``, a separate pass over the same
sizes), then times each op at each size on gloo, on MPI and through ``MixedTransport`` with that
table, in one interleaved loop (per repetition: a barrier, then one call of each). A time is the
median over repetitions of the slowest rank's. Writes experiments/results/mixed_dispatch_p<N>_<date>.
{json,md}: per (op, size), the three medians, mixed / best single, and the backend the table chose.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

import torch

from zensync.transport import MixedTransport, MPITransport, TorchTransport, init_torch_distributed, launch, tune
from zensync.transport.mixed import burst_calls, collective_call

SIZES = (8, 64, 512, 4096, 16384, 65536, 1 << 20, 1 << 24)
OPS = ("all_reduce", "all_gather", "broadcast")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--tune-reps", type=int, default=7)
    parser.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_torch_distributed("gloo", timeout=300)
    gloo, mpi = TorchTransport(), MPITransport(timeout=300)
    backends = {"gloo": gloo, "mpi": mpi}
    table, _ = tune(backends, sizes=SIZES, ops=OPS, reps=args.tune_reps)
    mixed = MixedTransport(backends, table)
    runs = {"gloo": gloo, "mpi": mpi, "mixed": mixed}
    rows = []
    for op in OPS:
        for size in SIZES:
            x = torch.ones(max(1, size // 4))
            calls = {name: collective_call(t, op, x) for name, t in runs.items()}
            for call in calls.values():
                call()
            times: dict[str, list[float]] = {name: [] for name in runs}
            burst = burst_calls(size)
            for _ in range(args.reps):
                for name, call in calls.items():
                    runs[name].barrier()
                    start = time.perf_counter()
                    for _ in range(burst):
                        call()
                    times[name].append((time.perf_counter() - start) / burst)
            slowest = {
                name: torch.stack(gloo.all_gather(torch.tensor(t, dtype=torch.float64))).max(0).values.tolist()
                for name, t in times.items()
            }
            medians = {name: statistics.median(s) for name, s in slowest.items()}
            best = min(medians["gloo"], medians["mpi"])
            rows.append(
                {
                    "op": op,
                    "bytes": size,
                    "us": {name: m * 1e6 for name, m in medians.items()},
                    "mixed_over_best": medians["mixed"] / best,
                    "gloo_over_mixed": medians["gloo"] / medians["mixed"],
                    "table_backend": table.backend_for(op, torch.float32, size),
                }
            )
    if rank == 0:
        date = datetime.date.today().isoformat()
        command = "mpiexec -n {} python -m mpi4py experiments/mixed_dispatch_bench.py {}".format(
            world, " ".join(sys.argv[1:])
        ).strip()
        lines = [
            f"# gloo, MPI (mpi4py + MPICH) and the mixed dispatch, {world} local ranks ({date})",
            "",
            f"Command: `{command}`; torch {torch.__version__}; median over {args.reps} repetitions of the slowest "
            "rank's per-call time (calls back to back: `burst_calls`), microseconds; the table from "
            "`zensync.transport.tune` in a separate pass.",
            "",
            "| op | bytes per rank | gloo | MPI | mixed | mixed / best single | gloo / mixed | table's backend |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            us = row["us"]
            lines.append(
                f"| {row['op']} | {row['bytes']:,} | {us['gloo']:.1f} | {us['mpi']:.1f} | {us['mixed']:.1f} | "
                f"{row['mixed_over_best']:.2f} | {row['gloo_over_mixed']:.1f} | {row['table_backend']} |"
            )
        out = pathlib.Path(args.results_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"mixed_dispatch_p{world}_{date}"
        stem.with_suffix(".json").write_text(
            json.dumps({"command": command, "rows": rows, "table": json.loads(table.to_json())}, indent=1)
        )
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    mpi.close()
    launch.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

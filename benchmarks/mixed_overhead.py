"""What the mixed dispatch itself costs per call: MixedTransport routed to MPI against MPITransport alone.

In a group of one rank (MPI singleton, gloo on a localhost port) a collective moves nothing, so each
call's time is the transport's own work: the Python layers, the handle, the MPI call. The mixed
dispatch then adds its routing (a dict lookup) and its issue hook (``MixedTransport._issue``).
``zensync bench --scan`` cannot show so small a cost: with 2 or 4 ranks on this 2-core machine its
paired ratios move by several per cent from one run to the next, also in cells where mixed runs the
very backend it is compared with. This measures the difference directly: for each op, the two
transports alternate bursts of ``--calls`` calls (order rotated each repetition), and the report gives
the median per-call time of each and the median over repetitions of their paired difference.

Run: ``python benchmarks/mixed_overhead.py [--reps 31] [--calls 2000] [--out experiments/results/mixed_overhead.json]``
(no mpiexec: MPI starts as a singleton).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import socket
import statistics
import sys

import torch
import torch.distributed as dist

from zensync.transport.mixed import MixedTransport, TuningTable, collective_call, interleaved_samples
from zensync.transport.mpi import MPITransport
from zensync.transport.torch_dist import TorchTransport

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed burst")
    parser.add_argument("--bytes", type=int, default=8, help="message size per call")
    parser.add_argument("--out", help="JSON report (default: experiments/results/mixed_overhead_<date>.json)")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mpi, gloo = MPITransport(), TorchTransport()
    mixed = MixedTransport({"gloo": gloo, "mpi": mpi}, TuningTable(default="mpi", world_size=1))
    x = torch.ones(max(1, args.bytes // 4))
    report: dict[str, object] = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "world_size": 1,
        "bytes": args.bytes,
        "reps": args.reps,
        "calls": args.calls,
        "ops": {},
    }
    print(f"{'op':15s} {'mpi (us)':>9s} {'mixed (us)':>10s} {'paired diff (us)':>17s}")
    for op in OPS:
        calls = {"mpi": collective_call(mpi, op, x), "mixed": collective_call(mixed, op, x)}
        for call in calls.values():
            for _ in range(100):  # warm-up
                call()
        samples = interleaved_samples(calls, {"mpi": mpi, "mixed": mpi}, args.reps, args.calls)
        diff = statistics.median(m - b for m, b in zip(samples["mixed"], samples["mpi"], strict=True))
        row = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
        row["paired_diff_us"] = diff * 1e6
        report["ops"][op] = row  # type: ignore[index]
        print(f"{op:15s} {row['mpi']:9.2f} {row['mixed']:10.2f} {row['paired_diff_us']:17.2f}")
    out = pathlib.Path(
        args.out
        or pathlib.Path(__file__).parents[1] / f"experiments/results/mixed_overhead_{datetime.date.today()}.json"
    )
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

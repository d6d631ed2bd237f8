"""Zen over MPI against Zen over gloo on the emulated cluster: time and bytes on the wire, one job.

Launch (from the repository root, as root; needs mpiexec: pip install "zensync[mpi]")::

    python experiments/zen_mpi_cluster.py                 # 4 hosts, 1gbit, about 1 min
    python experiments/zen_mpi_cluster.py --rate 100mbit

One MPI job spans the emulated hosts: mpiexec (MPMD, one rank per host) starts each rank inside its
host's network namespace, MPICH forced onto the network (``MPIR_CVAR_NOLOCAL=1``: no shared memory
between ranks it would see on one machine; the ofi netmod with libfabric's tcp provider on the
host's eth0: with the wheel's default netmod, ucx, eth0 counted no bytes at all). Every rank
joins torch.distributed (gloo on eth0) from MPI (``init_torch_distributed``, rendezvous at host 0's
address), so the same Zipf embedding gradient is summed by ``sparse_allreduce(scheme="zen")`` over
``MPITransport`` and over gloo's ``TorchTransport``, alternately, ``--reps`` times each; a dense
all-reduce of the same tensor on both is the reference. Per method: time (median over calls of the
slowest rank), bytes each host's eth0 sent per call (kernel counters, barriers subtracted) and
zensync's accounted bytes. Results: experiments/results/zen_mpi_<cluster>_<date>.{json,md}.

Expected: Zen moves the same bytes over MPI as over gloo (the same algorithm, the same messages)
and is no slower.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from zensync import SyncStats, sparse_allreduce
from zensync.testbed import EmulatedCluster, make_cluster
from zensync.transport import MPITransport, TorchTransport, Transport, init_torch_distributed
from zensync.workloads.zipf import zipf_gradient

_PORT = 29571
METHODS = ("zen over gloo", "zen over mpi", "dense over gloo", "dense over mpi")


def _tx(iface: str) -> int:
    return int(pathlib.Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def _fenced_tx(t: Transport, iface: str) -> int:
    """tx bytes after a barrier on ``t`` and a settle, so every rank reads at the same point."""
    t.barrier()
    time.sleep(0.3)
    return _tx(iface)


def _measure(t: Transport, call: Callable[[], object], reps: int, iface: str) -> dict[str, object]:
    call()  # warm-up
    times = []
    tx0 = _fenced_tx(t, iface)
    for _ in range(reps):
        t.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    tx = _fenced_tx(t, iface) - tx0
    one = _fenced_tx(t, iface)
    one = _fenced_tx(t, iface) - one  # one barrier (and its settle): reps + 1 of them ran above
    return {"times": times, "wire_bytes_per_call": (tx - one * (reps + 1)) / reps}


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank, _ = init_torch_distributed("gloo", timeout=300)
    gloo, mpi = TorchTransport(), MPITransport(timeout=300)
    # Integer values: every summation order gives the same sum, so the results compare exactly.
    grad = (zipf_gradient(rank, args.rows, args.dim, density=args.density, zipf_s=1.0, seed=7) * 8).round()
    runs: dict[str, dict[str, object]] = {}
    results = {}
    for method in METHODS:
        t = mpi if method.endswith("mpi") else gloo
        stats = SyncStats()
        if method.startswith("zen"):

            def call(t: Transport = t, stats: SyncStats = stats) -> torch.Tensor:
                return sparse_allreduce(grad, scheme="zen", group=t, stats=stats)

        else:

            def call(t: Transport = t) -> torch.Tensor:
                return t.all_reduce(grad.reshape(-1))

        runs[method] = _measure(t, call, args.reps, "eth0")
        results[method] = call().reshape(-1)
        runs[method]["accounted_bytes_per_call"] = stats.bytes_sent if method.startswith("zen") else None
    exact = {m: bool(torch.equal(results[m], results["dense over gloo"])) for m in METHODS}
    pathlib.Path(args.out, f"rank{rank}.json").write_text(json.dumps({"runs": runs, "exact": exact}))
    mpi.close()


def _mpmd(cluster: EmulatedCluster, args: argparse.Namespace, forwarded: list[str], out: str) -> list[str]:
    """mpiexec's MPMD line: one rank per host, each started inside its namespace with its env."""
    command = [shutil.which("mpiexec") or "mpiexec"]
    for i in range(args.hosts):
        env = {
            **cluster.env_for_torch(i, _PORT),
            "MPIR_CVAR_NOLOCAL": "1",
            "MPIR_CVAR_CH4_NETMOD": "ofi",  # the wheel's default, ucx, bypassed eth0 here (0 bytes counted)
            "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": "eth0",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
        }
        argv = [sys.executable, "-m", "mpi4py", os.path.abspath(__file__), *forwarded, "--worker", "--out", out]
        wrapped = cluster.command_for(i, ["env", *(f"{k}={v}" for k, v in env.items()), *argv])
        command += ["-n", "1", *wrapped] if i == 0 else [":", "-n", "1", *wrapped]
    return command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rows", type=int, default=200_000, help="embedding rows")
    p.add_argument("--dim", type=int, default=64, help="elements per row")
    p.add_argument("--density", type=float, default=0.02, help="fraction of rows each rank touches")
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp, make_cluster(args.hosts, rate=args.rate) as cluster:
        done = subprocess.run(_mpmd(cluster, args, forwarded, tmp), timeout=900, check=False)
        if done.returncode:
            print(f"mpiexec failed with exit code {done.returncode}", file=sys.stderr)
            return 1
        ranks = [json.loads(pathlib.Path(tmp, f"rank{r}.json").read_text()) for r in range(args.hosts)]
    _report(ranks, args, forwarded)
    return 0


def _report(ranks: list[dict], args: argparse.Namespace, forwarded: list[str]) -> None:
    label = f"netns{args.hosts}x{args.rate}"
    command = " ".join(["python", "experiments/zen_mpi_cluster.py", *forwarded])
    dense_mb = args.rows * args.dim * 4 / 1e6
    lines = [
        f"# Zen over MPI and over gloo, {label} ({datetime.date.today().isoformat()})",
        "",
        f"Command: `{command}`; {args.hosts} ranks, one per emulated host; gradient {args.rows:,} x {args.dim} "
        f"float32 ({dense_mb:.1f} MB), Zipf rows, density {args.density}; {args.reps} calls per method, "
        "alternating methods; time: median over calls of the slowest rank; bytes: per host per call, mean "
        "over hosts (eth0 tx counter, barriers subtracted); exact: result equal to the dense gloo sum on every rank.",
        "",
        "| method | ms | wire bytes / host | accounted bytes / host | exact |",
        "|---|---|---|---|---|",
    ]
    cells = {}
    for method in METHODS:
        runs = [r["runs"][method] for r in ranks]
        ms = statistics.median(max(run["times"][i] for run in runs) for i in range(args.reps)) * 1e3
        wire = statistics.mean(run["wire_bytes_per_call"] for run in runs)
        acc = runs[0]["accounted_bytes_per_call"]
        acc_mean = None if acc is None else statistics.mean(run["accounted_bytes_per_call"] for run in runs)
        exact = all(r["exact"][method] for r in ranks)
        cells[method] = {"ms": ms, "wire_bytes": wire, "accounted_bytes": acc_mean, "exact": exact}
        acc_text = "-" if acc_mean is None else f"{acc_mean:,.0f}"
        lines.append(f"| {method} | {ms:.2f} | {wire:,.0f} | {acc_text} | {exact} |")
    zen_gloo, zen_mpi = cells["zen over gloo"], cells["zen over mpi"]
    lines += [
        "",
        f"Zen over MPI / over gloo: time {zen_mpi['ms'] / zen_gloo['ms']:.3f}x, "
        f"wire bytes {zen_mpi['wire_bytes'] / zen_gloo['wire_bytes']:.3f}x.",
    ]
    out_dir = pathlib.Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"zen_mpi_{label}_{datetime.date.today().isoformat()}"
    meta = {"command": command, "label": label, "torch": torch.__version__, "args": vars(args)}
    stem.with_suffix(".json").write_text(json.dumps({**meta, "cells": cells}, indent=2, default=str))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

"""Sparse allreduce against the plain-torch peer on shaped links: zen vs torch's gloo sparse all_reduce.

Launch (from the repository root, as root; without root it falls back to unshaped loopback and says so)::

    python experiments/sparse_peer_bench.py                        # both workloads, 4 hosts, 1gbit, ~2 min
    python experiments/sparse_peer_bench.py --workload small --reps 5

Workloads (issue 13): an embedding gradient whose rows are touched by ``draws`` Zipf(1.1) draws per
rank (with replacement, rows in frequency order, each draw adding one random row of values, as an
embedding backward does):

* ``small``: [200000, 64] float32, 700 draws per rank (about 370 rows per rank, union about 1170);
* ``large``: [50000, 768] float32, 4480 draws per rank (about 3 % of rows per rank).

Every op starts from the same per-rank gradient and is timed after a barrier (median over
``--reps`` of the max over ranks, one warm-up call each):

* ``dense``: ``torch.distributed.all_reduce`` in place on a copy of the gradient (the copy is made
  before the barrier, not timed);
* ``torch sparse``: what a user of ``nn.Embedding(sparse=True)`` gets: gloo's sparse all_reduce of
  the ready-made coalesced COO gradient (sparse_dim 1, built before the barrier), then ``to_dense()``;
* ``torch sparse (COO out)``: the same without ``to_dense()``;
* ``zen`` / ``agsparse``: ``zensync.sparse_allreduce(g, scheme=...)`` from the dense gradient, result
  in a new tensor;
* ``zen out=input``: ``sparse_allreduce(buf, scheme="zen", out=buf)`` on a copy made before the barrier;
* floors (where zen's time goes): its scan alone (``kernels.nonzero_items`` of the gradient, every rank
  at once on the shared cores) and its collectives alone (a replay of its push and pull bytes, no
  compute, one size exchange more than zen's folded push).

Each op's CPU time (user + system, every thread of the rank's process: gloo's and the kernel's
network stack included) is read with getrusage around the call; summed over the ranks and divided by
the cores it gives the wall time the shared cores alone need (all hosts run on this one machine).
Wire bytes are eth0 tx byte deltas per host read inside each namespace, over all reps of an op,
minus the fencing barriers' bytes. Eq. 1's wire time is (n-1)/n (K+U)(4+4D) bytes at the nominal
link rate (K local rows, U the union). Every result is checked against a float64 sum of the ranks'
gradients. Results: ``experiments/results/sparse_peer_<cluster>_<date>.{json,md}``.
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
from typing import Any

import torch
import torch.distributed as dist

import zensync
from zensync import kernels
from zensync.testbed import EmulatedCluster, make_cluster, parse_rate
from zensync.transport import transport_for_group

# Sibling modules of this driver (experiments/ is not a package).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _counters import cpu_seconds, fenced_tx
from _results import versions, write

_PORT = 29561
_WORKLOADS = {"small": (200_000, 64, 700), "large": (50_000, 768, 4480)}


def zipf_rows(num_rows: int, draws: int, seed: int, s: float = 1.1) -> torch.Tensor:
    """``draws`` row ids drawn with replacement from P(i) ~ (i + 1) ** -s (row 0 the most frequent)."""
    weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow(-s)
    return torch.multinomial(weights, draws, replacement=True, generator=torch.Generator().manual_seed(seed))


def embedding_gradient(num_rows: int, dim: int, draws: int, rank: int) -> torch.Tensor:
    """One rank's dense embedding gradient: one random row added per draw (as index_add in backward)."""
    rows = zipf_rows(num_rows, draws, seed=7919 * (rank + 1))
    values = torch.randn(draws, dim, generator=torch.Generator().manual_seed(rank))
    return torch.zeros(num_rows, dim).index_add_(0, rows, values)


def _measure(prepare: Callable[[], Any], op: Callable[[Any], Any], reps: int, iface: str) -> dict[str, Any]:
    """Per-rep seconds and CPU seconds of ``op(prepare())`` (prepare untimed, before the barrier), tx bytes per rep."""
    result = op(prepare())  # warm-up
    before = fenced_tx(iface)
    seconds, cpu = [], []
    for _ in range(reps):
        arg = prepare()
        dist.barrier()
        start, start_cpu = time.perf_counter(), cpu_seconds()
        result = op(arg)
        seconds.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    return {"seconds": seconds, "cpu_s": cpu, "tx": (fenced_tx(iface) - before) / reps, "result": result}


def _torch_sparse(coo: torch.Tensor, dense: bool) -> torch.Tensor:
    work = dist.all_reduce(coo, async_op=True)
    work.wait()
    out = work.result()[0]
    return out.to_dense() if dense else out


def _dense_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def _zen(x: torch.Tensor, scheme: str, out: torch.Tensor | None, box: dict[str, Any]) -> torch.Tensor:
    stats = zensync.SyncStats()
    result = zensync.sparse_allreduce(x, scheme=scheme, out=out, stats=stats)
    box["stats"] = stats
    return result


def _workload(name: str, args: argparse.Namespace, barrier_tx: float) -> dict[str, Any]:
    """Every op on one workload, on this rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    rows, dim, draws = _WORKLOADS[name]
    g = embedding_gradient(rows, dim, draws, rank)
    expected = torch.stack([embedding_gradient(rows, dim, draws, r).double() for r in range(n)]).sum(0)
    union = int((expected != 0).any(1).sum())
    local = int((g != 0).any(1).sum())
    coo = g.to_sparse(sparse_dim=1).coalesce()
    buf = torch.empty_like(g)

    def copy() -> torch.Tensor:
        return buf.copy_(g)

    boxes: dict[str, dict[str, Any]] = {"zen": {}, "zen out=input": {}, "agsparse": {}}
    ops: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
        "dense": (copy, _dense_all_reduce),
        "torch sparse + to_dense": (coo.clone, lambda c: _torch_sparse(c, True)),
        "torch sparse (COO out)": (coo.clone, lambda c: _torch_sparse(c, False)),
        "zen": (lambda: g, lambda x: _zen(x, "zen", None, boxes["zen"])),
        "zen out=input": (copy, lambda x: _zen(x, "zen", x, boxes["zen out=input"])),
        "agsparse": (lambda: g, lambda x: _zen(x, "agsparse", None, boxes["agsparse"])),
    }
    rows_out: dict[str, Any] = {}
    for op_name, (prepare, op) in ops.items():
        m = _measure(prepare, op, args.reps, args.iface)
        result = m.pop("result")
        dense_result = result.to_dense() if result.is_sparse else result
        m["max_abs_err"] = float((dense_result.double() - expected).abs().max())
        m["tx"] -= barrier_tx / args.reps
        box = boxes.get(op_name)
        if box:
            st = box["stats"]
            m["phase_time_s"] = dict(st.phase_time_s)
            m["engine_bytes_sent"] = sum(p.bytes_sent + p.control_bytes_sent for p in st.phases.values())
            m["collectives"] = getattr(st, "collectives", None)
        rows_out[op_name] = m
    rows_out.update(_floors(g, boxes["zen out=input"]["stats"], args))
    return {"local_rows": local, "union": union, "ops": rows_out}


def _floors(g: torch.Tensor, zen_stats: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Where zen's time goes: its scan alone, and its collectives alone (same bytes, no compute).

    The replay sends zen's push bytes split evenly over the peers (with a size exchange first: one
    collective more than zen's folded push) and all-gathers a payload of zen's pull size.
    """
    transport = transport_for_group(None)
    n = transport.world_size
    push_bytes = zen_stats.phases["push"].bytes_sent
    pull_bytes = zen_stats.phases["pull"].bytes_sent // max(1, n - 1)
    counts = [0 if j == transport.rank else push_bytes // (n - 1) for j in range(n)]
    push = torch.zeros(sum(counts), dtype=torch.uint8)
    pull = torch.zeros(pull_bytes, dtype=torch.uint8)

    def replay(_: Any) -> torch.Tensor:
        transport.all_to_all_v(push, counts)
        transport.all_gather_v(pull)
        return push

    out = {}
    for name, (prepare, op) in {
        "floor: zen's scan alone": (lambda: g, kernels.nonzero_items),
        "floor: zen's collectives alone": (lambda: None, replay),
    }.items():
        m = _measure(prepare, op, args.reps, args.iface)
        m.pop("result")
        m["max_abs_err"] = None
        out[name] = m
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank: every op on every workload; writes rank<r>.json."""
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    barrier_tx = -fenced_tx(args.iface) + fenced_tx(args.iface)
    report: dict[str, Any] = {"rank": rank, "barrier_tx": barrier_tx, "workloads": {}}
    for name in args.workload:
        report["workloads"][name] = _workload(name, args, barrier_tx)
    pathlib.Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _summarize(args: argparse.Namespace, ranks: list[dict[str, Any]], rate_bits: int | None) -> dict[str, Any]:
    n = len(ranks)
    out: dict[str, Any] = {}
    for name in args.workload:
        rows, dim, draws = _WORKLOADS[name]
        per = [r["workloads"][name] for r in ranks]
        k = statistics.mean(p["local_rows"] for p in per)
        union = per[0]["union"]
        eq1_bytes = (n - 1) / n * (k + union) * (4 + 4 * dim)
        table = {}
        for op in per[0]["ops"]:
            med = statistics.median(max(p["ops"][op]["seconds"][i] for p in per) for i in range(args.reps))
            cpu = [statistics.median(p["ops"][op]["cpu_s"]) for p in per]
            table[op] = {
                "median_s": med,
                "cpu_s_per_rank": cpu,
                "cpu_bound_s": sum(cpu) / (os.cpu_count() or 1),
                "wire_tx_per_host": [p["ops"][op]["tx"] for p in per],
                "max_abs_err": None
                if per[0]["ops"][op]["max_abs_err"] is None
                else max(p["ops"][op]["max_abs_err"] for p in per),
                "engine_bytes_sent": [p["ops"][op].get("engine_bytes_sent") for p in per],
                "phase_time_s_rank0": per[0]["ops"][op].get("phase_time_s"),
                "collectives_rank0": per[0]["ops"][op].get("collectives"),
            }
        peer = table["torch sparse + to_dense"]["median_s"]
        for row in table.values():
            row["speedup_vs_torch_sparse"] = peer / row["median_s"]
            row["speedup_vs_dense"] = table["dense"]["median_s"] / row["median_s"]
        eq1_s = eq1_bytes * 8 / rate_bits if rate_bits else None
        out[name] = {
            "shape": [rows, dim],
            "draws": draws,
            "local_rows_mean": k,
            "union": union,
            "eq1_bytes_per_host": eq1_bytes,
            "eq1_s": eq1_s,
            "zen_over_eq1": table["zen"]["median_s"] / eq1_s if eq1_s else None,
            "zen_inplace_over_eq1": table["zen out=input"]["median_s"] / eq1_s if eq1_s else None,
            "ops": table,
        }
    return out


def _markdown(meta: dict[str, Any], res: dict[str, Any]) -> str:
    lines = [
        f"# zen vs torch's sparse all_reduce on {meta['label']} ({meta['date']})",
        "",
        f"Command: `{meta['command']}`; torch {meta['torch']}, {meta['cpus']} CPUs, reps {meta['reps']} "
        "(median of the max over ranks, after one warm-up).",
    ]
    for name, w in res.items():
        eq1 = f"{w['eq1_s'] * 1e3:.2f} ms" if w["eq1_s"] else "n/a (no shaping)"
        lines += [
            "",
            f"## {name}: [{w['shape'][0]}, {w['shape'][1]}] float32, {w['draws']} Zipf(1.1) draws per rank",
            "",
            f"K = {w['local_rows_mean']:.0f} rows per rank, U = {w['union']} union; Eq. 1 bytes per host "
            f"{w['eq1_bytes_per_host']:,.0f}, wire time {eq1}.",
            "",
            "| op | median ms | x torch sparse | x dense | CPU ms/rank | CPU floor ms | wire tx/host (mean) "
            "| max abs err | phases rank 0 (ms) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for op, row in w["ops"].items():
            phases = row["phase_time_s_rank0"]
            ph = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items()) if phases else ""
            lines.append(
                f"| {op} | {row['median_s'] * 1e3:.1f} | {row['speedup_vs_torch_sparse']:.2f} | "
                f"{row['speedup_vs_dense']:.1f} | {statistics.mean(row['cpu_s_per_rank']) * 1e3:.1f} | "
                f"{row['cpu_bound_s'] * 1e3:.1f} | {statistics.mean(row['wire_tx_per_host']):,.0f} | "
                f"{'n/a' if row['max_abs_err'] is None else format(row['max_abs_err'], '.2e')} | {ph} |"
            )
        lines += [
            "",
            "CPU ms/rank: median CPU time (user + system, all threads of the process) of one call, mean over "
            f"ranks; CPU floor: the ranks' CPU times summed over the {meta['cpus']} cores, the wall time the "
            "shared cores need for the op whatever the network.",
        ]
        if w["zen_over_eq1"]:
            lines += [
                "",
                f"zen / Eq. 1 wire time: {w['zen_over_eq1']:.2f}; "
                f"zen out=input / Eq. 1: {w['zen_inplace_over_eq1']:.2f}.",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Driver (or, with --worker, one rank)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--workload", nargs="+", choices=sorted(_WORKLOADS), default=["small", "large"])
    p.add_argument("--label", default="", help="results file stem: sparse_peer_<label>_<date>")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--iface", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp, make_cluster(args.hosts, rate=args.rate) as cluster:
        emulated = isinstance(cluster, EmulatedCluster)
        iface = "eth0" if emulated else ""
        cluster.run_workers(
            lambda r: [
                sys.executable,
                os.path.abspath(__file__),
                *forwarded,
                *("--worker", "--out", tmp, "--iface", iface),
            ],
            lambda r: {**cluster.env_for_torch(r, _PORT), "OMP_NUM_THREADS": "1"},
            timeout_s=args.timeout_s,
        )
        ranks = [json.loads(pathlib.Path(tmp, f"rank{r}.json").read_text()) for r in range(args.hosts)]
    res = _summarize(args, ranks, parse_rate(args.rate) if emulated else None)
    date = datetime.date.today().isoformat()
    label = args.label or (f"netns{args.hosts}x{args.rate}" if emulated else f"loopback{args.hosts}")
    meta = {
        "date": date,
        "label": label,
        "command": " ".join(["python", "experiments/sparse_peer_bench.py", *forwarded]),
        "hosts": args.hosts,
        "rate": args.rate,
        "reps": args.reps,
        **versions(),
    }
    write(args.results_dir, f"sparse_peer_{label}_{date}", meta, res, _markdown(meta, res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Emulated cluster: dense gloo allreduce vs zen sparse_allreduce on shaped links, wire bytes vs engine bytes.

Launch (from the repository root, as root; without root it falls back to unshaped loopback and says so)::

    python experiments/emulated_cluster.py                       # 4 hosts, 1gbit, ~1 min on 2 cores
    python experiments/emulated_cluster.py --hosts 4 --rate 100mbit --reps 3
    python experiments/emulated_cluster.py --no-offload          # MTU-sized frames (CPU-bound at 1gbit)
    # LM embedding gradients at their natural density (rows the LM workload's batches touch):
    python experiments/emulated_cluster.py --numel 38400000 --dim 768 --lm-batch 128 --dense-mb 0 --label lm768-b128

Each of ``--hosts`` workers runs as its own host in a network namespace (``zensync.testbed``), every
link shaped to ``--rate`` each way. Per rank, excluding one warm-up call each:

(a) dense: ``torch.distributed.all_reduce`` of ``--dense-mb`` MB float32 (0: the zen tensor's size;
    engine bytes by the ring model, 2(n-1)/n B per host), predicted time 2(n-1)/n B / (rate/8);
(b) zen: ``zensync.sparse_allreduce(x, scheme="zen")`` on ``--numel`` float32 elements (rows of
    ``--dim`` when > 1) at ``--density`` (uniform random ids per rank) or, with ``--lm-batch B``, the
    rows that B sequences of the LM workload touch on each rank; integer values so the sum is exact.
    Engine bytes = payload + control bytes of every phase (validate included); Eq. 1 bytes
    (n-1)/n (K+U)(4 + 4 dim), K local non-zero items, U the union;
(c) the same zen calls with every collective fenced by a barrier (``Transport.fenced``): the push +
    pull transfer time without waiting for slower ranks' local work, compared with Eq. 1 at the
    bandwidth the dense allreduce achieved.

Wire bytes are eth0 tx byte deltas per host read from the kernel (inside each namespace), minus the
bytes of the barriers that fence each measurement (measured separately). Expected at 4 hosts / 1gbit
on 2 cores: dense near its prediction, wire bytes within +-10 % of the engine's count (GSO offload:
headers add ~0.3 %; --no-offload ~4-5 %), zen's wall time dominated by local compute and per-
collective latency for small tensors, its fenced transfer near Eq. 1 for large ones. Results:
``experiments/results/emulated_cluster_[<label>_]<date>.{json,md}``.
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

import zensync
from zensync.testbed import EmulatedCluster, make_cluster, parse_rate
from zensync.transport import TrafficLog, transport_for_group
from zensync.workloads import lm

# Sibling modules of this driver (experiments/ is not a package).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _counters import fenced_tx

_PORT = 29533
"""Pause after a barrier before reading counters, so queued frames have left the interface."""
_WIRE_TOLERANCE = 0.10
"""Target: wire bytes within 10 % of the engine's count (TCP/IP headers are ~3-5 % at MTU 1500)."""


# -- worker (runs inside host namespace r) ---------------------------------------------------------


def _measure(fn: Any, reps: int, iface: str | None) -> tuple[list[float], float]:
    """(seconds per rep, tx bytes per rep) of ``fn``; barrier bytes are subtracted by the caller."""
    fn()  # warm-up
    before = fenced_tx(iface)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds, (fenced_tx(iface) - before) / reps


def _lm_rows(args: argparse.Namespace, rank: int) -> torch.Tensor:
    """Embedding rows rank ``rank`` touches in step 0 of the LM workload (its natural density)."""
    config = lm.Config(vocab_size=args.numel // args.dim, embed_dim=args.dim, batch_size=args.lm_batch)
    inputs, _ = lm.batch_for_rank(lm.load_corpus(config), config, rank, step=0)
    return torch.unique(inputs)


def _sparse_input(args: argparse.Namespace, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_items = args.numel // args.dim  # rows of an embedding gradient when --dim > 1
    if args.lm_batch:
        idx = _lm_rows(args, rank)
    else:
        gen = torch.Generator().manual_seed(1000 + rank)
        idx = torch.randperm(num_items, generator=gen)[: int(num_items * args.density)]
    x = torch.zeros(num_items, args.dim) if args.dim > 1 else torch.zeros(args.numel)
    x[idx] = float(rank + 1)
    return x, idx


def _replay_collectives(transport: Any, stats: Any, reps: int) -> list[float]:
    """Fenced push + pull times of zen's collectives alone: same byte counts, no hashing or decoding.

    Push: an all_to_all_v sending this rank's push bytes split evenly over its peers. Pull: an
    all_gather_v of this rank's share of the pull bytes (received bytes / peers). The ratio of zen's
    fenced transfer time to this is zen's overhead beyond what the collectives themselves cost here.
    """
    n = transport.world_size
    push_bytes, pull_bytes = stats.phases["push"].bytes_sent, stats.phases["pull"].bytes_recv
    counts = [0 if j == transport.rank else push_bytes // (n - 1) for j in range(n)]
    push = torch.zeros(sum(counts), dtype=torch.uint8)
    pull = torch.zeros(pull_bytes // (n - 1), dtype=torch.uint8)
    out = []
    for _ in range(reps):
        log = TrafficLog()
        with transport.recording(log), transport.fenced():
            transport.all_to_all_v(push, counts)
            transport.all_gather_v(pull)
        out.append(sum(p.comm_time_s for p in log.phases.values()))
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank: barrier cost, dense allreduce, zen sparse_allreduce; writes rank<r>.json."""
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
    rank, n = dist.get_rank(), dist.get_world_size()
    iface = args.iface or None
    # barrier cost: two fenced reads with nothing between them
    barrier_tx = -fenced_tx(iface) + fenced_tx(iface)
    dense_numel = int(args.dense_mb * 1e6) // 4 if args.dense_mb > 0 else (args.numel // args.dim) * args.dim
    dense = torch.full((dense_numel,), float(rank + 1))
    dense_s, dense_tx = _measure(lambda: dist.all_reduce(dense.clone()), args.reps, iface)
    chunk = dense.numel() // n + (1 if rank < dense.numel() % n else 0)
    x, idx = _sparse_input(args, rank)
    last: dict[str, Any] = {}

    def zen() -> None:
        stats = zensync.SyncStats()
        last["out"] = zensync.sparse_allreduce(x, scheme="zen", stats=stats)
        last["stats"] = stats

    zen_s, zen_tx = _measure(zen, args.reps, iface)
    stats = last["stats"]
    # The same calls with every collective fenced by a barrier: transfer time without rank skew.
    transport = transport_for_group(None)
    fenced_s = []
    for _ in range(args.reps):
        fenced_stats = zensync.SyncStats()
        with transport.fenced():
            zensync.sparse_allreduce(x, transport, scheme="zen", stats=fenced_stats)
        fenced_s.append({k: p.comm_time_s for k, p in fenced_stats.phases.items()})
    replay_s = _replay_collectives(transport, stats, args.reps)
    expected = torch.zeros_like(x)
    for r in range(n):
        expected[_sparse_input(args, r)[1]] += float(r + 1)
    union = int((expected.reshape(expected.shape[0], -1) != 0).any(1).sum())
    result = {
        "rank": rank,
        "barrier_tx": barrier_tx,
        "dense": {
            "seconds": dense_s,
            "tx_per_rep": dense_tx - barrier_tx / args.reps,
            "engine_bytes": 2 * (dense.numel() - chunk) * 4,
            "bytes": dense.numel() * 4,
        },
        "zen": {
            "seconds": zen_s,
            "tx_per_rep": zen_tx - barrier_tx / args.reps,
            "engine_bytes": sum(p.bytes_sent + p.control_bytes_sent for p in stats.phases.values()),
            "payload_bytes": stats.bytes_sent,
            "phases": {
                k: {"sent": p.bytes_sent, "control": p.control_bytes_sent, "comm_s": p.comm_time_s}
                for k, p in stats.phases.items()
            },
            "comm_s": sum(p.comm_time_s for p in stats.phases.values()),
            "fenced_phase_s": fenced_s,
            "replay_s": replay_s,
            "local_nnz": int(idx.numel()),
            "union": union,
            "exact": bool(torch.equal(last["out"], expected)),
        },
    }
    pathlib.Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# -- driver ----------------------------------------------------------------------------------------


def _summarize(
    args: argparse.Namespace, ranks: list[dict[str, Any]], rate_bits: int | None, emulated: bool
) -> dict[str, Any]:
    n = len(ranks)
    out: dict[str, Any] = {}
    k_mean = statistics.mean(r["zen"]["local_nnz"] for r in ranks)
    union = ranks[0]["zen"]["union"]
    record_bytes = 4 + 4 * args.dim  # int32 index + one item's float32 values
    predict = {
        "dense": 2 * (n - 1) / n * ranks[0]["dense"]["bytes"],
        "zen": (n - 1) / n * (k_mean + union) * record_bytes,
    }
    for name in ("dense", "zen"):
        med = statistics.median(max(r[name]["seconds"][i] for r in ranks) for i in range(args.reps))
        engine = [r[name]["engine_bytes"] for r in ranks]
        wire = [r[name]["tx_per_rep"] for r in ranks] if emulated else None
        row = {
            "median_s": med,
            "engine_bytes_per_host": engine,
            "wire_tx_bytes_per_host": wire,
            "wire_over_engine": [w / e for w, e in zip(wire, engine, strict=True)] if wire else None,
            "predicted_bytes_per_host": predict[name],
            "predicted_s": predict[name] * 8 / rate_bits if rate_bits else None,
        }
        if name == "zen":
            row["comm_s_max"] = max(r["zen"]["comm_s"] for r in ranks)
            # Transfer time of push + pull with fenced collectives: max over ranks, median over reps.
            row["fenced_transfer_s"] = statistics.median(
                max(
                    r["zen"]["fenced_phase_s"][i].get("push", 0.0) + r["zen"]["fenced_phase_s"][i].get("pull", 0.0)
                    for r in ranks
                )
                for i in range(args.reps)
            )
            row["fenced_phase_s_rank0"] = ranks[0]["zen"]["fenced_phase_s"]
            row["replay_s"] = statistics.median(max(r["zen"]["replay_s"][i] for r in ranks) for i in range(args.reps))
            row.update(
                local_nnz_mean=k_mean,
                item_density=k_mean / (args.numel // args.dim),
                union=union,
                exact=all(r["zen"]["exact"] for r in ranks),
                phases_rank0=ranks[0]["zen"]["phases"],
            )
        out[name] = row
    # Eq. 1 with the bandwidth the dense allreduce achieved (bytes per host / its median time).
    measured_bw = out["dense"]["predicted_bytes_per_host"] / out["dense"]["median_s"]
    out["measured_bandwidth_bytes_per_s"] = measured_bw
    out["zen"]["predicted_s_measured_bw"] = out["zen"]["predicted_bytes_per_host"] / measured_bw
    out["zen"]["fenced_over_eq1"] = out["zen"]["fenced_transfer_s"] / out["zen"]["predicted_s_measured_bw"]
    out["zen_transfer_over_dense_time"] = out["zen"]["fenced_transfer_s"] / out["dense"]["median_s"]
    out["zen"]["fenced_over_replay"] = out["zen"]["fenced_transfer_s"] / out["zen"]["replay_s"]
    out["zen"]["replay_over_eq1"] = out["zen"]["replay_s"] / out["zen"]["predicted_s_measured_bw"]
    out["zen_over_dense_time"] = out["zen"]["median_s"] / out["dense"]["median_s"]
    out["barrier_tx_bytes"] = [r["barrier_tx"] for r in ranks]
    return out


def _markdown(meta: dict[str, Any], res: dict[str, Any]) -> str:
    lines = [
        f"# Emulated cluster: dense vs zen on shaped links ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Cluster: {meta['cluster']}, {meta['hosts']} hosts, rate {meta['rate']} per link each way, "
        f"offload={meta['offload']}; torch {meta['torch']}, Python {meta['python']}, {meta['cpus']} CPUs, "
        f"kernel {meta['kernel']}; reps {meta['reps']} (after 1 warm-up).",
        "",
        "| op | median time (s) | predicted (s) | engine bytes/host | wire tx bytes/host | wire/engine |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in (
        ("dense", f"gloo allreduce {meta['dense_mb']} MB"),
        ("zen", f"zen {meta['numel']:,} el (item {meta.get('dim', 1)}) @ {res['zen']['item_density']:.2%}"),
    ):
        r = res[name]
        wire = ", ".join(f"{w:,.0f}" for w in r["wire_tx_bytes_per_host"]) if r["wire_tx_bytes_per_host"] else "n/a"
        ratio = ", ".join(f"{x:.3f}" for x in r["wire_over_engine"]) if r["wire_over_engine"] else "n/a"
        pred = f"{r['predicted_s']:.4f}" if r["predicted_s"] else "n/a"
        lines.append(
            f"| {label} | {r['median_s']:.4f} | {pred} | "
            f"{', '.join(f'{e:,}' for e in r['engine_bytes_per_host'])} | {wire} | {ratio} |"
        )
    z = res["zen"]
    lines += [
        "",
        f"zen: K = {z['local_nnz_mean']:,.0f} local non-zeros, U = {z['union']:,} union; Eq. 1 bytes/host "
        f"{z['predicted_bytes_per_host']:,.0f}; comm time inside collectives (max over ranks) "
        f"{z['comm_s_max']:.4f} s; result exact on every rank: {z['exact']}.",
        f"Measured bandwidth (dense allreduce) {res['measured_bandwidth_bytes_per_s'] / 1e6:.1f} MB/s; Eq. 1 time at "
        f"that bandwidth {z['predicted_s_measured_bw']:.4f} s; zen / dense time {res['zen_over_dense_time']:.3f}.",
        f"Fenced (every collective after a barrier) push + pull transfer time {z['fenced_transfer_s']:.4f} s = "
        f"{z['fenced_over_eq1']:.3f} x Eq. 1 at the measured bandwidth; zen transfer / dense time "
        f"{res['zen_transfer_over_dense_time']:.3f}.",
        f"The same collectives replayed alone (same bytes, no hashing or decoding, fenced): "
        f"{z['replay_s']:.4f} s = {z['replay_over_eq1']:.3f} x Eq. 1; zen's fenced transfer / replay = "
        f"{z['fenced_over_replay']:.3f}.",
        f"Barrier bytes subtracted per fence: {res['barrier_tx_bytes']}.",
        "",
        f"Wire target: every wire/engine within 1 +- {_WIRE_TOLERANCE:.0%}: {meta['wire_ok']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Driver (or, with --worker, one rank)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--dense-mb", type=float, default=32.0)
    p.add_argument("--numel", type=int, default=10_000_000)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--dim", type=int, default=1, help="item size: > 1 syncs rows of an (numel/dim, dim) table")
    p.add_argument(
        "--lm-batch",
        type=int,
        default=0,
        help="> 0: rows touched by this many sequences of the LM workload per rank (natural density; --density unused)",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-offload", action="store_true")
    p.add_argument("--label", default="", help="results file stem: emulated_cluster_<label>_<date>")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--iface", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    with (
        tempfile.TemporaryDirectory() as tmp,
        make_cluster(args.hosts, rate=args.rate, offload=not args.no_offload) as cluster,
    ):
        emulated = isinstance(cluster, EmulatedCluster)
        iface = "eth0" if emulated else ""
        before = cluster.counters()
        cluster.run_workers(
            lambda r: [
                sys.executable,
                os.path.abspath(__file__),
                *forwarded,
                "--worker",
                "--out",
                tmp,
                "--iface",
                iface,
            ],
            lambda r: {**cluster.env_for_torch(r, _PORT), "OMP_NUM_THREADS": "1"},
            timeout_s=args.timeout_s,
        )
        after = cluster.counters()
        ranks = [json.loads(pathlib.Path(tmp, f"rank{r}.json").read_text()) for r in range(args.hosts)]
    res = _summarize(args, ranks, parse_rate(args.rate) if emulated else None, emulated)
    ratios = (res["dense"]["wire_over_engine"] or []) + (res["zen"]["wire_over_engine"] or [])
    date = datetime.date.today().isoformat()
    meta = {
        "date": date,
        "command": " ".join(["python", "experiments/emulated_cluster.py", *forwarded]),
        "cluster": type(cluster).__name__,
        "hosts": args.hosts,
        "rate": args.rate,
        "offload": not args.no_offload,
        "dense_mb": args.dense_mb,
        "numel": args.numel,
        "density": args.density,
        "dim": args.dim,
        "reps": args.reps,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "zensync": zensync.__version__,
        "wire_ok": bool(ratios) and all(abs(x - 1) <= _WIRE_TOLERANCE for x in ratios),
        "whole_run_tx_per_host": [a[0] - b[0] for a, b in zip(after, before, strict=True)] if emulated else None,
    }
    out_dir = pathlib.Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"emulated_cluster_{args.label + '_' if args.label else ''}{date}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": res, "ranks": ranks}, indent=2))
    stem.with_suffix(".md").write_text(_markdown(meta, res))
    print(_markdown(meta, res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

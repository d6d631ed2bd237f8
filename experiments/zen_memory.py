"""Zen's extra memory per rank: a small multiple of the non-zeros it handles, never O(n * |G|).

Launch:
    python experiments/zen_memory.py            # default sweep, about a minute on 2 cores

Each configuration runs in a fresh child process (so the peak-RSS high-water mark is its own): the
child allocates every rank's input, records its resident set size, runs one zen sparse_allreduce on
the simulated world, and reads its peak RSS. Per rank,

    extra = (peak RSS - RSS before the call - n * output bytes) / n

is what zen allocated beyond its input and its result. It is compared with the bytes of the records
the rank handled (its own non-zeros, the records it received in the push, and the aggregated
partitions it decoded in the pull) and with the dense tensor size |G|. Expected: extra is a small
multiple of the handled records (plus one bitmap of |G|/8 bytes) and far below |G|; it does not grow
with n. Results go to experiments/results/zen_memory_<hardware>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import pathlib
import platform
import resource

import torch

import zensync

RESULTS = pathlib.Path(__file__).parent / "results"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _child(num_items: int, num_ranks: int, density: float, queue: mp.Queue) -> None:
    gen = torch.Generator().manual_seed(0)
    k = int(num_items * density)
    inputs = []
    for _ in range(num_ranks):
        x = torch.zeros(num_items)
        x[torch.randint(0, num_items, (k,), generator=gen)] = 1.0
        inputs.append(x)

    def body(t: zensync.Transport) -> dict:
        stats = zensync.SyncStats()
        out = zensync.sparse_allreduce(inputs[t.rank], group=t, scheme="zen", stats=stats)
        handled = stats.local_nnz + stats.phases["push"].bytes_recv // 8 + (stats.global_nnz or 0)
        del out
        return {"handled_records": handled, "bitmap_words": stats.pull_bitmap_words}

    # Warm up kernels (numba JIT) on a tiny world first, so compilation is not counted.
    zensync.SimulatedWorld(2).run(lambda t: zensync.sparse_allreduce(torch.ones(64), group=t))
    before = _rss_bytes()
    per_rank = zensync.SimulatedWorld(num_ranks, timeout_s=600).run(body)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out_bytes = num_items * 4
    extra = (peak - before - num_ranks * out_bytes) / num_ranks
    handled = sum(r["handled_records"] for r in per_rank) / num_ranks
    queue.put(
        {
            "num_items": num_items,
            "num_ranks": num_ranks,
            "density": density,
            "extra_bytes_per_rank": extra,
            "handled_record_bytes_per_rank": handled * 8,
            "bitmap_bytes": per_rank[0]["bitmap_words"] * 4,
            "dense_bytes": out_bytes,
        }
    )


def measure(num_items: int, num_ranks: int, density: float) -> dict:
    """Run one configuration in a fresh process and return its row."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(num_items, num_ranks, density, queue))
    proc.start()
    row = queue.get(timeout=900)
    proc.join(timeout=60)
    row["extra_over_handled"] = row["extra_bytes_per_rank"] / max(1.0, row["handled_record_bytes_per_rank"])
    row["extra_over_dense"] = row["extra_bytes_per_rank"] / row["dense_bytes"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-items", type=int, default=20_000_000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    args = parser.parse_args()
    rows = []
    for density in args.densities:
        for n in args.ranks:
            row = measure(args.num_items, n, density)
            rows.append(row)
            print(
                f"n={n:3d} d={density:.3%}: extra/rank {row['extra_bytes_per_rank'] / 2**20:8.1f} MiB, "
                f"handled records {row['handled_record_bytes_per_rank'] / 2**20:8.1f} MiB "
                f"(x{row['extra_over_handled']:.2f}), |G| {row['dense_bytes'] / 2**20:.0f} MiB "
                f"(x{row['extra_over_dense']:.3f})",
                flush=True,
            )
    date = datetime.date.today().isoformat()
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"zen_memory_cpu{mp.cpu_count()}core_{date}"
    meta = {"python": platform.python_version(), "torch": torch.__version__, "date": date, "args": vars(args)}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        f"# Zen extra memory per rank ({date})",
        "",
        f"Command: `python experiments/zen_memory.py` ({json.dumps(vars(args))}); torch {torch.__version__}.",
        "",
        "| n | density | extra/rank MiB | handled records MiB | extra/handled | bitmap MiB | extra/dense |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['num_ranks']} | {r['density']:.3%} | {r['extra_bytes_per_rank'] / 2**20:.1f} | "
            f"{r['handled_record_bytes_per_rank'] / 2**20:.1f} | {r['extra_over_handled']:.2f} | "
            f"{r['bitmap_bytes'] / 2**20:.2f} | {r['extra_over_dense']:.3f} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

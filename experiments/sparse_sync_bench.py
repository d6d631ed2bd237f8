"""Sparse sync bench: bytes received per rank by every scheme, against Zen's cost formulas.

Launch (from the repository root)::

    python experiments/sparse_sync_bench.py            # full run, 5-10 min on 2 CPU cores
    python experiments/sparse_sync_bench.py --quick    # smoke test, under 30 s

Workloads (reference/zen.md 1.1 and 4):

* ``lm``: embedding gradients (50k x 64 float32, row mode) of an LSTM LM trained on the Python
  stdlib's source (``zensync.workloads.lm``); natural density about 0.5 % of rows, skew ~12 at n=16.
* ``zipf-uniform`` / ``zipf-skewed``: 10M float32 elements (element mode) at 1 % density per rank,
  ids uniform (s=0, no shared pool) or Zipf s=1.1 with 30 % of each rank's ids from a shared pool.

For n in 4..128 logical ranks (``zensync.SimulatedWorld``, one thread each) every scheme syncs the
same per-rank tensors; each rank builds its dense tensor inside the SPMD function from a cached
compact form, so memory stays bounded. Received bytes are payload bytes over all phases except
``validate`` (the argument agreement, reported separately). Predictions, with e = value bytes per
item, i = 4 index bytes, K = mean local non-zero items, U = union of the n ranks' items, N = items:

* zen (hash-bitmap pull): (n-1)/n K (i+e) + (n-1)/n min(U (i+e), U e + N/8, N e); zen COO (Eq. 1):
  (n-1)/n (K+U)(i+e);
* sparcml (Eq. 2): sum over stages s=1..log2 n of U_{2^(s-1)} (i+e), U_m the mean union of aligned
  m-rank blocks (measured offline from the index sets);
* dense ring: 2 (n-1)/n M bytes; agsparse: (n-1) K (i+e).

Expected result (2 cores): zen within 10 % of its bitmap prediction at every n; zen push/pull
imbalance < 1.1 on Zipf (>= 100k non-zeros per rank); sparse_ps skew > 3 on the LM at n=16; the
n=128 zen run on 10M elements under 60 s; every scheme lossless (within the float32 summation
bound). On a 23 GB machine the 10M-element agsparse/sparcml/omnireduce runs stop at n=32-64: runs
whose extrapolated peak RSS or time exceed --memory-budget-gb / --max-run-s are skipped and listed.
Results: ``experiments/results/sparse_sync_<hardware>_<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import zensync
from zensync.workloads import lm, zipf

# Sibling modules of this driver (experiments/ is not a package).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _sparse_sync_guard as guards
import _sparse_sync_report as report

INDEX_BYTES = 4
"""Bytes of one item index on the wire (int32)."""
LOSSLESS_SLACK = 2.0
"""Margin on the worst-case summation error bound (n - 1) u sum|x| used by the lossless check."""
SCHEMES = tuple(zensync.SCHEMES)
DEFAULT_RANKS = (4, 8, 16, 32, 64, 128)
WORKLOADS = ("lm", "zipf")


@dataclasses.dataclass(kw_only=True, slots=True)
class Workload:
    """Per-rank non-zeros of one workload, compact: rank r's dense tensor is rebuilt on demand."""

    name: str
    params: dict[str, Any]
    num_items: int
    item_numel: int
    dtype: torch.dtype
    ids: list[torch.Tensor]
    """Sorted non-zero item ids per rank."""
    values: list[torch.Tensor]
    """Their values, (k,) or (k, item_numel)."""
    block_unions: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    """m -> union sizes of the aligned rank blocks [0, m), [m, 2m), ... (m a power of two)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_items,) if self.item_numel == 1 else (self.num_items, self.item_numel)

    @property
    def item_bytes(self) -> int:
        return self.item_numel * torch.empty((), dtype=self.dtype).element_size()

    def dense(self, rank: int) -> torch.Tensor:
        out = torch.zeros(self.shape, dtype=self.dtype)
        out[self.ids[rank]] = self.values[rank]
        return out

    def reference(self, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(dense sum over ranks 0..num_ranks-1 in rank order, allowed absolute error per element).

        Any summation order of n terms errs by at most (n - 1) u sum|x_r| (u = unit roundoff), so a
        lossless scheme stays within that bound (with LOSSLESS_SLACK) whatever its order.
        """
        total, bound = torch.zeros(self.shape, dtype=self.dtype), torch.zeros(self.shape, dtype=self.dtype)
        for rank in range(num_ranks):
            total.index_add_(0, self.ids[rank], self.values[rank])
            bound.index_add_(0, self.ids[rank], self.values[rank].abs())
        unit_roundoff = torch.finfo(self.dtype).eps / 2
        return total, bound.mul_(LOSSLESS_SLACK * max(num_ranks - 1, 1) * unit_roundoff)


# ---------------------------------------------------------------------------------------------------------------------
# Workload construction
# ---------------------------------------------------------------------------------------------------------------------


def build_lm(config: lm.Config, num_ranks: int, log: Callable[[str], None]) -> Workload:
    """Embedding gradients of ``num_ranks`` ranks (one shared model), stored as non-zero rows."""
    start = time.perf_counter()
    ids, values = [], []
    for grad in lm.iter_embedding_gradients(config, num_ranks, step=0, model_seed=config.seed):
        rows = grad.abs().sum(dim=1).nonzero().view(-1)
        ids.append(rows)
        values.append(grad[rows].clone())
    log(f"  lm: {num_ranks} ranks of embedding gradients in {time.perf_counter() - start:.1f} s")
    return Workload(
        name="lm",
        params={k: getattr(config, k) for k in config.__slots__},
        num_items=config.vocab_size,
        item_numel=config.embed_dim,
        dtype=torch.float32,
        ids=ids,
        values=values,
    )


def build_zipf(name: str, params: dict[str, Any], num_ranks: int, log: Callable[[str], None]) -> Workload:
    """Zipf tensors of ``num_ranks`` ranks (two generator threads), stored compactly."""
    start = time.perf_counter()

    def one(rank: int) -> zipf.ZipfSparse:
        return zipf.zipf_sparse(rank, params["num_items"], 1, **{k: v for k, v in params.items() if k != "num_items"})

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        parts = list(pool.map(one, range(num_ranks)))
    log(f"  {name}: {num_ranks} ranks generated in {time.perf_counter() - start:.1f} s")
    return Workload(
        name=name,
        params=params,
        num_items=params["num_items"],
        item_numel=1,
        dtype=torch.float32,
        ids=[p[0] for p in parts],
        values=[p[1] for p in parts],
    )


def measure_block_unions(workload: Workload) -> None:
    """Union sizes of aligned rank blocks of every power-of-two size, by pairwise sorted merges."""
    level = list(workload.ids)
    size = 1
    workload.block_unions[1] = [t.numel() for t in level]
    while len(level) >= 2:
        level = [torch.cat(level[j : j + 2]).unique() for j in range(0, len(level) - 1, 2)]
        size *= 2
        workload.block_unions[size] = [t.numel() for t in level]


def union_size(workload: Workload, num_ranks: int) -> int:
    """|I_0 | ... | I_{n-1}|: from the block tree when n is a power of two, else merged directly."""
    if workload.block_unions.get(num_ranks):
        return workload.block_unions[num_ranks][0]
    return int(torch.cat(workload.ids[:num_ranks]).unique().numel())


# ---------------------------------------------------------------------------------------------------------------------
# Predictions (reference/zen.md 1.3 and 1.6)
# ---------------------------------------------------------------------------------------------------------------------


def predictions(workload: Workload, num_ranks: int) -> dict[str, float | None]:
    """Predicted payload bytes received per rank for each scheme that has a formula."""
    n, e, i, num_items = num_ranks, workload.item_bytes, INDEX_BYTES, workload.num_items
    k = sum(t.numel() for t in workload.ids[:n]) / n
    u = union_size(workload, n)
    frac = (n - 1) / n
    sparcml: float | None = None
    if n & (n - 1) == 0:
        stage_unions = [_mean_block_union(workload, n, 2 ** (s - 1)) for s in range(1, n.bit_length())]
        sparcml = sum(stage_unions) * (i + e)
    return {
        "dense": 2 * frac * num_items * e,
        "zen": frac * k * (i + e) + frac * min(u * (i + e), u * e + num_items / 8, num_items * e),
        "zen_coo": frac * (k + u) * (i + e),
        "sparcml": sparcml,
        "agsparse": (n - 1) * k * (i + e),
    }


def _mean_block_union(workload: Workload, num_ranks: int, block: int) -> float:
    sizes = workload.block_unions[block][: num_ranks // block]
    return sum(sizes) / len(sizes)


# ---------------------------------------------------------------------------------------------------------------------
# Running one scheme
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class RankOutcome:
    stats: zensync.SyncStats
    max_abs_err: float
    within_bound: bool


def run_scheme(workload: Workload, num_ranks: int, scheme: str, reference: tuple[torch.Tensor, torch.Tensor] | None):
    """Sync every rank's tensor with ``scheme`` in a simulated world; (per-rank outcomes, wall seconds).

    ``reference`` is (dense sum, allowed absolute error) shared by all ranks; the check works in
    place on each rank's output so it adds no per-rank memory.
    """

    def fn(transport: Any) -> RankOutcome:
        x = workload.dense(transport.rank)
        stats = zensync.SyncStats()
        out = zensync.sparse_allreduce(x, group=transport, scheme=scheme, stats=stats)
        del x
        if reference is None:
            return RankOutcome(stats, math.nan, True)
        err = out.sub_(reference[0]).abs_()
        max_err = float(err.max())
        return RankOutcome(stats, max_err, bool(err.le_(reference[1]).all()))

    world = zensync.SimulatedWorld(num_ranks, timeout_s=900.0)
    start = time.perf_counter()
    outcomes = world.run(fn)
    return outcomes, time.perf_counter() - start


def summarise(
    workload: Workload, num_ranks: int, scheme: str, outcomes: Sequence[RankOutcome], wall_s: float, pred: dict
) -> dict[str, Any]:
    """One result row: received bytes (mean, max), observed statistics and prediction ratios."""
    recv = [sum(p.bytes_recv for name, p in o.stats.phases.items() if name != "validate") for o in outcomes]
    validate = [o.stats.phases["validate"].bytes_recv if "validate" in o.stats.phases else 0 for o in outcomes]
    first = outcomes[0].stats
    dense_bytes = workload.num_items * workload.item_bytes
    predicted = pred.get(first.scheme)
    mean_recv = sum(recv) / len(recv)
    return {
        "workload": workload.name,
        "n": num_ranks,
        "scheme": scheme,
        "ran": first.scheme,
        "num_items": workload.num_items,
        "bitmap_words_expected": -(-workload.num_items // 32),
        "recv_mean": mean_recv,
        "recv_max": max(recv),
        "recv_mean_over_M": mean_recv / dense_bytes,
        "validate_recv_mean": sum(validate) / len(validate),
        "predicted": predicted,
        "ratio": mean_recv / predicted if predicted else None,
        "ratio_zen_coo": mean_recv / pred["zen_coo"] if first.scheme == "zen" else None,
        "push_imbalance": first.push_imbalance,
        "pull_imbalance": first.pull_imbalance,
        "skew_mean": sum(o.stats.skew for o in outcomes) / len(outcomes),
        "density": first.mean_density,
        "gamma": first.densification,
        "overlap": first.overlap,
        "global_nnz": first.global_nnz,
        "pull_encodings": dict(first.pull_encodings),
        "pull_bitmap_words": first.pull_bitmap_words,
        "max_abs_err": max(o.max_abs_err for o in outcomes),
        "lossless": all(o.within_bound for o in outcomes),
        "wall_s": wall_s,
        "max_rank_time_s": max(o.stats.total_time_s for o in outcomes),
        "phases_rank0": {k: dataclasses.asdict(v) for k, v in first.phases.items()},
        "phase_time_s_rank0": dict(first.phase_time_s),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="world sizes (default 4..128)")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--num-items", type=int, default=None, help="Zipf elements (default 10M; quick 200k)")
    parser.add_argument("--density", type=float, default=0.01, help="Zipf density per rank")
    parser.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the skewed config")
    parser.add_argument("--overlap", type=float, default=0.3, help="shared-pool fraction of the skewed config")
    parser.add_argument("--vocab-size", type=int, default=None, help="LM vocabulary (default 50k; quick 10k)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test (< 30 s)")
    parser.add_argument("--no-check", action="store_true", help="skip the lossless check against a dense sum")
    parser.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="skip runs extrapolated above this peak RSS (default 70%% of MemAvailable at start)",
    )
    parser.add_argument("--max-run-s", type=float, default=90.0, help="skip runs extrapolated to take longer")
    parser.add_argument("--hardware", default=f"cpu{os.cpu_count()}core")
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    args.ranks = args.ranks or ([4, 8] if args.quick else list(DEFAULT_RANKS))
    args.num_items = args.num_items or (200_000 if args.quick else 10_000_000)
    args.vocab_size = args.vocab_size or (10_000 if args.quick else 50_000)
    if args.memory_budget_gb is None:
        args.memory_budget_gb = 0.7 * _available_memory_bytes() / 2**30
    return args


def _available_memory_bytes() -> float:
    """MemAvailable (Linux), else physical memory: other processes may share the machine."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def build_workloads(args: argparse.Namespace, log: Callable[[str], None]) -> list[Workload]:
    max_ranks = max(args.ranks)
    built = []
    if "lm" in args.workloads:
        max_bytes = 1_000_000 if args.quick else lm.Config().max_bytes
        built.append(
            build_lm(lm.Config(vocab_size=args.vocab_size, max_bytes=max_bytes, seed=args.seed), max_ranks, log)
        )
    if "zipf" in args.workloads:
        base = {"num_items": args.num_items, "density": args.density, "seed": args.seed}
        built.append(build_zipf("zipf-uniform", {**base, "zipf_s": 0.0, "overlap": 0.0}, max_ranks, log))
        built.append(
            build_zipf("zipf-skewed", {**base, "zipf_s": args.zipf_s, "overlap": args.overlap}, max_ranks, log)
        )
    for workload in built:
        measure_block_unions(workload)
    return built


def bench_workload(workload: Workload, args: argparse.Namespace, log: Callable[[str], None]) -> tuple[list, list, list]:
    """All (n, scheme) runs of one workload: (result rows, per-n prediction records, skipped runs)."""
    rows, pred_records, skipped = [], [], []
    guard = guards.Guard(
        dense_bytes=workload.num_items * workload.item_bytes,
        max_run_s=args.max_run_s,
        memory_budget_bytes=args.memory_budget_gb * 2**30,
    )
    for n in sorted(args.ranks):
        pred = predictions(workload, n)
        k, union = sum(t.numel() for t in workload.ids[:n]) / n, union_size(workload, n)
        pred_records.append({"workload": workload.name, "n": n, "K": k, "U": union, **pred})
        reference = None if args.no_check else workload.reference(n)
        for scheme in args.schemes:
            baseline = guards.start_measuring()
            estimate = guard.estimate(scheme, n, union, baseline)
            reason = guard.reason_to_skip(estimate)
            if reason is not None:
                skipped.append({"workload": workload.name, "n": n, "scheme": scheme, "reason": reason})
                log(f"  {workload.name} n={n} {scheme}: skipped, {reason}")
                continue
            outcomes, wall_s = run_scheme(workload, n, scheme, reference)
            peak = guards.peak_rss_bytes()
            row = summarise(workload, n, scheme, outcomes, wall_s, pred)
            row.update(
                peak_rss_bytes=peak,
                baseline_rss_bytes=baseline,
                estimate=dataclasses.asdict(estimate) if estimate else None,
            )
            rows.append(row)
            guard.record(scheme, n, wall_s, (peak or baseline) - baseline, union)
            log(report.progress_line(row))
        del reference
    return rows, pred_records, skipped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)

    log(f"sparse sync bench: ranks={args.ranks} schemes={args.schemes} workloads={args.workloads}")
    workloads = build_workloads(args, log)
    rows, pred_records, skipped = [], [], []
    for workload in workloads:
        w_rows, w_preds, w_skipped = bench_workload(workload, args, log)
        rows += w_rows
        pred_records += w_preds
        skipped += w_skipped
    total_s = time.perf_counter() - started
    meta = metadata(args, workloads, total_s)
    checks = report.target_checks(rows, pred_records, skipped)
    markdown = report.markdown(meta, rows, pred_records, checks, skipped)
    paths = report.write_outputs(args.out_dir, args.hardware, meta, rows, pred_records, checks, skipped, markdown)
    print(markdown)
    log("wrote " + ", ".join(str(p) for p in paths))
    return 1 if any(c["passed"] is False for c in checks) else 0


def metadata(args: argparse.Namespace, workloads: Sequence[Workload], total_s: float) -> dict[str, Any]:
    import numba  # version only; zensync.kernels owns its use

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "args": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
        "seed": args.seed,
        "hardware": args.hardware,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numba": numba.__version__,
            "zensync": zensync.__version__,
        },
        "workloads": [
            {"name": w.name, "num_items": w.num_items, "item_numel": w.item_numel, "dtype": str(w.dtype), **w.params}
            for w in workloads
        ],
        "total_s": total_s,
    }


if __name__ == "__main__":
    sys.exit(main())

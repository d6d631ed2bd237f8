"""Zen's scaling results (OSDI'25; reference/zen.md) regenerated with ``zensync.simulate``'s counted mode.

Launch (from the repository root; about 10-20 min on a 2-core CPU, resumable)::

    python experiments/zen_scaling.py                      # writes experiments/results/zen_scaling_sim_<date>.*
    python experiments/zen_scaling.py --tiny -o /tmp/zs    # seconds: the pipeline on small tensors

Every point is counted from the ranks' index sets (``zensync.simulate.counted``: records equal to a
full run's, Hypothesis-checked), priced on alpha-beta links (network only), for the gradient
statistics in experiments/configs/zen_{lstm,deepfm,nmt}.json (Table 1 sizes and densities). The rows
of DeepFM are divided by ``SCALE`` (16) to fit 2 cores, and its links made ``SCALE`` times slower, so each byte term
is the full tensor's and each latency term unchanged (``topology``); what scaling still changes (fewer
ids per rank: hashing balance, the Zipf draws' unions) the scale check measures. Parts:

1. Communication time of dense, agsparse, sparcml, omnireduce, sparse_ps and zen for n = 2..1024, one
   GPU per node at 25 Gbit/s (the Eq. 1 / Fig. 8 setting). Expected: dense flat in n; agsparse
   linear in n; zen lowest among the sparse schemes at large n.
2. The n where agsparse becomes slower than dense (Fig. 8: about 40 for NMT). Expected: about 80
   with row indices (one int32 per 512-float row), about 40 with one index per element as the paper
   counts COO (the ``nmt-element`` run).
3. Zen's speedups at 16 nodes x 8 GPUs (NVLink 50 GB/s inside, 25 / 100 Gbit/s between), vs Fig. 15:
   "flat" (all 128 ranks in one sparse sync) and "hier" (the paper's setup: a dense reduce-scatter
   and all-gather over NVLink, the 16 nodes' aggregates synced sparsely between nodes).
4. Push/pull imbalance (Theorem 2): zen about 1, sparse_ps (even ranges over skewed ids) far above.

Scale check: the time / dense ratios again with the rows divided by ``CHECK_SCALES`` at n = 16, 128,
1024 (LSTM and NMT run at the Table 1 size, so their check shows what dividing the rows would change).

Each finished point is cached in ``<prefix>.cache.json``; a rerun skips it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

import zensync
from zensync.planner.cluster import NVLINK_BYTES_PER_S
from zensync.simulate import Link, Topology, price
from zensync.simulate.analysis import counted_points, crossover, densification, imbalance, overlap_ratio
from zensync.simulate.sweep import ZipfWorkload, load_stats, payload_sent

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
SCHEMES = ("dense", "agsparse", "sparcml", "omnireduce", "sparse_ps", "zen")
RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SCALE = {"lstm": 1, "deepfm": 16, "nmt": 1}
"""Rows divided by this per model (dim and density kept): DeepFM's 13.4M rows / 16, so a sweep fits 2 cores."""
CHECK_SCALES = {"lstm": (8, 32), "deepfm": (64,), "nmt": (2, 8)}
"""The scale check: rows divided by these too, at CHECK_RANKS."""
CHECK_RANKS = (16, 128, 1024)
NMT_ELEMENT_SCALE = 64
"""nmt-element: NMT's 112M parameters as 112M/64 one-element items (the paper's COO: an index per value)."""
H0_SEED = 12345
INTER_LATENCY_S, INTRA_LATENCY_S = 10e-6, 5e-6
GPUS_PER_NODE, NODES = 8, 16
STATS_RANKS = 128
"""Ranks whose ids give the workload table's overlap, gamma_8 and gamma_n (C1-C3)."""


def _gbit(rate: float) -> Link:
    return Link(INTER_LATENCY_S, rate * 1e9 / 8)


TOPOLOGIES = {
    "flat25": Topology.flat(_gbit(25)),
    "flat100": Topology.flat(_gbit(100)),
    "nodes25": Topology(GPUS_PER_NODE, Link(INTRA_LATENCY_S, NVLINK_BYTES_PER_S), _gbit(25)),
    "nodes100": Topology(GPUS_PER_NODE, Link(INTRA_LATENCY_S, NVLINK_BYTES_PER_S), _gbit(100)),
}

# The paper's numbers each part is set beside (reference/zen.md sections in brackets).
PAPER = {
    "fig8_nmt_agsparse_crossover_gpus": 40,  # [1.3] AGsparse worse than AllReduce beyond 40 GPUs
    "fig8_nmt_zen_over_dense_at_128": 0.64,  # [1.3] Balanced Parallelism 36 % below AllReduce at 128
    "fig15_zen_speedup_over_dense_25g": {"lstm": 6.77, "deepfm": 2.10},  # [2] communication time
    "fig15_omnireduce_speedup_over_dense_max": 1.58,  # [2]
    "fig15_zen_over_sparcml_max": 2.82,  # [2]
    "fig15_zen_over_omnireduce_max": 5.16,  # [2]
    "throughput_100g_over_dense": {"deepfm": 1.33, "nmt": 1.38},  # [2] training throughput, not comm time
    "theorem2_practical_imbalance_max": 1.1,  # [1.5]
    "strawman_push_imbalance": [1.4, 5.1],  # [1.4] data-dependent quantiles, NMT n = 16
}


class Cache:
    """Finished points by key, in a JSON file rewritten after each point."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.rows: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}

    def put(self, key: str, row: dict[str, Any]) -> None:
        self.rows[key] = row
        self.path.write_text(json.dumps(self.rows, indent=1, sort_keys=True))


def _progress(total: int, desc: str) -> Callable[[], None]:
    try:
        from tqdm import tqdm
    except ImportError:
        done = [0]

        def tick() -> None:
            done[0] += 1
            print(f"{desc}: {done[0]}/{total}", flush=True)

        return tick
    bar = tqdm(total=total, desc=desc)
    return lambda: bar.update(1)


def topology(name: str, divide: int) -> Topology:
    """``TOPOLOGIES[name]`` with every link ``divide`` times slower: a tensor with 1/divide of the rows
    then takes the full tensor's byte time (its latency terms are unchanged)."""
    base = TOPOLOGIES[name]

    def slower(link: Link) -> Link:
        return Link(link.latency_s, link.bandwidth_bytes_per_s / divide)

    return dataclasses.replace(base, intra=slower(base.intra), inter=slower(base.inter))


def _row(
    n: int, scheme: str, calls: list[list[Any]], topologies: Iterable[str], divide: int, wall_s: float
) -> dict[str, Any]:
    push, pull = imbalance(calls)
    seconds = {name: price(calls, topology(name, divide), compute_scale=0.0).seconds for name in topologies}
    sent = max(payload_sent(c, r) for r, c in enumerate(calls))
    return {"ranks": n, "scheme": scheme, "mode": "counted", "seconds": seconds, "max_sent_bytes": sent,
            "push_imbalance": push, "pull_imbalance": pull, "wall_s": wall_s}  # fmt: skip


def _tag(label: str, divide: int) -> str:
    """Cache key prefix: rows divided by ``divide``, priced on links ``divide`` times slower."""
    return f"{label}/{divide}" if divide == 1 else f"{label}/{divide}/bw"


def sweep(
    cache: Cache,
    label: str,
    divide: int,
    workload: ZipfWorkload,
    schemes: Iterable[str],
    ranks: Iterable[int],
    topologies: Callable[[int], list[str]],
) -> list[dict[str, Any]]:
    """Every (n, scheme) point of ``workload`` (rows divided by ``divide``; priced full-size equivalent),
    counted (each rank's ids drawn once) or from the cache."""
    tag = _tag(label, divide)
    schemes, ranks = list(schemes), list(ranks)
    key = {(n, s): f"{tag}|{s}|{n}" for n in ranks for s in schemes}
    todo = [
        (n, s) for (n, s), k in key.items() if not set(topologies(n)) <= set(cache.rows.get(k, {}).get("seconds", {}))
    ]
    if todo:
        tick, last = _progress(len(todo), tag), time.perf_counter()
        todo_ranks = sorted({n for n, _ in todo})
        todo_schemes = [s for s in schemes if any(s == t for _, t in todo)]
        points = counted_points(todo_schemes, todo_ranks, workload.items, num_items=workload.num_items,
                                item_bytes=workload.item_bytes, seed=H0_SEED)  # fmt: skip
        for n, scheme, calls in points:
            now = time.perf_counter()
            if (n, scheme) in todo:
                cache.put(key[(n, scheme)], _row(n, scheme, calls, topologies(n), divide, now - last))
                tick()
            last = now
    return [cache.rows[key[(n, s)]] for n in ranks for s in schemes]


def hierarchical(cache: Cache, label: str, divide: int, workload: ZipfWorkload) -> dict[str, dict[str, float]]:
    """Part 3 "hier": per rate ("25", "100" Gbit/s), seconds per scheme at NODES x GPUS_PER_NODE in
    Zen's own two-level setup.

    Sparse schemes: a dense reduce-scatter and all-gather of the whole tensor over NVLink inside each
    node, and between nodes the scheme on the 16 node aggregates (node j's ids: the union of its 8
    GPUs'); the 8 GPUs of a node each sync 1/8 of it over the one NIC, which carries the bytes of one
    16-rank sync of the whole tensor (priced as that, on the inter link). Dense: one ring all-reduce
    over all 128 GPUs, NIC-bound.
    """
    key = f"{_tag(label, divide)}|hier"
    if key in cache.rows:
        return cache.rows[key]["seconds"]
    rates = (25, 100)
    dense_bytes = workload.num_items * workload.item_bytes
    intra = list(range(GPUS_PER_NODE))
    nvlink = topology("nodes25", divide)  # the intra-node link is the same at both rates
    intra_s = nvlink.reduce_scatter_s(GPUS_PER_NODE, dense_bytes, intra) + nvlink.all_gather_s(
        [dense_bytes / GPUS_PER_NODE] * GPUS_PER_NODE, intra
    )

    def node_items(node: int) -> torch.Tensor:
        first = node * GPUS_PER_NODE
        return torch.unique(torch.cat([workload.items(r) for r in range(first, first + GPUS_PER_NODE)]))

    seconds = {
        str(rate): {"dense": topology(f"nodes{rate}", divide).all_reduce_s(NODES * GPUS_PER_NODE, dense_bytes)}
        for rate in rates
    }
    sparse = [s for s in SCHEMES if s != "dense"]
    points = counted_points(sparse, [NODES], node_items, num_items=workload.num_items,
                            item_bytes=workload.item_bytes, seed=H0_SEED)  # fmt: skip
    for _, scheme, calls in points:
        for rate in rates:
            seconds[str(rate)][scheme] = (
                intra_s + price(calls, topology(f"flat{rate}", divide), compute_scale=0.0).seconds
            )
    cache.put(key, {"seconds": seconds, "intra_s": intra_s})
    return seconds


def statistics(workload: ZipfWorkload) -> dict[str, float]:
    """C1-C3 of the workload as drawn: density, pairwise overlap, gamma_8 and gamma_n (n = STATS_RANKS), skew."""
    sets = [workload.items(r) for r in range(STATS_RANKS)]
    first_eighth = float((sets[0] < workload.num_items / 8).float().mean())
    return {"density": sets[0].numel() / workload.num_items, "overlap_01": overlap_ratio(sets[0], sets[1]),
            "gamma_8": densification(sets[:8]), "gamma_n": densification(sets), "n": STATS_RANKS,
            "share_in_first_eighth": first_eighth}  # fmt: skip


def load(model: str, divide: int) -> ZipfWorkload:
    (workload,) = load_stats((CONFIGS / f"zen_{model}.json").read_text()).values()
    return dataclasses.replace(workload, num_items=max(1, workload.num_items // divide))


def run(prefix: pathlib.Path, *, tiny: bool) -> dict[str, Any]:
    """All four parts; returns the report's data (also written as ``prefix``.json)."""
    cache = Cache(_path(prefix, ".cache.json"))
    extra = 256 if tiny else 1  # --tiny: rows divided 256 times more, ranks to 64
    ranks = [n for n in RANKS if n <= (64 if tiny else 1024)]
    data: dict[str, Any] = {"models": {}, "paper": PAPER}
    for model, scale in SCALE.items():
        workload = load(model, scale * extra)
        rows = sweep(cache, model, scale * extra, workload, SCHEMES, ranks,
                     lambda n: ["flat25", "nodes25", "nodes100"] if n == 128 else ["flat25"])  # fmt: skip
        check_ranks = [n for n in CHECK_RANKS if n in ranks]
        checks = {}
        for check_scale in CHECK_SCALES[model]:
            divide = check_scale * extra
            checks[str(check_scale)] = sweep(cache, model, divide, load(model, divide), SCHEMES, check_ranks,
                                             lambda n: ["flat25"])  # fmt: skip
        hier = hierarchical(cache, model, scale * extra, workload)
        dense_params = json.loads((CONFIGS / f"zen_{model}.json").read_text())["dense_params"]
        data["models"][model] = {
            "workload": dataclasses.asdict(workload), "dense_params": dense_params,
            "dense_params_s": {str(r): TOPOLOGIES[f"nodes{r}"].all_reduce_s(NODES * GPUS_PER_NODE, 4 * dense_params)
                               for r in (25, 100)}, "scale": scale * extra, "rows": rows,
            "check_rows": checks, "hier_seconds": hier,
            "statistics": statistics(workload),
            "crossover_agsparse_dense": _crossover(rows, "agsparse", "dense"),
        }  # fmt: skip
    element = load("nmt", 1)
    element = dataclasses.replace(element, num_items=element.num_items * element.dim // (NMT_ELEMENT_SCALE * extra),
                                  dim=1)  # fmt: skip
    el_ranks = [n for n in ranks if n <= 256]
    el_rows = sweep(cache, "nmt-element", NMT_ELEMENT_SCALE * extra, element, ("dense", "agsparse"), el_ranks,
                    lambda n: ["flat25"])  # fmt: skip
    data["nmt_element"] = {"workload": dataclasses.asdict(element), "rows": el_rows,
                           "crossover_agsparse_dense": _crossover(el_rows, "agsparse", "dense")}  # fmt: skip
    return data


def _path(prefix: pathlib.Path, suffix: str) -> pathlib.Path:
    return pathlib.Path(str(prefix) + suffix)


def _crossover(rows: list[dict[str, Any]], a: str, b: str) -> float | None:
    times = {(r["ranks"], r["scheme"]): r["seconds"]["flat25"] for r in rows}
    ranks = sorted({n for n, _ in times})
    return crossover(ranks, [times[(n, a)] for n in ranks], [times[(n, b)] for n in ranks])


def versions() -> dict[str, str]:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        sha = "unknown"
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs (shared)"
    return {"zensync": getattr(zensync, "__version__", "?"), "git_sha": sha, "torch": torch.__version__,
            "python": platform.python_version(), "machine": machine}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    today = datetime.date.today().isoformat()
    parser.add_argument("-o", "--prefix", default=str(ROOT / "experiments" / "results" / f"zen_scaling_sim_{today}"))
    parser.add_argument("--tiny", action="store_true", help="small tensors and n <= 64 (a smoke test)")
    args = parser.parse_args(argv)
    prefix = pathlib.Path(args.prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    data = run(prefix, tiny=args.tiny)
    data["versions"] = versions()
    data["command"] = " ".join(["python", "experiments/zen_scaling.py", *(argv if argv is not None else sys.argv[1:])])
    workload_seeds = {m: d["workload"]["seed"] for m, d in data["models"].items()}
    data["seeds"] = {"h0_seed": H0_SEED, "workload_seeds": workload_seeds}
    data["wall_s"] = time.perf_counter() - start
    _path(prefix, ".json").write_text(json.dumps(data, indent=1))
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from _zen_scaling_report import write_report  # experiments/: the Markdown and the figure

    write_report(data, str(prefix))
    print(_path(prefix, ".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

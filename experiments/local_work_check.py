"""Counted points' fitted local work against the local work a full run measures, at a larger size.

Launch (from the repository root; CPU only, a few minutes on 2 cores)::

    python experiments/local_work_check.py
    python experiments/local_work_check.py --rows 4000000 --dim 16 --ranks 4,8 --schemes zen,agsparse

``zensync simulate`` charges a counted point (the records written from index sets, no kernels run)
with local work fitted to full runs of the same workload cut to at most 64 MiB per rank
(``zensync.simulate.local_work.calibrate``). This driver makes that fit for each scheme, then runs
full points of the uncut workload (``--rows``, larger than the calibration's rows, so the fit
extrapolates as it does at a counted point) and compares, per rank, the fitted seconds on the full
run's own records with the seconds the full run measured (thread CPU time, one core). Reported: the
largest rank's measured and fitted work, the error, and the median error over ranks.

Expected: the fit within about 25 % of the measurement for the rank with the most work; memory
passes are linear in bytes, but caches (a calibration tensor fits in fewer of them) and the CPU
contention of this shared 2-core machine are not modelled. Results:
``experiments/results/local_work_check_<date>.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
from typing import Any

import torch

from zensync.simulate.local_work import bytes_moved, calibrate, calibration_rows
from zensync.simulate.sweep import ZipfWorkload, full_calls

RESULTS = pathlib.Path(__file__).parent / "results"


def _check(scheme: str, workload: ZipfWorkload, ranks: list[int], seed: int) -> list[dict[str, Any]]:
    fit = calibrate(
        scheme,
        lambda n, rows: full_calls(scheme, n, dataclasses.replace(workload, num_items=rows), seed),
        num_items=workload.num_items,
        item_bytes=workload.item_bytes,
    )
    rows = []
    dense = workload.num_items * workload.item_bytes
    for n in ranks:
        calls = full_calls(scheme, n, workload, seed)
        network = [[c for c in per_rank if c.op != "local"] for per_rank in calls]
        measured = [sum(c.compute_s for c in per_rank) for per_rank in calls]
        fitted = [fit.seconds(dense, sent + received) for sent, received in bytes_moved(network)]
        errors = [abs(f - m) / m for f, m in zip(fitted, measured, strict=True)]
        top = max(range(n), key=measured.__getitem__)
        rows.append({
            "scheme": scheme, "ranks": n, "measured_max_s": measured[top], "fitted_at_that_rank_s": fitted[top],
            "error_at_max": errors[top], "median_error": statistics.median(errors), "fit": dataclasses.asdict(fit),
            "fit_max_relative_error": fit.max_relative_error,
        })  # fmt: skip
        print(f"{scheme} n={n}: measured {measured[top] * 1e3:.1f} ms, fitted {fitted[top] * 1e3:.1f} ms "
              f"({errors[top]:.0%}); median over ranks {statistics.median(errors):.0%}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--skew", type=float, default=1.1)
    parser.add_argument("--overlap", type=float, default=0.3)
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--schemes", default="zen,sparse_ps,agsparse,dense")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    workload = ZipfWorkload(args.rows, args.dim, args.density, args.skew, args.overlap, args.seed)
    ranks = [int(r) for r in args.ranks.split(",")]
    big, small = calibration_rows(workload.num_items, workload.item_bytes)
    print(f"calibration rows {big:,} and {small:,}; checked at {workload.num_items:,} rows", flush=True)
    table = [row for scheme in args.schemes.split(",") for row in _check(scheme, workload, ranks, 12345)]
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    document = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "versions": {"zensync": sha, "torch": torch.__version__, "python": platform.python_version()},
        "machine": f"{platform.platform()}, {os.cpu_count()} cores; load average at the end {os.getloadavg()}",
        "workload": dataclasses.asdict(workload),
        "calibration_rows": [big, small],
        "rows": table,
    }
    stem = f"local_work_check{'_' + args.label if args.label else ''}_{document['date']}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    lines = [
        f"# Counted points' fitted local work vs a full run's measured work ({document['date']})",
        "",
        f"Command: `{document['command']}`; zensync {sha}, torch {torch.__version__}, Python "
        f"{platform.python_version()}; {document['machine']}.",
        f"Workload: Zipf {workload.num_items:,} x {workload.dim} rows, density {workload.density}, skew "
        f"{workload.skew}, overlap {workload.overlap}, seed {workload.seed}. Fits made on full runs at "
        f"{big:,} and {small:,} rows (2, 4, 8 ranks); checked at {workload.num_items:,} rows.",
        "",
        "| scheme | ranks | measured, busiest rank (ms) | fitted, that rank (ms) | error | median error over ranks |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['scheme']} | {r['ranks']} | {r['measured_max_s'] * 1e3:.1f} | "
            f"{r['fitted_at_that_rank_s'] * 1e3:.1f} | {r['error_at_max']:.0%} | {r['median_error']:.0%} |"
        )
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

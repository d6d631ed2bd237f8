"""What ``zensync bench --scan`` reports on rank 0: a Markdown table, PREFIX.json (config, versions, rows), PNG."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import pathlib
import platform
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

import zensync
from zensync.cli._errors import write_failed

if TYPE_CHECKING:
    from zensync.cli.bench import ScanConfig
    from zensync.transport import TuningTable

__all__ = ["config_json", "format_table", "report"]


def config_json(config: ScanConfig, world: int, table: TuningTable | None) -> dict[str, Any]:
    from zensync.transport.mpi import mpi_module

    return {
        "command": " ".join(["mpiexec", "-n", str(world), "python -m mpi4py -m zensync", *sys.argv[1:]]),
        "world_size": world,
        "sizes": list(config.sizes),
        "ops": list(config.ops),
        "backends": list(config.backends),
        "reps": config.reps,
        "dtype": "float32",
        "tuning": config.tuning or ("measured" if table is not None else None),
        "table": None if table is None else json.loads(table.to_json()),
        "versions": {
            "zensync": zensync.__version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "mpi4py": importlib.metadata.version("mpi4py"),
            "mpi_library": mpi_module().Get_library_version().strip().splitlines()[0],
        },
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def format_table(rows: Sequence[dict[str, Any]], world: int, reps: int) -> str:
    """The scan as Markdown: one line per (op, size, backend)."""
    lines = [
        f"zensync bench --scan: {world} ranks, float32, median over {reps} repetitions of the slowest rank's "
        "per-call time; bandwidths as nccl-tests defines them; paired: median over repetitions of mixed's "
        "time over the best single backend's in the same repetition",
        "",
        "| op | bytes per rank | backend | latency (us) | algbw (GB/s) | busbw (GB/s) | routed to | mixed / best "
        "| paired |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio, paired = row["mixed_over_best_single"], row["mixed_over_best_single_paired"]
        lines.append(
            f"| {row['op']} | {row['bytes_per_rank']:,} | {row['backend']} | {row['latency_s'] * 1e6:.1f} | "
            f"{row['algbw_bytes_per_s'] / 1e9:.4g} | {row['busbw_bytes_per_s'] / 1e9:.4g} | "
            f"{row['routed_to'] or '-'} | {'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{'-' if paired is None else f'{paired:.2f}'} |"
        )
    mixed = [row for row in rows if row.get("best_single")]
    if mixed:
        right = sum(row["routed_to"] == row["best_single"] for row in mixed)
        paired_all = [row["mixed_over_best_single_paired"] for row in mixed]
        lines += [
            "",
            f"The mixed dispatch routed {right} of {len(mixed)} cells to the best single backend (lowest "
            f"median); paired ratio {min(paired_all):.2f} to {max(paired_all):.2f}. Where it routes to the "
            "best backend, mixed runs that backend's call: a paired ratio away from 1 there is this "
            "machine's noise plus the dispatch's own cost (benchmarks/mixed_overhead.py).",
        ]
    return "\n".join(lines)


def report(config: ScanConfig, world: int, rows: list[dict[str, Any]], table: TuningTable | None) -> None:
    """Rank 0: print the table, write PREFIX.json and, with --png, PREFIX.png (a failed write: exit 1)."""
    print(format_table(rows, world, config.reps))
    prefix = config.prefix(world)
    path = prefix + ".json"
    document = {"version": 1, "config": config_json(config, world, table), "rows": rows}
    try:
        pathlib.Path(path).write_text(json.dumps(document, indent=1) + "\n")
    except OSError as err:
        raise write_failed(path, err) from err
    print(f"wrote {path}")
    if config.png:
        from zensync.cli._scan_png import draw_scan

        path = prefix + ".png"
        try:
            draw_scan(rows, path, title=f"zensync bench --scan, {world} ranks")
        except OSError as err:
            raise write_failed(path, err) from err
        print(f"wrote {path}")

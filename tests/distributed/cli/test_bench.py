"""``zensync bench --scan`` under mpiexec (started here, under a deadline): every cell measured and logged,
bandwidths by comms.py's definitions, the mixed rows on the backend the tuning table routes to, the
printed table listing every row, and (with matplotlib) the PNG."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from zensync.transport import TuningTable
from zensync.transport.comms import bus_factor
from zensync.transport.mixed import TuningEntry, burst_calls

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")

DEADLINE_S = 120.0
"""A whole mpiexec run (about 7 s on 2 loaded cores: start, both worlds' setup, tune, the scan)."""
RANKS = 2
REPS = 3


def _bench(tmp_path: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """Run the scan on ``RANKS`` ranks; (the JSON rank 0 wrote, what it printed)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [MPIEXEC, "-n", str(RANKS), sys.executable, "-m", "mpi4py", "-m", "zensync", "bench", "--scan"]
    command += ["--sizes", "8,4096", "--ops", "all_reduce,broadcast", "--reps", str(REPS), "-o", str(tmp_path / "scan")]
    done = subprocess.run(
        [*command, *flags], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=DEADLINE_S, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "scan.json").read_text()), done.stdout


def _check_rows(scan: dict[str, Any], printed: str, backends: tuple[str, ...]) -> TuningTable | None:
    """Every (op, size, backend) once, measured, logged and printed; returns the mixed table."""
    config, rows = scan["config"], scan["rows"]
    assert config["world_size"] == RANKS and config["reps"] == REPS and set(config["versions"]) >= {"torch", "mpi4py"}
    cells = [(r["op"], r["bytes_per_rank"], r["backend"]) for r in rows]
    assert sorted(cells) == sorted((o, s, b) for o in ("all_reduce", "broadcast") for s in (8, 4096) for b in backends)
    lines = set(printed.splitlines())
    for row in rows:
        assert row["latency_s"] > 0 and len(row["slowest_rank_s"]) == REPS, row
        assert row["size_bytes"] == row["bytes_per_rank"]  # all_reduce and broadcast: the tensor (comms.py)
        assert row["algbw_bytes_per_s"] == row["size_bytes"] / row["latency_s"]
        assert row["busbw_bytes_per_s"] == row["algbw_bytes_per_s"] * bus_factor(row["op"], RANKS)
        assert row["calls_logged"] == 1 + REPS * burst_calls(row["bytes_per_rank"])  # warm-up + bursts
        prefix = f"| {row['op']} | {row['bytes_per_rank']:,} | {row['backend']} | {row['latency_s'] * 1e6:.1f} |"
        assert any(line.startswith(prefix) for line in lines), (prefix, printed)
    return None if config["table"] is None else TuningTable.from_json(json.dumps(config["table"]))


def _check_mixed(scan: dict[str, Any], table: TuningTable) -> set[str]:
    """The mixed rows name the backend the table routes each (op, size) to; returns those backends."""
    routed = set()
    for row in (r for r in scan["rows"] if r["backend"] == "mixed"):
        expected = table.backend_for(row["op"], torch.float32, row["bytes_per_rank"])
        assert row["routed_to"] == expected and expected in {"gloo", "mpi"}, row
        assert row["mixed_over_best_single"] is None or row["mixed_over_best_single"] > 0
        singles = [r for r in scan["rows"] if r["op"] == row["op"] and r["bytes_per_rank"] == row["bytes_per_rank"]]
        singles = [r for r in singles if r["backend"] != "mixed"]
        if singles:  # paired: per repetition against the backend of the lowest median
            best_row = min(singles, key=lambda r: r["latency_s"])
            assert row["best_single"] == best_row["backend"]
            ratios = [m / b for m, b in zip(row["slowest_rank_s"], best_row["slowest_rank_s"], strict=True)]
            assert row["mixed_over_best_single_paired"] == statistics.median(ratios)
        else:
            assert row["mixed_over_best_single_paired"] is None and row["best_single"] is None
        routed.add(expected)
    return routed


def test_scan_with_a_measured_table(tmp_path: Path) -> None:
    scan, printed = _bench(tmp_path)
    table = _check_rows(scan, printed, ("gloo", "mpi", "mixed"))
    assert table is not None and scan["config"]["tuning"] == "measured"
    _check_mixed(scan, table)
    mixed = [r for r in scan["rows"] if r["backend"] == "mixed"]
    right = sum(r["routed_to"] == r["best_single"] for r in mixed)
    assert f"The mixed dispatch routed {right} of {len(mixed)} cells to the best single backend" in printed
    assert f"wrote {tmp_path / 'scan.json'}" in printed


def test_scan_with_a_given_table_routes_as_it_says(tmp_path: Path) -> None:
    """A fixed table that sends 8-byte all-reduces to MPI and everything else to gloo: both routes seen."""
    table = TuningTable(default="gloo", entries=(TuningEntry(op="all_reduce", backend="mpi", max_bytes=8),))
    (tmp_path / "tuning.json").write_text(table.to_json())
    scan, printed = _bench(tmp_path, "--backends", "mixed", "--tuning", str(tmp_path / "tuning.json"))
    assert _check_rows(scan, printed, ("mixed",)) == table
    assert _check_mixed(scan, table) == {"gloo", "mpi"}
    assert all(r["mixed_over_best_single"] is None for r in scan["rows"])  # no single backend to compare


def test_scan_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    scan, printed = _bench(tmp_path, "--backends", "gloo,mpi", "--png")
    _check_rows(scan, printed, ("gloo", "mpi"))
    assert (tmp_path / "scan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

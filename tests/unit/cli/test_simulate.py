"""``zensync simulate``: the report holds what the library computes for each point, and bad flags exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zensync.cli import main
from zensync.simulate import Link, Topology
from zensync.simulate.sweep import ZipfWorkload, simulate_step

ARGS = ["--items", "3000", "--dim", "4", "--density", "0.05", "--skew", "1.1", "--overlap", "0.2", "--seed", "3",
        "--ranks-per-node", "2", "--intra", "50GB/s", "--inter", "1Gbit", "--intra-latency-us", "2",
        "--inter-latency-us", "40"]  # fmt: skip


def test_the_report_holds_each_points_priced_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = str(tmp_path / "sim")
    code = main(["simulate", *ARGS, "--ranks", "4,2", "--schemes", "zen,dense,sparcml", "--memory-gb", "1e-4",
                 "-o", prefix])  # fmt: skip
    assert code == 0
    document = json.loads(Path(prefix + ".json").read_text())
    printed = capsys.readouterr().out
    assert Path(prefix + ".md").read_text().strip() in printed
    workload = ZipfWorkload(num_items=3000, dim=4, density=0.05, skew=1.1, overlap=0.2, seed=3)
    topology = Topology(2, Link(2e-6, 50e9), Link(40e-6, 1e9 / 8))
    assert document["workload"]["num_items"] == 3000 and document["topology"]["ranks_per_node"] == 2
    assert [(r["ranks"], r["scheme"]) for r in document["rows"]] == [
        (n, s) for n in (2, 4) for s in ("zen", "dense", "sparcml")
    ]
    for row in document["rows"]:
        # 1e-4 GB holds 2 ranks' dense tensors (96 kB) but not 4: auto counts zen and dense at 4 and
        # skips sparcml there (counted mode does not cover it).
        big = row["ranks"] == 4
        expected_mode = ("skip" if row["scheme"] == "sparcml" else "counted") if big else "full"
        assert row["mode"] == expected_mode, row
        if row["mode"] == "skip":
            assert row["seconds"] is None
            continue
        again = simulate_step(row["scheme"], row["ranks"], workload, topology, mode=row["mode"])
        assert row["seconds"] == pytest.approx(again["seconds"], rel=1e-12)
        assert row["max_sent_bytes"] == again["max_sent_bytes"] > 0
    assert "| 4 | " in printed and " - |" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schemes", "zen,bogus"], "unknown ['bogus']"),
        (["--schemes", "auto"], "unknown ['auto']"),
        (["--ranks", "0,4"], "1..4096"),
        (["--density", "0"], "--density"),
        (["--inter", "fast"], "bandwidth"),
        (["--mode", "counted", "--schemes", "sparcml"], "need full runs"),
        (["--ranks-per-node", "0"], "ranks_per_node"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *argv, "-o", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

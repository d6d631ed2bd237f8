"""``zensync simulate``: the report holds what the library computes for each point, and bad flags exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from zensync.cli import main
from zensync.planner.cluster import parse_bandwidth
from zensync.simulate import Link, Topology
from zensync.simulate.sweep import ZipfWorkload, simulate_step

ARGS = ["--items", "3000", "--dim", "4", "--density", "0.05", "--skew", "1.1", "--overlap", "0.2", "--seed", "3",
        "--ranks-per-node", "2", "--intra", "50GB/s", "--inter", "1Gbit", "--intra-latency-us", "2",
        "--inter-latency-us", "40"]  # fmt: skip


def test_the_report_holds_each_points_priced_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = str(tmp_path / "sim")
    code = main(["simulate", *ARGS, "--ranks", "4,2", "--schemes", "zen,dense,sparcml", "--memory-gb", "1e-4",
                 "--compute-scale", "0", "-o", prefix])  # fmt: skip
    assert code == 0
    document = json.loads(Path(prefix + ".json").read_text())
    printed = capsys.readouterr().out
    assert Path(prefix + ".md").read_text().strip() in printed
    workload = ZipfWorkload(num_items=3000, dim=4, density=0.05, skew=1.1, overlap=0.2, seed=3)
    topology = Topology(2, Link(2e-6, 50e9), Link(40e-6, 1e9 / 8))
    assert (
        document["workload"]["tensors"]["gradient"]["num_items"] == 3000 and document["topology"]["ranks_per_node"] == 2
    )
    assert [(r["ranks"], r["scheme"]) for r in document["rows"]] == [
        (n, s) for n in (2, 4) for s in ("zen", "dense", "sparcml")
    ]
    for row in document["rows"]:
        # 1e-4 GB holds 2 ranks' dense tensors (96 kB) but not 4: auto counts the points at 4.
        assert row["mode"] == ("counted" if row["ranks"] == 4 else "full"), row
        again = simulate_step(row["scheme"], row["ranks"], workload, topology, mode=row["mode"], compute_scale=0.0)
        assert row["seconds"] == pytest.approx(again["seconds"], rel=1e-12)
        assert row["max_sent_bytes"] == again["max_sent_bytes"] > 0
    assert "| 4 | " in printed and " C (" in printed
    assert "Zipf 3,000 x 4 rows, density 0.05, skew 1.1, overlap 0.2" in printed


def test_every_point_adds_its_local_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """At the default --compute-scale a full point costs its network time plus its measured local
    work, a counted point its network time plus the fitted work, and the report shows both. The rank
    with the most local work ends no earlier than that work plus every collective's time, which is
    the network-only step."""
    prefix = str(tmp_path / "sim")
    argv = ["simulate", *ARGS, "--ranks", "2,4", "--schemes", "zen", "--memory-gb", "1e-4", "-o", prefix]
    assert main(argv) == 0
    document = json.loads(Path(prefix + ".json").read_text())
    assert document["compute_scale"] == 1.0 and "measured at full" in document["priced"]
    full, counted = document["rows"]
    assert (full["mode"], counted["mode"]) == ("full", "counted")
    workload = ZipfWorkload(num_items=3000, dim=4, density=0.05, skew=1.1, overlap=0.2, seed=3)
    topology = Topology(2, Link(2e-6, 50e9), Link(40e-6, 1e9 / 8))
    for row in (full, counted):
        network = simulate_step("zen", row["ranks"], workload, topology, mode=row["mode"], compute_scale=0.0)
        assert row["compute_seconds"] > 0 and row["seconds"] >= network["seconds"] + row["compute_seconds"] - 1e-12
    # The fit: both calibration sizes (3000 rows and 375) at 2, 4 and 8 ranks, one sample per rank.
    fit = document["local_work_fits"]["zen"]
    assert fit == counted["local_work"] and fit["samples"] == 2 * (2 + 4 + 8)
    assert "Counted zen's local work per rank" in capsys.readouterr().out


def test_cores_and_transport_cpu_reach_every_points_price(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--cores and --transport-cpu reach every point's pricing (full and counted); the report says so."""
    import zensync.simulate.sweep as sweep
    from zensync.simulate.timeline import price

    seen: list[tuple[float | None, Any]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append((kwargs.get("cores"), kwargs.get("transport_cpu")))
        return price(*args, **kwargs)

    monkeypatch.setattr(sweep, "price", spy)
    prefix = str(tmp_path / "sim")
    argv = ["simulate", *ARGS, "--ranks", "2,4", "--schemes", "zen", "--memory-gb", "1e-4", "--cores", "1.5",
            "--transport-cpu", "all_to_all_v=0.5,all_gather_v=2"]  # fmt: skip
    assert main([*argv, "-o", prefix]) == 0
    document = json.loads(Path(prefix + ".json").read_text())
    assert [row["mode"] for row in document["rows"]] == ["full", "counted"]
    costs = {"all_to_all_v": 0.5e-9, "all_gather_v": 2e-9}
    assert seen == [(1.5, costs)] * 2 and document["cores"] == 1.5 and "sharing 1.5 cores" in document["priced"]
    assert document["transport_cpu_s_per_byte"] == costs and "all_gather_v 2 ns/byte" in document["priced"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schemes", "zen,bogus"], "unknown ['bogus']"),
        (["--schemes", "auto"], "unknown ['auto']"),
        (["--ranks", "0,4"], "1..4096"),
        (["--density", "0"], "--density"),
        (["--inter", "fast"], "bandwidth"),
        (["--ranks-per-node", "0"], "ranks_per_node"),
        (["--compute-scale", "-1"], "--compute-scale"),
        (["--cores", "0"], "--cores must be finite and > 0"),
        (["--inter-burst-kib", "-1"], "burst_bytes"),
        (["--cores", "inf"], "--cores must be finite and > 0"),
        (["--transport-cpu", "all_reduce=-1"], "--transport-cpu: 'all_reduce=-1' must be OP=NS"),
        (["--transport-cpu", "gather=1"], "OP one of all_reduce"),
        (["--transport-cpu", "all_reduce"], "must be OP=NS"),
        (["--model", "alexnet"], "valid: resnet50"),
        (["--model", "resnet50", "--ranks", "8,12"], "[12] are not multiples of --ranks-per-node 8"),
        (["--model", "resnet50", "--stats", "x.json"], "give one"),
        (["--model", "resnet50", "--ranks", "8", "--compressor", "powersgd:2"], "matrix shapes"),
        (["--model", "resnet50", "--ranks", "8", "--compressor", "bogus"], "--compressor"),
        (["--lm-batch", "-2"], "--lm-batch must be >= 1"),
        (["--lm-batch", "4", "--model", "resnet50"], "without --stats or --model"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *argv, "-o", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_stats_tensors_add_up_to_the_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zensync.simulate.sweep import load_stats, simulate_sweep

    stats = {"version": 1, "seed": 7, "tensors": [
        {"name": "emb", "rows": 4000, "dim": 4, "density": 0.05, "skew": 1.1, "overlap": 0.2},
        {"name": "out", "rows": 900, "density": 0.3, "skew": 0.0},
    ]}  # fmt: skip
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(stats))
    prefix = str(tmp_path / "sim")
    # 100 kB: emb's dense tensors (128 kB at 2 ranks) are counted, out's run in full: a mixed point.
    argv = ["simulate", *ARGS, "--stats", str(path), "--ranks", "2,3", "--schemes", "zen,agsparse",
            "--compute-scale", "0", "--memory-gb", "1e-4", "-o", prefix]  # fmt: skip
    assert main(argv) == 0
    document = json.loads(Path(prefix + ".json").read_text())
    printed = capsys.readouterr().out
    assert "2 Zipf tensors (emb, out) synced in turn" in printed and " F+C (" in printed
    assert {row["mode"] for row in document["rows"]} == {"mixed"}
    tensors = load_stats(path.read_text())
    assert tensors["emb"].seed == 7 and tensors["out"].seed == 8 and tensors["out"].dim == 1
    topology = Topology(2, Link(2e-6, 50e9), Link(40e-6, 1e9 / 8))
    alone = {
        n: simulate_sweep(["zen", "agsparse"], [2, 3], w, topology, compute_scale=0.0, memory_bytes=1e5)
        for n, w in tensors.items()
    }
    for i, row in enumerate(document["rows"]):
        parts = [alone["emb"][i], alone["out"][i]]
        assert row["seconds"] == pytest.approx(sum(p["seconds"] for p in parts), rel=1e-12)
        assert row["max_sent_bytes"] == sum(p["max_sent_bytes"] for p in parts)
        assert row["tensors"]["emb"]["seconds"] == pytest.approx(parts[0]["seconds"], rel=1e-12)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1]", "version"),
        ('{"version": 1, "tensors": []}', "non-empty"),
        ('{"version": 1, "tensors": [{"rows": 10}]}', "density"),
        ('{"version": 1, "tensors": [{"rows": 10, "density": 2}]}', "density must be in"),
        (json.dumps({"version": 1, "tensors": [{"name": "a", "rows": 9, "density": 0.1}] * 2}), "twice"),
        ("not json", "not a gradient-statistics file"),
    ],
)
def test_bad_stats_files_exit_2(content: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "stats.json"
    path.write_text(content)
    assert main(["simulate", "--stats", str(path), "--ranks", "2", "-o", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err
    assert main(["simulate", "--stats", str(tmp_path / "missing.json"), "-o", str(tmp_path / "x")]) == 2


def test_png_without_matplotlib_exits_1_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["simulate", *ARGS, "--ranks", "2", "--png", "-o", str(tmp_path / "x")]) == 1
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_png_is_written_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    prefix = str(tmp_path / "x")
    assert main(["simulate", *ARGS, "--ranks", "2,4", "--schemes", "zen,dense", "--png", "-o", prefix]) == 0
    assert Path(prefix + ".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # three 25M-element steps: about 10 s
def test_a_models_planned_step_is_reported_per_strategy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zensync.planner import builtin_profile
    from zensync.simulate.planned import plan_sweep

    prefix = str(tmp_path / "sim")
    argv = ["simulate", "--model", "resnet50", "--ranks", "4", "--ranks-per-node", "2", "--inter", "10Gbit",
            "--compute-scale", "0", "-o", prefix]  # fmt: skip
    assert main(argv) == 0
    document = json.loads(Path(prefix + ".json").read_text())
    assert document["workload"]["parameters"] == 25_557_032 and "resnet50 (25,557,032" in capsys.readouterr().out
    topology = Topology(2, Link(5e-6, parse_bandwidth("nvlink")), Link(10e-6, parse_bandwidth("10Gbit")))
    expected = plan_sweep(builtin_profile("resnet50"), "dgc:0.01", [4], topology, compute_scale=0.0)
    assert [r["scheme"] for r in document["rows"]] == ["fp32", "fp16", "plan"]
    for row, want in zip(document["rows"], expected, strict=True):
        assert row["seconds"] == pytest.approx(want["seconds"], rel=1e-12) and row["mode"] == "mirror"


def test_the_lm_workload_is_the_rows_its_batches_touch(tmp_path: Path) -> None:
    """--lm-batch: each rank's rows are its batch's distinct token ids; a counted point prices the
    records a full run makes (both network only)."""
    from zensync.simulate.lm_workload import LMWorkload
    from zensync.workloads import lm

    prefix = str(tmp_path / "sim")
    argv = ["simulate", "--lm-batch", "8", "--items", "5000", "--dim", "4", "--ranks", "2,3", "--schemes",
            "zen,dense", "--ranks-per-node", "2", "--compute-scale", "0", "--memory-gb", "1", "-o", prefix]  # fmt: skip
    assert main(argv) == 0
    document = json.loads(Path(prefix + ".json").read_text())
    assert document["workload"]["family"] == "lm"
    workload = LMWorkload(num_items=5000, dim=4, batch_size=8)
    config = lm.Config(vocab_size=5000, embed_dim=4, batch_size=8)
    inputs, _ = lm.batch_for_rank(lm.load_corpus(config), config, 1, step=0)
    assert torch.equal(workload.items(1), inputs.unique())
    assert torch.equal(workload.tensor(1).abs().sum(1).nonzero().squeeze(1), inputs.unique())
    topology = Topology(2, Link(5e-6, parse_bandwidth("nvlink")), Link(10e-6, parse_bandwidth("25Gbit")))
    for row in document["rows"]:
        assert row["mode"] == "full"
        counted = simulate_step(row["scheme"], row["ranks"], workload, topology, mode="counted", compute_scale=0)
        assert row["seconds"] == pytest.approx(counted["seconds"], rel=1e-12)
        assert row["max_sent_bytes"] == counted["max_sent_bytes"]


def test_an_inter_burst_gives_the_inter_links_a_token_bucket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--inter-burst-kib: the inter-node links hold a bucket (Link.burst_bytes); the points are priced with it."""
    prefix = str(tmp_path / "sim")
    argv = ["simulate", *ARGS, "--ranks", "4", "--schemes", "zen", "--compute-scale", "0", "--inter-burst-kib", "64"]
    assert main([*argv, "-o", prefix]) == 0
    document = json.loads(Path(prefix + ".json").read_text())
    assert document["topology"]["inter"]["burst_bytes"] == 65536
    workload = ZipfWorkload(num_items=3000, dim=4, density=0.05, skew=1.1, overlap=0.2, seed=3)
    bucket = Topology(2, Link(2e-6, 50e9), Link(40e-6, 1e9 / 8, 65536))
    (row,) = document["rows"]
    again = simulate_step("zen", 4, workload, bucket, mode=row["mode"], compute_scale=0.0)
    plain = simulate_step(
        "zen", 4, workload, Topology(2, Link(2e-6, 50e9), Link(40e-6, 1e9 / 8)), mode=row["mode"], compute_scale=0.0
    )
    assert row["seconds"] == pytest.approx(again["seconds"], rel=1e-12) and row["seconds"] < plain["seconds"]
    assert "a 64 KiB bucket" in capsys.readouterr().out

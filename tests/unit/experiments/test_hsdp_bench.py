"""experiments/hsdp_bench.py: Eq. 1 of the replica groups from recorded rows (the unit), and a short run
of the whole benchmark on 2 emulated nodes x 2 ranks (slow tier: about a minute)."""

from __future__ import annotations

import json

import pytest

from zensync.cost.sparse import TensorShape, measured_union, predict_bytes
from zensync.demo.config import DemoConfig


@pytest.fixture(scope="module")
def bench(experiment_module):
    return experiment_module("hsdp_bench")


def test_eq1_sums_every_shards_replica_group(bench) -> None:
    """Ranks 0, 1 on node 0 and 2, 3 on node 1: shard 0's group is ranks 0 and 2, shard 1's 1 and 3."""

    def run(rows: int, union: int) -> dict:
        return {"steps": [{"embedding": {"replica_rows": rows, "replica_union": union}}]}

    config = DemoConfig()
    runs = [run(400, 600), run(20, 30), run(400, 600), run(20, 30)]
    expected = 0.0
    for rows, union in ((400, 600), (20, 30)):
        shape = TensorShape(world_size=2, num_items=25_000, item_bytes=4 * config.embed_dim, index_bytes=4, nnz=rows)
        expected += 2 * predict_bytes("zen", shape, measured_union(shape, union / rows))
    assert bench._eq1_bytes(runs, 2, config) == [pytest.approx(expected)]
    # Eq. 1 by hand for one group: each of 2 ranks receives half of (pushed rows + pulled union), COO.
    assert expected == pytest.approx(2 * 0.5 * (400 + 600) * 260 + 2 * 0.5 * (20 + 30) * 260)


@pytest.mark.slow
def test_a_short_run_matches_native_hsdp_and_eq1(bench, tmp_path) -> None:
    assert bench.main(["--steps", "2", "--warmup", "1", "--rounds", "1", "--strategies", "native", "zen",
                       "--results-dir", str(tmp_path), "--label", "smoke"]) == 0  # fmt: skip
    (report,) = tmp_path.glob("hsdp_smoke_*.json")
    results = json.loads(report.read_text())["results"]
    zen = results["zen"]
    assert zen["max_param_diff_vs_native"] < 1e-5  # lossless: native HSDP's parameters, up to summation order
    assert zen["embedding_paths"] == ["rows", "rows", "zen"]
    assert zen["embedding_over_eq1"] == pytest.approx(1.0, abs=0.1)
    if results["native"]["wire_s_per_step"] is not None:  # emulated (root): the veths counted the replica sync
        assert zen["inter_node_bytes_per_step"] < results["native"]["inter_node_bytes_per_step"] / 4
        assert 1.0 < zen["veth_over_engine"] < 1.15  # the payload zensync counts, plus headers

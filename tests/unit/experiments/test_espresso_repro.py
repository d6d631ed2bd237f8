"""experiments/espresso_repro.py on a tiny config: LSTM at 16 and 64 GPUs, one selection repeat.

Checks real values under the planner's own model: the plan is never slower than FP32 or FP16 and
never faster than the upper bound; the restricted planners that are subsets of the full search
(GPU-only, no fusion) are never faster than it; the selection-time workload is the batch the rule
(``selection_batch``) picks; a rerun reuses every finished point.
"""

from __future__ import annotations

import json

import pytest

ARGS = ["--models", "lstm", "--gpus", "16", "64", "--repeats", "1", "--date", "test", "--no-plot"]
EPS_S = 1e-9
"""Float noise of the simulator's sums, in milliseconds here (far below any real difference)."""


@pytest.fixture(scope="module")
def driver(experiment_module):
    return experiment_module("espresso_repro")


@pytest.fixture(scope="module")
def result(driver, tmp_path_factory):
    out = tmp_path_factory.mktemp("espresso_repro")
    assert driver.main([*ARGS, "--out", str(out)]) == 0
    return out, json.loads((out / "espresso_repro_test.json").read_text())


def test_iteration_points_are_bounded(result) -> None:
    _, doc = result
    for cluster in ("pcie-25gbit", "nvlink-100gbit"):
        for gpus in (16, 64):
            r = doc["points"][f"iter|lstm|{cluster}|{gpus}"]
            assert r["upper_bound_ms"] <= r["plan_ms"] + EPS_S
            assert r["plan_ms"] <= min(r["fp32_ms"], r["fp16_ms"]) + EPS_S
            assert r["compute_ms"] <= r["upper_bound_ms"] + EPS_S
            assert r["scaling_fp32"] == pytest.approx(r["compute_ms"] / r["fp32_ms"])


def test_lstm_calibrated_to_table_1(result) -> None:
    """Table 1: LSTM's FP32 scaling factor on 64 GPUs, PCIe + 25 Gbit/s, is 0.46."""
    _, doc = result
    assert doc["points"]["iter|lstm|pcie-25gbit|64"]["scaling_fp32"] == pytest.approx(0.46, abs=0.01)


def test_subset_ablations_never_beat_the_full_plan(result) -> None:
    _, doc = result
    for cluster in ("pcie-25gbit", "nvlink-100gbit"):
        full = doc["points"][f"ablate|lstm|{cluster}|full"]["plan_ms"]
        for variant in ("gpu-only", "no-fusion"):
            assert doc["points"][f"ablate|lstm|{cluster}|{variant}"]["plan_ms"] >= full - EPS_S


def test_report_names_the_paper_and_versions(result) -> None:
    out, doc = result
    text = (out / "espresso_repro_test.md").read_text()
    assert "Table 1 (DGC): FP32 0.46" in text
    assert "| lstm | 10 / 10 | 64 |" in text
    assert doc["versions"]["torch"] and doc["command"].startswith("python experiments/espresso_repro.py")


def test_algorithm1_as_stated_beside_table_5(result) -> None:
    """Algorithm 1 timed as the paper states it (F(S) per variant) and in O(1): same choices, one full
    simulation for the start and one per GPU option of every tensor tried, both in the report."""
    out, doc = result
    r = doc["points"]["alg1|lstm|64|1"]
    assert r["same_choice"] and r["tensors"] == 10
    assert r["simulations"] == 1 + r["tensors_tried"] * r["gpu_options"] and 0 < r["tensors_tried"] <= 10
    assert r["as_stated_ms"] > 0 and r["max_plus_ms"] > 0
    text = (out / "espresso_repro_test.md").read_text()
    assert "on section 1's workload and on one of Table 6's size" in text and "| lstm | 10 / 10 | 10 |" in text


def test_selection_batch_rule(driver) -> None:
    """The count closest to the target wins; ties go to the batch nearest the anchor, then the larger."""
    assert driver.selection_batch({1: 20, 2: 9, 3: 13, 4: 0}, target=11, anchor=4) == 3
    assert driver.selection_batch({1: 20, 2: 9, 3: 13, 4: 0}, target=11, anchor=1) == 2
    assert driver.selection_batch({1: 5, 2: 5, 3: 5, 4: 5}, target=5, anchor=2) == 2
    assert driver.selection_batch({1: 4, 2: 6, 3: 6}, target=5, anchor=2) == 2  # 2 is the anchor
    assert driver.selection_batch({1: 4, 3: 6}, target=5, anchor=2) == 3  # equally near: the larger
    assert driver.selection_batch({1: 90, 2: 60, 3: 40}, target=54, anchor=3) == 2  # |60 - 54| < |40 - 54|


def test_selection_workload_follows_the_rule(result) -> None:
    """LSTM: the scan covers 1 .. 2 x section 1's batch, the batch it picks has the count closest to Table
    6's (5 tensors), the selection timings are of that workload and its plan compresses that count."""
    out, doc = result
    anchor = int(doc["batches"]["lstm"].split()[0])
    rule = doc["points"][f"selbatch|lstm|{anchor}"]
    counts = {int(b): c for b, c in rule["counts"].items()}
    assert rule["target"] == 5 and sorted(counts) == list(range(1, 2 * anchor + 1))
    assert abs(counts[rule["batch"]] - 5) == min(abs(c - 5) for c in counts.values())
    assert doc["selection_batches"]["lstm"].startswith(f"{rule['batch']} x ")
    select = doc["points"][f"select-w|lstm|{rule['batch']}|1"]
    assert select["compressed_full"] == counts[rule["batch"]]
    alg1, alg1_before = doc["points"][f"alg1-w|lstm|{rule['batch']}|1"], doc["points"]["alg1|lstm|64|1"]
    assert alg1["tensors"] == 10
    text = (out / "espresso_repro_test.md").read_text()
    near = ", ".join(str(counts.get(rule["batch"] + step, "-")) for step in (-1, 0, 1))
    assert f"/ 5 | {alg1_before['compressed']} -> {alg1['compressed']} | {near} |" in text


def test_rerun_reuses_finished_points(driver, result, monkeypatch) -> None:
    out, before = result

    def fail(*args, **kwargs):
        raise AssertionError("a finished point was recomputed")

    for name in (
        "iteration_point",
        "selection_point",
        "algorithm1_point",
        "ablation_point",
        "compressed_tensors",
        "_calibrated",
    ):
        monkeypatch.setattr(driver, name, fail)
    assert driver.main([*ARGS, "--out", str(out)]) == 0
    assert json.loads((out / "espresso_repro_test.json").read_text())["points"] == before["points"]

"""experiments/compression_volume.py: 1-bit volumes equal the bytes computed by hand, and counted
payloads equal the cost model's for every compressor the planner prices."""

from __future__ import annotations

import json

import pytest

from zensync import compress


@pytest.fixture(scope="module")
def driver(experiment_module):
    return experiment_module("compression_volume")


def test_onebit_allreduce_bytes_by_hand(driver) -> None:
    """2**20 elements over 4 ranks: chunks of 2**18 elements = 32768 sign bytes + 4 scale bytes (efsignsgd),
    sent to 3 ranks in each of 2 phases; a ring fp32 allreduce sends 2 * 3/4 * 4 * 2**20 bytes."""
    import torch

    numel, ranks = 2**20, 4
    generator = torch.Generator().manual_seed(0)
    onebit = driver.onebit_allreduce_bytes(compress.build("efsignsgd"), numel, ranks, generator)
    assert onebit == 2 * 3 * (32768 + 4) == 196_632
    assert driver.onebit_predicted_bytes("efsignsgd", numel, ranks) == onebit
    fp32 = driver.ring_allreduce_bytes(numel, ranks, 4)
    assert fp32 == 6_291_456
    assert fp32 / onebit == pytest.approx(32 * 32768 / 32772)


def test_end_to_end_ratio(driver) -> None:
    """16x on the compressed stage with 15 % dense warm-up: 1 / (0.15 + 0.85 / 16) = 4.92 (DeepSpeed: up to 5x)."""
    assert driver.end_to_end_ratio(16.0, 0.15) == pytest.approx(1 / (0.15 + 0.85 / 16))
    assert driver.end_to_end_ratio(16.0, 0.15) == pytest.approx(4.92, abs=0.005)
    assert driver.end_to_end_ratio(32.0, 0.0) == 32.0


def test_counted_bytes_match_model_and_hand(driver) -> None:
    shapes = [(64, 32), (100,)]
    rows = {
        r["compressor"]: r for r in driver.compressor_rows(shapes, ["fp16", "topk:0.01", "efsignsgd", "powersgd:2"])
    }
    assert rows["fp16"]["counted_bytes"] == 2 * (64 * 32 + 100)
    assert rows["fp16"]["dense_bytes"] == 4 * (64 * 32 + 100)
    # top-k 1 %: ceil-or-at-least-one values (fp32) + indices (int32) per tensor, as the model says.
    assert rows["topk:0.01"]["counted_bytes"] == rows["topk:0.01"]["predicted_bytes"]
    # sign + one fp32 scale per tensor: 2048 / 8 + 4 and ceil(100 / 8) + 4.
    assert rows["efsignsgd"]["counted_bytes"] == (256 + 4) + (13 + 4)
    assert rows["efsignsgd"]["counted_over_predicted"] == 1.0
    # PowerSGD rank 2: P (64 x 2) and Q (32 x 2) for the matrix, the vector sent dense; not planner-priced.
    assert rows["powersgd:2"]["counted_bytes"] == 4 * (64 * 2 + 32 * 2) + 4 * 100
    assert rows["powersgd:2"]["predicted_bytes"] is None


def test_main_writes_tables(driver, tmp_path) -> None:
    args = ["--models", "resnet50", "--compressors", "fp16", "efsignsgd", "--ranks", "4", "--date", "test"]
    assert driver.main([*args, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "compression_volume_test.json").read_text())
    part = doc["models"]["resnet50"]
    assert part["numel"] == 25_557_032  # torchvision ResNet-50's parameter count
    fused = next(r for r in part["onebit"] if r["layout"] == "fused" and r["compressor"] == "efsignsgd")
    assert fused["onebit_bytes"] == fused["predicted_bytes"]
    assert 31.9 < fused["ratio_vs_fp32"] <= 32.0
    assert "| efsignsgd | fused |" in (tmp_path / "compression_volume_test.md").read_text()

"""experiments/zen_scaling.py end to end on its --tiny workloads (n <= 4): dense's time by hand, the
report's parts, and a rerun served from the cache."""

from __future__ import annotations

import json
import pathlib

import pytest


@pytest.fixture(scope="module")
def driver(experiment_module):
    return experiment_module("zen_scaling")


def _shrink(driver, monkeypatch) -> None:
    """n <= 4, 2 nodes for part 3, 8 ranks for the statistics: a few dozen draws in all."""
    monkeypatch.setattr(driver, "RANKS", (2, 4))
    monkeypatch.setattr(driver, "CHECK_RANKS", (4,))
    monkeypatch.setattr(driver, "CHECK_SCALES", {"lstm": (32, 4), "deepfm": (64,), "nmt": (8,)})
    monkeypatch.setattr(driver, "NODES", 2)
    monkeypatch.setattr(driver, "STATS_RANKS", 8)


def test_tiny_run_reports_every_part_and_resumes(
    driver, experiment_module, tmp_path: pathlib.Path, monkeypatch
) -> None:
    _shrink(driver, monkeypatch)
    report_module = experiment_module("_zen_scaling_report")
    monkeypatch.setattr(report_module, "_figure", lambda data, path: False)  # matplotlib: the slow test below
    prefix = tmp_path / "zs"
    assert driver.main(["--tiny", "-o", str(prefix)]) == 0
    data = json.loads((tmp_path / "zs.json").read_text())
    lstm = data["models"]["lstm"]
    # LSTM rows / (1 * 256) = 793471 // 256 = 3099 rows of 512 float32: M = 6,346,752 bytes, priced
    # on links 256 times slower (the full tensor's byte time). Dense ring all-reduce at n = 2, one GPU
    # per node, 25 Gbit/s: 2 * 10 us + 2 * (1/2) * M / (3.125e9 / 256 B/s).
    assert lstm["workload"]["num_items"] == 3099
    dense2 = next(r for r in lstm["rows"] if (r["ranks"], r["scheme"]) == (2, "dense"))
    assert dense2["seconds"]["flat25"] == pytest.approx(2e-5 + 6_346_752 * 256 / 3.125e9, rel=1e-12)
    assert {r["mode"] for m in data["models"].values() for r in m["rows"]} == {"counted"}
    assert set(lstm["hier_seconds"]["25"]) == {"dense", "agsparse", "sparcml", "omnireduce", "sparse_ps", "zen"}
    report = (tmp_path / "zs.md").read_text()
    for part in ("## 1.", "## 2.", "## 3.", "## 4.", "## Scale check", "| nmt-element"):
        assert part in report
    # A rerun counts nothing: every point comes from the cache.
    monkeypatch.setattr(driver, "counted_points", lambda *a, **k: pytest.fail("recounted a cached point"))
    assert driver.main(["--tiny", "-o", str(prefix)]) == 0
    assert json.loads((tmp_path / "zs.json").read_text())["models"]["lstm"]["rows"] == lstm["rows"]


@pytest.mark.slow
def test_tiny_run_draws_its_figure(driver, tmp_path: pathlib.Path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")  # the report draws its figure only where matplotlib is installed
    _shrink(driver, monkeypatch)
    assert driver.main(["--tiny", "-o", str(tmp_path / "zs")]) == 0
    assert (tmp_path / "zs.png").stat().st_size > 10_000
    assert "Figure: zs.png." in (tmp_path / "zs.md").read_text()

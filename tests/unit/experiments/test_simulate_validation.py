"""experiments/simulate_validation.py's calibration fit: synthetic rank files made from a known
network and host model give that model back (alpha, beta, the all-to-all's efficiency and latency
scale, the exchange efficiency, the cores and each collective's transport CPU per byte), on links
that hold the testbed's token bucket."""

from __future__ import annotations

import pytest

from zensync.cost.topology import Link


@pytest.fixture(scope="module")
def driver(experiment_module):
    return experiment_module("simulate_validation")


@pytest.mark.parametrize("n", [4, 16])
def test_the_calibration_fit_recovers_the_model_that_made_the_timings(driver, n: int) -> None:
    alpha, beta, e, scale, x, c, g = 2e-3, 1.1e7, 0.7, 0.5, 0.5, n / 1.7, 0.75
    costs = {
        "all_reduce": 0.6e-9,
        "all_to_all_v": 0.9e-9,
        "send_recv": 1.3e-9,
        "all_gather_v": 1.6e-9,
        "all_gather": 2e-9,
    }
    sizes = driver._sizes(100 * 10**6)
    reps, burst = 3, driver.burst_bytes(100 * 10**6)  # the testbed's token bucket at 100 Mbit/s
    link = Link(alpha, beta, burst)
    r0 = {
        "allreduce_s": {b: [link.ring_s(2 * (n - 1), b / n)] * reps for b in sizes},
        "all_to_all_s": {b: [scale * (n - 1) * alpha + max(0, b - burst) / (e * beta)] * reps for b in sizes},
        "one_way_s": {b: [b / 1.2e7] * reps for b in sizes[1:]},
        "exchange_s": {b: [b / (x * 1.2e7)] * reps for b in sizes[1:]},
        "all_gather_v_s": {b: [0.1] * reps for b in sizes},
        "all_gather_s": {b: [(n - 1) * alpha + (n - 1) / n * b / (g * beta)] * reps for b in sizes},
        "job_solo_thread_cpu_s": [0.3] * reps,
        "job_concurrent_wall_s": [0.3 * c] * reps,
        "transport_cpu_s": {
            f"{op}/{b}": [0.004 + cost * driver.MOVED_PER_SIZE[op](n, b)] * reps
            for op, cost in costs.items()
            for b in sizes
        },
        # The whole machine: the processes' CPU plus the kernel's uncharged network work (half again).
        "transport_machine_cpu_s": {
            f"{op}/{b}": 0.01 + 1.5 * cost * driver.MOVED_PER_SIZE[op](n, b)
            for op, cost in costs.items()
            for b in sizes
        },
    }
    cal = driver.fit_calibration([r0], n, 100 * 10**6)
    assert cal["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert cal["beta_bytes_per_s"] == pytest.approx(beta, rel=1e-6)
    assert cal["burst_bytes"] == burst
    assert cal["all_to_all_efficiency"] == pytest.approx(e, rel=1e-6)
    assert driver.all_to_all_latency_scale(cal, n) == pytest.approx(scale, rel=1e-6)
    assert cal["exchange_efficiency"] == pytest.approx(x, rel=1e-6)
    assert driver.cores_of(cal, n) == pytest.approx(1.7, rel=1e-9)
    assert cal["transport_cpu_s_per_byte"] == pytest.approx(costs, rel=1e-6)
    machine = {op: 1.5 * c for op, c in costs.items()}
    assert cal["transport_machine_cpu_s_per_byte"] == pytest.approx(machine, rel=1e-6)
    assert cal["all_gather_efficiency"] == pytest.approx(g, rel=1e-6)
    topology = driver.topology_of(cal, n)
    assert topology.all_to_all_latency_scale == pytest.approx(scale, rel=1e-6)
    assert (topology.exchange_efficiency, topology.all_to_all_efficiency) == pytest.approx((x, e), rel=1e-6)
    assert topology.all_gather_efficiency == pytest.approx(g, rel=1e-6)


def test_one_exchange_size_at_the_other_rate_does_not_move_the_exchange_efficiency(driver) -> None:
    """Exchanges on the emulated hosts run at about half the link each way or near all of it; the
    median over the sizes keeps the rate most sizes ran at, where the slopes' ratio would not."""
    one_way = {b: b / 1.2e8 for b in (6_250_000, 25_000_000, 75_000_000)}
    exchange = {b: t / 0.5 for b, t in one_way.items()}
    exchange[75_000_000] = one_way[75_000_000] / 0.76  # this size ran at the faster rate
    assert driver.exchange_efficiency(one_way, exchange) == pytest.approx(0.5, rel=1e-12)


def test_a_point_over_its_cluster_starts_takes_the_medians_and_the_median_starts_details(
    experiment_module,
) -> None:
    report = experiment_module("_validation_report")
    driver = experiment_module("simulate_validation")

    def row(start: int, measured: float, predicted: float, step: float) -> dict:
        return {"start": start, "measured_s": measured, "predicted_s": predicted, "step_predicted_s": step,
                "step_error": step / measured - 1, "detail": f"start {start}"}  # fmt: skip

    cache = {"points": {
        "1gbit/16@1/zen": row(1, 1.30, 1.00, 1.10),
        "1gbit/16@2/zen": row(2, 1.10, 1.20, 1.30),
        "1gbit/16@3/zen": row(3, 1.20, 0.90, 1.00),
    }}  # fmt: skip
    point = report.combined(cache, "1gbit/16", "zen", 3)
    assert (point["measured_s"], point["predicted_s"], point["step_predicted_s"]) == (1.20, 1.00, 1.10)
    assert point["error"] == pytest.approx(1.00 / 1.20 - 1)
    assert point["step_error"] == pytest.approx(1.10 / 1.20 - 1)
    assert point["detail"] == "start 3"  # the start whose measured time is the median
    assert [s["start"] for s in point["starts"]] == [1, 2, 3]
    # Two starts cached of three: medians of two, details of the lower middle one; none: no point.
    del cache["points"]["1gbit/16@3/zen"]
    point = report.combined(cache, "1gbit/16", "zen", 3)
    assert point["measured_s"] == pytest.approx(1.20) and point["step_predicted_s"] == pytest.approx(1.20)
    assert point["detail"] == "start 2"
    assert report.combined(cache, "1gbit/16", "dense", 3) is None
    assert driver.split_cluster(driver.cluster_key("100mbit", 8, 2)) == ("100mbit", 8, 2)

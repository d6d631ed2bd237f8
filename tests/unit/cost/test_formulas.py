"""zensync.cost: the ring allreduce priced by the sync engine (alpha per step) and by the planner (alpha
once per collective), the other collectives, and the measured union, against values worked by hand.

Inputs are powers of two or small integers so that each expected value is exact in binary: equality is
checked with ``==`` where no rounding can occur.
"""

from __future__ import annotations

import numpy as np
import pytest

from zensync.cost import (
    CostModel,
    TensorShape,
    allgather_s,
    allreduce_s,
    alltoall_s,
    broadcast_s,
    gather_s,
    independent_union,
    measured_union,
    predict_bytes,
    predict_time,
    reduce_scatter_s,
)

REL = 1e-12
"""Relative tolerance where a value is a short float expression with rounding (a root, a power)."""
_BANDWIDTH = 100.0
_LATENCY = 0.25


def _dense_shape(world_size: int, nbytes: int) -> TensorShape:
    return TensorShape(world_size=world_size, num_items=nbytes // 4, item_bytes=4, index_bytes=4, nnz=nbytes / 4)


@pytest.mark.parametrize(
    ("ranks", "planner_s", "engine_s"),
    [
        # 800 bytes at 100 B/s. k=2: volume 2(1)/2 = 1 -> 8 s; alpha once: 8.25; alpha 2(k-1)=2 times: 8.5.
        (2, 8.25, 8.5),
        # k=4: volume 2(3)/4 = 1.5 -> 12 s; planner 12 + 0.25; engine 12 + 6 * 0.25 = 13.5.
        (4, 12.25, 13.5),
        # k=8: volume 2(7)/8 = 1.75 -> 14 s; planner 14.25; engine 14 + 14 * 0.25 = 17.5.
        (8, 14.25, 17.5),
        # One rank: nothing to send, no latency, in both models.
        (1, 0.0, 0.0),
    ],
)
def test_ring_allreduce_in_both_latency_conventions(ranks: int, planner_s: float, engine_s: float) -> None:
    assert allreduce_s(800.0, ranks, _BANDWIDTH, _LATENCY) == planner_s
    shape = _dense_shape(ranks, 800)
    model = CostModel(latency_s=_LATENCY, bandwidth_bytes_per_s=_BANDWIDTH)
    assert predict_time("dense", shape, independent_union(shape), model) == engine_s


@pytest.mark.parametrize("ranks", [2, 3, 5, 7, 8, 12, 48, 1000])
@pytest.mark.parametrize("nbytes", [4, 1_000_004, 102_760_448])
def test_dense_byte_term_is_the_planners_bit_for_bit(ranks: int, nbytes: int) -> None:
    """With alpha = 0 the two models are one formula: identical floats, and those of the pre-refactor code
    (``2 * (n - 1) / n * bytes / bandwidth`` in sync/cost.py, ``2.0 * (k - 1) / k`` in planner/costs.py)."""
    bandwidth = 3.125e9
    shape = _dense_shape(ranks, nbytes)
    engine = predict_time(
        "dense", shape, independent_union(shape), CostModel(latency_s=0.0, bandwidth_bytes_per_s=bandwidth)
    )
    planner = allreduce_s(float(nbytes), ranks, bandwidth, 0.0)
    assert engine == planner == 2 * (ranks - 1) / ranks * (nbytes // 4 * 4) / bandwidth
    assert predict_bytes("dense", shape, independent_union(shape)) == 2.0 * (ranks - 1) / ranks * nbytes
    latency = 150e-6
    with_latency = CostModel(latency_s=latency, bandwidth_bytes_per_s=bandwidth)
    old_engine = latency * (2 * (ranks - 1)) + 2 * (ranks - 1) / ranks * nbytes / bandwidth
    assert predict_time("dense", shape, independent_union(shape), with_latency) == old_engine
    assert (
        allreduce_s(float(nbytes), ranks, bandwidth, latency)
        == latency + 2.0 * (ranks - 1) / ranks * nbytes / bandwidth
    )


def test_other_collectives_by_hand() -> None:
    # 800 bytes per rank over 4 ranks at 100 B/s, alpha 0.25 once.
    assert reduce_scatter_s(800.0, 4, _BANDWIDTH, _LATENCY) == 0.25 + 0.75 * 8  # (k-1)/k of the input
    assert alltoall_s(800.0, 4, _BANDWIDTH, _LATENCY) == 0.25 + 0.75 * 8  # (k-1)/k sent and received
    assert allgather_s(800.0, 4, _BANDWIDTH, _LATENCY) == 0.25 + 3 * 8  # k-1 payloads received
    assert gather_s(800.0, 4, _BANDWIDTH, _LATENCY) == 0.25 + 3 * 8  # the root receives k-1 payloads
    assert broadcast_s(800.0, 4, _BANDWIDTH, _LATENCY) == 0.25 + 8  # pipelined chain: one payload
    for collective in (allreduce_s, reduce_scatter_s, alltoall_s, allgather_s, gather_s, broadcast_s):
        assert collective(800.0, 1, _BANDWIDTH, _LATENCY) == 0.0, collective.__name__


def test_collectives_price_arrays_elementwise() -> None:
    got = allreduce_s(np.array([800.0, 0.0, 400.0]), 4, _BANDWIDTH, _LATENCY)
    np.testing.assert_array_equal(got, [12.25, 0.25, 6.25])
    np.testing.assert_array_equal(allreduce_s(np.array([800.0]), 1, _BANDWIDTH, _LATENCY), [0.0])


def test_measured_union_matches_the_measurement_at_n() -> None:
    # n=2, 100 items, K=10, gamma=1.9: union(2) = 19; per-rank density d' = 1 - sqrt(1 - 0.19) = 0.1.
    shape = TensorShape(world_size=2, num_items=100, item_bytes=4, index_bytes=4, nnz=10.0)
    union = measured_union(shape, gamma=1.9)
    assert union(1) == 10.0
    assert union(2) == pytest.approx(19.0, rel=REL)
    assert union(4) == pytest.approx(100 * (1 - 0.9**4), rel=REL)  # 34.39
    # Never above the tensor, never below one rank's items, nothing for an empty tensor.
    assert measured_union(shape, gamma=50.0)(2) == pytest.approx(100.0, rel=1e-9)
    assert measured_union(shape, gamma=0.5)(2) == 10.0
    empty = TensorShape(world_size=2, num_items=0, item_bytes=4, index_bytes=4, nnz=0.0)
    assert measured_union(empty, gamma=1.0)(2) == 0.0

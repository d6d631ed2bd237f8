"""Counted points' local work: bytes moved per rank, the non-negative fit, and where it is charged."""

from __future__ import annotations

import pytest

from zensync.simulate import Call, Link, Topology, price
from zensync.simulate.local_work import (
    CALIBRATION_RANKS,
    LocalWorkFit,
    bytes_moved,
    calibrate,
    calibration_rows,
    charge,
    fit,
)

G3 = (0, 1, 2)


def _a2a(sent: tuple[int, ...]) -> Call:
    return Call("all_to_all_v", G3, "push", sum(sent), sent=sent)


def test_bytes_moved_counts_each_collective_by_hand() -> None:
    calls = [
        [_a2a((5, 10, 20)), Call("all_gather_v", G3, "pull", 7), Call("all_reduce", (0, 1), "d", 100)],
        [_a2a((1, 2, 3)), Call("all_gather_v", G3, "pull", 8), Call("all_reduce", (0, 1), "d", 100)],
        [_a2a((4, 0, 6)), Call("all_gather_v", G3, "pull", 9), Call("local", (2,), "pull", compute_s=1.0)],
    ]
    # Rank 0 sends 10 + 20 (a2a), 2 x 7 (gather), 2 * 1/2 * 100 (ring); receives 1 + 4, 8 + 9, 100.
    assert bytes_moved(calls) == [(30 + 14 + 100, 5 + 17 + 100), (4 + 16 + 100, 10 + 16 + 100), (4 + 18, 20 + 3 + 15)]


def test_the_fit_recovers_linear_work_and_never_goes_negative() -> None:
    exact = [(d, m, 0.002 + 1e-9 * d + 3e-9 * m) for d in (1e6, 8e6) for m in (1e5, 5e5, 2e6)]
    got = fit("zen", exact)
    assert (got.fixed_s, got.per_dense_byte_s, got.per_moved_byte_s) == pytest.approx((0.002, 1e-9, 3e-9), rel=1e-9)
    assert got.samples == 6 and got.max_relative_error < 1e-9
    # Work that falls with the moved bytes cannot be fitted with a negative slope: it gets none.
    falling = [(1e6, m, 0.01 - 1e-9 * m) for m in (1e5, 1e6, 5e6)]
    clamped = fit("dense", falling)
    assert clamped.per_moved_byte_s == 0.0 and min(clamped.fixed_s, clamped.per_dense_byte_s) >= 0.0
    with pytest.raises(ValueError, match="no samples"):
        fit("zen", [])


def test_charge_puts_send_side_work_first_and_receive_side_work_last() -> None:
    work = LocalWorkFit(
        "zen", fixed_s=0.5, per_dense_byte_s=0.0, per_moved_byte_s=0.01, samples=1, max_relative_error=0
    )
    calls = [[Call("all_gather_v", (0, 1), "pull", 100)], [Call("all_gather_v", (0, 1), "pull", 300)]]
    charged = charge(calls, work, lambda rank: 0.0)
    assert [c[0].compute_s for c in charged] == [0.5 + 0.01 * 100, 0.5 + 0.01 * 300]
    assert [(c[-1].op, c[-1].compute_s) for c in charged] == [("local", 0.01 * 300), ("local", 0.01 * 100)]
    topo = Topology.flat(Link(1e-6, 1e9))
    network = price(calls, topo, compute_scale=0).seconds
    # Rank 1 prepares longer (3.5 s), both gather, then rank 0 unpacks rank 1's 300 bytes (3 s).
    assert price(charged, topo).seconds == pytest.approx(3.5 + network + 3.0, rel=1e-12)


def test_calibrate_fits_full_runs_at_two_sizes_and_three_world_sizes() -> None:
    item_bytes, seen = 64, []

    def full_calls(n: int, rows: int) -> list[list[Call]]:
        seen.append((n, rows))
        group = tuple(range(n))
        gather = Call("all_gather_v", group, "pull", rows)  # each rank moves rows * (n-1) each way
        work = 1e-3 + 2e-9 * rows * item_bytes + 4e-9 * 2 * rows * (n - 1)
        return [[gather, Call("local", (r,), "pull", compute_s=work)] for r in range(n)]

    rows = calibration_rows(10**9, item_bytes)
    assert rows == (2**26 // item_bytes, 2**26 // item_bytes // 8) and calibration_rows(500, 4) == (500, 62)
    got = calibrate("agsparse", full_calls, num_items=10**9, item_bytes=item_bytes)
    assert seen == [(n, r) for r in rows for n in CALIBRATION_RANKS]
    assert (got.fixed_s, got.per_dense_byte_s, got.per_moved_byte_s) == pytest.approx((1e-3, 2e-9, 4e-9), rel=1e-6)
    assert got.samples == 2 * sum(CALIBRATION_RANKS)

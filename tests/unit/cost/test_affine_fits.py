"""The least-squares affine fit shared by the hook's calibration and the compressor-cost profiler."""

from __future__ import annotations

import pytest

from zensync.cost import fit_affine
from zensync.profiling.costs import clamped_fit


def test_fit_affine_recovers_a_line_and_the_least_squares_solution() -> None:
    assert fit_affine([1, 2, 3], [3.0, 5.0, 7.0]) == pytest.approx((1.0, 2.0), abs=1e-12)
    # Three points off a line: the normal equations give intercept 1/3 and slope 1 by hand.
    intercept, slope = fit_affine([0, 1, 2], [0.0, 2.0, 2.0])
    assert intercept == pytest.approx(1 / 3, abs=1e-12) and slope == pytest.approx(1.0, abs=1e-12)


def test_profiler_fit_clamps_to_non_negative_costs() -> None:
    exact = clamped_fit([1000, 2000, 4000], [2e-3, 3e-3, 5e-3])
    assert (exact.fixed_s, exact.per_element_s) == pytest.approx((1e-3, 1e-6), rel=1e-9)
    flat = clamped_fit([1000, 2000, 4000], [3e-3, 2e-3, 1e-3])  # negative slope: noise, a flat cost
    assert (flat.fixed_s, flat.per_element_s) == pytest.approx((2e-3, 0.0))
    through_origin = clamped_fit([1000, 2000], [0.0, 4e-3])  # negative intercept: y ~ per * x
    assert through_origin.fixed_s == 0.0
    assert through_origin.per_element_s == pytest.approx(8e-6 / 5, rel=1e-12)  # sum(xy) / sum(x^2)
    single = clamped_fit([1000], [2e-3])
    assert (single.fixed_s, single.per_element_s) == (2e-3, 0.0)

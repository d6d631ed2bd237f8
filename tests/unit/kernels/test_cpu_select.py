"""Unit tests of the numba top-k selection (``cpu_select``): hand-checked cases, threshold rounding, threads.

Sizes of 150_000 keys cross ``_PARALLEL_MIN_SELECT``, so from the main thread the parallel builds
run; ``test_worker_thread_takes_the_serial_path`` runs them from a worker thread.
"""

from __future__ import annotations

import inspect
import math
import threading

import pytest
import torch

from tests.strategies import DENSE_DTYPES
from zensync.kernels import cpu, cpu_select, reference

_LARGE = 150_000


def _both(x: torch.Tensor, k: int, threshold: float, **relax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk, sampled_topk), each checked equal to its reference first."""
    exact = cpu_select.topk(x, k)
    sampled = cpu_select.sampled_topk(x, k, threshold, **relax)
    assert torch.equal(exact, reference.topk(x, k))
    assert torch.equal(sampled, reference.sampled_topk(x, k, threshold, **relax))
    return exact, sampled


# ---------------------------------------------------------------- API and hand-checked examples


def test_signatures_match_reference() -> None:
    assert set(cpu_select.__all__) == {"topk", "sampled_topk", "topk_abs", "sampled_topk_abs"}
    for name in cpu_select.__all__:
        assert inspect.signature(getattr(cpu_select, name)) == inspect.signature(getattr(reference, name)), name


def test_kernels_have_distinct_parallel_and_serial_builds() -> None:
    kernels = [k for k in vars(cpu_select).values() if isinstance(k, cpu._Kernel)]
    assert len(kernels) == 4
    for kernel in kernels:
        assert kernel.parallel.targetoptions.get("parallel")
        assert not kernel.serial.targetoptions.get("parallel")


def test_docstring_examples() -> None:
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0])
    exact, sampled = _both(x, 3, threshold=2.5)
    assert exact.tolist() == sampled.tolist() == [1, 2, 3]  # 3.0, 3.0 and the first 2.0


def test_nan_above_inf_and_signed_zeros_tie() -> None:
    """NaN (negative sign too) > inf > numbers; -0.0 == 0.0, so a tie at zero goes to the lowest position."""
    x = torch.tensor([-0.0, 0.0, -math.nan, math.inf, -math.inf, 0.0])
    assert x[2].view(torch.int32) < 0  # the NaN's sign bit is set
    assert _both(x, 2, threshold=1.0)[0].tolist() == [2, 3]
    assert _both(x, 3, threshold=1.0)[0].tolist() == [0, 2, 3]  # the -0.0 at position 0 wins the tie
    assert _both(x, 4, threshold=-0.0)[0].tolist() == [0, 1, 2, 3]
    assert _both(x, 5, threshold=0.5)[0].tolist() == [0, 1, 2, 3, 5]


def test_kth_largest_is_nan() -> None:
    x = torch.tensor([math.nan, 1.0, math.nan, math.nan])
    assert _both(x, 2, threshold=5.0)[0].tolist() == [0, 2]


@pytest.mark.parametrize("k", [0, 5, 6])
def test_k_zero_and_k_at_least_numel(k: int) -> None:
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0])
    expected = [] if k == 0 else [0, 1, 2, 3, 4]
    for out in _both(x, k, threshold=2.5):
        assert out.dtype == torch.int64 and out.tolist() == expected
    assert cpu_select.topk(torch.empty(0), 0).tolist() == []


def test_relax_path_and_exhausted_tries() -> None:
    """Threshold 10 relaxed by 0.5: 10, 5, 2.5 (two pass), 1.25 (four pass); one try falls back to exact."""
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0])
    assert _both(x, 3, threshold=10.0, relax_factor=0.5)[1].tolist() == [1, 2, 3]
    assert _both(x, 3, threshold=10.0, max_tries=1)[1].tolist() == [1, 2, 3]
    assert _both(x, 3, threshold=-math.inf)[1].tolist() == [1, 2, 3]
    assert _both(x, 2, threshold=3.0)[1].tolist() == [1, 3]  # exactly k candidates at the first try


def test_bad_arguments_raise_like_the_reference() -> None:
    x = torch.ones(4)
    for k in (-1, True, 1.5):
        with pytest.raises(ValueError, match="k="):
            cpu_select.topk(x, k)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="k="):
            cpu_select.sampled_topk(x, k, 0.5)  # type: ignore[arg-type]
    for factor in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="relax_factor"):
            cpu_select.sampled_topk(x, 2, 0.5, relax_factor=factor)


def test_unsupported_inputs_run_the_reference() -> None:
    """Integer dtypes and non-contiguous views: the reference's result (the view is copied, not refused)."""
    ints = torch.tensor([4, 1, 4, 9], dtype=torch.int32)
    assert torch.equal(cpu_select.topk(ints, 2), reference.topk(ints, 2))
    strided = torch.tensor([1.0, 0.0, 3.0, 0.0, 2.0, 0.0, 3.0])[::2]
    assert cpu_select.topk(strided, 2).tolist() == [1, 3]


# ---------------------------------------------------------------- threshold rounding


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_threshold_rounds_like_torch_comparison(dtype: torch.dtype) -> None:
    """Every finite value of the dtype against midpoints of neighbours nudged by less than a float32 ulp.

    torch rounds the scalar to the tensor's dtype (through float32, ties to even) before comparing:
    1.0 >= 1.00048828125 * (1 + 2**-30) is True in float16, though the scalar exceeds the midpoint.
    """
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    values = values[values.isfinite()]
    generator = torch.Generator().manual_seed(0)
    picks = values[torch.randint(0, values.numel(), (400,), generator=generator)].double()
    neighbours = torch.nextafter(picks.to(dtype), torch.full_like(picks, math.inf).to(dtype)).double()
    midpoints = (picks + neighbours) / 2
    counts = torch.zeros(1, dtype=torch.int64).numpy()
    value_bits, spec = cpu_select._bits_of(values)
    for midpoint in midpoints.tolist():
        for threshold in (midpoint, midpoint * (1 + 2.0**-30), midpoint * (1 - 2.0**-30)):
            lo = cpu_select._threshold_key(threshold, dtype)
            cpu_select._count_at_least.serial(value_bits, spec, lo, values.numel(), counts)
            assert int(counts[0]) == int((values >= threshold).sum()), threshold


# ---------------------------------------------------------------- large inputs and threads


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_large_inputs_parallel_build(dtype: torch.dtype) -> None:
    """Gaussian magnitudes (with NaNs) at k = 1 % under three thresholds, k = 50 %, and all-tied zeros."""
    x = torch.randn(_LARGE, generator=torch.Generator().manual_seed(1)).abs().to(dtype)
    x[::997] = math.nan
    for threshold in (2.5, 1e9, -1.0):  # passes at once, relaxes, everything passes
        _both(x, _LARGE // 100, threshold)
    _both(x, _LARGE // 2, 2.5)
    _both(torch.zeros(_LARGE, dtype=dtype), _LARGE - 1, 0.5)


def test_worker_thread_takes_the_serial_path() -> None:
    x = torch.randn(_LARGE, generator=torch.Generator().manual_seed(2)).abs()
    k = _LARGE // 100
    expected = (reference.topk(x, k), reference.sampled_topk(x, k, 2.5))
    results: list[object] = []
    worker = threading.Thread(
        target=lambda: results.append((cpu_select.topk(x, k), cpu_select.sampled_topk(x, k, 2.5)))
    )
    worker.start()
    worker.join()
    assert len(results) == 1
    actual = results[0]
    assert isinstance(actual, tuple)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])

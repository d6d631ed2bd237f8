"""Measuring compressors on the local device: seconds per compress and decompress by tensor size.

For each compressor spec and each size, the median of ``repeats`` timed calls (after a warm-up)
of ``compress`` and of ``decompress``; then a least-squares fit ``seconds = a + b * numel`` per
operation, which is what the planner's cost model takes (``zensync.cost.CostFit``).

Example::

    costs = measure_compressor_costs(["topk:0.01", "efsignsgd"], sizes=[2**12, 2**16, 2**20])
    costs[0].compress.at(10**6)  # predicted seconds for a 1M-element tensor
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from zensync import kernels
from zensync.compress import build
from zensync.cost import CostFit, fit_affine

__all__ = ["CompressorCost", "measure_compressor_costs"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CompressorCost:
    """Measured cost of one compressor on one device."""

    spec: str
    device: str
    compress: CostFit
    decompress: CostFit


def measure_compressor_costs(
    specs: Sequence[str],
    sizes: Sequence[int] = (2**12, 2**16, 2**20),
    *,
    device: torch.device | str = "cpu",
    repeats: int = 10,
) -> list[CompressorCost]:
    """Time every spec at every size on ``device``; float32 normal data, one warm-up call each."""
    if repeats < 1 or not sizes or min(sizes) < 1:
        raise ValueError(f"repeats={repeats} must be >= 1 and sizes={list(sizes)} non-empty and positive")
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(n, generator=gen).to(dev) for n in sizes}
    out = []
    for spec in specs:
        comp = build(spec)
        enc, dec = [], []
        for n in sizes:
            x = inputs[n]
            enc.append(_median_s(functools.partial(comp.compress, x, name="profile", step=0), repeats, dev))
            packed = comp.compress(x, name="profile", step=0)
            dec.append(_median_s(functools.partial(comp.decompress, packed), repeats, dev))
        out.append(
            CompressorCost(
                spec=comp.spec(),
                device=kernels.device_name(dev),
                compress=clamped_fit(sizes, enc),
                decompress=clamped_fit(sizes, dec),
            )
        )
    return out


def _median_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        kernels.synchronize(device)
        start = time.perf_counter()
        fn()
        kernels.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def clamped_fit(sizes: Sequence[float], seconds: Sequence[float]) -> CostFit:
    """Least-squares affine fit of seconds by size, clamped to non-negative coefficients."""
    measured = tuple(round(s) for s in sizes)
    if len(sizes) == 1:
        return CostFit(fixed_s=seconds[0], per_element_s=0.0, sizes=measured, seconds=tuple(seconds))
    fixed, per = fit_affine(sizes, seconds)
    if per < 0:  # noise on tiny sizes: a flat cost
        fixed, per = statistics.fmean(seconds), 0.0
    if fixed < 0:  # through the origin: least squares of y ~ per * x
        per = max(0.0, sum(a * b for a, b in zip(sizes, seconds, strict=True)) / sum(a * a for a in sizes))
        fixed = 0.0
    return CostFit(fixed_s=fixed, per_element_s=per, sizes=measured, seconds=tuple(seconds))

"""Deep Gradient Compression's selection (Lin et al., ICLR 2018): top-k through a sampled threshold.

Sorting a large gradient for its exact top-k is slow, so DGC estimates the magnitude threshold of
the top ``ratio`` from a small random sample and keeps the elements above it (GRACE ``dgc.py``: 1 %
sample, at most 10 threshold adjustments). Message sizes must not depend on the data (a rank
unpacks the others' payloads with its own layout), so this version always sends exactly k:

1. Below ``EXACT_BELOW_NUMEL`` elements: exact top-k.
2. Estimate the threshold: the k_s-th largest |x| of a seeded random sample of
   max(1, ceil(sample_fraction * numel)) elements, k_s = max(1, ceil(ratio * sample size)).
3. Select |x| >= threshold; while fewer than k pass, relax the threshold (x ``RELAX_FACTOR``, at
   most ``MAX_TRIES`` times).
4. If at least k passed, keep the k largest of them; otherwise fall back to the exact top-k.

Whenever at least k elements pass the threshold, the k-th largest |x| is >= the threshold, so the
candidates contain the whole top-k: the result equals ``topk`` exactly (same tie rule, lowest
positions first) and only the cost differs. The momentum correction, local gradient clipping and
momentum factor masking of the paper belong to the optimizer, not to this compressor.

Example::

    comp = build("dgc:0.001")
    values, indices = comp.compress(grad, name="fc.weight", step=3).payloads  # k of each, as topk
"""

from __future__ import annotations

import dataclasses
import math

import torch

from zensync import kernels
from zensync.compress.base import (
    check_ratio,
    format_spec,
    register_compressor,
    selected_count,
    shared_generator,
    to_float,
    to_int,
)
from zensync.compress.topk import SelectedValues

__all__ = ["EXACT_BELOW_NUMEL", "MAX_TRIES", "RELAX_FACTOR", "DGCCompressor"]

EXACT_BELOW_NUMEL = 16384
"""Tensors smaller than this take the exact top-k (sampling would not pay for itself)."""
RELAX_FACTOR = 0.8
"""Threshold multiplier when too few elements pass it."""
MAX_TRIES = 10
"""Thresholds tried before falling back to the exact top-k."""
_DEFAULT_SAMPLE_FRACTION = 0.01


@register_compressor
class DGCCompressor(SelectedValues):
    """``dgc:ratio``: DGC's sampled-threshold selection of exactly k = max(1, ceil(ratio * numel)) elements.

    Args:
        ratio: Fraction of the elements sent, in (0, 1] (a spec string such as ``"0.01"`` is accepted).
        sample_fraction: Fraction of the elements sampled to estimate the threshold, in (0, 1].
        seed: Seed of the sample positions; combined with the tensor name and the step.

    Example::

        comp = DGCCompressor(0.01, sample_fraction=0.02)
        comp.spec()  # 'dgc:0.01,sample_fraction=0.02'
    """

    name = "dgc"
    needs_error_feedback = True

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        """Hyperparameters of DGC's selection."""

        ratio: float
        """Fraction of the elements sent, in (0, 1]."""
        sample_fraction: float = _DEFAULT_SAMPLE_FRACTION
        """Fraction of the elements sampled (with replacement) to estimate the threshold, in (0, 1]."""
        seed: int = 0
        """Seed of the sample positions; combined with the tensor name and the step."""

        def __post_init__(self) -> None:
            check_ratio("ratio", self.ratio)
            if not 0.0 < self.sample_fraction <= 1.0:
                raise ValueError(
                    f"sample_fraction={self.sample_fraction!r} must be in (0, 1]: it is the fraction of the "
                    f"elements sampled to estimate the threshold"
                )

        def build(self) -> DGCCompressor:
            return DGCCompressor(self.ratio, sample_fraction=self.sample_fraction, seed=self.seed)

    def __init__(
        self, ratio: float | str, *, sample_fraction: float | str = _DEFAULT_SAMPLE_FRACTION, seed: int | str = 0
    ) -> None:
        self.config = DGCCompressor.Config(
            ratio=to_float("ratio", ratio),
            sample_fraction=to_float("sample_fraction", sample_fraction),
            seed=to_int("seed", seed),
        )

    def spec(self) -> str:
        options: dict[str, object] = {}
        if self.config.sample_fraction != _DEFAULT_SAMPLE_FRACTION:
            options["sample_fraction"] = self.config.sample_fraction
        if self.config.seed != 0:
            options["seed"] = self.config.seed
        return format_spec(self.name, [self.config.ratio], options)

    @property
    def ratio(self) -> float:
        return self.config.ratio

    def select(self, flat: torch.Tensor, *, name: str, step: int) -> torch.Tensor:
        """Sorted int64 positions of exactly k elements of the 1-D values ``flat``, by |value| (steps 1-4 above)."""
        numel = flat.numel()
        k = selected_count(self.config.ratio, numel)
        # NaN ranks above every number, as in top-k: a NaN gradient is sent, never silently dropped
        # (the kernels let NaN pass every threshold).
        # Step 1: small tensors take the exact top-k.
        if numel < EXACT_BELOW_NUMEL:
            return kernels.topk_abs(flat, k)
        # Step 2: the threshold of the top `ratio` of a shared-seed random sample.
        num_samples = max(1, math.ceil(self.config.sample_fraction * numel))
        generator = shared_generator(self.config.seed, name, step, purpose="dgc", device=flat.device)
        positions = torch.randint(0, numel, (num_samples,), generator=generator, device=flat.device)
        # A NaN threshold would pass nothing; index_select, not flat[positions] (15x faster on CPU).
        sample = torch.nan_to_num(flat.index_select(0, positions).abs(), nan=float("inf"))
        threshold = torch.topk(sample, selected_count(self.config.ratio, num_samples), sorted=False).values.min()
        # Steps 3-4: relax the threshold until k pass, then the k largest of the candidates (a kernel;
        # equal to the exact top-k whatever the threshold, so only the cost depends on the sample).
        threshold_value = float(threshold)  # host-device sync
        return kernels.sampled_topk_abs(flat, k, threshold_value, relax_factor=RELAX_FACTOR, max_tries=MAX_TRIES)

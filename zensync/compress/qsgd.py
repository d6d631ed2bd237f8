"""QSGD (Alistarh et al., NeurIPS 2017): per-bucket norm plus stochastically rounded int8 levels.

The flattened tensor is cut into buckets of ``bucket`` consecutive elements (the last one may be
shorter). Each bucket sends its L2 norm as one fp32 and each element an int8 ``sign * l`` with

    l = floor(|x| / norm * s + u),  u ~ U[0, 1) from the shared generator (purpose "qsgd"),

clamped to 0..s, so E[l] = |x| / norm * s and decompress(x) = norm * sign * l / s is unbiased.
s = ``levels`` is at most 127 to fit int8. Arithmetic is in float32 (float64 for float64 input),
with the norm rounded (up) to its fp32 wire value before quantising, so the decompression uses
exactly the numbers the quantisation used. A bucket whose norm is 0 sends l = 0 everywhere.

The draws are ``torch.rand(numel, generator=shared_generator(seed, name, step, purpose="qsgd"),
dtype=<compute dtype>)``; tests replay them. Payloads of different ranks have different norms, so
QSGD is not allreduce-compatible (GRACE ``qsgd.py``).

Example::

    comp = build("qsgd:127,128")
    levels, norms = comp.compress(grad, name="fc.weight", step=3).payloads  # int8 [numel], fp32 [buckets]
"""

from __future__ import annotations

import dataclasses
import math

import torch

from zensync import kernels
from zensync.compress.base import (
    Compressed,
    Compressor,
    compute_dtype,
    format_spec,
    fp32_round_up,
    register_compressor,
    shared_generator,
    to_int,
)

__all__ = ["MAX_LEVELS", "QSGDCompressor"]

MAX_LEVELS = 127
"""The largest ``levels``: sign * l must fit an int8."""
_DEFAULT_BUCKET = 128


def _bucketed(flat: torch.Tensor, bucket: int) -> torch.Tensor:
    """``flat`` zero-padded to whole buckets, viewed as (num_buckets, bucket)."""
    num_buckets = math.ceil(flat.numel() / bucket)
    padded = torch.zeros(num_buckets * bucket, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    return padded.view(num_buckets, bucket)


@register_compressor
class QSGDCompressor(Compressor):
    """``qsgd:levels[,bucket]``: int8 stochastic levels and one fp32 L2 norm per bucket.

    Args:
        levels: s, the number of non-zero magnitude levels, 1..127 (a spec string is accepted).
        bucket: Elements per norm, >= 1.
        seed: Seed of the dither; combined with the tensor name and the step.

    Example::

        comp = QSGDCompressor(127, 128)
        comp.payload_bytes(1000, torch.float32)  # 1000 int8 + 8 norms * 4 = 1032
    """

    name = "qsgd"

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        """Hyperparameters of QSGD."""

        levels: int = MAX_LEVELS
        """s, the number of non-zero magnitude levels, 1..127 (sign * level is an int8)."""
        bucket: int = _DEFAULT_BUCKET
        """Consecutive elements that share one fp32 norm, >= 1."""
        seed: int = 0
        """Seed of the dither; combined with the tensor name and the step."""

        def __post_init__(self) -> None:
            if not 1 <= self.levels <= MAX_LEVELS:
                raise ValueError(f"levels={self.levels} must be in 1..{MAX_LEVELS}: sign * level is sent as an int8")
            if self.bucket < 1:
                raise ValueError(f"bucket={self.bucket} must be >= 1: it is the number of elements per norm")

        def build(self) -> QSGDCompressor:
            return QSGDCompressor(self.levels, self.bucket, seed=self.seed)

    def __init__(
        self, levels: int | str = MAX_LEVELS, bucket: int | str = _DEFAULT_BUCKET, *, seed: int | str = 0
    ) -> None:
        self.config = QSGDCompressor.Config(
            levels=to_int("levels", levels), bucket=to_int("bucket", bucket), seed=to_int("seed", seed)
        )

    def spec(self) -> str:
        options: dict[str, object] = {"seed": self.config.seed} if self.config.seed != 0 else {}
        return format_spec(self.name, [self.config.levels, self.config.bucket], options)

    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> Compressed:
        s, bucket = self.config.levels, self.config.bucket
        compute = compute_dtype(x.dtype)
        flat = x.reshape(-1).to(compute)
        numel = flat.numel()
        # Step 1: one L2 norm per bucket, rounded up to its fp32 wire value (so |x| / norm <= 1):
        # the whole buckets as rows of a view, the last, shorter one apart (no padded copy).
        whole = numel // bucket * bucket
        norms = flat[:whole].view(-1, bucket).norm(dim=1)
        if whole < numel:
            norms = torch.cat([norms, flat[whole:].norm().reshape(1)])
        norms = fp32_round_up(norms)
        # Step 2: |x| / norm * s, dithered and floored; a zero norm gives level 0. Step 3: the
        # sign goes into the int8 (0 stays 0 whatever the sign). One pass (kernels.quantize_levels).
        levels_per_norm = torch.where(norms > 0, s / norms.to(compute), 0.0)
        generator = shared_generator(self.config.seed, name, step, purpose="qsgd", device=x.device)
        dither = torch.rand(numel, generator=generator, dtype=compute, device=x.device)
        signed = kernels.quantize_levels(flat, levels_per_norm, dither, bucket, s)
        return Compressed((signed, norms), (x.shape, x.dtype))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        signed, norms = compressed.payloads
        shape, dtype = compressed.ctx
        compute = compute_dtype(dtype)
        # norm * (sign * level) / s, one bucket per row.
        values = _bucketed(signed.to(compute), self.config.bucket).mul_(
            (norms.to(compute) / self.config.levels)[:, None]
        )
        return values.view(-1)[: signed.numel()].to(dtype).view(shape)

    def decompress_add(self, compressed: Compressed, out: torch.Tensor) -> torch.Tensor:
        """``out += decompress(compressed)`` in one pass (``kernels.dequantize_add``: the same
        products, norm / s times sign * level in the compute dtype, and the same addition)."""
        signed, norms = compressed.payloads
        if out.dtype != compute_dtype(out.dtype) or not out.is_contiguous():
            return super().decompress_add(compressed, out)
        scales = norms.to(out.dtype) / self.config.levels
        kernels.dequantize_add(out.view(-1), signed, scales, self.config.bucket)
        return out

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel + 4 * math.ceil(numel / self.config.bucket)

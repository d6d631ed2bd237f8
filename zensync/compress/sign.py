"""The sign family: one bit per element (packed 8 per byte) plus zero, one or two fp32 scales.

- ``signsgd`` (Bernstein et al. 2018): the signs alone; decompress gives +1 / -1 (no scale).
- ``efsignsgd`` (Karimireddy et al. 2019, EF-SignSGD): scale = mean |x|; decompress = scale * sign.
- ``onebit`` (1-bit SGD, Seide et al. 2014): two scales, the mean of the non-negative elements and
  the mean of the negative ones; each element decompresses to the mean of its group.

An element is "non-negative" (bit 1) when ``x >= 0``, so 0 and -0.0 decompress as +1 (and NaN as
-1). Bits are packed in little-endian bit order, as ``numpy.packbits(bitorder="little")``: element
8j + i is bit i of byte j, and the last byte is zero-padded. Packed signs cannot be summed by an
allreduce (BytePS ``docs/gradient-compression.md``), so these run with allgather or
alltoall+allgather; ``efsignsgd`` and ``onebit`` are biased and meant for error feedback.

A NaN or infinity makes the scales of ``efsignsgd`` and ``onebit`` non-finite, so it reaches their
output (as under dense allreduce); ``signsgd`` has no scale to carry it, so error feedback, which
would keep it, is refused for it (``CompressedSync``).

Example::

    comp = build("onebit")
    bits, scales = comp.compress(grad).payloads  # uint8 [ceil(numel / 8)], fp32 [2]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch

from zensync import kernels
from zensync.compress.base import Compressed, Compressor, compute_dtype, register_compressor

__all__ = ["EFSignSGDCompressor", "OneBitCompressor", "SignSGDCompressor"]

_BITS_PER_BYTE = 8
_ONE_PASS_DTYPES = (torch.float32, torch.float64)
"""Output dtypes the one-pass decode and residual handle (half types: the compressor's general path)."""


class _SignCompressor(Compressor):
    """Shared body: payload 0 is the packed ``x >= 0`` bits, then ``num_scales`` fp32 scales.

    Subclasses give ``_scales`` (what is sent besides the bits, from ``kernels.sign_encode``'s
    count and sums) and ``_levels`` (the value of a 0 bit and of a 1 bit, from the scales). One
    pass encodes (bits and sums together), one decodes every sender into the sum
    (``decompress_sum``), one computes the residual (``subtract_transmitted``).
    """

    num_scales: ClassVar[int]

    def _scales(self, stats: torch.Tensor, numel: int) -> torch.Tensor:
        """fp32 [num_scales] from float64 [count of x >= 0, sum of max(x, 0), sum of min(x, 0)]."""
        return torch.empty(0, dtype=torch.float32, device=stats.device)

    def _levels(self, scales: torch.Tensor) -> torch.Tensor:
        """[value of a 0 bit, value of a 1 bit] (fp32)."""
        return torch.tensor([-1.0, 1.0], device=scales.device)

    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> Compressed:
        flat = x.reshape(-1).to(compute_dtype(x.dtype))
        packed, stats = kernels.sign_encode(flat)
        payloads = (packed, self._scales(stats, flat.numel())) if self.num_scales else (packed,)
        return Compressed(payloads, (x.shape, x.dtype))

    def _part_levels(self, compressed: Compressed, device: torch.device) -> torch.Tensor:
        """[value of a 0 bit, value of a 1 bit] of one sender (fp32)."""
        scales = compressed.payloads[1] if self.num_scales else torch.empty(0, dtype=torch.float32, device=device)
        return self._levels(scales)

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, dtype = compressed.ctx
        packed = compressed.payloads[0]
        levels = self._part_levels(compressed, packed.device).to(dtype)
        return kernels.unpack_bits(packed, 1, shape.numel(), levels).view(shape)

    def decompress_sum(self, parts: Sequence[Compressed], out: torch.Tensor) -> torch.Tensor:
        """Every sender's bits decoded and summed in one pass over ``out`` (``kernels.sign_decode_sum``)."""
        if out.dtype not in _ONE_PASS_DTYPES or not out.is_contiguous() or not parts:
            return super().decompress_sum(parts, out)
        levels = torch.stack([self._part_levels(p, out.device) for p in parts]).to(out.dtype)
        kernels.sign_decode_sum([p.payloads[0] for p in parts], levels, out.view(-1))
        return out

    def subtract_transmitted(self, x: torch.Tensor, compressed: Compressed) -> torch.Tensor:
        """x minus the level of its own bit, in one pass (``kernels.sign_residual``)."""
        if x.dtype not in _ONE_PASS_DTYPES or not x.is_contiguous():
            return super().subtract_transmitted(x, compressed)
        kernels.sign_residual(x.view(-1), self._part_levels(compressed, x.device).to(x.dtype))
        return x

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return math.ceil(numel / _BITS_PER_BYTE) + 4 * self.num_scales


@register_compressor
class SignSGDCompressor(_SignCompressor):
    """``signsgd``: 1 bit per element, decompressed to +1 (x >= 0) or -1; no scale.

    Example::

        SignSGDCompressor().payload_bytes(1000)  # 125
    """

    name = "signsgd"
    num_scales = 0
    carries_nonfinite = False  # a NaN is sent as -1 and an infinity as +1: no scale to carry them


@register_compressor
class EFSignSGDCompressor(_SignCompressor):
    """``efsignsgd``: 1 bit per element and one fp32 scale, mean |x|; decompress = scale * sign.

    Example::

        EFSignSGDCompressor().payload_bytes(1000)  # 125 + 4 = 129
    """

    name = "efsignsgd"
    needs_error_feedback = True
    num_scales = 1

    def _scales(self, stats: torch.Tensor, numel: int) -> torch.Tensor:
        mean_magnitude = (stats[1] - stats[2]) / max(numel, 1)
        return mean_magnitude.to(torch.float32).reshape(1)

    def _levels(self, scales: torch.Tensor) -> torch.Tensor:
        return torch.cat([-scales, scales])


@register_compressor
class OneBitCompressor(_SignCompressor):
    """``onebit``: 1 bit per element and two fp32 scales, the means of the x >= 0 and of the x < 0 elements.

    A group with no element has mean 0.

    Example::

        OneBitCompressor().payload_bytes(1000)  # 125 + 8 = 133
    """

    name = "onebit"
    needs_error_feedback = True
    num_scales = 2

    def _scales(self, stats: torch.Tensor, numel: int) -> torch.Tensor:
        counts = torch.stack([stats[0], numel - stats[0]]).clamp_(min=1)
        return (stats[1:] / counts).to(torch.float32)  # [mean of x >= 0, mean of x < 0]

    def _levels(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.flip(0)

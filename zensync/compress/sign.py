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

Example::

    comp = build("onebit")
    bits, scales = comp.compress(grad).payloads  # uint8 [ceil(numel / 8)], fp32 [2]
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from zensync.compress.base import Compressed, Compressor, compute_dtype, register_compressor

__all__ = ["EFSignSGDCompressor", "OneBitCompressor", "SignSGDCompressor"]

_BITS_PER_BYTE = 8


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """1-D bool -> uint8 of ceil(numel / 8) bytes, element 8j + i in bit i of byte j (zero-padded).

    Example::

        _pack_bits(torch.tensor([True, False, True]))  # tensor([5], dtype=torch.uint8)
    """
    numel = bits.numel()
    padded = torch.zeros(math.ceil(numel / _BITS_PER_BYTE) * _BITS_PER_BYTE, dtype=torch.uint8, device=bits.device)
    padded[:numel] = bits
    columns = padded.view(-1, _BITS_PER_BYTE)  # column i holds bit i of every byte
    packed = columns[:, 0].clone()
    for bit in range(1, _BITS_PER_BYTE):  # 8 vectorised passes, one per bit position
        packed |= columns[:, bit] << bit
    return packed


_BYTE_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(_BITS_PER_BYTE)) & 1
"""(256, 8) int64: row b holds the bits of byte value b, least significant first."""


def _unpack_bits(packed: torch.Tensor, numel: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``_pack_bits``: the first ``numel`` bits, each mapped to ``levels[bit]`` (default: 0/1 uint8).

    A (256, 8) table gives the 8 values of every possible byte, and one gather of 8-value rows by
    byte writes the output (about 10x faster on CPU than shifting out each bit position).

    Example::

        _unpack_bits(torch.tensor([5], dtype=torch.uint8), 3)  # tensor([1, 0, 1], dtype=torch.uint8)
    """
    if levels is None:
        levels = torch.tensor([0, 1], dtype=torch.uint8, device=packed.device)
    byte_values = levels[_BYTE_BITS.to(packed.device)]  # (256, 8)
    return byte_values.index_select(0, packed.to(torch.int32)).view(-1)[:numel]


class _SignCompressor(Compressor):
    """Shared body: payload 0 is the packed ``x >= 0`` bits, then ``num_scales`` fp32 scales.

    Subclasses give ``_scales`` (what is sent besides the bits) and ``_levels`` (the value of a 0
    bit and of a 1 bit, from the scales).
    """

    num_scales: ClassVar[int]

    def _scales(self, flat: torch.Tensor, nonnegative: torch.Tensor) -> torch.Tensor:
        """fp32 [num_scales] computed from the flattened input (compute dtype) and its bits."""
        return torch.empty(0, dtype=torch.float32, device=flat.device)

    def _levels(self, scales: torch.Tensor) -> torch.Tensor:
        """[value of a 0 bit, value of a 1 bit] (fp32)."""
        return torch.tensor([-1.0, 1.0], device=scales.device)

    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> Compressed:
        flat = x.reshape(-1).to(compute_dtype(x.dtype))
        nonnegative = flat >= 0
        scales = self._scales(flat, nonnegative)
        payloads = (_pack_bits(nonnegative), scales) if self.num_scales else (_pack_bits(nonnegative),)
        return Compressed(payloads, (x.shape, x.dtype))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        shape, dtype = compressed.ctx
        packed = compressed.payloads[0]
        scales = compressed.payloads[1] if self.num_scales else packed.new_empty(0, dtype=torch.float32)
        return _unpack_bits(packed, shape.numel(), self._levels(scales).to(dtype)).view(shape)

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


@register_compressor
class EFSignSGDCompressor(_SignCompressor):
    """``efsignsgd``: 1 bit per element and one fp32 scale, mean |x|; decompress = scale * sign.

    Example::

        EFSignSGDCompressor().payload_bytes(1000)  # 125 + 4 = 129
    """

    name = "efsignsgd"
    needs_error_feedback = True
    num_scales = 1

    def _scales(self, flat: torch.Tensor, nonnegative: torch.Tensor) -> torch.Tensor:
        mean_magnitude = flat.abs().sum() / max(flat.numel(), 1)
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

    def _scales(self, flat: torch.Tensor, nonnegative: torch.Tensor) -> torch.Tensor:
        num_nonnegative = torch.count_nonzero(nonnegative)
        counts = torch.stack([num_nonnegative, flat.numel() - num_nonnegative]).clamp_(min=1)
        sums = torch.stack([flat.clamp(min=0).sum(), flat.clamp(max=0).sum()])
        return (sums / counts).to(torch.float32)  # [mean of x >= 0, mean of x < 0]

    def _levels(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.flip(0)

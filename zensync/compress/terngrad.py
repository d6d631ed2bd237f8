"""TernGrad (Wen et al., NeurIPS 2017): each element sent as -1, 0 or +1 times one per-tensor scale.

With s = max|x| (one fp32), element i is sent as sign(x_i) * b_i, b_i ~ Bernoulli(|x_i| / s), and
decompressed to s * sign(x_i) * b_i, so E[decompress(x)] = x. The Bernoulli draws are
``torch.rand(numel, generator=shared_generator(seed, name, step, purpose="terngrad"),
dtype=<compute dtype>) < |x| / s`` (float32 arithmetic, float64 for float64 input, with s rounded
up to its fp32 wire value first, so |x| / s <= 1). The paper's layer-wise gradient clipping (2.5 sigma) is left to the
caller. Not allreduce-compatible: each rank has its own scale (GRACE ``terngrad.py``).

On the wire each element is a 2-bit code, sign * b + 1 in {0, 1, 2}, packed four per byte
(``kernels.pack_bits``, least significant first); decompression unpacks straight to the levels
(-s, 0, s) in one pass (``kernels.unpack_bits`` with a level table).

Example::

    comp = build("terngrad")
    packed, scale = comp.compress(grad, name="fc.weight", step=3).payloads  # uint8 [ceil(numel / 4)], fp32 [1]
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

__all__ = ["TernGradCompressor"]

_CODE_BITS = 2


@register_compressor
class TernGradCompressor(Compressor):
    """``terngrad``: a 2-bit code of {-1, 0, 1} per element plus one fp32 scale (max |x|).

    Args:
        seed: Seed of the Bernoulli draws; combined with the tensor name and the step.

    Example::

        TernGradCompressor().payload_bytes(1000, torch.float32)  # 250 bytes of codes + 4 = 254
    """

    name = "terngrad"

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        """Hyperparameters of TernGrad."""

        seed: int = 0
        """Seed of the Bernoulli draws; combined with the tensor name and the step."""

        def build(self) -> TernGradCompressor:
            return TernGradCompressor(seed=self.seed)

    def __init__(self, *, seed: int | str = 0) -> None:
        self.config = TernGradCompressor.Config(seed=to_int("seed", seed))

    def spec(self) -> str:
        return format_spec(self.name, [], {"seed": self.config.seed} if self.config.seed != 0 else {})

    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> Compressed:
        compute = compute_dtype(x.dtype)
        flat = x.reshape(-1).to(compute)
        magnitude = flat.abs()
        # Step 1: the scale, max |x| (0 for an empty tensor), rounded up to its fp32 wire value.
        scale = fp32_round_up(magnitude.max() if flat.numel() > 0 else flat.new_zeros(())).reshape(1)
        wire_scale = scale.to(compute)
        # Step 2: b ~ Bernoulli(|x| / s). A zero scale gives 0 / 0 = NaN, never kept (and sign 0 anyway).
        probability = magnitude.div_(wire_scale)
        generator = shared_generator(self.config.seed, name, step, purpose="terngrad", device=x.device)
        kept = torch.rand(flat.numel(), generator=generator, dtype=compute, device=x.device) < probability
        # Step 3: sign * b + 1 as 2-bit codes (sign(0) = 0), four per byte.
        codes = flat.sign().to(torch.int8).mul_(kept).add_(1).view(torch.uint8)
        return Compressed((kernels.pack_bits(codes, _CODE_BITS), scale), (x.shape, x.dtype))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        packed, scale = compressed.payloads
        shape, dtype = compressed.ctx
        compute = compute_dtype(dtype)
        s = scale.to(compute)
        # Code 3 never occurs. The zero level is s * 0, so a non-finite scale (the input held a NaN
        # or infinity) makes every element NaN, as dense allreduce would carry it.
        zero = s * 0
        levels = torch.cat([-s, zero, s, zero])
        return kernels.unpack_bits(packed, _CODE_BITS, shape.numel(), levels).to(dtype).view(shape)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return math.ceil(numel * _CODE_BITS / 8) + 4

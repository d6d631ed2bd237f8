"""Casts: ``none`` (identity), ``fp16`` and ``bf16`` (16-bit values on the wire).

The casts are PyTorch's ``fp16_compress_hook``/``bf16_compress_hook`` (and Horovod's
``Compression.fp16``) as compressors: the payload is the tensor in 16 bits, summed by allreduce in
16 bits, and cast back to the input dtype. fp16 overflows to inf above 65504 (the DDP hook divides
by the world size before the allreduce for this reason); bf16 keeps fp32's range with 8 bits of
mantissa. ``none`` sends the tensor itself and is the reference "no compression" entry.

Example::

    comp = build("fp16")
    packed = comp.compress(grad)  # payloads == (grad.half(),)
    comp.decompress(packed).dtype  # grad.dtype
"""

from __future__ import annotations

from typing import ClassVar

import torch

from zensync.compress.base import AllReduce, Compressed, Compressor, Parts, register_compressor

__all__ = ["BF16Compressor", "FP16Compressor", "IdentityCompressor", "pipeline_pieces"]

_SCALE_CHUNK = 1 << 17
"""Elements per chunk of the CPU scale-and-cast: a 512 KB float32 scratch stays in cache (a
16K chunk pays 20 us of per-call overhead per chunk, 23 ms for 8.4M elements; 128K: 6.8 ms)."""

_PIPELINE_PIECE = 1 << 21
"""Elements per allreduce of the CPU cast pipeline, roughly (the pieces are even; 4 MB in 16
bits): a 34 MB fp32 bucket goes in 4 pieces of 2.1M. Each piece costs gloo CPU time beside its
bytes, so smaller pieces hide more of the passes and cost more. benchmarks/hook_fixed_cost.py
--hosts 4 --rate 1gbit (DDP on the 34 MB MLP, 30 paired rounds, two runs): one allreduce of the
whole 1.001x and 0.997x torch's fp16 hook, pieces of 2^20 0.958x and 0.978x, of 2^21 0.973x and
0.968x; CPU per rank and step 107, 116 and 112 ms (torch's hook 106)."""

_MAX_PIECES = 64
"""At most this many pieces per tensor: larger tensors get larger pieces."""


def pipeline_pieces(numel: int) -> list[tuple[int, int]]:
    """The CPU cast pipeline's (start, stop) pieces of ``numel`` elements: as many as pieces of
    ``_PIPELINE_PIECE`` need (at most ``_MAX_PIECES``), of even sizes; one below two such pieces."""
    count = min(_MAX_PIECES, max(1, numel // _PIPELINE_PIECE))
    size = max(1, -(-numel // count))
    return [(lo, min(numel, lo + size)) for lo in range(0, numel, size)] or [(0, 0)]


def _scale_cast_into(src: torch.Tensor, scale: float, dst: torch.Tensor) -> None:
    """``dst = (scale * src)`` cast to dst's dtype, both 1-D, the product in src's precision.

    On CPU through a cache-sized scratch, chunk by chunk (see ``compress_scaled``); elsewhere one
    mixed-dtype ``mul``. ``scale == 1``: one conversion pass.
    """
    if scale == 1.0:
        dst.copy_(src)
    elif src.device.type != "cpu":
        torch.mul(src, scale, out=dst)
    else:
        scratch = torch.empty(min(src.numel(), _SCALE_CHUNK), dtype=src.dtype)
        for lo in range(0, src.numel(), _SCALE_CHUNK):
            hi = min(src.numel(), lo + _SCALE_CHUNK)
            dst[lo:hi].copy_(torch.mul(src[lo:hi], scale, out=scratch[: hi - lo]))


@register_compressor
class IdentityCompressor(Compressor):
    """``none``: the payload is the tensor itself (made contiguous), decompress returns it.

    Example::

        IdentityCompressor().payload_bytes(1000, torch.float32)  # 4000
    """

    name = "none"
    allreduce_compatible = True

    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> Compressed:
        return Compressed((x.contiguous(),), None)

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        return compressed.payloads[0]

    def decompress_into(self, compressed: Compressed, out: torch.Tensor) -> torch.Tensor:
        payload = compressed.payloads[0]
        return out if payload is out else out.copy_(payload.view(out.shape))

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * dtype.itemsize


class _CastCompressor(Compressor):
    """Shared body of ``fp16`` and ``bf16``: the payload is ``x`` cast to ``wire_dtype``; ctx is x's dtype."""

    wire_dtype: ClassVar[torch.dtype]
    allreduce_compatible = True
    folds_scale = True
    """The DDP hook's division by the world size is applied in the cast's own pass (scaled in x's
    precision first, so no value overflows the wire dtype that the division brings back in range,
    as casting first, torch's hook's order, would above 65504)."""

    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> Compressed:
        return Compressed((x.to(self.wire_dtype, memory_format=torch.contiguous_format),), x.dtype)

    def compress_scaled(self, x: torch.Tensor, scale: float, *, name: str = "", step: int = 0) -> Compressed:
        """``scale * x`` in x's precision, cast to the wire dtype, in one pass over x.

        On CPU, torch.mul(x, s, out=<fp16>) takes a slow mixed-dtype path (40 ms for 8.4M float32
        on one thread) and x * s then a cast is two passes (9 ms): the product goes through a
        cache-sized scratch chunk by chunk instead (6.8 ms). Elsewhere one mixed-dtype ``mul``.
        """
        if scale == 1.0:
            return self.compress(x, name=name, step=step)
        flat = x.reshape(-1)
        wire = torch.empty(flat.numel(), dtype=self.wire_dtype, device=x.device)
        _scale_cast_into(flat, scale, wire)
        return Compressed((wire.view(x.shape),), x.dtype)

    async def allreduce_sync(
        self,
        x: torch.Tensor,
        all_reduce: AllReduce,
        *,
        name: str = "",
        step: int = 0,
        out: torch.Tensor | None = None,
        scale: float = 1.0,
        parts: Parts | None = None,
    ) -> torch.Tensor:
        """The sum in pieces on CPU: piece i is on the wire while piece i+1 is cast, and decoded while
        the pieces after it are (``AllReduce`` issues at the call).

        Only the first piece's cast and the last one's decode stay outside the collective's time,
        where one allreduce of the whole (torch's fp16_compress_hook) waits for both full passes.
        Every rank cuts the same pieces from the same numel and issues them in order. Each element
        is the same sum over ranks in the wire dtype (the backend may add its ranks' terms in
        another order than in one allreduce of the whole). Elsewhere (a GPU's cast costs little
        beside the collective) and below two pieces: the one-round default.
        """
        flat = x.reshape(-1)
        numel = flat.numel()
        bounds = pipeline_pieces(numel)
        if x.device.type != "cpu" or len(bounds) < 2:
            return await super().allreduce_sync(x, all_reduce, name=name, step=step, out=out, scale=scale)
        wire = torch.empty(numel, dtype=self.wire_dtype)
        pending = []
        for i, (lo, hi) in enumerate(bounds):
            _scale_cast_into(flat[lo:hi], scale, wire[lo:hi])
            pending.append(all_reduce(wire[lo:hi], last=i == len(bounds) - 1))
        # Every piece is cast before any is written: ``out`` may be ``x`` itself.
        direct = out is not None and out.is_contiguous()
        target = out.view(-1) if out is not None and direct else torch.empty(numel, dtype=x.dtype)
        for (lo, hi), summed in zip(bounds, pending, strict=True):
            target[lo:hi].copy_(await summed)
        if out is None:
            return target.view(x.shape)
        return out if direct else out.copy_(target.view(out.shape))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        return compressed.payloads[0].to(compressed.ctx)

    def decompress_into(self, compressed: Compressed, out: torch.Tensor) -> torch.Tensor:
        # One conversion pass straight into out, as torch's fp16_compress_hook copies into the bucket.
        return out.copy_(compressed.payloads[0].view(out.shape))

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * self.wire_dtype.itemsize


@register_compressor
class FP16Compressor(_CastCompressor):
    """``fp16``: IEEE half precision on the wire (2 bytes per element; inf above 65504).

    Example::

        FP16Compressor().payload_bytes(1000, torch.float32)  # 2000
    """

    name = "fp16"
    wire_dtype = torch.float16


@register_compressor
class BF16Compressor(_CastCompressor):
    """``bf16``: bfloat16 on the wire (2 bytes per element, fp32's exponent range, 8-bit mantissa).

    Example::

        BF16Compressor().payload_bytes(1000, torch.float64)  # 2000
    """

    name = "bf16"
    wire_dtype = torch.bfloat16

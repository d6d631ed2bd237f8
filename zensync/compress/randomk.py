"""Random-k sparsification with a shared seed: only the k values cross the wire.

Every rank draws the same k indices (without replacement: the k smallest of numel uniform keys)
from a generator seeded by (seed, tensor name, step), so the indices need not be sent and the
payloads of different ranks line up element by element: random-k runs inside an allreduce
(GRACE ``randomk.py``; BytePS PR #395 seeds workers and servers the same way). Random-k is biased
unless ``scale`` multiplies the kept values by numel / k, which makes E[decompress(compress(x))] = x;
either way it is meant to run with error feedback.

A NaN or infinity among the elements not drawn would be neither sent nor seen: it would sit in the
error-feedback residual. So when the input holds one, every value sent is NaN (one ``aminmax`` pass
over the input, no host-device sync): the sum is non-finite, as under dense allreduce.

Example::

    comp = build("randomk:0.01,scale=true")
    packed = comp.compress(grad, name="fc.weight", step=3)  # payloads == (grad.flatten()[idx],)
    approx = comp.decompress(packed)  # zeros except at idx, where grad * numel / k
"""

from __future__ import annotations

import dataclasses
import math

import torch

from zensync.compress.base import (
    Compressed,
    Compressor,
    all_finite,
    check_ratio,
    format_spec,
    register_compressor,
    selected_count,
    shared_generator,
    to_bool,
    to_float,
    to_int,
)
from zensync.compress.topk import scatter_values, topk_indices

__all__ = ["RandomKCompressor"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Context:
    shape: torch.Size
    indices: torch.Tensor
    """Sorted int64 positions in the flattened tensor; the same on every rank for one name and step."""


@register_compressor
class RandomKCompressor(Compressor):
    """``randomk:ratio``: k = max(1, ceil(ratio * numel)) shared-seed random elements.

    Args:
        ratio: Fraction of the elements sent, in (0, 1] (a spec string such as ``"0.01"`` is accepted).
        scale: Multiply the kept values by numel / k on decompression (unbiased estimator).
        seed: Seed shared by all ranks; combined with the tensor name and the step.

    Example::

        comp = RandomKCompressor(0.25, seed=1)
        comp.payload_bytes(10, torch.float32)  # k = ceil(2.5) = 3 values -> 12 bytes
    """

    name = "randomk"
    allreduce_compatible = True
    needs_error_feedback = True
    context_depends_on_name = True

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        """Hyperparameters of random-k."""

        ratio: float
        """Fraction of the elements sent, in (0, 1]."""
        scale: bool = False
        """Multiply the kept values by numel / k on decompression, so that the estimate is unbiased."""
        seed: int = 0
        """Seed shared by all ranks; combined with the tensor name and the step."""

        def __post_init__(self) -> None:
            check_ratio("ratio", self.ratio)

        def build(self) -> RandomKCompressor:
            return RandomKCompressor(self.ratio, scale=self.scale, seed=self.seed)

    def __init__(self, ratio: float | str, *, scale: bool | str = False, seed: int | str = 0) -> None:
        self.config = RandomKCompressor.Config(
            ratio=to_float("ratio", ratio), scale=to_bool("scale", scale), seed=to_int("seed", seed)
        )

    def spec(self) -> str:
        options: dict[str, object] = {}
        if self.config.scale:
            options["scale"] = True
        if self.config.seed != 0:
            options["seed"] = self.config.seed
        return format_spec(self.name, [self.config.ratio], options)

    def indices(self, numel: int, *, name: str, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The k sorted int64 positions drawn for a tensor of ``numel`` elements (same on every rank).

        The positions of the k smallest of ``numel`` i.i.d. uniform float64 keys are a uniform random
        k-subset (random-keys sampling without replacement); keys below a cut-off that lets about k
        plus 8 binomial standard deviations through are preselected, so only those are ranked.
        """
        k = selected_count(self.config.ratio, numel)
        generator = shared_generator(self.config.seed, name, step, purpose="randomk", device=device)
        keys = torch.rand(numel, generator=generator, dtype=torch.float64, device=device)
        cutoff = (k + 8 * math.sqrt(k) + 8) / max(numel, 1)
        candidates = (keys < cutoff).nonzero().squeeze(1)  # host-device sync (a data-dependent size)
        if candidates.numel() < k:  # fewer than k below the cut-off has probability < 1e-14
            candidates = torch.arange(numel, device=device)
        # Ascending candidates and sorted topk positions: the result is sorted (sequential gather/scatter).
        return candidates[topk_indices(keys[candidates].neg_(), k)]

    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> Compressed:
        flat = x.reshape(-1)
        indices = self.indices(flat.numel(), name=name, step=step, device=x.device)
        # A non-finite element must reach the output even when it was not drawn (module docstring).
        values = flat.index_select(0, indices).masked_fill_(~all_finite(flat), math.nan)
        return Compressed((values,), _Context(x.shape, indices))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        ctx: _Context = compressed.ctx
        (values,) = compressed.payloads
        if self.config.scale and values.numel() > 0:
            values = values * (ctx.shape.numel() / values.numel())
        return scatter_values(values, ctx.indices, ctx.shape)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return selected_count(self.config.ratio, numel) * dtype.itemsize

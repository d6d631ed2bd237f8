"""The ``Compressor`` interface every gradient compressor implements, its registry and spec strings.

A compressor turns one gradient tensor into a few payload tensors (all that crosses the wire) plus a
local context, and back (GRACE's ``compress -> (payload, ctx)``)::

    comp = build("topk:0.01")
    packed = comp.compress(grad, name="fc.weight", step=7)  # Compressed(payloads=(values, indices), ctx=...)
    approx = comp.decompress(packed)  # same shape and dtype as grad

What the collectives need to know about a compressor is declared on the class:

- ``allreduce_compatible``: payloads of different ranks may be summed element-wise and the sum
  decompresses to the sum of the ranks' approximations (fp16, bf16, random-k with a shared seed).
  Such compressors run inside an allreduce; the others need an allgather or a two-phase scheme.
- ``needs_error_feedback``: the compressor is biased (top-k, DGC, sign), so it is meant to run with
  an ``ErrorFeedback`` memory (the hook and the collectives add one unless told not to).
- ``payload_bytes(numel, dtype)``: bytes of the payloads for a tensor of ``numel`` elements, as a
  formula (the planner prices plans with it; tests check it against real payloads).

Compressors whose aggregation is not one allreduce of payloads (PowerSGD: two dependent
allreduces with a matrix product between) override ``allreduce_sync``.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch

__all__ = [
    "Compressed",
    "Compressor",
    "build",
    "compressor_names",
    "parse_spec",
    "register_compressor",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Compressed:
    """One compressed tensor: ``payloads`` cross the wire, ``ctx`` stays local (shape, dtype, ...)."""

    payloads: tuple[torch.Tensor, ...]
    ctx: Any

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the sum of the payloads' sizes."""
        return sum(p.numel() * p.element_size() for p in self.payloads)


class Compressor(abc.ABC):
    """compress(x) -> Compressed; decompress(Compressed) -> tensor like x. See the module docstring.

    Subclasses set ``name`` and the class flags, take their hyperparameters in ``__init__`` (the
    spec string's argument is the first positional one, e.g. the ratio of ``topk:0.01``), validate
    them with errors that name the parameter, value and bound, and must be deterministic given
    (input, name, step, seed) so every rank of a shared-seed scheme draws the same randomness.
    """

    name: ClassVar[str]
    allreduce_compatible: ClassVar[bool] = False
    needs_error_feedback: ClassVar[bool] = False

    @abc.abstractmethod
    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> Compressed:
        """Compress ``x`` (any shape, floating dtype). ``name``/``step`` seed shared randomness."""

    @abc.abstractmethod
    def decompress(self, compressed: Compressed) -> torch.Tensor:
        """The approximation of the compressed tensor: same shape and dtype as the input."""

    @abc.abstractmethod
    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes on the wire for a tensor of ``numel`` elements of ``dtype`` (a formula, no data)."""

    def spec(self) -> str:
        """The spec string that rebuilds this compressor with ``build`` (e.g. ``"topk:0.01"``)."""
        return self.name

    def allreduce_sync(
        self, x: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor], *, name: str = "", step: int = 0
    ) -> torch.Tensor:
        """Sum of every rank's approximation of its ``x``, using ``all_reduce`` (sum over ranks of a tensor).

        The default compresses, all-reduces each payload and decompresses the summed payloads: correct
        for ``allreduce_compatible`` compressors only. Multi-round compressors override it.
        """
        if not self.allreduce_compatible:
            raise ValueError(
                f"compressor {self.spec()!r} is not allreduce-compatible (its payloads cannot be summed); "
                f"use an allgather or alltoall+allgather scheme"
            )
        packed = self.compress(x, name=name, step=step)
        summed = tuple(all_reduce(p) for p in packed.payloads)
        return self.decompress(Compressed(summed, packed.ctx))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"


_REGISTRY: dict[str, type[Compressor]] = {}
_SPEC = re.compile(r"^([a-z][a-z0-9_]*)(?::(.+))?$")


def register_compressor(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make ``cls`` buildable by its ``name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"compressor name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def compressor_names() -> tuple[str, ...]:
    """Registered compressor names, sorted."""
    return tuple(sorted(_REGISTRY))


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``"topk:0.01"`` -> ("topk", ["0.01"]); ``"qsgd:256,128"`` -> ("qsgd", ["256", "128"]).

    Raises:
        ValueError: If the string is malformed or the name is not registered (listing the valid ones).
    """
    match = _SPEC.match(spec.strip().lower()) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"compressor spec {spec!r}: expected 'name' or 'name:arg[,arg...]', e.g. 'topk:0.01'")
    name, args = match.group(1), match.group(2)
    if name not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r} in spec {spec!r}; valid: {', '.join(compressor_names())}")
    return name, [a.strip() for a in args.split(",")] if args else []


def build(spec: str, **options: Any) -> Compressor:
    """The compressor of a spec string such as ``"fp16"``, ``"topk:0.01"`` or ``"powersgd:4"``.

    Positional spec arguments are passed first, then ``options`` as keywords; each compressor's
    ``__init__`` converts and validates them.
    """
    name, args = parse_spec(spec)
    try:
        return _REGISTRY[name](*args, **options)
    except TypeError as exc:
        raise ValueError(f"compressor spec {spec!r} with options {options}: {exc}") from exc

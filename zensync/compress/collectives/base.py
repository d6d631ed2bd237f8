"""The interface of a compressed collective, its registry, and what the collectives share.

A ``CompressedCollective`` sums a tensor over the ranks of a transport as a compressor lets it
through (Espresso Table 2): ``reduce`` is a coroutine of the transport's non-blocking collectives
(``transport.all_gather_v_async`` and so on) returning, on every rank, the sum over ranks of the
compressed tensors, and this rank's own transmitted approximation where the collective can tell it
apart (error feedback needs it). Each collective is one file of this package, registered under its
name with ``register_collective``; ``build_collective(name)`` looks one up.

Payload sizes are a function of the tensor size (``Compressor.payload_bytes``), so a rank can
unpack another rank's payloads with the shapes of its own (``unpack``), and the decompression
context (shape, dtype, shared-seed indices) is the same on every rank for the same name and step.
A rank that must decompress an owner's re-compression uses the layout of its own compression of
that part, or, where the context depends on the name (random-k), rebuilds it by compressing under
the owner's name (``Codec.server_layout``).

Example::

    reduce = build_collective("allgather")
    out, own = await reduce.reduce(x, transport, Codec(build("topk:0.01"), None), name="w", step=3, want_own=True)
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar, Literal, TypeVar, get_args

import torch

from zensync.compress.base import Compressed, Compressor, Parts, sum_in_rank_order
from zensync.compress.error_feedback import ErrorFeedback
from zensync.transport import Handle, Transport
from zensync.transport.packing import ByteReader

__all__ = [
    "COMPRESSED_SCHEMES",
    "Codec",
    "CompressedCollective",
    "Own",
    "Scheme",
    "build_collective",
    "collective_names",
    "register_collective",
    "sum_in_rank_order",
    "unpack",
]

T = TypeVar("T")

Own = torch.Tensor | Compressed | None
"""This rank's own transmitted approximation, as a collective returns it: decompressed, still
compressed (the allgather's own payloads: error feedback subtracts them with
``Compressor.subtract_transmitted``), or None where the collective cannot separate it."""

Scheme = Literal["allreduce", "allgather", "alltoall_allgather", "gather_broadcast"]
"""The names of the compressed collectives."""
COMPRESSED_SCHEMES: tuple[str, ...] = get_args(Scheme)
"""Every compressed collective's name, in the order of ``Scheme`` (the registry holds the same)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Codec:
    """What a collective compresses with: the compressor, and the server-side error-feedback memory.

    ``server_memory`` is None without error feedback: an owner then re-compresses its aggregated
    chunk as it is.
    """

    compressor: Compressor
    server_memory: ErrorFeedback | None
    parts: Parts | None = None
    """The (name, shape) of each tensor a fused 1-D input concatenates, for compressors that
    compress part by part (``Compressor.fuses_named_parts``; the allreduce scheme passes them on)."""
    on_issued: Callable[[], None] | None = None
    """Called once the collective has issued its last transport collective (``last``): the DDP
    hook then lets the next bucket start (``zensync.transport.hand_on``)."""

    keep_own: Callable[[Compressed], None] | None = None
    """Error feedback's early residual: a collective that knows this rank's own transmitted payloads
    when it sends them, and reads its input no more after that (allgather), hands them here right
    after issuing them, before waiting, so the residual is computed while they are on the wire (it
    then returns no ``own``)."""

    def last(self, pending: Handle[T], *, last: bool = True) -> Handle[T]:
        """``pending``, the collective's last transport collective (where ``last``), just issued and
        not yet awaited: ``on_issued`` runs now. Nothing may be issued after it."""
        if last and self.on_issued is not None:
            self.on_issued()
        return pending

    def roundtrip(self, x: torch.Tensor, name: str, step: int) -> torch.Tensor:
        """decompress(compress(x)): what one rank alone transmits."""
        return self.compressor.decompress(self.compressor.compress(x, name=name, step=step))

    def server_layout(self, x: torch.Tensor, own: Compressed, key: str, step: int) -> Compressed:
        """Payload shapes and context of the owner's re-compression under ``key`` (for unpacking it).

        Sizes depend only on the tensor size, so this rank's own compression of the same part serves,
        unless the context depends on the name (random-k's shared indices): then the context is
        rebuilt by compressing under the owner's name and step.
        """
        if not self.compressor.context_depends_on_name:
            return own
        return self.compressor.compress(x, name=f"{key}#server", step=step)

    def server_recompress(self, summed: torch.Tensor, key: str, step: int) -> Compressed:
        """The owner's re-compression of an aggregated chunk, with server-side error feedback."""
        memory = self.server_memory
        corrected = memory.compensate(key, summed) if memory is not None else summed
        packed = self.compressor.compress(corrected, name=f"{key}#server", step=step)
        if memory is not None:
            memory.update(key, corrected, self.compressor.decompress(packed))
        return packed


class CompressedCollective(abc.ABC):
    """Sum over ranks of a compressed tensor (``reduce``); subclasses implement ``_reduce``.

    Collectives are stateless: the compressor and the server-side memory come in a ``Codec``.
    Each passes its last transport collective through ``codec.last`` as it issues it.
    """

    name: ClassVar[str]
    roundtrip_on_one_rank: ClassVar[bool] = True
    """Whether a world of one rank skips the collectives and returns decompress(compress(x))."""
    folds_scale: ClassVar[bool] = False
    """Whether ``reduce(scale=...)`` is supported (the compressor must fold it too: ``Compressor.folds_scale``)."""

    def check(self, compressor: Compressor) -> None:  # noqa: B027 - a no-op unless the collective needs more
        """Raise a ValueError if ``compressor`` does not suit this collective (every one does by default)."""

    async def reduce(
        self,
        x: torch.Tensor,
        transport: Transport,
        codec: Codec,
        *,
        name: str,
        step: int,
        want_own: bool,
        out: torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> tuple[torch.Tensor, Own]:
        """(sum over ranks, this rank's own transmitted approximation), both of x's shape and dtype.

        The second may come compressed (``Own``); it is None where the collective cannot separate
        it (allreduce) and, for the collectives that would decompress for it alone, when
        ``want_own`` is False (no error feedback needs it). The sum is the same on every rank. With
        ``out`` (x's shape and dtype;
        it may be ``x`` itself, which is read before ``out`` is written) the sum is written there
        and ``out`` is returned as it. ``scale`` (only where ``folds_scale``): the sum of the
        approximations of ``scale * x``.
        """
        if scale != 1.0 and not self.folds_scale:
            raise ValueError(f"compressed collective {self.name!r} does not fold a scale (scale={scale})")
        if transport.world_size == 1 and self.roundtrip_on_one_rank:
            own = codec.roundtrip(x, name, step)
            return (own.clone() if out is None else out.copy_(own)), own
        return await self._reduce_into(
            x, transport, codec, name=name, step=step, want_own=want_own, out=out, scale=scale
        )

    async def _reduce_into(
        self,
        x: torch.Tensor,
        transport: Transport,
        codec: Codec,
        *,
        name: str,
        step: int,
        want_own: bool,
        out: torch.Tensor | None,
        scale: float,
    ) -> tuple[torch.Tensor, Own]:
        """``_reduce`` with its sum copied into ``out`` when given (collectives that can write there override it)."""
        summed, own = await self._reduce(x, transport, codec, name=name, step=step, want_own=want_own)
        if out is None or summed is out:
            return summed, own
        return out.copy_(summed.view(out.shape)), own

    async def _reduce(
        self, x: torch.Tensor, transport: Transport, codec: Codec, *, name: str, step: int, want_own: bool
    ) -> tuple[torch.Tensor, Own]:
        """``reduce`` on a world of any size (awaiting only ``*_async`` collectives).

        Each collective overrides this or, where it writes the sum into ``out`` itself,
        ``_reduce_into`` (``register_collective`` checks one of them is); this default is then
        ``_reduce_into`` with no ``out``.
        """
        return await self._reduce_into(
            x, transport, codec, name=name, step=step, want_own=want_own, out=None, scale=1.0
        )


_REGISTRY: dict[str, type[CompressedCollective]] = {}


def register_collective(cls: type[CompressedCollective]) -> type[CompressedCollective]:
    """Class decorator: make ``cls`` buildable by its ``name``.

    Raises:
        TypeError: If ``cls`` overrides neither ``_reduce`` nor ``_reduce_into`` (each default calls the other).
    """
    base = CompressedCollective
    if cls._reduce is base._reduce and cls._reduce_into is base._reduce_into:
        raise TypeError(f"compressed collective {cls.__name__} must override _reduce or _reduce_into")
    if cls.name in _REGISTRY:
        raise ValueError(f"compressed collective {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def collective_names() -> tuple[str, ...]:
    """Registered compressed collective names, sorted."""
    return tuple(sorted(_REGISTRY))


def build_collective(name: str) -> CompressedCollective:
    """The compressed collective registered as ``name``.

    Raises:
        ValueError: If no collective has that name (listing the valid ones).
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown compressed collective {name!r}; valid: {', '.join(collective_names())}")
    return cls()


def unpack(buf: torch.Tensor, like: Compressed) -> Compressed:
    """Another rank's payloads, read from ``buf`` with the shapes and dtypes of ``like``'s."""
    reader = ByteReader(buf)
    payloads = tuple(reader.take(p.dtype, p.numel()).view(p.shape) for p in like.payloads)
    if reader.remaining:
        raise ValueError(
            f"compressed payload of {buf.numel()} bytes does not match the local layout "
            f"({like.nbytes} bytes): compressors must produce sizes that depend only on the tensor size"
        )
    return Compressed(payloads, like.ctx)

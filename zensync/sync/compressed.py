"""Collective schemes for compressed gradients (Espresso Table 2), flat or hierarchical, with error feedback.

Every scheme returns, on every rank, the sum over ranks of the gradients as the compressor lets
them through (the DDP hook divides by the world size first, so that sum is the average):

- ``allreduce`` (allreduce-compatible compressors: fp16, bf16, shared-seed random-k, PowerSGD):
  the payloads are summed by allreduce and decompressed once (``Compressor.allreduce_sync``).
- ``allgather`` (indivisible): every rank's payloads go to every rank; each rank decompresses
  the n approximations and sums them.
- ``alltoall_allgather`` (divisible; DeepSpeed's compressed allreduce): the tensor is cut into n
  chunks; chunk j of every rank goes to rank j (alltoall), which decompresses and sums them, adds
  its server-side error, re-compresses, and every rank gathers the n re-compressed chunks.
- ``gather_broadcast`` (divisible with one root): rank 0 receives every rank's payloads,
  decompresses and sums them, adds its server error, re-compresses and broadcasts.

``hierarchy`` makes any of them two-level (Espresso's intra-node divisible form): intra-node
reduce-scatter of the uncompressed tensor, the compressed scheme across nodes on each local rank's
shard, intra-node allgather of the shards.

Payload sizes are a function of the tensor size (``Compressor.payload_bytes``), so a rank can
unpack another rank's payloads with the shapes of its own, and the decompression context (shape,
dtype, shared-seed indices) is the same on every rank for the same name and step. A rank that must
decompress an owner's re-compression uses the layout of its own compression of that part, or, where
the context depends on the name (random-k), rebuilds it by compressing under the owner's name.

Non-finite values (``zensync.compress.error_feedback`` states the rule): a NaN or infinity in any
rank's compensated input, or in a chunk owner's aggregated input, reaches the output of every rank
as it would under dense allreduce (GradScaler then skips the step), and that step's updates of the
worker residual, the server residuals and the compressor's own state (PowerSGD's Q) are dropped on
every rank. The output is the same on every rank, so one ``aminmax`` pass over it per call decides
for all of them, with no extra collective.

Example::

    sync = CompressedSync("topk:0.01", scheme="allgather")
    out = sync.sync(grad, transport, name="fc.weight", step=3)  # approx. sum over ranks
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, get_args

import torch

from zensync.compress import Compressed, Compressor, ErrorFeedback, build
from zensync.compress.base import all_finite
from zensync.sync.base import accumulation_dtype
from zensync.sync.packing import ByteReader, pack
from zensync.transport import Transport

__all__ = ["COMPRESSED_SCHEMES", "CompressedSync", "Hierarchy", "Scheme", "hierarchy"]

Scheme = Literal["allreduce", "allgather", "alltoall_allgather", "gather_broadcast"]
COMPRESSED_SCHEMES: tuple[str, ...] = get_args(Scheme)


@dataclasses.dataclass(frozen=True, slots=True)
class Hierarchy:
    """The two groups of a two-level scheme: this rank's node, and its local rank across nodes."""

    intra: Transport
    inter: Transport


def hierarchy(transport: Transport, ranks_per_node: int) -> Hierarchy:
    """Split ``transport`` into nodes of ``ranks_per_node`` consecutive ranks (a collective).

    Raises:
        ValueError: If ``ranks_per_node`` does not divide the world size.
    """
    n = transport.world_size
    if ranks_per_node < 1 or n % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide the world size {n}")
    intra = transport.split(transport.rank // ranks_per_node)
    inter = transport.split(transport.rank % ranks_per_node)
    return Hierarchy(intra=intra, inter=inter)


class CompressedSync:
    """One compressor, one scheme, and the error-feedback memories they need.

    Args:
        compressor: A ``Compressor`` or a spec string (``"topk:0.01"``).
        scheme: One of ``COMPRESSED_SCHEMES``, or "auto": allreduce when the compressor allows it,
            else allgather.
        error_feedback: Keep worker-side (and, for divisible schemes, server-side) residuals;
            None follows ``compressor.needs_error_feedback``.

    Raises:
        ValueError: If the scheme is unknown or does not suit the compressor, or error feedback is
            asked of a compressor that cannot carry a non-finite value to its output (``signsgd``).
    """

    __slots__ = ("compressor", "error_feedback", "scheme", "server_memory", "worker_memory")

    def __init__(
        self, compressor: Compressor | str, scheme: str = "auto", *, error_feedback: bool | None = None
    ) -> None:
        self.compressor = build(compressor) if isinstance(compressor, str) else compressor
        if scheme == "auto":
            scheme = "allreduce" if self.compressor.allreduce_compatible else "allgather"
        if scheme not in COMPRESSED_SCHEMES:
            raise ValueError(f"scheme={scheme!r} is not one of {', '.join(COMPRESSED_SCHEMES)} or 'auto'")
        if scheme == "allreduce" and not self.compressor.allreduce_compatible:
            raise ValueError(
                f"scheme='allreduce' needs an allreduce-compatible compressor; {self.compressor.spec()!r} is not "
                f"(its payloads cannot be summed): use allgather, alltoall_allgather or gather_broadcast"
            )
        self.scheme: str = scheme
        self.error_feedback = self.compressor.needs_error_feedback if error_feedback is None else error_feedback
        if self.error_feedback and not self.compressor.carries_nonfinite:
            raise ValueError(
                f"error_feedback=True needs a compressor that carries a NaN or infinity to its output; "
                f"{self.compressor.spec()!r} does not (it would stay in the residual at every later step): "
                f"use efsignsgd or onebit, which send a scale, or error_feedback=False"
            )
        self.worker_memory = ErrorFeedback()
        self.server_memory = ErrorFeedback()

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the error-feedback residuals (worker and server side)."""
        return self.worker_memory.nbytes + self.server_memory.nbytes

    def sync(
        self,
        x: torch.Tensor,
        transport: Transport,
        *,
        name: str,
        step: int,
        hierarchy: Hierarchy | None = None,
    ) -> torch.Tensor:
        """Sum over ranks of the compressed ``x`` (a new tensor of x's shape and dtype).

        Step 1: add this rank's residual (error feedback). Step 2: run the scheme, flat or two-level.
        Step 3: keep what compression dropped as the new residual. Step 4: commit the step's new
        residuals and compressor state only if the output is finite (module docstring).
        """
        if not (self.error_feedback or self.compressor.keeps_state):
            return self._run(x, transport, name=name, step=step, hierarchy=hierarchy)
        keep = False
        self._begin_step()
        try:
            out = self._run(x, transport, name=name, step=step, hierarchy=hierarchy)
            keep = bool(all_finite(out))  # host sync; the same output, so the same decision, on every rank
        finally:
            self._end_step(keep=keep)
        return out

    def _run(
        self, x: torch.Tensor, transport: Transport, *, name: str, step: int, hierarchy: Hierarchy | None
    ) -> torch.Tensor:
        """Steps 1-3 of ``sync``."""
        compensated = self.worker_memory.compensate(name, x) if self.error_feedback else x
        if hierarchy is None:
            out, own = self._flat(compensated, transport, name=name, step=step, want_own=self.error_feedback)
        else:
            out, own = self._two_level(compensated, hierarchy, name=name, step=step)
        if self.error_feedback:
            # Linear (allreduce) schemes cannot separate this rank's share of the result: the residual
            # is then the rank's part of the total loss, compensated - out / n, which sums to it exactly.
            transmitted = own if own is not None else out / transport.world_size
            self.worker_memory.update(name, compensated, transmitted)
        return out

    def _begin_step(self) -> None:
        """Hold back the residual updates and compressor state changes of this call (Step 4)."""
        self.worker_memory.begin_step()
        self.server_memory.begin_step()
        self.compressor.begin_step()

    def _end_step(self, *, keep: bool) -> None:
        self.worker_memory.end_step(keep=keep)
        self.server_memory.end_step(keep=keep)
        self.compressor.end_step(keep=keep)

    # -- flat schemes --------------------------------------------------------------------------------
    def _flat(
        self, x: torch.Tensor, transport: Transport, *, name: str, step: int, want_own: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sum over ranks, this rank's own transmitted approximation).

        The second is None for allreduce (not separable) and when ``want_own`` is False (no error
        feedback needs it: its decompressions are skipped).
        """
        if transport.world_size == 1 and self.scheme != "allreduce":
            own = self._roundtrip(x, name, step)
            return own.clone(), own
        if self.scheme == "allreduce":
            return self._allreduce(x, transport, name, step), None
        if self.scheme == "allgather":
            return self._allgather(x, transport, name, step)
        if self.scheme == "alltoall_allgather":
            return self._alltoall_allgather(x, transport, name, step, want_own)
        return self._gather_broadcast(x, transport, name, step, want_own)

    def _roundtrip(self, x: torch.Tensor, name: str, step: int) -> torch.Tensor:
        return self.compressor.decompress(self.compressor.compress(x, name=name, step=step))

    def _allreduce(self, x: torch.Tensor, transport: Transport, name: str, step: int) -> torch.Tensor:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            return transport.all_reduce(t.reshape(-1)).view(t.shape)

        return self.compressor.allreduce_sync(x, all_reduce, name=name, step=step)

    def _allgather(
        self, x: torch.Tensor, transport: Transport, name: str, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Step 1: compress; Step 2: every rank's packed payloads to every rank; Step 3: decompress and sum.
        packed = self.compressor.compress(x, name=name, step=step)
        gathered = transport.all_gather_v(pack(*packed.payloads))
        parts = [self.compressor.decompress(_unpack(buf, packed)) for buf in gathered]
        return _sum(parts, x), parts[transport.rank]

    def _alltoall_allgather(
        self, x: torch.Tensor, transport: Transport, name: str, step: int, want_own: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, r = transport.world_size, transport.rank
        chunks = list(x.reshape(-1).tensor_split(n))
        # Step 1: compress each chunk; chunk j goes to its owner, rank j.
        packed = [self.compressor.compress(c, name=f"{name}#{j}", step=step) for j, c in enumerate(chunks)]
        buffers = [pack(*p.payloads) for p in packed]
        received, counts = transport.all_to_all_v(torch.cat(buffers), [b.numel() for b in buffers])
        # Step 2: the owner decompresses and sums its chunk from every rank, adds its server error,
        # and re-compresses the sum.
        mine = [self.compressor.decompress(_unpack(buf, packed[r])) for buf in received.split(counts)]
        own = None
        if want_own:
            own = torch.cat([self.compressor.decompress(p).reshape(-1) for p in packed]).view(x.shape)
        server = self._server_recompress(_sum(mine, chunks[r]), f"{name}#{r}", step)
        # Step 3: everyone gathers the re-compressed chunks.
        gathered = transport.all_gather_v(pack(*server.payloads))
        like = [
            server if j == r else self._server_layout(c, packed[j], f"{name}#{j}", step) for j, c in enumerate(chunks)
        ]
        summed = [self.compressor.decompress(_unpack(buf, like[j])).reshape(-1) for j, buf in enumerate(gathered)]
        return torch.cat(summed).view(x.shape), own

    def _gather_broadcast(
        self, x: torch.Tensor, transport: Transport, name: str, step: int, want_own: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, root = transport.world_size, 0
        packed = self.compressor.compress(x, name=name, step=step)
        buf = pack(*packed.payloads)
        # Step 1: gather to the root (an all-to-all whose only non-empty chunks go to the root).
        counts = [buf.numel() if j == root else 0 for j in range(n)]
        received, recv_counts = transport.all_to_all_v(buf, counts)
        own = self.compressor.decompress(packed) if want_own else None
        key = f"{name}#root"
        if transport.rank == root:
            parts = [self.compressor.decompress(_unpack(b, packed)) for b in received.split(recv_counts)]
            like = self._server_recompress(_sum(parts, x), key, step)
            out_buf = pack(*like.payloads)
        else:
            like = self._server_layout(x, packed, key, step)
            out_buf = torch.empty(like.nbytes, dtype=torch.uint8, device=x.device)
        # Step 2: the root broadcasts the re-compressed sum.
        out_buf = transport.broadcast(out_buf, root)
        return self.compressor.decompress(_unpack(out_buf, like)), own

    def _server_layout(self, x: torch.Tensor, own: Compressed, key: str, step: int) -> Compressed:
        """Payload shapes and context of the owner's re-compression under ``key`` (for unpacking it).

        Sizes depend only on the tensor size, so this rank's own compression of the same part serves,
        unless the context depends on the name (random-k's shared indices): then the context is
        rebuilt by compressing under the owner's name and step.
        """
        if not self.compressor.context_depends_on_name:
            return own
        return self.compressor.compress(x, name=f"{key}#server", step=step)

    def _server_recompress(self, summed: torch.Tensor, key: str, step: int) -> Compressed:
        """The owner's re-compression of an aggregated chunk, with server-side error feedback."""
        corrected = self.server_memory.compensate(key, summed) if self.error_feedback else summed
        packed = self.compressor.compress(corrected, name=f"{key}#server", step=step)
        if self.error_feedback:
            self.server_memory.update(key, corrected, self.compressor.decompress(packed))
        return packed

    # -- two-level -----------------------------------------------------------------------------------
    def _two_level(
        self, x: torch.Tensor, levels: Hierarchy, *, name: str, step: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        intra, k = levels.intra, levels.intra.world_size
        flat = x.reshape(-1)
        # Step 1: intra-node reduce-scatter (uncompressed): local rank l sums shard l over the node.
        shards = list(flat.tensor_split(k))
        received, counts = intra.all_to_all_v(flat.contiguous(), [s.numel() for s in shards])
        shard = _sum(list(received.split(counts)), shards[intra.rank])
        # Step 2: the compressed scheme across nodes, on this local rank's shard.
        summed, _ = self._flat(shard, levels.inter, name=f"{name}@{intra.rank}", step=step, want_own=False)
        # Step 3: intra-node allgather of the summed shards.
        out = torch.cat(intra.all_gather_v(summed.reshape(-1).contiguous())).view(x.shape)
        return out, None


def _unpack(buf: torch.Tensor, like: Compressed) -> Compressed:
    """Another rank's payloads, read from ``buf`` with the shapes and dtypes of ``like``'s."""
    reader = ByteReader(buf)
    payloads = tuple(reader.take(p.dtype, p.numel()).view(p.shape) for p in like.payloads)
    if reader.remaining:
        raise ValueError(
            f"compressed payload of {buf.numel()} bytes does not match the local layout "
            f"({like.nbytes} bytes): compressors must produce sizes that depend only on the tensor size"
        )
    return Compressed(payloads, like.ctx)


def _sum(parts: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Sum in rank order, accumulated in float32 for half types; shape and dtype of ``like``."""
    acc_dtype = accumulation_dtype(like.dtype)
    total = torch.zeros(like.shape, dtype=acc_dtype, device=like.device)
    for part in parts:
        total += part.reshape(like.shape).to(acc_dtype)
    return total.to(like.dtype)

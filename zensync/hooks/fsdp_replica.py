"""HSDP's replica sync through zensync: the all-reduce of the reduce-scattered shards over the replicas.

torch's HSDP (``fully_shard`` on a 2-D mesh) all-reduces every shard over the replicate group with
its own ``dist.all_reduce`` inside ``foreach_reduce``, and its all-reduce hook runs after that
all-reduce: the native replica all-reduce cannot be replaced. zensync's HSDP therefore shards the
model on the mesh's shard dimension (``fully_shard(model, mesh=mesh["shard"])``) and syncs the
replicas itself, over ``mesh["replicate"]``, right after each reduce-scatter
(``zensync.register_fsdp(model, mesh=mesh)``). Per segment of the shard:

    rows      the strategy's sparse scheme (Zen unless another is named) over the replicas: only
              the shard's non-zero rows move (``zensync.sparse_allreduce``); lossless
    compress  the strategy's or the plan's compressor (``CompressedSync``, error feedback per
              parameter, PowerSGD on the parameter's matrix)
    dense     one all-reduce of every dense segment of the call together

Then the shard is divided by the number of replicas (FSDP averaged over its shard group only),
unless the user set a gradient divide factor: FSDP's factor is then the whole division.
"""

from __future__ import annotations

import dataclasses

import torch

from zensync.api import sparse_allreduce
from zensync.compress import CompressedSync
from zensync.sync.agreement import group_seed
from zensync.sync.base import SyncOptions
from zensync.transport import Transport
from zensync.transport.fsdp import Segment, gather_segments, scatter_segments
from zensync.types import SyncStats

__all__ = ["ReplicaSync", "matrix_shape"]


def matrix_shape(segment: Segment) -> tuple[int, ...]:
    """The shape a segment of the shard is synced in: a shard of a matrix is a block of its rows,
    which PowerSGD factors as one; anything else flat."""
    return (segment.rows, segment.width) if segment.rows and len(segment.shape) >= 2 else (segment.numel,)


class ReplicaSync:
    """The replica all-reduce of one HSDP model's shards (one per ``register_fsdp``)."""

    def __init__(
        self,
        transport: Transport,
        sparse_scheme: str,
        *,
        average: bool,
        compressed_scheme: str = "auto",
        sync_options: SyncOptions | None = None,
    ) -> None:
        self.transport, self.sparse_scheme, self.average = transport, sparse_scheme, average
        self.compressed_scheme = compressed_scheme
        self.sync_options = sync_options if sync_options is not None else SyncOptions()
        self._compressed: dict[str, CompressedSync] = {}
        self.seed: int | None = self.sync_options.h0_seed
        """Zen's hash seed over the replicas (None: the group's, drawn at its first use); a checkpoint's once loaded."""

    @property
    def unit(self) -> float:
        """The factor from the synced sum to the gradient FSDP hands the optimizer (``finish``'s average)."""
        return 1.0 / self.transport.world_size if self.average else 1.0

    def rows(self, shard: torch.Tensor, segment: Segment) -> SyncStats:
        """A row-sparse segment of the shard, summed over the replicas in place; returns what the call did."""
        view = shard[segment.offset : segment.offset + segment.numel].view(segment.rows, segment.width)
        options, stats = dataclasses.replace(self.sync_options, h0_seed=self.seed), SyncStats()
        sparse_allreduce(
            view, self.transport, scheme=self.sparse_scheme, granularity="row", out=view, options=options, stats=stats
        )
        return stats

    def zen_seed(self) -> int | None:
        """The hash seed the rows path uses (None before its first sync)."""
        return self.seed if self.seed is not None else group_seed(self.transport)

    def dense(self, shard: torch.Tensor, segments: list[Segment]) -> None:
        """The dense segments of the shard, summed over the replicas in one all-reduce, in place."""
        if segments:
            summed = self.transport.all_reduce(gather_segments(shard, segments))
            scatter_segments(summed, shard, segments)

    def sync_for(self, spec: str) -> CompressedSync:
        """The ``CompressedSync`` of ``spec`` (its error-feedback memory and compressor state)."""
        sync = self._compressed.get(spec)
        if sync is None:
            sync = self._compressed[spec] = CompressedSync(spec, self.compressed_scheme)
        return sync

    def dense_bytes(self, nbytes: int) -> int:
        """Bytes one replica sends for ``nbytes`` of the dense all-reduce (a ring's 2 (R - 1) / R)."""
        replicas = self.transport.world_size
        return 2 * (replicas - 1) * nbytes // replicas

    def compressed(self, shard: torch.Tensor, segment: Segment, spec: str, step: int) -> int:
        """A segment summed over the replicas through ``spec``, in place; returns its payload bytes per replica."""
        sync = self.sync_for(spec)
        part = shard[segment.offset : segment.offset + segment.numel]
        x = part.view(matrix_shape(segment))
        part.copy_(sync.sync(x, self.transport, name=segment.name, step=step).reshape(-1))
        return sync.compressor.shaped_payload_bytes(x.shape, part.dtype)

    def finish(self, shard: torch.Tensor) -> None:
        """The average over the replicas (see the module docstring)."""
        if self.average and self.transport.world_size > 1:
            shard.div_(self.transport.world_size)

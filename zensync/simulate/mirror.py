"""Symmetric steps at any world size: one rank runs the real code, its records stand for every rank.

A dense gradient step compressed with a fixed-size compressor (fp16, top-k, DGC, random-k, sign,
QSGD, ...) is symmetric: every rank compresses a tensor of the same size, sends payloads of the same
sizes in the same collectives and decompresses as many. Its records at n ranks therefore follow from
one rank's, without n ranks' memory (1024 ranks of a 25M-element model would need 100 GB):

- ``MirrorTransport`` is a transport for one rank of a world of ``world_size``: each collective
  completes at once, as if every peer had passed what this rank passed (the same sizes; this rank's
  own data stands in for theirs, so values are not the sum, sizes are). The real algorithm runs on
  it unchanged and ``RecordingTransport`` records its calls and local work as in a full run.
- ``replicate(calls, world_size, ranks_per_node)`` writes every rank's records from representative
  rank 0's: each call goes to the same group of every rank shifted by whole nodes and local ranks
  (the world; the rank's node; its local rank across nodes), with the same sizes.

Exactness: the records equal a full run's wherever every rank's shard of a cut tensor has the
representative's size (a tensor that the group size divides); otherwise a rank's shard-sized payload
differs from rank 0's by one element's share, a few bytes in megabytes (the tests bound the price).
Point-to-point calls and splits are not symmetric in this sense and are refused: build two-level
groups with ``MirrorTransport.groups``.

Example::

    calls: list[Call] = []
    world = RecordingTransport(MirrorTransport(0, 1024), calls)
    CompressedSync("topk:0.01", "allgather").sync(grad, world, name="w", step=0)
    every_rank = replicate([calls], 1024, 8)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from zensync.simulate.record import Call
from zensync.transport import reduce_scatter as _rs
from zensync.transport.base import Transport
from zensync.transport.handle import Handle

__all__ = ["MirrorTransport", "replicate"]


class MirrorTransport(Transport):
    """Rank ``rank`` of ``world_size`` ranks that all pass what this one passes (module docstring)."""

    def _all_reduce(self, tensor: torch.Tensor) -> Handle[torch.Tensor]:
        return Handle.completed(tensor)

    def _all_gather(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        # One tensor object for every rank: receivers only read what they gathered.
        return Handle.completed([tensor] * self.world_size)

    def _all_gather_v(self, tensor: torch.Tensor) -> Handle[tuple[list[torch.Tensor], int | None]]:
        return Handle.completed(([tensor] * self.world_size, None))

    def _all_to_all_v(
        self, tensor: torch.Tensor, counts: list[int], recv_counts: list[int] | None
    ) -> Handle[tuple[torch.Tensor, list[int]]]:
        # Every peer cuts its tensor as this rank does, so each sends this rank counts[rank] elements.
        r = self.rank
        start = sum(counts[:r])
        mine = tensor[start : start + counts[r]]
        got = [counts[r]] * self.world_size
        if recv_counts is not None and recv_counts != got:
            raise ValueError(f"mirror all_to_all_v: recv_counts={recv_counts}, but symmetric peers send {got}")
        return Handle.completed((mine.repeat(self.world_size), got))

    def _reduce_scatter(self, tensor: torch.Tensor, algorithm: str) -> Handle[_rs.Traffic]:
        del algorithm
        edges = _rs.bounds(tensor.numel(), self.world_size)
        chunk = tensor.reshape(-1)[edges[self.rank] : edges[self.rank + 1]].clone()
        moved = (tensor.numel() - chunk.numel()) * tensor.element_size()  # the ring: all but one's chunk
        return Handle.completed((chunk, moved, moved, self.world_size - 1, 0))

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        del src
        return Handle.completed(tensor.clone())

    def _send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> Handle[torch.Tensor | None]:
        raise ValueError("MirrorTransport: point-to-point messages are not symmetric; run the step in full")

    def _barrier(self) -> Handle[None]:
        return Handle.completed(None)

    def _split(self, color: int) -> Transport:
        raise ValueError("MirrorTransport cannot split by color; build the groups with MirrorTransport.groups")

    def groups(self, ranks_per_node: int) -> tuple[MirrorTransport, MirrorTransport, tuple[int, ...], tuple[int, ...]]:
        """This rank's node and its local rank across nodes, as mirror transports, with their members
        (global ranks, in group order): what ``zensync.compress.hierarchy`` would split.

        Raises:
            ValueError: If ``ranks_per_node`` does not divide the world size.
        """
        n = self.world_size
        if ranks_per_node < 1 or n % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide the world size {n}")
        node, local = divmod(self.rank, ranks_per_node)
        intra = tuple(range(node * ranks_per_node, (node + 1) * ranks_per_node))
        inter = tuple(range(local, n, ranks_per_node))
        return MirrorTransport(local, ranks_per_node), MirrorTransport(node, n // ranks_per_node), intra, inter


def replicate(calls: Sequence[Sequence[Call]], world_size: int, ranks_per_node: int) -> list[list[Call]]:
    """Every rank's records from rank 0's (``calls[0]``; module docstring).

    Rank s = node * ranks_per_node + local gets each of rank 0's calls on the group whose members
    are rank 0's group's shifted by ``node`` nodes and ``local`` local ranks (mod the counts), in
    ascending order as splits number them; sizes, phase and local work are rank 0's.

    Raises:
        ValueError: If ``ranks_per_node`` does not divide ``world_size``, or a call is point-to-point.
    """
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide world_size={world_size}")
    nodes = world_size // ranks_per_node
    representative = list(calls[0])
    if any(c.op == "send_recv" for c in representative):
        raise ValueError("replicate: point-to-point calls are not symmetric")
    out: list[list[Call]] = []
    for s in range(world_size):
        node, local = divmod(s, ranks_per_node)
        shifted: dict[tuple[int, ...], tuple[int, ...]] = {}
        for group in {c.group for c in representative}:
            moved = (
                ((m // ranks_per_node + node) % nodes) * ranks_per_node + (m % ranks_per_node + local) % ranks_per_node
                for m in group
            )
            shifted[group] = tuple(sorted(moved))
        out.append([dataclasses.replace(call, group=shifted[call.group]) for call in representative])
    return out

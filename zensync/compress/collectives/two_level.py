"""Two-level compressed collectives (Espresso's intra-node divisible form) and the groups they run on.

``hierarchy(transport, ranks_per_node)`` splits a transport into this rank's node and its local
rank across nodes. ``two_level`` then runs any compressed collective in three steps:

1. intra-node reduce-scatter of the uncompressed tensor: local rank l sums shard l over the node;
2. the compressed collective across nodes, on this local rank's shard (named ``<name>@<l>``);
3. intra-node allgather of the summed shards.

Example::

    levels = hierarchy(transport, ranks_per_node=8)  # a collective, between steps
    out = await two_level(build_collective("allgather"), codec, grad, levels, name="w", step=3)
"""

from __future__ import annotations

import dataclasses

import torch

from zensync.compress.collectives.base import Codec, CompressedCollective, sum_in_rank_order
from zensync.transport import Transport

__all__ = ["Hierarchy", "hierarchy", "two_level"]


@dataclasses.dataclass(frozen=True, slots=True)
class Hierarchy:
    """The two groups of a two-level scheme: this rank's node, and its local rank across nodes."""

    intra: Transport
    inter: Transport


def hierarchy(transport: Transport, ranks_per_node: int) -> Hierarchy:
    """Split ``transport`` into nodes of ``ranks_per_node`` consecutive ranks (a collective).

    Blocking (``Transport.split``): call it between steps, not from a coroutine.

    Raises:
        ValueError: If ``ranks_per_node`` does not divide the world size.
    """
    n = transport.world_size
    if ranks_per_node < 1 or n % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide the world size {n}")
    intra = transport.split(transport.rank // ranks_per_node)
    inter = transport.split(transport.rank % ranks_per_node)
    return Hierarchy(intra=intra, inter=inter)


async def two_level(
    collective: CompressedCollective, codec: Codec, x: torch.Tensor, levels: Hierarchy, *, name: str, step: int
) -> torch.Tensor:
    """Sum over every rank of ``levels`` of the compressed ``x`` (steps 1-3 of the module docstring).

    Returns:
        A new tensor of x's shape and dtype, the same on every rank.
    """
    intra, k = levels.intra, levels.intra.world_size
    flat = x.reshape(-1)
    # Step 1: intra-node reduce-scatter (uncompressed): local rank l sums shard l over the node.
    shards = list(flat.tensor_split(k))
    received, counts = await intra.all_to_all_v_async(flat.contiguous(), [s.numel() for s in shards])
    shard = sum_in_rank_order(list(received.split(counts)), shards[intra.rank])
    # Step 2: the compressed collective across nodes, on this local rank's shard.
    summed, _ = await collective.reduce(
        shard,
        levels.inter,
        dataclasses.replace(codec, on_issued=None),
        name=f"{name}@{intra.rank}",
        step=step,
        want_own=False,
    )
    # Step 3: intra-node allgather of the summed shards.
    gathered = await codec.last(intra.all_gather_v_async(summed.reshape(-1).contiguous()))
    return torch.cat(gathered).view(x.shape)

"""``alltoall_allgather``: DeepSpeed's compressed allreduce (Espresso Table 2, divisible compressors).

1. The tensor is cut into n chunks; each is compressed under ``<name>#<j>`` and chunk j of every
   rank goes to rank j, its owner (one ``all_to_all_v``).
2. The owner decompresses and sums its chunk from every rank, adds its server-side error, and
   re-compresses the sum under ``<name>#<j>#server``.
3. Every rank gathers the n re-compressed chunks (one ``all_gather_v``) and decompresses them.

Example::

    out, own = await build_collective("alltoall_allgather").reduce(x, t, codec, name="w", step=3, want_own=True)
"""

from __future__ import annotations

import torch

from zensync.compress.collectives.base import (
    Codec,
    CompressedCollective,
    register_collective,
    sum_in_rank_order,
    unpack,
)
from zensync.transport import Transport
from zensync.transport.packing import pack

__all__ = ["AllToAllAllGatherCollective"]


@register_collective
class AllToAllAllGatherCollective(CompressedCollective):
    """Chunk owners aggregate and re-compress (alltoall), then everyone gathers the chunks (allgather)."""

    name = "alltoall_allgather"

    async def _reduce(
        self, x: torch.Tensor, transport: Transport, codec: Codec, *, name: str, step: int, want_own: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        compressor, n, r = codec.compressor, transport.world_size, transport.rank
        chunks = list(x.reshape(-1).tensor_split(n))
        # Step 1: compress each chunk; chunk j goes to its owner, rank j.
        with transport.timed("compress"):
            packed = [compressor.compress(c, name=f"{name}#{j}", step=step) for j, c in enumerate(chunks)]
            buffers = [pack(*p.payloads) for p in packed]
        received, counts = await transport.all_to_all_v_async(torch.cat(buffers), [b.numel() for b in buffers])
        # Step 2: the owner decompresses and sums its chunk from every rank, adds its server error,
        # and re-compresses the sum.
        with transport.timed("decompress"):
            mine = [compressor.decompress(unpack(buf, packed[r])) for buf in received.split(counts)]
            own = None
            if want_own:
                own = torch.cat([compressor.decompress(p).reshape(-1) for p in packed]).view(x.shape)
        with transport.timed("compress"):
            server = codec.server_recompress(sum_in_rank_order(mine, chunks[r]), f"{name}#{r}", step)
        # Step 3: everyone gathers the re-compressed chunks.
        gathered = await codec.last(transport.all_gather_v_async(pack(*server.payloads)))
        with transport.timed("decompress"):
            like = [
                server if j == r else codec.server_layout(c, packed[j], f"{name}#{j}", step)
                for j, c in enumerate(chunks)
            ]
            summed = [compressor.decompress(unpack(buf, like[j])).reshape(-1) for j, buf in enumerate(gathered)]
            return torch.cat(summed).view(x.shape), own

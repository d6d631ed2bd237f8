"""``gather_broadcast``: a parameter-server round through rank 0 (Espresso Table 2, divisible, one root).

1. Rank 0 receives every rank's packed payloads (an all-to-all whose only non-empty chunks go to it).
2. It decompresses and sums them, adds its server error, re-compresses the sum under
   ``<name>#root#server`` and broadcasts it; every rank decompresses the broadcast.

Example::

    out, own = await build_collective("gather_broadcast").reduce(x, t, codec, name="w", step=3, want_own=True)
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

__all__ = ["GatherBroadcastCollective"]

ROOT = 0
"""The rank that aggregates and re-compresses."""


@register_collective
class GatherBroadcastCollective(CompressedCollective):
    """Gather the payloads to the root, which sums, re-compresses and broadcasts."""

    name = "gather_broadcast"

    async def _reduce(
        self, x: torch.Tensor, transport: Transport, codec: Codec, *, name: str, step: int, want_own: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        compressor, n = codec.compressor, transport.world_size
        with transport.timed("compress"):
            packed = compressor.compress(x, name=name, step=step)
            buf = pack(*packed.payloads)
        # Step 1: gather to the root (an all-to-all whose only non-empty chunks go to the root).
        counts = [buf.numel() if j == ROOT else 0 for j in range(n)]
        received, recv_counts = await transport.all_to_all_v_async(buf, counts)
        key = f"{name}#root"
        with transport.timed("decompress"):
            own = compressor.decompress(packed) if want_own else None
            if transport.rank == ROOT:
                parts = [compressor.decompress(unpack(b, packed)) for b in received.split(recv_counts)]
                like = codec.server_recompress(sum_in_rank_order(parts, x), key, step)
                out_buf = pack(*like.payloads)
            else:
                like = codec.server_layout(x, packed, key, step)
                out_buf = torch.empty(like.nbytes, dtype=torch.uint8, device=x.device)
        # Step 2: the root broadcasts the re-compressed sum.
        out_buf = await codec.last(transport.broadcast_async(out_buf, ROOT))
        with transport.timed("decompress"):
            return compressor.decompress(unpack(out_buf, like)), own

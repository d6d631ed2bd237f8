"""``allgather``: every rank's payloads go to every rank (Espresso Table 2, indivisible compressors).

Each rank compresses its tensor, the packed payloads are gathered everywhere (one ``all_gather_v``),
and each rank decompresses the n approximations and sums them in rank order. This rank's own
approximation is one of them.

Example::

    out, own = await build_collective("allgather").reduce(x, transport, codec, name="w", step=3, want_own=True)
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

__all__ = ["AllGatherCollective"]


@register_collective
class AllGatherCollective(CompressedCollective):
    """Compress; gather every rank's packed payloads; decompress each and sum them."""

    name = "allgather"

    async def _reduce(
        self, x: torch.Tensor, transport: Transport, codec: Codec, *, name: str, step: int, want_own: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        compressor = codec.compressor
        # Step 1: compress; Step 2: every rank's packed payloads to every rank; Step 3: decompress and sum.
        packed = compressor.compress(x, name=name, step=step)
        gathered = await transport.all_gather_v_async(pack(*packed.payloads))
        parts = [compressor.decompress(unpack(buf, packed)) for buf in gathered]
        return sum_in_rank_order(parts, x), parts[transport.rank]

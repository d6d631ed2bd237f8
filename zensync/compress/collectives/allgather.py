"""``allgather``: every rank's payloads go to every rank (Espresso Table 2, indivisible compressors).

Each rank compresses its tensor, the packed payloads are gathered everywhere (one ``all_gather_v``),
and each rank decompresses the n approximations and sums them in rank order. This rank's own
approximation is one of them.

Example::

    out, own = await build_collective("allgather").reduce(x, transport, codec, name="w", step=3, want_own=True)
"""

from __future__ import annotations

import torch

from zensync.compress.collectives.base import Codec, CompressedCollective, Own, register_collective, unpack
from zensync.transport import Transport
from zensync.transport.packing import pack

__all__ = ["AllGatherCollective"]


@register_collective
class AllGatherCollective(CompressedCollective):
    """Compress; gather every rank's packed payloads; decompress them into one sum.

    The sum is decoded straight into ``out`` (``Compressor.decompress_sum``: top-k adds its k values
    per sender, the sign family decodes every sender in one pass), and this rank's own
    approximation is returned compressed, for error feedback's residual (``subtract_transmitted``):
    no tensor of x's size per sender.
    """

    name = "allgather"

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
        compressor = codec.compressor
        # Step 1: compress; Step 2: every rank's packed payloads to every rank; Step 3: decode the sum.
        with transport.timed("compress"):
            packed = compressor.compress(x, name=name, step=step)
            payload = pack(*packed.payloads)
        pending = codec.last(transport.all_gather_v_async(payload))
        keep_own = codec.keep_own if want_own else None
        if keep_own is not None:  # the payload is a buffer of its own: x may become the residual now
            keep_own(packed)
        gathered = await pending
        # The gathered buffers are the collective's own memory: writing out (which may be x) is safe.
        with transport.timed("decompress"):
            parts = [unpack(buf, packed) for buf in gathered]
            target = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
            compressor.decompress_sum(parts, target)
        return target, parts[transport.rank] if want_own and keep_own is None else None

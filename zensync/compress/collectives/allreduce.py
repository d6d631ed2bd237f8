"""``allreduce``: the payloads are summed by allreduce and decompressed once (Espresso Table 2).

For allreduce-compatible compressors (fp16, bf16, shared-seed random-k, PowerSGD): the compressor
runs its own rounds through ``Compressor.allreduce_sync``, which awaits one allreduce per payload
(PowerSGD: two, with a matrix product between, in one coroutine, so every rank issues them in the
same order). The sum is linear, so this rank's own share of it cannot be told apart (``own`` None).

Example::

    out, _ = await build_collective("allreduce").reduce(x, transport, codec, name="w", step=3, want_own=False)
"""

from __future__ import annotations

import time
from collections.abc import Awaitable

import torch

from zensync.compress.base import Compressor
from zensync.compress.collectives.base import Codec, CompressedCollective, register_collective
from zensync.transport import Transport

__all__ = ["AllReduceCollective"]


@register_collective
class AllReduceCollective(CompressedCollective):
    """Compress, allreduce the payloads, decompress the sum (``Compressor.allreduce_sync``)."""

    name = "allreduce"
    folds_scale = True
    roundtrip_on_one_rank = False
    """One rank still runs ``allreduce_sync``: PowerSGD's rounds differ from compress/decompress."""

    def check(self, compressor: Compressor) -> None:
        """Raise unless the payloads of ``compressor`` can be summed."""
        if not compressor.allreduce_compatible:
            raise ValueError(
                f"scheme='allreduce' needs an allreduce-compatible compressor; {compressor.spec()!r} is not "
                f"(its payloads cannot be summed): use allgather, alltoall_allgather or gather_broadcast"
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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The compressor decodes the summed payloads straight into ``out`` (fp16: one conversion pass).

        A payload the compressor made for the round (fp16's cast, PowerSGD's products) is summed in
        place; one that shares memory with ``x`` (the identity's) is copied first, so ``x`` is
        read, never written, by the rounds.
        """
        storage = x.untyped_storage().data_ptr()
        waited_s = 0.0

        def all_reduce(t: torch.Tensor, *, last: bool = False) -> Awaitable[torch.Tensor]:
            # Issued now, awaited later: a compressor may put several rounds on the wire first.
            flat = t.reshape(-1)
            fresh = flat.is_contiguous() and flat.untyped_storage().data_ptr() != storage
            pending = codec.last(transport.all_reduce_async(flat, inplace=fresh), last=last)

            async def wait() -> torch.Tensor:
                nonlocal waited_s
                start = time.perf_counter()
                summed = await pending
                waited_s += time.perf_counter() - start
                return summed.view(t.shape)

            return wait()

        start = time.perf_counter()
        summed = await codec.compressor.allreduce_sync(
            x, all_reduce, name=name, step=step, out=out, scale=scale, parts=codec.parts
        )
        # The compressor's own passes (fp16's casts, PowerSGD's products), its rounds' waits apart.
        transport.note_time("codec", time.perf_counter() - start - waited_s)
        return summed, None

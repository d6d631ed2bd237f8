"""Dense baseline: one ring allreduce of the whole tensor, zeros included."""

from __future__ import annotations

import torch

from zensync.sync.base import SyncContext, SyncScheme, register_scheme

__all__ = ["DenseScheme"]


@register_scheme
class DenseScheme(SyncScheme):
    """Plain allreduce (what DDP does): received volume 2(n-1)/n * M per rank."""

    name = "dense"

    async def run(self, ctx: SyncContext) -> torch.Tensor:
        x2d = ctx.view.x2d
        with ctx.phase("allreduce"):
            if ctx.out is None:
                summed = await ctx.transport.all_reduce_async(x2d.reshape(-1))
                return summed.view(x2d.shape)
            if not ctx.out_is_input:
                ctx.out.copy_(x2d)
            await ctx.transport.all_reduce_async(ctx.out.view(-1), inplace=True)  # no copy of its own
            return ctx.out

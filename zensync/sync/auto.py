"""auto: pick the scheme with the lowest predicted time from the closed forms and measured density.

A first version: every rank's non-zero count arrives with the call's descriptor exchange, so all ranks
evaluate the same formulas on the same numbers and pick the same scheme. The union after aggregation
is estimated by independent placement (``zensync.cost.independent_union``); the hook layer refines this with
measured densification and network parameters.
"""

from __future__ import annotations

import torch

from zensync.cost import CostModel, TensorShape, independent_union, predict_time
from zensync.sync.base import SyncContext, SyncScheme, for_scheme, get_scheme, index_dtype, register_scheme

__all__ = ["AUTO_CANDIDATES", "AutoScheme"]

AUTO_CANDIDATES = ("dense", "zen", "sparcml", "agsparse")
"""Schemes auto chooses from: the optimal pair of Theorem 1 plus the two baselines users know."""


@register_scheme
class AutoScheme(SyncScheme):
    """Chooses per call among ``AUTO_CANDIDATES``."""

    name = "auto"
    records = True  # it passes the context on, prepared for the scheme it chooses
    divides = True

    async def run(self, ctx: SyncContext) -> torch.Tensor:
        choice = self.choose(ctx)
        ctx.stats.scheme = choice
        scheme = get_scheme(choice)
        return await scheme.run(for_scheme(ctx, scheme))

    def choose(self, ctx: SyncContext) -> str:
        """The candidate with the lowest predicted time (ties: the earlier candidate)."""
        if ctx.nnz_per_rank is None:
            raise ValueError("auto needs every rank's non-zero count (measured by sparse_allreduce)")
        view = ctx.view
        shape = TensorShape(
            world_size=ctx.transport.world_size,
            num_items=view.num_items,
            item_bytes=view.item_bytes,
            index_bytes=index_dtype(view.num_items).itemsize,
            nnz=sum(ctx.nnz_per_rank) / len(ctx.nnz_per_rank),
        )
        model = CostModel(latency_s=ctx.options.latency_s, bandwidth_bytes_per_s=ctx.options.bandwidth_bytes_per_s)
        union = independent_union(shape)
        predicted = {name: predict_time(name, shape, union, model) for name in AUTO_CANDIDATES}
        ctx.stats.predicted_s = predicted
        return min(AUTO_CANDIDATES, key=lambda name: predicted[name])

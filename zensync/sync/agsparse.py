"""AGsparse: all-gather every rank's COO, then every rank sums everything (Horovod, torch gloo sparse).

1. Encode. Each rank finds its non-zero items and packs them as COO records (index, value row).
2. All-gather. One all-gather with uneven sizes gives every rank every rank's records.
3. Aggregate. Every rank sums all records by index, in rank order (identical result on every rank).

Received volume per rank (n-1) * k * (index + value bytes): linear in n (reference/zen.md 1.3).
"""

from __future__ import annotations

import torch

from zensync import kernels
from zensync.sync.base import SyncContext, SyncScheme, accumulation_dtype, index_dtype, register_scheme
from zensync.sync.coo import decode_records, encode_records
from zensync.sync.observe import local_skew, record_densities, record_overlap

__all__ = ["AGSparseScheme"]


@register_scheme
class AGSparseScheme(SyncScheme):
    """All-gather of COO with one-shot aggregation."""

    name = "agsparse"
    records = True
    divides = True

    async def run(self, ctx: SyncContext) -> torch.Tensor:
        view, transport, stats = ctx.view, ctx.transport, ctx.stats
        idx_dtype = index_dtype(view.num_items)
        # Step 1: local COO (from the known items where the call has them: no scan).
        with ctx.phase("encode"):
            items, rows = ctx.local_records()
            stats.local_nnz = items.numel()
            stats.skew = local_skew(items, view.num_items, transport.world_size)
            block = encode_records(items, rows, idx_dtype)
        # Step 2: all-gather.
        with ctx.phase("allgather"):
            gathered = await transport.all_gather_v_async(block.view(-1))
        # Step 3: every rank sums all records, in rank order (identical result on every rank).
        with ctx.phase("aggregate"):
            decoded = [decode_records(g, idx_dtype, view.x2d.dtype, view.item_numel) for g in gathered]
            indices = torch.cat([d[0] for d in decoded])
            acc = accumulation_dtype(view.x2d.dtype)
            values = torch.cat([d[1].to(acc) for d in decoded])
            unique, sums, multiplicity = kernels.aggregate(indices, values)
            if ctx.sparse_out:
                out = torch.sparse_coo_tensor(
                    unique.unsqueeze(0),
                    sums.to(view.x2d.dtype),
                    (view.num_items, view.item_numel),
                    is_coalesced=True,
                    check_invariants=False,
                )
            else:
                out = ctx.output()  # the input itself with out=: only the union's items are written
                out[unique] = sums.to(out.dtype)
        nnz_per_rank = [d[0].numel() for d in decoded]
        record_densities(stats, nnz_per_rank, unique.numel())
        shared_pairs = int((multiplicity * (multiplicity - 1) // 2).sum())  # host-device sync
        record_overlap(stats, nnz_per_rank, shared_pairs)
        return out

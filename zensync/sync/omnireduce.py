"""OmniReduce (SIGCOMM'21; reference/zen.md 3.4): blocks of 256 elements, only non-zero blocks move,
no per-element indices; owners (aggregators) hold contiguous even ranges of blocks.

1. Push. Each rank sends each owner, in one all-to-all, a bitmap of which of the owner's blocks
   follow (one bit per block: the block ids OmniReduce carries in its packets) and the values of
   its non-zero blocks.
2. Aggregate. Each owner sums the blocks it received, in source-rank order (still the push phase).
3. Pull. Every rank all-gathers the owners' non-zero aggregated blocks, encoded the same way.

Skewed gradients put most non-zero blocks on the first owners, and at high density almost every
block is non-zero: the two weaknesses Zen's evaluation points out.
"""

from __future__ import annotations

import torch

from zensync import kernels
from zensync.sync.base import SyncContext, SyncScheme, accumulation_dtype, register_scheme
from zensync.sync.observe import imbalance, record_densities
from zensync.transport.packing import ByteReader, pack

__all__ = ["OmniReduceScheme", "block_ranges"]


def block_ranges(num_blocks: int, num_owners: int) -> list[tuple[int, int]]:
    """(first block, number of blocks) of each owner: contiguous, ceil(num_blocks / n) blocks each."""
    per_owner = -(-num_blocks // num_owners) if num_blocks else 0
    return [(j * per_owner, max(0, min(per_owner, num_blocks - j * per_owner))) for j in range(num_owners)]


def _encode_blocks(blocks: torch.Tensor, first: int, count: int, numel: int, block: int) -> torch.Tensor:
    """Bitmap of the non-zero blocks among blocks[first:first+count], then their exact elements."""
    mine = blocks[first : first + count]
    nonzero = (mine != 0).any(dim=1)
    ids = nonzero.nonzero().squeeze(1)
    words = kernels.bitmap_encode(ids, count)
    values = mine[ids].reshape(-1)
    tail_pad = (first + count) * block - numel  # padding of the tensor's last, partial block
    if tail_pad > 0 and ids.numel() and int(ids[-1]) == count - 1:  # host-device sync
        values = values[: values.numel() - tail_pad]
    return pack(words, values)


def _decode_blocks(
    payload: torch.Tensor, first: int, count: int, numel: int, block: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(global block ids, (k, block) values zero-padded) from ``_encode_blocks``'s payload."""
    reader = ByteReader(payload)
    ids = kernels.bitmap_decode(reader.take(torch.int32, (count + 31) // 32), count)
    values = reader.take(dtype, reader.remaining // dtype.itemsize)
    padded = torch.zeros(ids.numel() * block, dtype=dtype, device=payload.device)
    padded[: values.numel()] = values
    return ids + first, padded.view(-1, block)


@register_scheme
class OmniReduceScheme(SyncScheme):
    """Block-sparse push/pull over contiguous owner ranges."""

    name = "omnireduce"

    async def run(self, ctx: SyncContext) -> torch.Tensor:
        view, transport, stats = ctx.view, ctx.transport, ctx.stats
        n, rank = transport.world_size, transport.rank
        block = ctx.options.omnireduce_block
        flat = view.x2d.reshape(-1)
        numel, dtype = flat.numel(), flat.dtype
        num_blocks = -(-numel // block)
        blocks = torch.zeros(num_blocks * block, dtype=dtype, device=flat.device)
        blocks[:numel] = flat
        blocks = blocks.view(num_blocks, block)
        ranges = block_ranges(num_blocks, n)
        stats.local_nnz = int(kernels.nonzero_items(view.x2d).numel())
        # Step 1: push each owner the bitmap + non-zero blocks of its range.
        with ctx.phase("push"):
            parts = [_encode_blocks(blocks, first, count, numel, block) for first, count in ranges]
            received, counts = await transport.all_to_all_v_async(torch.cat(parts), [p.numel() for p in parts])
            push_bytes_recv = sum(c for j, c in enumerate(counts) if j != rank)
            # Step 2: the owner sums the blocks of its range in source-rank order.
            first, count = ranges[rank]
            acc = torch.zeros((count, block), dtype=accumulation_dtype(dtype), device=flat.device)
            for chunk in received.split(counts):
                ids, values = _decode_blocks(chunk, first, count, numel, block, dtype)
                acc.index_add_(0, ids - first, values.to(acc.dtype))
        # Step 3: every rank pulls every owner's non-zero aggregated blocks.
        with ctx.phase("pull"):
            header = torch.tensor([push_bytes_recv, stats.local_nnz], dtype=torch.int64, device=flat.device)
            aggregated = acc.to(dtype)
            body = _encode_blocks(aggregated, 0, count, numel - first * block, block)
            payloads = await transport.all_gather_v_async(pack(header, body))
            out = torch.zeros(num_blocks, block, dtype=dtype, device=flat.device)
            headers = []
            for owner, payload in enumerate(payloads):
                headers.append(ByteReader(payload[:16]).take(torch.int64, 2).tolist())  # host-device sync
                owner_first, owner_count = ranges[owner]
                ids, values = _decode_blocks(payload[16:], owner_first, owner_count, numel, block, dtype)
                out[ids] = values
        stats.push_imbalance = imbalance([h[0] for h in headers])
        total = sum(p.numel() for p in payloads)
        stats.pull_imbalance = imbalance([total - p.numel() for p in payloads])
        record_densities(stats, [h[1] for h in headers], None)
        return out.view(-1)[:numel].view(view.x2d.shape)

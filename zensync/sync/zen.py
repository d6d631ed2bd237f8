"""Zen's Balanced Parallelism (OSDI'25, reference/zen.md 1.4-1.6), and sparse_ps, its unhashed twin.

Every rank is both a worker and the owner (server) of one partition of the item space:

1. Push. Each rank finds its non-zero items, maps each to its owner with the shared first-level hash
   h0 (a keyed bijection followed by contiguous ranges, ``zensync.types.Partition``), and sends each
   owner its (position, value) records in one all-to-all with uneven splits.
2. Aggregate. Each owner sums the records it received by position (incremental aggregation).
3. Pull. Each owner encodes its aggregated partition as the smallest of COO, hash bitmap (one bit
   per position of its fixed potential set I_j, then the values) or dense, and all ranks all-gather
   the encoded partitions. Decoding is arithmetic: item = perm^-1(range start + position).

Because h0 is shared, aggregation is complete and the result equals the dense sum. Because h0 is a
pseudorandom permutation, push and pull volumes are balanced whatever the skew of the indices.
Per-rank received volume: (n-1)/n * (K + U) * (index + value bytes) with COO (Eq. 1), U = union size;
the bitmap pull replaces U index words by ceil(M/32) bitmap words in total.

``sparse_ps`` is the same algorithm with the identity permutation: owners get contiguous even ranges,
so skewed indices (embedding rows ranked by frequency) overload the first owners.
"""

from __future__ import annotations

import dataclasses

import torch

from zensync import kernels
from zensync.kernels.hashing import Partition
from zensync.sync.base import (
    ItemView,
    SyncContext,
    SyncScheme,
    accumulation_dtype,
    index_dtype,
    local_records,
    register_scheme,
)
from zensync.sync.coo import decode_records, encode_records
from zensync.sync.observe import imbalance, local_skew, record_densities, record_overlap
from zensync.sync.partition import make_partition
from zensync.transport.packing import ByteReader, pack

__all__ = ["PULL_ENCODINGS", "PreparedPush", "SparsePSScheme", "ZenScheme", "bucket_records", "pull_payload_bytes"]

PULL_ENCODINGS = ("coo", "bitmap", "dense")
_HEADER_FIELDS = 5  # encoding, unique positions, shared pairs, push bytes received, local nnz
_HEADER_BYTES = 8 * _HEADER_FIELDS


def pull_payload_bytes(encoding: str, num_unique: int, range_len: int, index_bytes: int, item_bytes: int) -> int:
    """Body bytes of one owner's pull payload (header excluded) in ``encoding``."""
    if encoding == "coo":
        return num_unique * (index_bytes + item_bytes)
    if encoding == "bitmap":
        return (range_len + 31) // 32 * 4 + num_unique * item_bytes
    if encoding == "dense":
        return range_len * item_bytes
    raise ValueError(f"pull encoding {encoding!r} is unknown (valid: {PULL_ENCODINGS})")


@dataclasses.dataclass(slots=True)
class _Pushed:
    """What an owner holds after push + aggregation."""

    positions: torch.Tensor
    sums: torch.Tensor
    shared_pairs: int
    push_bytes_recv: int
    local_nnz: int


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedPush:
    """One rank's non-zero records grouped by owner under one partition: Zen's Step 1.1 done.

    ``sparse_allreduce`` prepares it before its agreement exchange when the hash seed is known then,
    so the exchange also carries every rank's per-owner counts and the push needs no size exchange.
    """

    seed: int
    """Seed of the partition the records are grouped by."""
    hashed: bool
    """Zen's hashed partition (True) or sparse_ps's contiguous ranges."""
    items: torch.Tensor
    """int64 item ids, grouped by owner (owner 0 first), ascending within an owner."""
    positions: torch.Tensor
    """int64 position of each item inside its owner's range."""
    counts: list[int]
    """Records per owner."""
    values: torch.Tensor
    """(k, item_numel) rows of ``items``, divided as the call asks."""
    recv_counts: list[int] | None = None
    """Records every rank sends this one, where the agreement carried them; None: exchange sizes."""


def bucket_records(
    x2d: torch.Tensor,
    part: Partition,
    items: torch.Tensor | None,
    values: torch.Tensor | None,
    divisor: int,
    *,
    seed: int,
    hashed: bool,
) -> PreparedPush:
    """Step 1.1: non-zero detection, h0 and bucketing by owner.

    One fused kernel over the tensor, or, where the non-zero items are known (``items``, and
    ``values`` for a COO input), h0 and bucketing of those alone: no scan.
    """
    if items is None:
        grouped, positions, counts = kernels.bucket_nonzero(x2d, part)
        rows = x2d.index_select(0, grouped)
        if divisor != 1:
            rows = rows / divisor
    else:
        found, rows = local_records(x2d, items, values, divisor)
        order, positions, counts = kernels.bucket_items(found, part)
        grouped, rows = found[order], rows[order]
    return PreparedPush(
        seed=seed,
        hashed=hashed,
        items=grouped,
        positions=positions,
        counts=counts.tolist(),  # host-device sync
        values=rows,
    )


def _coalesced(parts: list[tuple[torch.Tensor, torch.Tensor]], view: ItemView) -> torch.Tensor:
    """The owners' (items, values) as one coalesced COO tensor of shape (num_items, item_numel)."""
    if parts:
        items = torch.cat([p[0] for p in parts])
        values = torch.cat([p[1] for p in parts])
    else:
        items = torch.empty(0, dtype=torch.int64, device=view.x2d.device)
        values = view.x2d.new_empty((0, view.item_numel))
    order = torch.argsort(items)
    return torch.sparse_coo_tensor(
        items[order].unsqueeze(0),
        values[order],
        (view.num_items, view.item_numel),
        is_coalesced=True,
        check_invariants=False,
    )


@register_scheme
class ZenScheme(SyncScheme):
    """Balanced Parallelism with hash-bitmap pull."""

    name = "zen"
    hashed = True
    records = True
    divides = True

    async def run(self, ctx: SyncContext) -> torch.Tensor:
        part = make_partition(ctx.view.num_items, ctx.transport.world_size, seed=ctx.h0_seed, hashed=self.hashed)
        with ctx.phase("push"):
            pushed = await self._push_and_aggregate(ctx, part)
        with ctx.phase("pull"):
            return await self._pull(ctx, part, pushed)

    # -- Steps 1 and 2 ---------------------------------------------------------------------------
    async def _push_and_aggregate(self, ctx: SyncContext, part: Partition) -> _Pushed:
        view, transport, stats = ctx.view, ctx.transport, ctx.stats
        idx_dtype = index_dtype(part.range_len)
        # Step 1.1: the records grouped by owner, prepared before the call's agreement (which then
        # carried every rank's per-owner counts) or now.
        push = ctx.push
        if push is None or (push.seed, push.hashed) != (ctx.h0_seed, self.hashed):
            push = bucket_records(
                view.x2d, part, ctx.items, ctx.values, ctx.divisor, seed=ctx.h0_seed, hashed=self.hashed
            )
        items = push.items
        stats.local_nnz = items.numel()
        stats.skew = local_skew(items, view.num_items, transport.world_size)
        # Step 1.2: one all-to-all of records, cut by owner (no size exchange where counts are known).
        block = encode_records(push.positions, push.values, idx_dtype)
        record_bytes = block.shape[1]
        send_counts = [c * record_bytes for c in push.counts]
        known = None if push.recv_counts is None else [c * record_bytes for c in push.recv_counts]
        received, recv_counts = await transport.all_to_all_v_async(block.view(-1), send_counts, known)
        push_bytes_recv = sum(c for j, c in enumerate(recv_counts) if j != transport.rank)
        # Step 2: owner-side aggregation (sum by position), in source-rank order.
        recv_positions, recv_values = decode_records(received, idx_dtype, view.x2d.dtype, view.item_numel)
        unique, sums, multiplicity = kernels.aggregate(
            recv_positions, recv_values.to(accumulation_dtype(view.x2d.dtype))
        )
        return _Pushed(
            positions=unique,
            sums=sums.to(view.x2d.dtype),
            shared_pairs=int((multiplicity * (multiplicity - 1) // 2).sum()),  # host-device sync
            push_bytes_recv=push_bytes_recv,
            local_nnz=items.numel(),
        )

    # -- Step 3 ----------------------------------------------------------------------------------
    def _encode_partition(self, ctx: SyncContext, part: Partition, pushed: _Pushed) -> torch.Tensor:
        view = ctx.view
        idx_dtype = index_dtype(part.range_len)
        index_bytes = idx_dtype.itemsize
        _, range_len = part.owner_range(ctx.transport.rank)
        num_unique = pushed.positions.numel()
        sizes = [pull_payload_bytes(e, num_unique, range_len, index_bytes, view.item_bytes) for e in PULL_ENCODINGS]
        encoding = sizes.index(min(sizes))
        header = torch.tensor(
            [encoding, num_unique, pushed.shared_pairs, pushed.push_bytes_recv, pushed.local_nnz],
            dtype=torch.int64,
            device=view.x2d.device,
        )
        if PULL_ENCODINGS[encoding] == "coo":
            return pack(header, pushed.positions.to(idx_dtype), pushed.sums)
        if PULL_ENCODINGS[encoding] == "bitmap":
            return pack(header, kernels.bitmap_encode(pushed.positions, range_len), pushed.sums)
        dense = torch.zeros((range_len, view.item_numel), dtype=view.x2d.dtype, device=view.x2d.device)
        dense[pushed.positions] = pushed.sums
        return pack(header, dense)

    async def _pull(self, ctx: SyncContext, part: Partition, pushed: _Pushed) -> torch.Tensor:
        view, transport = ctx.view, ctx.transport
        payloads = await transport.all_gather_v_async(self._encode_partition(ctx, part, pushed))
        idx_dtype = index_dtype(part.range_len)
        device = view.x2d.device
        # The input itself with out=: only the union's items are written. A sparse result collects
        # each owner's (items, values) instead.
        out = None if ctx.sparse_out else ctx.output()
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        headers: list[list[int]] = []
        encodings = dict.fromkeys(PULL_ENCODINGS, 0)
        bitmap_words = 0
        # Decode owner by owner straight into the output: peak memory stays one partition's worth.
        for owner, payload in enumerate(payloads):
            reader = ByteReader(payload)
            header = reader.take(torch.int64, _HEADER_FIELDS).tolist()  # host-device sync
            headers.append(header)
            encoding, num_unique = PULL_ENCODINGS[header[0]], header[1]
            base, range_len = part.owner_range(owner)
            encodings[encoding] += 1
            if encoding == "coo":
                positions = reader.take(idx_dtype, num_unique).to(torch.int64)
            elif encoding == "bitmap":
                words = reader.take(torch.int32, (range_len + 31) // 32)
                bitmap_words += words.numel()
                positions = kernels.bitmap_decode(words, range_len)
            else:
                positions = torch.arange(range_len, dtype=torch.int64, device=device)
            values = reader.take(view.x2d.dtype, positions.numel() * view.item_numel).view(-1, view.item_numel)
            if out is None and encoding == "dense":  # a sparse result holds the union only
                positions = kernels.nonzero_items(values)
                values = values.index_select(0, positions)
            items = kernels.unpermute(positions + base, part)
            if out is None:
                parts.append((items, values))
            else:
                out[items] = values
        self._record(ctx, headers, [p.numel() for p in payloads], encodings, bitmap_words)
        if out is None:
            return _coalesced(parts, view)
        return out

    def _record(
        self,
        ctx: SyncContext,
        headers: list[list[int]],
        payload_sizes: list[int],
        encodings: dict[str, int],
        bitmap_words: int,
    ) -> None:
        stats = ctx.stats
        total = sum(payload_sizes)
        stats.pull_encodings = encodings
        stats.pull_bitmap_words = bitmap_words
        stats.push_imbalance = imbalance([h[3] for h in headers])
        stats.pull_imbalance = imbalance([total - size for size in payload_sizes])
        nnz_per_rank = [h[4] for h in headers]
        record_densities(stats, nnz_per_rank, sum(h[1] for h in headers))
        record_overlap(stats, nnz_per_rank, sum(h[2] for h in headers))


@register_scheme
class SparsePSScheme(ZenScheme):
    """Sparse parameter server with owners by contiguous even ranges (no hash): shows the skew Zen removes."""

    name = "sparse_ps"
    hashed = False

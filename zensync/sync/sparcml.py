"""SparCML's hierarchical centralization (SC'19; reference/zen.md 1.3, 3.5): recursive doubling with
incremental aggregation, switching a stage to dense once the merged set is denser than COO pays for.

Any world size, with p the largest power of two <= n; all three steps are the "exchange" phase:

1. Fold. Ranks p..n-1 send their non-zeros (COO) to ranks 0..n-p-1, which merge them.
2. Double. The first p ranks run log2(p) stages; in stage s each swaps its partial sum with the rank
   2^(s-1) away and merges it (COO, or dense once COO would be larger).
3. Hand back. Ranks 0..n-p-1 send the result to the folded ranks.

Stage s (s = 1..log2 p) receives the partner's aggregate of 2^(s-1) ranks: Eq. 2,
T = sum_s gamma_{2^(s-1)} * 2 * M * d / b.

Every merge adds the lower rank group's values before the upper group's, and both partners merge the
same (transmitted, rounded) operands, so every rank ends with bit-identical sums.
"""

from __future__ import annotations

import dataclasses

import torch

from zensync import kernels
from zensync.sync.base import (
    ItemView,
    SyncContext,
    SyncScheme,
    accumulation_dtype,
    index_dtype,
    register_scheme,
)
from zensync.sync.observe import local_skew
from zensync.transport.packing import ByteReader, pack

__all__ = ["SparCMLScheme"]

_COO, _DENSE = 0, 1


@dataclasses.dataclass(slots=True)
class _State:
    """A partial sum: COO (ascending indices + value rows) or dense (all rows; indices None)."""

    indices: torch.Tensor | None
    values: torch.Tensor

    @property
    def is_dense(self) -> bool:
        return self.indices is None


def _encode(state: _State, view: ItemView) -> torch.Tensor:
    idx_dtype = index_dtype(view.num_items)
    values = state.values.to(view.x2d.dtype)
    if state.indices is None:
        header = torch.tensor([_DENSE, view.num_items], dtype=torch.int64, device=values.device)
        return pack(header, values)
    header = torch.tensor([_COO, state.indices.numel()], dtype=torch.int64, device=values.device)
    return pack(header, state.indices.to(idx_dtype), values)


def _decode(payload: torch.Tensor, view: ItemView) -> _State:
    reader = ByteReader(payload)
    kind, count = reader.take(torch.int64, 2).tolist()  # host-device sync
    acc = accumulation_dtype(view.x2d.dtype)
    if kind == _DENSE:
        values = reader.take(view.x2d.dtype, count * view.item_numel)
        return _State(None, values.view(count, view.item_numel).to(acc))
    indices = reader.take(index_dtype(view.num_items), count).to(torch.int64)
    values = reader.take(view.x2d.dtype, count * view.item_numel)
    return _State(indices, values.view(count, view.item_numel).to(acc))


def _rounded(state: _State, view: ItemView) -> _State:
    """The state as its partner will see it (values rounded to the wire dtype)."""
    acc = accumulation_dtype(view.x2d.dtype)
    return _State(state.indices, state.values.to(view.x2d.dtype).to(acc))


def _to_dense(state: _State, view: ItemView) -> torch.Tensor:
    if state.indices is None:
        return state.values
    dense = torch.zeros((view.num_items, view.item_numel), dtype=state.values.dtype, device=state.values.device)
    dense[state.indices] = state.values
    return dense


def _merge(lower: _State, upper: _State, view: ItemView, dense_ratio: float) -> _State:
    """lower + upper, lower group's values first; switches to dense when COO would be larger."""
    if lower.is_dense or upper.is_dense:
        merged = _to_dense(lower, view).clone()
        if upper.indices is None:
            merged += upper.values
        else:
            merged.index_add_(0, upper.indices, upper.values)
        return _State(None, merged)
    assert lower.indices is not None and upper.indices is not None
    unique, sums, _ = kernels.aggregate(
        torch.cat([lower.indices, upper.indices]), torch.cat([lower.values, upper.values])
    )
    index_bytes = index_dtype(view.num_items).itemsize
    if unique.numel() * (index_bytes + view.item_bytes) > dense_ratio * view.num_items * view.item_bytes:
        return _State(None, _to_dense(_State(unique, sums), view))
    return _State(unique, sums)


@register_scheme
class SparCMLScheme(SyncScheme):
    """Recursive doubling with incremental aggregation and a dense switch."""

    name = "sparcml"

    async def run(self, ctx: SyncContext) -> torch.Tensor:
        view, transport, stats = ctx.view, ctx.transport, ctx.stats
        n, rank = transport.world_size, transport.rank
        device = view.x2d.device
        items = kernels.nonzero_items(view.x2d)
        stats.local_nnz = items.numel()
        stats.skew = local_skew(items, view.num_items, n)
        acc = accumulation_dtype(view.x2d.dtype)
        state = _State(items, view.x2d.index_select(0, items).to(acc))
        ratio = ctx.options.sparcml_dense_ratio
        power = 1 << (n.bit_length() - 1)
        with ctx.phase("exchange"):
            # Step 1: fold ranks >= power into their partner rank - power.
            if rank >= power:
                await transport.send_recv_async(_encode(state, view), rank - power, None, device=device)
            elif rank + power < n:
                received = await transport.send_recv_async(None, None, rank + power, device=device)
                assert received is not None
                state = _merge(_rounded(state, view), _decode(received, view), view, ratio)
            # Step 2: recursive doubling among the first `power` ranks.
            distance = 1
            while rank < power and distance < power:
                partner = rank ^ distance
                received = await transport.send_recv_async(_encode(state, view), partner, partner, device=device)
                assert received is not None
                mine, theirs = _rounded(state, view), _decode(received, view)
                state = _merge(mine, theirs, view, ratio) if rank < partner else _merge(theirs, mine, view, ratio)
                distance *= 2
            # Step 3: hand the result to the folded ranks.
            if rank >= power:
                received = await transport.send_recv_async(None, None, rank - power, device=device)
                assert received is not None
                state = _decode(received, view)
            elif rank + power < n:
                await transport.send_recv_async(_encode(state, view), rank + power, None, device=device)
        final = _rounded(state, view)
        if not final.is_dense:
            stats.global_nnz = final.values.shape[0]
        return _to_dense(final, view).to(view.x2d.dtype)

"""Records of (index, value row) pairs as bytes: the COO format every sparse scheme moves.

A record is the index (int32 or int64) followed by the item's value bytes; k records are one
(k, index_bytes + item_bytes) uint8 block, so a block can be cut between destinations by rows.
"""

from __future__ import annotations

import torch

from zensync.transport.packing import as_bytes, from_bytes

__all__ = ["decode_records", "encode_records"]


def encode_records(indices: torch.Tensor, values: torch.Tensor, index_dtype: torch.dtype) -> torch.Tensor:
    """(k, record_bytes) uint8 block of ``indices`` (k,) and ``values`` (k, item_numel)."""
    k = indices.numel()
    index_bytes = as_bytes(indices.to(index_dtype)).view(k, -1) if k else _empty(index_dtype, values)
    value_bytes = as_bytes(values).view(k, -1) if k else _empty(values.dtype, values, values.shape[1])
    return torch.cat([index_bytes, value_bytes], dim=1)


def _empty(dtype: torch.dtype, like: torch.Tensor, count: int = 1) -> torch.Tensor:
    width = dtype.itemsize * count
    return torch.empty((0, width), dtype=torch.uint8, device=like.device)


def decode_records(
    block: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype, item_numel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``encode_records`` on a flat uint8 buffer: (int64 indices (k,), values (k, item_numel))."""
    index_width = index_dtype.itemsize
    value_width = value_dtype.itemsize * item_numel
    record = index_width + value_width
    if block.numel() % record:
        raise ValueError(f"COO block of {block.numel()} bytes is not a whole number of {record}-byte records")
    rows = block.view(-1, record)
    indices = from_bytes(rows[:, :index_width].contiguous().view(-1), index_dtype).to(torch.int64)
    values = from_bytes(rows[:, index_width:].contiguous().view(-1), value_dtype).view(-1, item_numel)
    return indices, values

"""COO on the wire and at the API: records of (index, value row) pairs as bytes, and torch's sparse
COO tensors as items.

A record is the index (int32 or int64) followed by the item's value bytes; k records are one
(k, index_bytes + item_bytes) uint8 block, so a block can be cut between destinations by rows.
``CooItems`` turns a sparse COO tensor into the (item ids, value rows) a scheme works from, and a
scheme's (num_items, item_numel) COO sum back into the tensor's shape.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from zensync.sync.base import ItemView
from zensync.transport.packing import as_bytes, from_bytes
from zensync.types import Granularity

__all__ = ["CooItems", "decode_records", "encode_records"]


@dataclasses.dataclass(frozen=True, slots=True)
class CooItems:
    """A sparse COO tensor as a sync scheme's items: the entries of its sparse dims, each holding
    its dense dims' values (rows of an embedding gradient, whose sparse_dim is 1)."""

    shape: torch.Size
    sparse_dim: int
    items: torch.Tensor
    """Ascending int64 linear indices over the sparse dims (coalesced order)."""
    values: torch.Tensor
    """(nnz, item_numel) values."""
    view: ItemView
    """A stride-0 zero view of (num_items, item_numel): shape, dtype and device, no data."""

    @classmethod
    def of(cls, tensor: torch.Tensor) -> CooItems:
        """``tensor`` coalesced (duplicate entries summed, indices sorted) and seen as items."""
        coo = tensor.detach().coalesce()
        sparse_dim = coo.sparse_dim()
        sparse_shape, dense_shape = coo.shape[:sparse_dim], coo.shape[sparse_dim:]
        num_items, item_numel = math.prod(sparse_shape), math.prod(dense_shape)
        indices = coo.indices()
        items = indices[0] if sparse_dim == 1 else _linear(indices, sparse_shape)
        values = coo.values().reshape(indices.shape[1], item_numel)
        x2d = values.new_zeros(()).expand(num_items, item_numel)
        granularity: Granularity = "row" if sparse_dim == 1 and coo.dim() >= 2 else "element"
        return cls(coo.shape, sparse_dim, items, values, ItemView(x2d=x2d, granularity=granularity))

    def restore(self, summed: torch.Tensor, divisor: int) -> torch.Tensor:
        """The (num_items, item_numel) COO sum in the input's shape and sparse dims, coalesced."""
        items, values = summed.indices()[0], summed.values()
        if divisor != 1:
            values = values / divisor
        if self.sparse_dim == 1:
            indices = items.unsqueeze(0)
        else:
            indices = torch.stack(torch.unravel_index(items, self.shape[: self.sparse_dim]))
        values = values.reshape((values.shape[0], *self.shape[self.sparse_dim :]))
        if values.numel() == 0:  # an empty result may come with stride-0 views: give it ordinary strides
            values = torch.empty(values.shape, dtype=values.dtype, device=values.device)
        return torch.sparse_coo_tensor(indices, values, self.shape, is_coalesced=True, check_invariants=False)


def _linear(indices: torch.Tensor, sparse_shape: torch.Size) -> torch.Tensor:
    """Row-major linear index of each column of ``indices`` (ascending for coalesced indices)."""
    strides = torch.tensor(
        [math.prod(sparse_shape[d + 1 :]) for d in range(len(sparse_shape))], dtype=torch.int64, device=indices.device
    )
    return (indices * strides.unsqueeze(1)).sum(0)


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

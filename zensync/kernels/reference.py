"""Plain-torch reference kernels: the definitions every faster implementation is tested against.

Each op works on any device torch supports, and is what ``zensync.kernels`` runs where no faster
implementation applies. Items are rows of a 2-D view ``x2d`` of shape (num_items, item_numel): an
element (item_numel = 1) or an embedding row. An item is non-zero when any of its elements is
non-zero; NaN counts as non-zero and -0.0 as zero, exactly as ``x != 0``.
"""

from __future__ import annotations

import torch

from zensync.types import Partition

__all__ = [
    "FEISTEL_MUL1",
    "FEISTEL_MUL2",
    "aggregate",
    "bitmap_decode",
    "bitmap_encode",
    "bucket_nonzero",
    "nonzero_items",
    "permute",
    "unpermute",
]

MASK32 = 0xFFFFFFFF
FEISTEL_MUL1 = 0x2C1B3C6D
"""Round-function multipliers: below 2^30, so a 32-bit operand times either fits in int64."""
FEISTEL_MUL2 = 0x297A2D39


def _round(half: torch.Tensor, key: int, mask: int) -> torch.Tensor:
    x = (half ^ key) & MASK32
    x = (x * FEISTEL_MUL1) & MASK32
    x = x ^ (x >> 12)
    x = (x * FEISTEL_MUL2) & MASK32
    x = x ^ (x >> 15)
    return x & mask


def _feistel(v: torch.Tensor, part: Partition, inverse: bool) -> torch.Tensor:
    h = part.half_bits
    mask = (1 << h) - 1
    left, right = v >> h, v & mask
    if inverse:
        for key in reversed(part.keys):
            left, right = right ^ _round(left, key, mask), left
    else:
        for key in part.keys:
            left, right = right, left ^ _round(right, key, mask)
    return (left << h) | right


def _walk(items: torch.Tensor, part: Partition, inverse: bool) -> torch.Tensor:
    """Apply the Feistel permutation until the value lands in [0, num_items) (cycle walking)."""
    v = _feistel(items.to(torch.int64), part, inverse)
    pending = (v >= part.num_items).nonzero().squeeze(1)
    while pending.numel():
        stepped = _feistel(v[pending], part, inverse)
        v[pending] = stepped
        pending = pending[stepped >= part.num_items]
    return v


def permute(items: torch.Tensor, part: Partition) -> torch.Tensor:
    """perm(i): the perm-space position of each item (int64). Example: identity when not hashed."""
    if not part.hashed:
        return items.to(torch.int64)
    return _walk(items, part, inverse=False)


def unpermute(positions: torch.Tensor, part: Partition) -> torch.Tensor:
    """perm^-1(q): the item at each perm-space position (int64); unpermute(permute(i)) == i."""
    if not part.hashed:
        return positions.to(torch.int64)
    return _walk(positions, part, inverse=True)


def nonzero_items(x2d: torch.Tensor) -> torch.Tensor:
    """Ascending int64 indices of the non-zero items of ``x2d``.

    Example: rows [[0, 0], [0, 1], [nan, 0]] -> tensor([1, 2]).
    """
    return (x2d != 0).any(dim=1).nonzero().squeeze(1)


def bucket_nonzero(x2d: torch.Tensor, part: Partition) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-zero detection + hashing + bucketing by owner (Zen's push preparation).

    Returns:
        items: int64 non-zero item indices grouped by owner (owner 0 first), ascending within an owner.
        positions: int64 position of each item inside its owner's range (perm(i) - owner * range_len).
        counts: int64 tensor of num_owners counts (items per owner).

    Example: 4 items, 2 owners, identity partition of range_len 32: rows 1 and 3 non-zero ->
    items [1, 3], positions [1, 3], counts [2, 0].
    """
    items = nonzero_items(x2d)
    perm = permute(items, part)
    owners = perm // part.range_len
    order = torch.argsort(owners, stable=True)
    items, perm, owners = items[order], perm[order], owners[order]
    positions = perm - owners * part.range_len
    counts = torch.bincount(owners, minlength=part.num_owners)
    return items, positions, counts


def aggregate(positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum the value rows of equal positions (owner-side aggregation).

    Args:
        positions: int64 (k,) positions, duplicates allowed, any order.
        values: (k, item_numel) values; summed in their own dtype, in input order per position.

    Returns:
        unique_positions: ascending int64 (u,).
        sums: (u, item_numel) sums.
        multiplicity: int64 (u,) number of contributions per position.

    Example: positions [5, 2, 5], values [[1], [2], [3]] -> [2, 5], [[2], [4]], [1, 2].
    """
    unique, inverse, multiplicity = torch.unique(positions, sorted=True, return_inverse=True, return_counts=True)
    sums = torch.zeros((unique.numel(), values.shape[1]), dtype=values.dtype, device=values.device)
    sums.index_add_(0, inverse, values)
    return unique, sums, multiplicity


def bitmap_encode(positions: torch.Tensor, length: int) -> torch.Tensor:
    """One bit per position of a range of ``length``: int32 words, bit p % 32 of word p // 32.

    Example: positions [0, 33], length 40 -> words [1, 2] (as int32).
    """
    num_words = (length + 31) // 32
    bits = torch.zeros(num_words * 32, dtype=torch.bool, device=positions.device)
    bits[positions] = True
    weights = torch.ones(32, dtype=torch.int64, device=positions.device) << torch.arange(32, device=positions.device)
    words = (bits.view(num_words, 32).to(torch.int64) * weights).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def bitmap_decode(words: torch.Tensor, length: int) -> torch.Tensor:
    """Ascending int64 positions of the set bits (inverse of ``bitmap_encode``)."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int64)
    bits = ((words.to(torch.int64).unsqueeze(1) >> shifts) & 1).view(-1)[:length]
    return bits.nonzero().squeeze(1)

"""Statistics a scheme records about the data it moved (reference/zen.md 1.1 and Def. 8)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zensync.types import SyncStats

__all__ = ["imbalance", "local_skew", "record_densities", "record_overlap"]


def local_skew(items: torch.Tensor, num_items: int, num_ranges: int) -> float:
    """max density over ``num_ranges`` even ranges of the item space / overall density (Zen C3).

    Example: 4 ranges of 100 items with non-zeros only in the first -> 4.0.
    """
    if items.numel() == 0 or num_items == 0:
        return 0.0
    ranges = torch.div(items.to(torch.int64) * num_ranges, num_items, rounding_mode="floor")
    counts = torch.bincount(ranges, minlength=num_ranges).to(torch.float64)
    sizes = torch.tensor(
        [(num_items * (j + 1)) // num_ranges - (num_items * j) // num_ranges for j in range(num_ranges)],
        dtype=torch.float64,
        device=counts.device,
    )
    density = counts / sizes.clamp(min=1)
    return float(density.max() / (items.numel() / num_items))  # host-device sync


def imbalance(received: Sequence[int]) -> float | None:
    """max / mean of per-rank received volumes (1.0 is perfect balance; None if nothing moved)."""
    total = sum(received)
    if not received or total == 0:
        return None
    return max(received) * len(received) / total


def record_densities(stats: SyncStats, nnz_per_rank: Sequence[int], global_nnz: int | None) -> None:
    """Fill mean density, union size and densification gamma_n from per-rank and union counts."""
    num_items = stats.num_items
    mean_nnz = sum(nnz_per_rank) / len(nnz_per_rank)
    stats.mean_density = mean_nnz / num_items if num_items else 0.0
    stats.global_nnz = global_nnz
    if global_nnz is not None and mean_nnz > 0:
        stats.densification = global_nnz / mean_nnz


def record_overlap(stats: SyncStats, nnz_per_rank: Sequence[int], shared_pairs: int) -> None:
    """Pooled pairwise overlap: sum_{a<b} |I_a & I_b| / sum_{a<b} min(|I_a|, |I_b|) (Zen C1).

    ``shared_pairs`` is sum over indices of C(c, 2), c = number of ranks holding the index, which
    equals sum over rank pairs of their intersection sizes.
    """
    sizes = sorted(nnz_per_rank)
    n = len(sizes)
    # sum over pairs of the smaller size: the i-th smallest is the min of (n - 1 - i) pairs.
    min_sum = sum(size * (n - 1 - i) for i, size in enumerate(sizes))
    stats.overlap = shared_pairs / min_sum if min_sum else None

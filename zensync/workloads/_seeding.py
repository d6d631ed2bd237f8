"""Deriving independent generator seeds from integers, shared by the workloads."""

from __future__ import annotations

from zensync.kernels.hashing import MASK64, splitmix64

__all__ = ["mix_seed"]


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 finaliser over a running state).

    Example: ``torch.Generator().manual_seed(mix_seed(seed, rank, step))``.
    """
    state = 0
    for part in parts:
        _, state = splitmix64((state + (part & MASK64)) & MASK64)
    return state >> 1

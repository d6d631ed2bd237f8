"""Deriving independent generator seeds from integers, shared by the workloads."""

from __future__ import annotations

__all__ = ["mix_seed"]

_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 finaliser over a running state).

    Example: ``torch.Generator().manual_seed(mix_seed(seed, rank, step))``.
    """
    state = 0
    for part in parts:
        state = (state + (part & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1

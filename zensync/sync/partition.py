"""Building Zen's first-level hash h0 (a ``Partition``) from a seed all ranks agreed on."""

from __future__ import annotations

from zensync.kernels.hashing import MASK64, Partition, splitmix64

__all__ = ["NUM_FEISTEL_ROUNDS", "make_partition"]

NUM_FEISTEL_ROUNDS = 4
"""Rounds of the Feistel permutation: 3 suffice for a pseudorandom permutation; 4 for margin."""
_BITMAP_WORD_BITS = 32


def make_partition(num_items: int, num_owners: int, *, seed: int, hashed: bool = True) -> Partition:
    """h0 over ``num_items`` items for ``num_owners`` owners, keyed by ``seed``.

    Owner ranges are ceil(num_items / num_owners) rounded up to a multiple of 32 positions, so bitmaps
    of all owners tile ceil(num_items / 32) words exactly. With ``hashed=False`` the permutation is
    the identity (contiguous even ranges: sparse_ps).

    Example::

        part = make_partition(1000, 4, seed=7)
        part.range_len  # 256
    """
    if num_items < 0 or num_owners < 1:
        raise ValueError(f"make_partition: num_items={num_items} must be >= 0 and num_owners={num_owners} >= 1")
    if num_items >= 1 << 62:
        raise ValueError(f"make_partition: num_items={num_items} exceeds the supported 2**62")
    per_owner = -(-num_items // num_owners)
    range_len = max(_BITMAP_WORD_BITS, -(-per_owner // _BITMAP_WORD_BITS) * _BITMAP_WORD_BITS)
    bits = max(1, (num_items - 1).bit_length()) if num_items > 1 else 1
    half_bits = max(1, -(-bits // 2))
    keys = []
    state = seed & MASK64
    for _ in range(NUM_FEISTEL_ROUNDS):
        state, value = splitmix64(state)
        keys.append(value & 0xFFFFFFFF)
    return Partition(
        num_items=num_items,
        num_owners=num_owners,
        range_len=range_len,
        half_bits=half_bits,
        keys=tuple(keys),
        hashed=hashed,
    )

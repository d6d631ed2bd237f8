"""Zen's first-level hash h0 as the kernels implement it: the ``Partition`` definition and splitmix64.

The kernels (reference, numba, CUDA) compute owners, bitmap positions and inverses from these
fields; ``zensync.sync.partition.make_partition`` builds a Partition from an agreed seed.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MASK64", "Partition", "splitmix64"]


@dataclasses.dataclass(frozen=True, slots=True)
class Partition:
    """Zen's first-level hash h0 as a bijection followed by contiguous owner ranges.

    h0(i) = owner of item i = perm(i) // range_len, where perm is a keyed permutation of
    [0, num_items) (a 4-round Feistel network over 2 * half_bits bits with cycle walking; identity
    when ``hashed`` is False, which gives sparse_ps's contiguous even ranges). Owner j's potential
    index set I_j is the perm-space range [j * range_len, (j+1) * range_len) clipped to num_items, so
    an item's bitmap position inside its owner's range is perm(i) - j * range_len: owner, bitmap
    position and decode (perm^-1) are pure arithmetic with no |G|-sized table (reference/zen.md 1.6).

    range_len is a multiple of 32, so the owners' bitmaps together are exactly ceil(num_items / 32)
    32-bit words.
    """

    num_items: int
    num_owners: int
    range_len: int
    half_bits: int
    keys: tuple[int, ...]
    hashed: bool

    def owner_range(self, owner: int) -> tuple[int, int]:
        """(first perm-space position, length) of ``owner``'s range; length may be 0."""
        base = owner * self.range_len
        return base, max(0, min(self.range_len, self.num_items - base))


MASK64 = (1 << 64) - 1


def splitmix64(state: int) -> tuple[int, int]:
    """One splitmix64 step: (next state, output); the mixer behind hash keys and derived seeds."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)

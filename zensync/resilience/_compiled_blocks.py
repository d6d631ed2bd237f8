"""The checkpoint store's block loops, compiled with numba: hash, copy-and-hash, gather and scatter
of blocks of bytes (``store.py``'s per-block checksums, written and checked in one pass).

A *block* is a span of a byte buffer: a tensor's row (a row-blocked tensor) or a whole tensor. Every
loop takes the buffer twice, as ``uint64`` words and as bytes, and each block's byte ``start`` is a
multiple of 8 (the store aligns tensors to 64 bytes and row-blocks only rows of a multiple of 8
bytes), so the loops read words and only a block's last ``length % 8`` bytes one by one.

The hash: four lanes, each over every fourth word by the step ``h -> rotl((h ^ w) * P, 31)`` (a
change of one word changes its lane: the step is a bijection of ``h`` for a fixed ``w`` and of ``w``
for a fixed ``h``; the rotation carries high bits down, which a multiplication alone never does),
then the tail word and the length, the lanes folded by the same step and mixed (MurmurHash3's
finalizer). Not cryptographic: it detects corruption (a flipped bit, a truncated or zeroed page, a
block from another version), as CRC-32 did, with a 2**-64 chance of missing a random change.

Examples (bytes in, one hash per block out)::

    data = np.arange(32, dtype=np.uint8)
    starts = np.array([0, 16])
    lengths = np.array([16, 16])
    out = np.empty(2, np.uint64)
    hash_blocks(data.view(np.uint64), data, starts, lengths, out)
    out[0] != out[1]  # different bytes, different hashes
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["copy_blocks", "copy_hash_blocks", "hash_blocks"]

_P = np.uint64(0x9E3779B185EBCA87)  # xxHash64's first prime
_R = np.uint64(31)
_L = np.uint64(33)
_SEEDS = (np.uint64(0xCBF29CE484222325), np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F),
          np.uint64(0x165667B19E3779F9))  # fmt: skip
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


@numba.njit(nogil=True, cache=True, inline="always")
def _step(h: np.uint64, w: np.uint64) -> np.uint64:
    x = (h ^ w) * _P
    return (x << _R) | (x >> _L)  # the rotation carries a change of a high bit down to the low ones


@numba.njit(nogil=True, cache=True, inline="always")
def _tail(data8: np.ndarray, at: int, count: int) -> np.uint64:
    """The last ``count`` (< 8) bytes of a block as one little-endian word."""
    w = np.uint64(0)
    for b in range(count):
        w |= np.uint64(data8[at + b]) << np.uint64(8 * b)
    return w


@numba.njit(nogil=True, cache=True, inline="always")
def _finish(h0: np.uint64, h1: np.uint64, h2: np.uint64, h3: np.uint64, tail: np.uint64, length: int) -> np.uint64:
    h = _step(_step(_step(_step(_step(h0, h1), h2), h3), tail), np.uint64(length))
    h ^= h >> _S33
    h *= _M1
    h ^= h >> _S33
    h *= _M2
    h ^= h >> _S33
    return h


@numba.njit(nogil=True, cache=True)
def hash_blocks(
    data64: np.ndarray, data8: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray
) -> None:
    """``out[i]`` = the hash of bytes ``[starts[i], starts[i] + lengths[i])`` of the buffer."""
    for i in range(starts.shape[0]):
        first, length = starts[i] >> 3, lengths[i]
        words = length >> 3
        h0, h1, h2, h3 = _SEEDS
        j = 0
        while j + 4 <= words:
            h0 = _step(h0, data64[first + j])
            h1 = _step(h1, data64[first + j + 1])
            h2 = _step(h2, data64[first + j + 2])
            h3 = _step(h3, data64[first + j + 3])
            j += 4
        while j < words:
            h0 = _step(h0, data64[first + j])
            j += 1
        out[i] = _finish(h0, h1, h2, h3, _tail(data8, starts[i] + 8 * words, length & 7), length)


@numba.njit(nogil=True, cache=True)
def copy_hash_blocks(src64: np.ndarray, src8: np.ndarray, src_starts: np.ndarray, dst64: np.ndarray,
                     dst8: np.ndarray, dst_starts: np.ndarray, lengths: np.ndarray,
                     out: np.ndarray) -> None:  # fmt: skip
    """Copy block i from ``src_starts[i]`` to ``dst_starts[i]`` (``lengths[i]`` bytes) and hash it into
    ``out[i]``, in one pass (the same hash as ``hash_blocks``)."""
    for i in range(src_starts.shape[0]):
        s, d, length = src_starts[i] >> 3, dst_starts[i] >> 3, lengths[i]
        words = length >> 3
        h0, h1, h2, h3 = _SEEDS
        j = 0
        while j + 4 <= words:
            w0, w1, w2, w3 = src64[s + j], src64[s + j + 1], src64[s + j + 2], src64[s + j + 3]
            dst64[d + j], dst64[d + j + 1], dst64[d + j + 2], dst64[d + j + 3] = w0, w1, w2, w3
            h0, h1, h2, h3 = _step(h0, w0), _step(h1, w1), _step(h2, w2), _step(h3, w3)
            j += 4
        while j < words:
            w0 = src64[s + j]
            dst64[d + j] = w0
            h0 = _step(h0, w0)
            j += 1
        rest = length & 7
        for b in range(rest):
            dst8[dst_starts[i] + 8 * words + b] = src8[src_starts[i] + 8 * words + b]
        out[i] = _finish(h0, h1, h2, h3, _tail(src8, src_starts[i] + 8 * words, rest), length)


@numba.njit(nogil=True, cache=True)
def copy_blocks(src64: np.ndarray, src8: np.ndarray, src_starts: np.ndarray, dst64: np.ndarray, dst8: np.ndarray,
                dst_starts: np.ndarray, lengths: np.ndarray) -> None:  # fmt: skip
    """Copy block i from ``src_starts[i]`` to ``dst_starts[i]`` (``lengths[i]`` bytes)."""
    for i in range(src_starts.shape[0]):
        s, d, length = src_starts[i] >> 3, dst_starts[i] >> 3, lengths[i]
        words = length >> 3
        for j in range(words):
            dst64[d + j] = src64[s + j]
        for b in range(length & 7):
            dst8[dst_starts[i] + 8 * words + b] = src8[src_starts[i] + 8 * words + b]

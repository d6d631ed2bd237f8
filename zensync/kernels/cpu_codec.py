"""numba CPU kernels for decompression and low-bit codes: ``scatter_add``, ``pack_bits``, ``unpack_bits``.

Same signatures and bit-identical results as ``reference`` (the tests compare them with
``torch.equal``). ``scatter_add`` accumulates in input order on one thread, as ``index_add_`` does,
so sums of duplicates round the same way; it is a pass of k random read-modify-writes, memory-bound,
and threads would race on shared positions. Packing and unpacking are independent per output byte
or code and run in parallel over fixed chunks (``cpu._kernel``), so the result never depends on the
thread count.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from zensync.kernels import reference
from zensync.kernels.cpu import _chunk_size, _jit, _kernel, _use_parallel

__all__ = ["pack_bits", "scatter_add", "unpack_bits"]

_PARALLEL_MIN_CODES = 1 << 18
"""Fewest codes for the parallel pack/unpack: a byte-per-iteration loop is a few ns per code, so
smaller inputs finish before a thread launch pays off."""
_MIN_CHUNK_BYTES = 1 << 14
"""Fewest packed bytes per parallel chunk."""
_SUM_DTYPES = (torch.float32, torch.float64)
_TABLE_DTYPES = (torch.float32, torch.float64, torch.uint8)
"""dtypes of an ``unpack_bits`` levels table that numba handles (float16/bfloat16 run the reference)."""
"""dtypes numba adds natively; others (float16, bfloat16, integers) run the reference."""


@_jit
def _accumulate(indices: np.ndarray, values: np.ndarray, out: np.ndarray) -> int:
    """out[indices[t]] += values[t] in input order; returns the first out-of-range t, or -1."""
    numel = out.shape[0]
    for t in range(indices.shape[0]):
        i = indices[t]
        if i < 0 or i >= numel:
            return t
        out[i] += values[t]
    return -1


def scatter_add(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Zeros of ``numel`` plus each value at its index (duplicates summed); see ``reference.scatter_add``.

    Args:
        indices: 1-D int32 or int64 positions in [0, numel).
        values: 1-D values, as many as indices.
        numel: Length of the dense output.

    Returns:
        A new 1-D tensor of ``values.dtype``.

    Example::

        scatter_add(torch.tensor([2, 0, 2]), torch.tensor([1.0, 2.0, 3.0]), 4)  # tensor([2., 0., 4., 0.])
    """
    reference._check_pairs("scatter_add", indices, values)
    if values.dtype not in _SUM_DTYPES:
        return reference.scatter_add(indices, values, numel)
    # np.zeros is calloc: fresh zero pages cost nothing until written, and only the k written
    # positions are, so a sparse decode no longer pays a memset of the whole dense tensor.
    out = np.zeros(numel, dtype=np.float32 if values.dtype == torch.float32 else np.float64)
    bad = _accumulate(indices.detach().contiguous().numpy(), values.detach().contiguous().numpy(), out)
    if bad >= 0:
        raise ValueError(f"scatter_add: indices must lie in [0, {numel}), got {int(indices[bad])} at position {bad}")
    return torch.from_numpy(out)


@_kernel
def _pack(codes: np.ndarray, bits: int, chunk: int, out: np.ndarray) -> None:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    num_codes = codes.shape[0]
    for c in numba.prange(-(-out.shape[0] // chunk)):
        for j in range(c * chunk, min((c + 1) * chunk, out.shape[0])):
            acc = 0
            first = j * per_byte
            for s in range(min(per_byte, num_codes - first)):
                acc |= (np.int64(codes[first + s]) & mask) << (s * bits)
            out[j] = acc


@_kernel
def _pack_words(words: np.ndarray, bits: int, chunk: int, out: np.ndarray) -> None:
    """1-, 2- or 4-bit codes, 8 at a time from a little-endian 64-bit word, into ``bits`` bytes.

    1 bit: the low bit of each byte gathered by one multiply (bit i of byte i lands in bit 56 + i;
    the partial products never overlap, so nothing carries). 2 and 4 bits: shift-or folds that
    bring the codes of 4 (2 bits) or 2 (4 bits) consecutive bytes into one byte, read at byte
    offsets 0 and 4, or 0, 2, 4 and 6.
    """
    for c in numba.prange(-(-words.shape[0] // chunk)):
        for j in range(c * chunk, min((c + 1) * chunk, words.shape[0])):
            w = words[j]
            if bits == 1:
                out[j] = ((w & np.uint64(0x0101010101010101)) * np.uint64(0x0102040810204080)) >> np.uint64(56)
            elif bits == 2:
                w &= np.uint64(0x0303030303030303)
                w |= w >> np.uint64(6)
                w |= w >> np.uint64(12)
                out[2 * j] = w & np.uint64(0xFF)
                out[2 * j + 1] = (w >> np.uint64(32)) & np.uint64(0xFF)
            else:
                w &= np.uint64(0x0F0F0F0F0F0F0F0F)
                w |= w >> np.uint64(4)
                for b in range(4):
                    out[4 * j + b] = (w >> np.uint64(16 * b)) & np.uint64(0xFF)


@_jit
def _unpack_run(packed: np.ndarray, byte_table: np.ndarray, out: np.ndarray) -> None:
    """out[j * per_byte + s] = byte_table[packed[j], s]: a loop from 0 over slices, which LLVM
    vectorizes (indexing from a chunk offset inside the chunk loop ran 5x slower)."""
    per_byte = byte_table.shape[1]
    for j in range(packed.shape[0]):
        b = packed[j]
        first = j * per_byte
        for s in range(per_byte):
            out[first + s] = byte_table[b, s]


@_kernel
def _unpack(packed: np.ndarray, chunk: int, byte_table: np.ndarray, out: np.ndarray) -> None:
    """``_unpack_run`` over fixed chunks of whole bytes (every code of each byte is wanted)."""
    per_byte = byte_table.shape[1]
    for c in numba.prange(-(-packed.shape[0] // chunk)):
        lo = c * chunk
        hi = min(lo + chunk, packed.shape[0])
        _unpack_run(packed[lo:hi], byte_table, out[lo * per_byte : hi * per_byte])


def _byte_table(levels: np.ndarray, bits: int) -> np.ndarray:
    """(256, 8 // bits): row b holds the levels of the codes packed in byte value b."""
    per_byte = 8 // bits
    codes = (np.arange(256)[:, None] >> (np.arange(per_byte) * bits)) & ((1 << bits) - 1)
    return np.ascontiguousarray(levels[codes])


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Low ``bits`` bits of each uint8/bool code, packed LSB first; see ``reference.pack_bits``.

    Example::

        pack_bits(torch.tensor([3, 1], dtype=torch.uint8), 2)  # tensor([7], dtype=torch.uint8)
    """
    reference._check_pack(codes, bits)
    if bits == 8:  # one code per byte: packing is a copy
        return codes.detach().to(torch.uint8, copy=True).contiguous()
    src = codes.detach().contiguous().view(torch.uint8).numpy()
    num_bytes = -(-src.shape[0] * bits // 8)
    out = np.empty(num_bytes, dtype=np.uint8)
    parallel = _use_parallel(src.shape[0], _PARALLEL_MIN_CODES)
    chunk = _chunk_size(num_bytes, _MIN_CHUNK_BYTES, parallel)
    if bits < 8 and src.ctypes.data % 8 == 0:  # whole groups of 8 codes as 64-bit words, then the tail
        full = src.shape[0] // 8
        _pack_words.pick(parallel)(src[: full * 8].view(np.uint64), bits, chunk, out[: full * bits])
        _pack.serial(src[full * 8 :], bits, 1, out[full * bits :])
    else:
        _pack.pick(parallel)(src, bits, chunk, out)
    return torch.from_numpy(out)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``numel`` codes of ``bits`` bits as uint8, or ``levels[code]``; see ``reference.unpack_bits``.

    Example::

        unpack_bits(torch.tensor([7], dtype=torch.uint8), 2, 2)  # tensor([3, 1], dtype=torch.uint8)
    """
    reference._check_unpack(packed, bits, numel, levels)
    if levels is not None and levels.dtype not in _TABLE_DTYPES:
        return reference.unpack_bits(packed, bits, numel, levels)
    per_byte = 8 // bits
    table = np.arange(1 << bits, dtype=np.uint8) if levels is None else levels.detach().contiguous().numpy()
    src = packed.detach().contiguous().numpy()[: -(-numel // per_byte)]
    # numpy's allocator: it advises huge pages for large arrays, so faulting in a fresh output costs
    # far less than with torch.empty (25M float32: 6 vs 42 ms here, default glibc settings).
    out = np.empty(numel, dtype=table.dtype)
    parallel = _use_parallel(numel, _PARALLEL_MIN_CODES)
    byte_table = _byte_table(table, bits)
    full = numel // per_byte  # bytes whose codes are all wanted; the last one may be partial
    _unpack.pick(parallel)(src[:full], _chunk_size(full, _MIN_CHUNK_BYTES, parallel), byte_table, out)
    if numel > full * per_byte:
        out[full * per_byte :] = byte_table[src[full], : numel - full * per_byte]
    return torch.from_numpy(out)

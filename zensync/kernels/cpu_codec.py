"""numba CPU kernels for decompression and low-bit codes: ``scatter_add``, ``pack_bits``, ``unpack_bits``,
and the sign family's fused passes (``sign_encode``, ``sign_decode_sum``, ``sign_residual``).

Same signatures and bit-identical results as ``reference`` (the tests compare them with
``torch.equal``). ``scatter_add`` accumulates in input order on one thread, as ``index_add_`` does,
so sums of duplicates round the same way; it is a pass of k random read-modify-writes, memory-bound,
and threads would race on shared positions. Packing and unpacking are independent per output byte
or code and run in parallel over fixed chunks (``cpu._kernel``), so the result never depends on the
thread count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import torch

from zensync.kernels import reference
from zensync.kernels.cpu import _chunk_size, _jit, _kernel, _reassociating_kernel, _use_parallel

__all__ = [
    "dequantize_add",
    "index_add",
    "pack_bits",
    "quantize_levels",
    "scatter_add",
    "sign_decode_sum",
    "sign_encode",
    "sign_residual",
    "unpack_bits",
]

_PARALLEL_MIN_CODES = 1 << 18
"""Fewest codes for the parallel pack/unpack: a byte-per-iteration loop is a few ns per code, so
smaller inputs finish before a thread launch pays off."""
_MIN_CHUNK_BYTES = 1 << 14
"""Fewest packed bytes per parallel chunk."""
_SUM_DTYPES = (torch.float32, torch.float64)
"""dtypes numba adds natively; others (float16, bfloat16, integers) run the reference."""
_TABLE_DTYPES = (torch.float32, torch.float64, torch.uint8)
"""dtypes of an ``unpack_bits`` levels table that numba handles (float16/bfloat16 run the reference)."""
_SIGN_CHUNK = 1 << 16
"""Elements per chunk of ``sign_encode``, whatever the thread count: its float64 partial sums are
added in chunk order, so the sums do not depend on how many threads ran."""


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


def index_add(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """In place, each value added at its index, in order; see ``reference.index_add``.

    One serial pass over the pairs (torch's CPU ``index_add_`` costs about 2 ms per 84K pairs,
    this about 0.3 ms: top-k's decode of 4 senders into an 8.4M bucket).
    """
    if out.dtype not in _SUM_DTYPES or out.device.type != "cpu":
        return reference.index_add(out, indices, values)
    reference._check_index_add(out, indices, values)  # bounds first: a bad call adds nothing
    bad = _accumulate(indices.detach().contiguous().numpy(), values.detach().contiguous().numpy(), out.detach().numpy())
    assert bad < 0, "indices were checked"
    return out


@_kernel
def _dequantize_add(out: np.ndarray, codes: np.ndarray, scales: np.ndarray, group: int, rows_per_chunk: int) -> None:
    """out[i] += codes[i] * scales[row of i], row by row (no division per element)."""
    n = out.shape[0]
    num_rows = scales.shape[0]
    for c in numba.prange(-(-num_rows // rows_per_chunk)):
        for row in range(c * rows_per_chunk, min(num_rows, (c + 1) * rows_per_chunk)):
            scale = scales[row]
            for i in range(row * group, min(n, (row + 1) * group)):
                out[i] += out.dtype.type(codes[i]) * scale


@_kernel
def _quantize_levels(
    x: np.ndarray, scales: np.ndarray, dither: np.ndarray, group: int, levels: int, rows_per_chunk: int, out: np.ndarray
) -> None:
    """out[i] = sign(x[i]) * clamp(floor(|x[i]| * scale + dither[i]), 0, levels), row by row."""
    n = x.shape[0]
    num_rows = scales.shape[0]
    top = x.dtype.type(levels)
    zero = x.dtype.type(0)
    for c in numba.prange(-(-num_rows // rows_per_chunk)):
        for row in range(c * rows_per_chunk, min(num_rows, (c + 1) * rows_per_chunk)):
            scale = scales[row]
            for i in range(row * group, min(n, (row + 1) * group)):
                v = x[i]
                level = np.floor(abs(v) * scale + dither[i])
                if not level >= zero:  # NaN (and no negative level: the dither is >= 0)
                    level = zero
                out[i] = np.int8(np.copysign(min(level, top), v))  # no branch on the sign


def quantize_levels(
    x: torch.Tensor, scales: torch.Tensor, dither: torch.Tensor, group: int, levels: int
) -> torch.Tensor:
    """QSGD's int8 signed levels in one pass over x and the dither; see ``reference.quantize_levels``.

    23 ms for 8.4M float32 elements on one thread, against 175 ms for the reference's torch passes
    (abs, product, sum, floor, clamp, sign, product, cast). Products and sums in x's dtype, as there.
    """
    reference._check_quantize(x, scales, dither, group, levels)
    if x.device.type != "cpu":
        return reference.quantize_levels(x, scales, dither, group, levels)
    out = np.empty(x.numel(), dtype=np.int8)
    parallel = _use_parallel(x.numel(), _PARALLEL_MIN_CODES)
    rows_per_chunk = _chunk_size(scales.numel(), max(1, _MIN_CHUNK_BYTES // group), parallel)
    src = x.detach().contiguous().numpy()
    _quantize_levels.pick(parallel)(
        src,
        scales.detach().contiguous().numpy(),
        dither.detach().contiguous().numpy(),
        group,
        levels,
        rows_per_chunk,
        out,
    )
    return torch.from_numpy(out)


def dequantize_add(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """In place, each code times its group's scale added into ``out``, in one pass; see
    ``reference.dequantize_add`` (bit for bit: the same product and sum in out's dtype).

    QSGD's decode of one sender: 13 ms for 8.4M elements on one thread, against 106 ms for the
    reference (a repeated scale per element, the cast, the product, the addition).
    """
    reference._check_dequantize(out, codes, scales, group)
    if out.device.type != "cpu":
        return reference.dequantize_add(out, codes, scales, group)
    parallel = _use_parallel(out.numel(), _PARALLEL_MIN_CODES)
    rows_per_chunk = _chunk_size(scales.numel(), max(1, _MIN_CHUNK_BYTES // group), parallel)
    _dequantize_add.pick(parallel)(
        out.detach().numpy(), codes.detach().numpy(), scales.detach().numpy(), group, rows_per_chunk
    )
    return out


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


# ---------------------------------------------------------------- the sign family's fused passes


@_reassociating_kernel
def _sign_sums(x: np.ndarray, chunk: int, partial: np.ndarray) -> None:
    """partial[c] = (sum of max(x, 0), sum of min(x, 0)) of chunk c, in float64.

    No branch and nothing but the two sums in the loop, reassociated, so the compiler vectorizes
    it (with numpy's packbits, the whole encode of 8.4M float32 on a worker thread: 10.1 ms
    against 22.6 for the scalar loop that also packed the bits; benchmarks/kernels_cpu.py,
    experiments/results/revision_compare/sign_kernels); a NaN gives NaN for both sums, as
    ``clamp`` does.
    """
    n = x.shape[0]
    for c in numba.prange(partial.shape[0]):
        segment = x[c * chunk : min(n, (c + 1) * chunk)]  # a loop from 0 over a slice vectorizes (5x)
        pos = 0.0
        neg = 0.0
        for i in range(segment.shape[0]):
            wide = np.float64(segment[i])
            pos += max(wide, 0.0)
            neg += min(wide, 0.0)
        partial[c, 0] = pos
        partial[c, 1] = neg


def sign_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ``x >= 0`` bits and their float64 stats; see ``reference.sign_encode``.

    The bits and the count from one comparison (numpy's packbits, vectorized: a NaN is not >= 0,
    bit 0), the sums in one vectorized pass (``_sign_sums``), added in chunk order.
    """
    reference._check_sign_input("sign_encode", x)
    if x.dtype not in _SUM_DTYPES or x.device.type != "cpu":
        return reference.sign_encode(x)
    src = x.detach().contiguous().numpy()
    n = src.shape[0]
    nonnegative = src >= 0
    out = np.packbits(nonnegative, bitorder="little")  # ceil(n / 8) bytes, the last zero-padded
    partial = np.zeros((max(1, -(-n // _SIGN_CHUNK)), 2), dtype=np.float64)
    _sign_sums.pick(_use_parallel(n, _PARALLEL_MIN_CODES))(src, _SIGN_CHUNK, partial)
    stats = np.zeros(3, dtype=np.float64)
    stats[0] = np.count_nonzero(nonnegative)
    for row in partial:  # chunk order
        stats[1:] += row
    return torch.from_numpy(out), torch.from_numpy(stats)


@_kernel
def _sign_decode_sum(packed: np.ndarray, tables: np.ndarray, chunk: int, out: np.ndarray) -> None:
    """out[8j + s] = sum over r of tables[r, packed[r, j], s], from 0 in rank order (whole bytes only).

    Eight scalar accumulators (one per bit slot), which the compiler keeps in one vector register.
    """
    full = out.shape[0] // 8
    senders = packed.shape[0]
    zero = out.dtype.type(0)
    for c in numba.prange(-(-full // chunk)):
        for j in range(c * chunk, min(full, (c + 1) * chunk)):
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
            for r in range(senders):
                row = tables[r, packed[r, j]]
                a0 += row[0]
                a1 += row[1]
                a2 += row[2]
                a3 += row[3]
                a4 += row[4]
                a5 += row[5]
                a6 += row[6]
                a7 += row[7]
            first = 8 * j
            out[first] = a0
            out[first + 1] = a1
            out[first + 2] = a2
            out[first + 3] = a3
            out[first + 4] = a4
            out[first + 5] = a5
            out[first + 6] = a6
            out[first + 7] = a7


def sign_decode_sum(packed: Sequence[torch.Tensor], levels: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Every sender's signs decoded and summed in one pass over ``out``; see ``reference.sign_decode_sum``."""
    reference._check_sign_sum(packed, levels, out)
    if out.dtype not in _SUM_DTYPES or out.device.type != "cpu" or not out.is_contiguous() or not packed:
        return reference.sign_decode_sum(packed, levels, out)
    numel = out.numel()
    table = levels.detach().contiguous().numpy()
    tables = np.ascontiguousarray(np.stack([_byte_table(pair, 1) for pair in table]))  # [senders, 256, 8]
    rows = torch.stack([p.detach() for p in packed]).numpy()
    dst = out.detach().numpy()
    full = numel // 8
    parallel = _use_parallel(numel, _PARALLEL_MIN_CODES)
    _sign_decode_sum.pick(parallel)(rows, tables, _chunk_size(full, _MIN_CHUNK_BYTES, parallel), dst)
    if numel > full * 8:  # the last, partial byte
        tail = np.zeros(numel - full * 8, dtype=dst.dtype)
        for r in range(rows.shape[0]):
            tail += tables[r, rows[r, full], : numel - full * 8]
        dst[full * 8 :] = tail
    return out


@_kernel
def _sign_residual(x: np.ndarray, levels: np.ndarray, chunk: int) -> None:
    """x[i] -= levels[1] if x[i] >= 0 else levels[0]: a select the compiler turns into a vector
    blend (8.4M float32 on a worker thread: 3.2 ms; a level loaded by index took 15.7, see
    ``_sign_sums``; a branch mispredicts at every random sign: 66 ms)."""
    low = levels[0]
    high = levels[1]
    for c in numba.prange(-(-x.shape[0] // chunk)):
        segment = x[c * chunk : min(x.shape[0], (c + 1) * chunk)]  # a loop from 0 over a slice vectorizes
        for i in range(segment.shape[0]):
            v = segment[i]
            segment[i] = v - (high if v >= 0 else low)


def sign_residual(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """In place, x minus its sign code's level, in one pass; see ``reference.sign_residual``."""
    reference._check_sign_input("sign_residual", x)
    if x.dtype not in _SUM_DTYPES or x.device.type != "cpu" or not x.is_contiguous() or levels.shape != (2,):
        return reference.sign_residual(x, levels)
    pair = levels.detach().to(x.dtype).contiguous().numpy()
    dst = x.detach().numpy()
    parallel = _use_parallel(x.numel(), _PARALLEL_MIN_CODES)
    _sign_residual.pick(parallel)(dst, pair, _chunk_size(x.numel(), _MIN_CHUNK_BYTES, parallel))
    return x

"""numba CPU top-k selection: ``topk`` and ``sampled_topk`` with the results of ``reference``.

Both return the same int64 positions, in the same ascending order, as the torch definitions. They
work on order-preserving integer keys of the raw bits (a float tensor viewed as the signed integer
of its width, so float16 and bfloat16 need no conversion): key = |bits| for a non-negative number,
-|bits| for a negative one (-0.0 gets the key of 0.0), and inf_key + 1 for every NaN whatever its
sign or payload, so NaN sits above +inf and all NaNs tie.

The exact top-k is a radix select: parallel histograms of the key's top bits over fixed chunks, then
the bucket that holds the k-th largest key, then the next bits of that bucket only, until the k-th
key is exact. Once the keys at or above the bucket are few, they are compacted (raw bits and
positions, in position order) and the select continues on them. The result is written by an ordered
compaction: with per-chunk counts of keys above the k-th and equal to it, each chunk knows where its
positions go and how many of the ties (lowest positions first) are still wanted, so the output is
ascending with no sort. ``sampled_topk`` counts the keys at or above the threshold in one parallel
pass, relaxes the threshold as DGC does, compacts the candidates and selects among them.

Like ``cpu``, every kernel is compiled parallel and serial (``cpu._kernel``); the parallel one runs
only from the main thread and for large inputs, and chunks are combined by prefix sums, so results
never depend on the thread count.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros

from zensync.kernels import reference
from zensync.kernels.cpu import _WORD_BITS, _chunk_size, _jit, _kernel, _offsets, _use_parallel

__all__ = ["sampled_topk", "sampled_topk_abs", "topk", "topk_abs"]

_PARALLEL_MIN_SELECT = 1 << 17
"""Fewest keys (input or candidates) for the parallel version of a pass."""
_MIN_CHUNK_KEYS = 1 << 14
"""Fewest keys per parallel chunk: below that the per-chunk histogram costs more than the keys."""
_DIGIT_BITS = 11
"""Key bits resolved per histogram pass: _TALLIES copies of 2^11 + 2 int64 bins (64 KiB) per chunk."""
_BLOCK = 256
"""Keys whose digits the histogram computes at once (a vectorized loop), before tallying them."""
_TALLIES = 4
"""Interleaved histogram copies per chunk (key i counts in copy i % 4): with one, runs of equal
digits (ties, narrow distributions) serialize on one counter's load-add-store."""
_SHRINK = 8
"""Compact once the keys at or above the current bucket are at most 1/_SHRINK of the keys scanned:
later passes then read those few instead of the whole input. ``sampled_topk`` with more candidates
than that runs ``topk`` (same result, fewer bytes moved)."""
_KEY_BITS = {
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float32: (torch.int32, 0x7FFF_FFFF, 0x7F80_0000),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}
"""dtype -> (integer view of the same width, mask of the magnitude bits, magnitude bits of +inf)."""
_NO_POSITIONS = np.empty(0, dtype=np.int64)
"""``positions`` argument meaning 'key i is at position i' (the whole input)."""
_Spec = tuple[int, int, bool]
"""(mask of the magnitude bits, key of +inf, signed): ``signed`` False orders by absolute value."""
_Chunking = tuple[bool, int, int]
"""(parallel, keys per chunk, number of chunks) of a pass."""


# ---------------------------------------------------------------- keys and kernels


@_jit
def _key(bits: int, absmask: int, inf_key: int, signed: bool) -> int:
    """Order-preserving int64 key of a float's bits: -|b| .. |b| (``signed``) or |b| (the order of
    the absolute values), -0.0 -> 0, every NaN -> inf_key + 1."""
    magnitude = np.int64(bits) & absmask
    key = -magnitude if signed and bits < 0 else magnitude
    return inf_key + 1 if magnitude > inf_key else key


@_jit
def _digits(block: np.ndarray, spec: _Spec, lo: int, hi: int, shift: int, digits: np.ndarray) -> None:
    """digits[i] = (key >> shift) - (lo >> shift) for keys in [lo, hi], else the discard bin (len(bins) - 1)."""
    absmask, inf_key, signed = spec
    base = lo >> shift
    discard = ((hi >> shift) - base) + 1
    for i in range(block.shape[0]):  # branch-free, so LLVM vectorizes it
        key = _key(block[i], absmask, inf_key, signed)
        digits[i] = (key >> shift) - base if lo <= key and key <= hi else discard


@_kernel
def _histogram(bits: np.ndarray, spec: _Spec, lo: int, hi: int, shift: int, chunk: int, hist: np.ndarray) -> None:
    """hist[c, (key >> shift) - (lo >> shift)] = keys of chunk c in that bin; keys outside [lo, hi] in hist[c, -1].

    Digits are computed a block at a time (vectorized), then tallied into _TALLIES copies.
    """
    for c in numba.prange(hist.shape[0]):
        tallies = np.zeros((_TALLIES, hist.shape[1]), dtype=np.int64)
        digits = np.empty(_BLOCK, dtype=np.int64)
        stop = min(bits.shape[0], (c + 1) * chunk)
        for first in range(c * chunk, stop, _BLOCK):
            size = min(_BLOCK, stop - first)
            _digits(bits[first : first + size], spec, lo, hi, shift, digits)
            for i in range(size):
                tallies[i % _TALLIES, digits[i]] += 1
        for b in range(hist.shape[1]):
            hist[c, b] = tallies[:, b].sum()


@_kernel
def _count_at_least(bits: np.ndarray, spec: _Spec, lo: int, chunk: int, counts: np.ndarray) -> None:
    """counts[c] = keys of chunk c that are >= lo."""
    absmask, inf_key, signed = spec
    for c in numba.prange(counts.shape[0]):
        block = bits[c * chunk : min(bits.shape[0], (c + 1) * chunk)]
        total = 0
        for i in range(block.shape[0]):
            total += _key(block[i], absmask, inf_key, signed) >= lo
        counts[c] = total


@_jit
def _word_at_least(bits: np.ndarray, first: int, last: int, spec: _Spec, lo: int) -> int:
    """Bit i - first of the result = key of bits[i] >= lo, for i in [first, last) (at most 64)."""
    absmask, inf_key, signed = spec
    block = bits[first:last]  # a slice indexes from 0: no wraparound checks, so LLVM vectorizes
    word = np.int64(0)
    if last - first == _WORD_BITS:
        for b in range(_WORD_BITS):
            word |= np.int64(_key(block[b], absmask, inf_key, signed) >= lo) << b
    else:
        for b in range(last - first):
            word |= np.int64(_key(block[b], absmask, inf_key, signed) >= lo) << b
    return word


@_kernel
def _compact(
    bits: np.ndarray,
    positions: np.ndarray,
    spec: _Spec,
    lo: int,
    chunk: int,
    offsets: np.ndarray,
    out_bits: np.ndarray,
    out_positions: np.ndarray,
) -> None:
    """Chunk c copies its keys >= lo (raw bits and position), in order, to [offsets[c], offsets[c + 1])."""
    identity = positions.shape[0] == 0
    for c in numba.prange(offsets.shape[0] - 1):
        dst = offsets[c]
        stop = min(bits.shape[0], (c + 1) * chunk)
        for first in range(c * chunk, stop, _WORD_BITS):
            word = _word_at_least(bits, first, min(first + _WORD_BITS, stop), spec, lo)
            while word != 0:
                i = first + trailing_zeros(word)
                word &= word - 1
                out_bits[dst] = bits[i]
                out_positions[dst] = i if identity else positions[i]
                dst += 1


@_kernel
def _write_selected(
    bits: np.ndarray,
    positions: np.ndarray,
    spec: _Spec,
    kth: int,
    chunk: int,
    above_offsets: np.ndarray,
    tie_offsets: np.ndarray,
    out: np.ndarray,
) -> None:
    """Ordered compaction: chunk c writes its positions with key > kth and its ties still wanted.

    Ties wanted: k - (keys > kth) overall, the lowest positions first; chunk c starts after
    above_offsets[c] + min(tie_offsets[c], wanted) earlier positions.
    """
    absmask, inf_key, signed = spec
    identity = positions.shape[0] == 0
    wanted = out.shape[0] - above_offsets[-1]
    for c in numba.prange(above_offsets.shape[0] - 1):
        ties = tie_offsets[c]
        dst = above_offsets[c] + min(ties, wanted)
        stop = min(bits.shape[0], (c + 1) * chunk)
        for first in range(c * chunk, stop, _WORD_BITS):
            word = _word_at_least(bits, first, min(first + _WORD_BITS, stop), spec, kth)
            while word != 0:
                i = first + trailing_zeros(word)
                word &= word - 1
                if _key(bits[i], absmask, inf_key, signed) == kth:
                    if ties >= wanted:
                        continue
                    ties += 1
                out[dst] = i if identity else positions[i]
                dst += 1


# ---------------------------------------------------------------- host-side steps


def _bits_of(values: torch.Tensor, *, signed: bool = True) -> tuple[np.ndarray, _Spec] | None:
    """(raw bits as a numpy integer array, its key spec); None where the reference must run.

    ``signed`` False: the keys order the absolute values (the sign bit is ignored, no ``abs`` pass).
    """
    if values.dim() != 1 or values.dtype not in _KEY_BITS or values.device.type != "cpu":
        return None
    view_dtype, absmask, inf_key = _KEY_BITS[values.dtype]
    return values.detach().contiguous().view(view_dtype).numpy(), (absmask, inf_key, signed)


def _lowest(spec: _Spec) -> int:
    """The smallest key of a number under ``spec`` (-inf's, or 0 for absolute values)."""
    return -spec[1] if spec[2] else 0


def _threshold_key(threshold: float, dtype: torch.dtype) -> int:
    """Key of ``threshold`` rounded to ``dtype``, the scalar that ``magnitudes >= threshold`` compares with.

    torch converts a Python scalar to the tensor's dtype before comparing (for float16/bfloat16 via
    float32, as ``torch.tensor(threshold, dtype=dtype)`` does): 1.0000001 >= 1.0 is True in float16.
    """
    view_dtype, absmask, inf_key = _KEY_BITS[dtype]
    bits = int(torch.tensor(threshold, dtype=dtype).view(view_dtype))
    magnitude = bits & absmask
    return inf_key + 1 if magnitude > inf_key else (-magnitude if bits < 0 else magnitude)


def _chunks(num_keys: int) -> _Chunking:
    """(parallel, keys per chunk, number of chunks) for a pass over ``num_keys`` keys."""
    parallel = _use_parallel(num_keys, _PARALLEL_MIN_SELECT)
    chunk = _chunk_size(num_keys, _MIN_CHUNK_KEYS, parallel)
    return parallel, chunk, -(-num_keys // chunk)


def _narrow(hist: np.ndarray, above: np.ndarray, k: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(bucket holding the k-th largest key, per-chunk keys above it, per-chunk keys in it)."""
    total = hist.sum(axis=0)
    from_top = np.cumsum(total[::-1])
    bucket = total.shape[0] - 1 - int(np.searchsorted(from_top, k - int(above.sum())))
    return bucket, above + hist[:, bucket + 1 :].sum(axis=1), hist[:, bucket]


def _compacted(
    bits: np.ndarray, positions: np.ndarray, spec: _Spec, lo: int, counts: np.ndarray, chunking: _Chunking
) -> tuple[np.ndarray, np.ndarray]:
    """The keys >= lo (raw bits, positions) in position order; counts[c] of them in chunk c."""
    parallel, chunk, _ = chunking
    offsets = _offsets(counts)
    out_bits = np.empty(int(offsets[-1]), dtype=bits.dtype)
    out_positions = np.empty(int(offsets[-1]), dtype=np.int64)
    _compact.pick(parallel)(bits, positions, spec, lo, chunk, offsets, out_bits, out_positions)
    return out_bits, out_positions


def _select(bits: np.ndarray, positions: np.ndarray, spec: _Spec, k: int, lo: int) -> np.ndarray:
    """Ascending positions of the k largest keys (0 < k <= len(bits)); every key is >= lo.

    Step 1: histogram the top bits of the keys in [lo, hi] and narrow [lo, hi] to the bucket of the
    k-th largest key, counting per chunk the keys above it; repeat until the bucket is one key.
    Step 2: once the keys >= lo are few, compact them and continue on them (Step 1 again).
    Step 3: the ordered compaction of the keys above the k-th and the first ties.
    """
    if k == bits.shape[0]:
        return np.arange(k, dtype=np.int64) if positions.shape[0] == 0 else positions
    chunking = _chunks(bits.shape[0])
    parallel, chunk, num_chunks = chunking
    hi = spec[1] + 1
    above = np.zeros(num_chunks, dtype=np.int64)
    while True:
        # Step 1 (Python ints: hi - lo can exceed int64 for float64 keys)
        shift = max(0, (hi - lo).bit_length() - _DIGIT_BITS)
        hist = np.empty((num_chunks, (hi >> shift) - (lo >> shift) + 2), dtype=np.int64)
        _histogram.pick(parallel)(bits, spec, lo, hi, shift, chunk, hist)
        hist = hist[:, :-1]  # drop the keys outside [lo, hi]
        bucket, above, ties = _narrow(hist, above, k)
        first = (lo >> shift) + bucket
        lo, hi = max(lo, first << shift), min(hi, ((first + 1) << shift) - 1)
        if shift == 0:
            break
        # Step 2
        if int(above.sum() + ties.sum()) * _SHRINK <= bits.shape[0]:
            candidates, candidate_positions = _compacted(bits, positions, spec, lo, above + ties, chunking)
            return _select(candidates, candidate_positions, spec, k, lo)
    # Step 3
    out = np.empty(k, dtype=np.int64)
    _write_selected.pick(parallel)(bits, positions, spec, lo, chunk, _offsets(above), _offsets(ties), out)
    return out


# ---------------------------------------------------------------- public ops


def topk(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest entries (canonical); see ``reference.topk``.

    Args:
        magnitudes: 1-D CPU tensor, float16, bfloat16, float32 or float64 (others run the reference).
        k: How many entries to select; k >= numel selects everything.

    Returns:
        int64 positions, ascending: NaN above every number, -0.0 equal to 0.0, ties at the k-th
        largest value resolved to the lowest positions.

    Example::

        topk(torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0]), 3)  # tensor([1, 2, 3])
    """
    reference._check_k(k)
    view = _bits_of(magnitudes)
    if view is None:
        return reference.topk(magnitudes, k)
    return _topk_of(view, k)


def topk_abs(values: torch.Tensor, k: int) -> torch.Tensor:
    """``topk(values.abs(), k)`` with no ``abs`` pass: the keys ignore the sign bit; see ``reference.topk_abs``.

    Example::

        topk_abs(torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0]), 3)  # tensor([1, 2, 3])
    """
    reference._check_k(k)
    view = _bits_of(values, signed=False)
    if view is None:
        return reference.topk_abs(values, k)
    return _topk_of(view, k)


def _topk_of(view: tuple[np.ndarray, _Spec], k: int) -> torch.Tensor:
    bits, spec = view
    if k >= bits.shape[0]:
        return torch.arange(bits.shape[0])
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.from_numpy(_select(bits, _NO_POSITIONS, spec, k, _lowest(spec)))  # every key >= the lowest


def sampled_topk(
    magnitudes: torch.Tensor, k: int, threshold: float, *, relax_factor: float = 0.8, max_tries: int = 10
) -> torch.Tensor:
    """DGC's threshold selection with exact-k output; see ``reference.sampled_topk``.

    Step 1 counts the entries at or above the threshold (NaN always passes) in one parallel pass,
    the threshold rounded to the tensor's dtype as torch's comparison rounds it; while fewer than k
    pass, the threshold is multiplied by ``relax_factor`` (at most ``max_tries`` thresholds).
    Step 2 compacts the candidates and selects the exact top-k among them. With too few candidates
    after every try, or so many that the whole input is cheaper, the exact ``topk`` of everything
    runs; the result is ``topk(magnitudes, k)`` in every case.

    Args:
        magnitudes: 1-D CPU tensor, float16, bfloat16, float32 or float64 (others run the reference).
        k: How many entries to select.
        threshold: First threshold, e.g. the k/numel quantile of a random sample.
        relax_factor: In (0, 1): the threshold's factor after a try with fewer than k candidates.
        max_tries: Most thresholds tried before the exact top-k of everything.

    Returns:
        int64 positions, ascending, equal to ``topk(magnitudes, k)``.

    Example::

        sampled_topk(torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0]), 3, threshold=2.5)  # tensor([1, 2, 3])
    """
    reference._check_sampled(k, relax_factor)
    view = _bits_of(magnitudes)
    if view is None:
        return reference.sampled_topk(magnitudes, k, threshold, relax_factor=relax_factor, max_tries=max_tries)
    return _sampled_of(view, magnitudes.dtype, k, threshold, relax_factor, max_tries)


def sampled_topk_abs(
    values: torch.Tensor, k: int, threshold: float, *, relax_factor: float = 0.8, max_tries: int = 10
) -> torch.Tensor:
    """``sampled_topk(values.abs(), ...)`` with no ``abs`` pass; see ``reference.sampled_topk_abs``."""
    reference._check_sampled(k, relax_factor)
    view = _bits_of(values, signed=False)
    if view is None:
        return reference.sampled_topk_abs(values, k, threshold, relax_factor=relax_factor, max_tries=max_tries)
    return _sampled_of(view, values.dtype, k, threshold, relax_factor, max_tries)


def _sampled_of(
    view: tuple[np.ndarray, _Spec], dtype: torch.dtype, k: int, threshold: float, relax_factor: float, max_tries: int
) -> torch.Tensor:
    bits, spec = view
    if k == 0 or k >= bits.shape[0]:
        return _topk_of(view, k)
    chunking = _chunks(bits.shape[0])
    parallel, chunk, num_chunks = chunking
    for _ in range(max_tries):
        # Step 1
        lo = _threshold_key(threshold, dtype)
        counts = np.zeros(num_chunks, dtype=np.int64)
        _count_at_least.pick(parallel)(bits, spec, lo, chunk, counts)
        num_candidates = int(counts.sum())
        if num_candidates >= k:
            if num_candidates * _SHRINK > bits.shape[0]:
                break
            # Step 2
            candidates, positions = _compacted(bits, _NO_POSITIONS, spec, lo, counts, chunking)
            return torch.from_numpy(_select(candidates, positions, spec, k, lo))
        threshold *= relax_factor
    return _topk_of(view, k)

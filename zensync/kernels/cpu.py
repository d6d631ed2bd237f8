"""numba CPU kernels: the ops of ``reference`` with the same signatures, dtypes and bit-identical results.

Every kernel is compiled twice, a parallel version (``prange`` over chunks) and a serial one (there
``prange`` is plain ``range``), both ``nogil``. The parallel one runs only from the main thread and
only for inputs large enough to pay for the thread launch: numba's 'workqueue' threading layer (its
fallback when neither TBB nor OpenMP is installed) is unsafe when several Python threads launch
parallel kernels at once, and the simulated world runs one rank per thread. Parallel kernels work on
fixed chunks whose results are combined by prefix sums, so the output never depends on the thread
count or on which version ran. On an oversubscribed machine under the 'omp' layer a parallel launch
can stall for tens of milliseconds (spin-waiting OpenMP pools of numba and torch compete for cores);
``NUMBA_THREADING_LAYER=workqueue`` or ``OMP_WAIT_POLICY=passive`` avoids that.

Dense inputs are scanned as raw bits (a float tensor viewed as the signed integer of its width), so
float16 and bfloat16 need no conversion: ``(bits & ~signbit) != 0`` is exactly ``x != 0`` for IEEE
floats, NaN counting as non-zero and -0.0 as zero. Non-zero flags are packed 64 items to a word; a
64-bit little-endian word holds the same bits as two consecutive 32-bit bitmap words, so bitmap
decoding reuses the same extraction kernel.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import torch
from numba.core import types as nbtypes
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from zensync.kernels import reference
from zensync.kernels.hashing import Partition

__all__ = [
    "aggregate",
    "bitmap_decode",
    "bitmap_encode",
    "bucket_nonzero",
    "nonzero_items",
    "permute",
    "unpermute",
]

_WORD_BITS = 64
_CHUNKS_PER_THREAD = 4
"""Chunks per thread in parallel kernels: a few, so a slow chunk does not leave threads idle."""
_MIN_CHUNK_WORDS = 256
"""Fewest 64-item words per parallel chunk (16384 items): below that the chunk bookkeeping dominates."""
_MIN_CHUNK_KEYS = 1 << 13
"""Fewest positions per parallel chunk of aggregate's run detection."""
_WALK_BLOCK = 256
"""Values the vectorized Feistel walk (_walk_block) carries through the rounds together."""
_WALK_CHUNK = _WALK_BLOCK * 64
"""Values per parallel chunk of permute / unpermute."""
_NARROW_ROW = 8
"""Rows of at most this many elements are OR-reduced whole, with no per-row slice or first-element
check (3x faster on 8-wide rows; 2-wide to 16-wide measured)."""
_PARALLEL_MIN_SCAN = 1 << 18
"""Fewest dense elements (nonzero scan) or bitmap bits (decode) for the parallel version.

Measured on 2 idle cores (best of 25, scan): 'omp' layer 28 vs serial 74 us at 2^18 elements and
14 vs 23 us at 2^16. With the other core busy, the 'workqueue' layer broke even only near 2^19.
"""
_PARALLEL_MIN_HASH = 1 << 14
"""Fewest items to hash (permute, unpermute, bucket_nonzero) for the parallel version.

Measured as above: 'omp' 63 vs serial 113 us at 2^14 items ('workqueue', other core busy: 158 vs 115).
"""
_PARALLEL_MIN_SUM = 1 << 18
"""Fewest positions to aggregate for the parallel version: the sort is serial, so only run
detection and summation gain, and they break even near 2^18 positions."""
_BITS_VIEW = {
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
    torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF),
    torch.bool: (torch.uint8, -1),
    torch.uint8: (torch.uint8, -1),
    torch.int8: (torch.int8, -1),
    torch.int16: (torch.int16, -1),
    torch.int32: (torch.int32, -1),
    torch.int64: (torch.int64, -1),
}
"""Dense dtype -> (integer view of the same width, mask of the bits that make an element non-zero)."""
_SUM_DTYPES = (torch.float32, torch.float64)


# ---------------------------------------------------------------- compilation helpers


@intrinsic
def _popcount(typingctx: Any, x: Any) -> Any:
    """Set bits of an integer (LLVM ctpop)."""
    if not isinstance(x, nbtypes.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.ctpop(args[0])

    return x(x), codegen


def _jit(fn: Callable[..., Any]) -> Any:
    """Decorator for device-side helpers and serial-only kernels (returns a numba dispatcher)."""
    return numba.njit(nogil=True, cache=True)(fn)


class _Kernel:
    """A kernel compiled parallel and serial; ``pick(parallel)`` returns the dispatcher to call."""

    __slots__ = ("parallel", "serial")

    def __init__(self, fn: types.FunctionType, *, reassociate: bool = False) -> None:
        # A renamed copy gets its own cache file: numba's cache index key does not include `parallel`.
        serial_fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__)
        serial_fn.__qualname__ = fn.__qualname__ + "_serial"
        # Reassociation only (no "nnan"/"ninf": NaN and infinity keep their IEEE meaning).
        fastmath: Any = {"reassoc"} if reassociate else False
        self.parallel = numba.njit(parallel=True, nogil=True, cache=True, fastmath=fastmath)(fn)
        self.serial = numba.njit(parallel=False, nogil=True, cache=True, fastmath=fastmath)(serial_fn)

    def pick(self, parallel: bool) -> Any:
        return self.parallel if parallel else self.serial


def _kernel(fn: Callable[..., Any]) -> _Kernel:
    """Decorator: compile ``fn`` (whose ``numba.prange`` loops are the parallel part) both ways."""
    assert isinstance(fn, types.FunctionType)
    return _Kernel(fn)


def _reassociating_kernel(fn: Callable[..., Any]) -> _Kernel:
    """``_kernel`` for a reduction the compiler may reassociate, so it vectorizes: its float sums
    may differ from a sequential sum in the last bits (deterministic for a given build and input)."""
    assert isinstance(fn, types.FunctionType)
    return _Kernel(fn, reassociate=True)


def _use_parallel(size: int, threshold: int) -> bool:
    """Parallel only for large inputs, from the main thread, and within torch's intra-op thread budget.

    Processes that share a host (several ranks per machine, as torchrun sets up with
    OMP_NUM_THREADS=1) keep torch at one thread; numba follows, because spinning OpenMP workers of
    several processes on the same cores stall each other's collectives by tens of milliseconds.
    """
    if size < threshold or threading.current_thread() is not threading.main_thread():
        return False
    budget = min(numba.config.NUMBA_NUM_THREADS, torch.get_num_threads())
    if budget < 2:
        return False
    numba.set_num_threads(budget)
    return True


def _chunk_size(num_units: int, min_units: int, parallel: bool) -> int:
    """Units per chunk: one chunk when serial, else a few chunks per thread of at least ``min_units``."""
    if not parallel:
        return max(1, num_units)
    per_chunk = -(-num_units // (_CHUNKS_PER_THREAD * numba.get_num_threads()))
    return max(min_units, per_chunk)


def _offsets(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum with the total appended: chunk c writes [offsets[c], offsets[c + 1])."""
    out = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


# ---------------------------------------------------------------- Feistel permutation


@_jit
def _round32(half: np.uint32, key: np.uint64) -> np.uint64:
    """reference._round without its final mask, for half < 2^32 (uint64: numba would widen uint32
    products without wrapping them, so every product is masked to 32 bits as the reference's is)."""
    x = np.uint64(half) ^ key
    x = (x * np.uint64(reference.FEISTEL_MUL1)) & np.uint64(reference.MASK32)
    x = x ^ (x >> np.uint64(12))
    x = (x * np.uint64(reference.FEISTEL_MUL2)) & np.uint64(reference.MASK32)
    return x ^ (x >> np.uint64(15))


@_jit
def _walk_block(
    src: np.ndarray, dst: np.ndarray, num_items: int, half_bits: int, keys: np.ndarray, inverse: bool
) -> None:
    """dst[i] = src[i]'s Feistel walk (reference.permute, or unpermute when ``inverse``): the rounds
    over 2 * half_bits bits, repeated until the value is below num_items; _WALK_BLOCK values at a time.

    The rounds run over the whole block in branch-free loops that LLVM vectorizes; the values still
    out of range afterwards (cycle walking: about 40 % after the first pass at 10M items) are
    compacted to the front and walk again. 3x the scalar walk per value, same results.
    """
    mask = np.uint32((np.int64(1) << half_bits) - 1)
    num_rounds = keys.shape[0]
    lefts = np.empty(_WALK_BLOCK, dtype=np.uint32)
    rights = np.empty(_WALK_BLOCK, dtype=np.uint32)
    where = np.empty(_WALK_BLOCK, dtype=np.int64)
    for start in range(0, src.shape[0], _WALK_BLOCK):
        pending = min(_WALK_BLOCK, src.shape[0] - start)
        for i in range(pending):
            lefts[i] = np.uint32(src[start + i] >> half_bits)
            rights[i] = np.uint32(src[start + i] & mask)
            where[i] = start + i
        while pending > 0:
            for step in range(num_rounds):
                if inverse:
                    key = np.uint64(keys[num_rounds - 1 - step])
                    for i in range(pending):
                        left = lefts[i]
                        lefts[i] = rights[i] ^ (np.uint32(_round32(left, key)) & mask)
                        rights[i] = left
                else:
                    key = np.uint64(keys[step])
                    for i in range(pending):
                        right = rights[i]
                        rights[i] = lefts[i] ^ (np.uint32(_round32(right, key)) & mask)
                        lefts[i] = right
            still = 0
            for i in range(pending):
                v = (np.int64(lefts[i]) << half_bits) | np.int64(rights[i])
                if v < num_items:
                    dst[where[i]] = v
                else:
                    lefts[still], rights[still], where[still] = lefts[i], rights[i], where[i]
                    still += 1
            pending = still


@_kernel
def _walk_all(
    src: np.ndarray, dst: np.ndarray, num_items: int, half_bits: int, keys: np.ndarray, inverse: bool
) -> None:
    num_chunks = (src.shape[0] + _WALK_CHUNK - 1) // _WALK_CHUNK
    for c in numba.prange(num_chunks):
        first, last = c * _WALK_CHUNK, min(src.shape[0], (c + 1) * _WALK_CHUNK)
        _walk_block(src[first:last], dst[first:last], num_items, half_bits, keys, inverse)


def _keys(part: Partition) -> np.ndarray:
    return np.asarray(part.keys, dtype=np.int64)


def _permute(items: torch.Tensor, part: Partition, inverse: bool) -> torch.Tensor:
    src = items.detach().to(torch.int64).contiguous().reshape(-1).numpy()
    if src.shape[0] and (src.min() < 0 or src.max() >= part.num_items):
        name = "positions" if inverse else "items"
        raise ValueError(
            f"{'un' if inverse else ''}permute: {name} must lie in [0, num_items={part.num_items}); got "
            f"[{src.min()}, {src.max()}] (cycle walking from outside the range need not terminate)"
        )
    dst = np.empty_like(src)
    kernel = _walk_all.pick(_use_parallel(src.shape[0], _PARALLEL_MIN_HASH))
    kernel(src, dst, part.num_items, part.half_bits, _keys(part), inverse)
    return torch.from_numpy(dst).reshape(items.shape)


def permute(items: torch.Tensor, part: Partition) -> torch.Tensor:
    """perm(i): the perm-space position of each item (int64); see ``reference.permute``."""
    if not part.hashed:
        return items.to(torch.int64)
    return _permute(items, part, inverse=False)


def unpermute(positions: torch.Tensor, part: Partition) -> torch.Tensor:
    """perm^-1(q): the item at each perm-space position (int64); see ``reference.unpermute``."""
    if not part.hashed:
        return positions.to(torch.int64)
    return _permute(positions, part, inverse=True)


# ---------------------------------------------------------------- non-zero flags and bit extraction


@_jit
def _flag_word(flat: np.ndarray, first: int, last: int, item_numel: int, signmask: int) -> int:
    """Non-zero flags of items [first, last) (at most 64) as the bits of one word."""
    # Slices index from 0, so numba drops its negative-index wraparound and LLVM vectorizes (10x).
    word = np.int64(0)
    if item_numel == 1 and last - first == _WORD_BITS:
        block = flat[first:last]
        for b in range(_WORD_BITS):
            word |= np.int64((block[b] & signmask) != 0) << b
    elif item_numel == 1:
        block = flat[first:last]
        for b in range(last - first):
            word |= np.int64((block[b] & signmask) != 0) << b
    else:
        # A group of rows whose first element is zero is OR-reduced whole first (one streaming
        # reduction LLVM vectorizes): an all-zero group, the common case of a sparse gradient, costs
        # that pass alone. Otherwise each row is flagged by its first element or its whole OR
        # (1.3-2x faster than the per-row blocks with early exit this replaced; see kernels_cpu).
        rows = flat[first * item_numel : last * item_numel]
        if (rows[0] & signmask) == 0:
            acc = rows[0]
            for e in range(1, rows.shape[0]):
                acc |= rows[e]
            if (acc & signmask) == 0:
                return word
        if item_numel <= _NARROW_ROW:
            for b in range(last - first):
                acc = rows[b * item_numel]
                for e in range(1, item_numel):
                    acc |= rows[b * item_numel + e]
                word |= np.int64((acc & signmask) != 0) << b
            return word
        for b in range(last - first):
            row = rows[b * item_numel : (b + 1) * item_numel]
            if (row[0] & signmask) != 0:  # dense rows: one element
                word |= np.int64(1) << b
                continue
            acc = row[0]
            for e in range(1, item_numel):
                acc |= row[e]
            word |= np.int64((acc & signmask) != 0) << b
    return word


@_kernel
def _nonzero_words(
    flat: np.ndarray,
    num_items: int,
    item_numel: int,
    signmask: int,
    chunk_words: int,
    words: np.ndarray,
    counts: np.ndarray,
) -> None:
    """Step 1 of the scan: bit i % 64 of words[i // 64] = item i is non-zero; counts[c] = set bits of chunk c."""
    num_words = words.shape[0]
    for c in numba.prange(counts.shape[0]):
        total = 0
        for w in range(c * chunk_words, min(num_words, (c + 1) * chunk_words)):
            first = w * _WORD_BITS
            word = _flag_word(flat, first, min(first + _WORD_BITS, num_items), item_numel, signmask)
            words[w] = word
            total += _popcount(word)
        counts[c] = total


@_jit
def _masked_word(words: np.ndarray, w: int, num_bits: int) -> int:
    """words[w] without the bits at or past num_bits."""
    word = words[w]
    remaining = num_bits - w * _WORD_BITS
    if remaining < _WORD_BITS:
        word &= (np.int64(1) << remaining) - 1
    return word


@_kernel
def _count_bits(words: np.ndarray, num_bits: int, chunk_words: int, counts: np.ndarray) -> None:
    num_words = (num_bits + _WORD_BITS - 1) // _WORD_BITS
    for c in numba.prange(counts.shape[0]):
        total = 0
        for w in range(c * chunk_words, min(num_words, (c + 1) * chunk_words)):
            total += _popcount(_masked_word(words, w, num_bits))
        counts[c] = total


@_kernel
def _extract_bits(words: np.ndarray, num_bits: int, chunk_words: int, offsets: np.ndarray, out: np.ndarray) -> None:
    """Step 2: chunk c writes the indices of its set bits, ascending, from offsets[c] on."""
    num_words = (num_bits + _WORD_BITS - 1) // _WORD_BITS
    for c in numba.prange(offsets.shape[0] - 1):
        dst = offsets[c]
        for w in range(c * chunk_words, min(num_words, (c + 1) * chunk_words)):
            word = _masked_word(words, w, num_bits)
            while word != 0:
                out[dst] = w * _WORD_BITS + trailing_zeros(word)
                word &= word - 1
                dst += 1


def _scan(x2d: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int, bool] | None:
    """Non-zero flags of the items of ``x2d``: (words, offsets, chunk_words, parallel); None if unsupported."""
    if x2d.dim() != 2 or x2d.dtype not in _BITS_VIEW:
        return None
    num_items, item_numel = x2d.shape
    view_dtype, signmask = _BITS_VIEW[x2d.dtype]
    flat = x2d.detach().contiguous().view(view_dtype).reshape(-1).numpy()
    num_words = -(-num_items // _WORD_BITS)
    parallel = _use_parallel(num_items * item_numel, _PARALLEL_MIN_SCAN)
    chunk_words = _chunk_size(num_words, _MIN_CHUNK_WORDS, parallel)
    words = np.empty(num_words, dtype=np.int64)
    counts = np.zeros(-(-num_words // chunk_words), dtype=np.int64)
    if item_numel == 0:
        words[:] = 0
    else:
        _nonzero_words.pick(parallel)(flat, num_items, item_numel, signmask, chunk_words, words, counts)
    return words, _offsets(counts), chunk_words, parallel


def nonzero_items(x2d: torch.Tensor) -> torch.Tensor:
    """Ascending int64 indices of the non-zero items (rows) of ``x2d``; see ``reference.nonzero_items``."""
    scanned = _scan(x2d)
    if scanned is None:
        return reference.nonzero_items(x2d)
    words, offsets, chunk_words, parallel = scanned
    out = np.empty(int(offsets[-1]), dtype=np.int64)
    _extract_bits.pick(parallel)(words, x2d.shape[0], chunk_words, offsets, out)
    return torch.from_numpy(out)


# ---------------------------------------------------------------- bucketing by owner


@_kernel
def _hash_bits(
    words: np.ndarray,
    chunk_words: int,
    offsets: np.ndarray,
    part_args: tuple[int, int, np.ndarray, bool, int],
    items_out: np.ndarray,
    perm_out: np.ndarray,
    owner_counts: np.ndarray,
) -> None:
    """Step 2 of bucketing: extract chunk c's items, hash them, count them per owner in owner_counts[c]."""
    num_items, half_bits, keys, hashed, range_len = part_args
    num_words = words.shape[0]
    for c in numba.prange(owner_counts.shape[0]):
        dst = offsets[c]
        for w in range(c * chunk_words, min(num_words, (c + 1) * chunk_words)):
            word = words[w]
            while word != 0:
                items_out[dst] = w * _WORD_BITS + trailing_zeros(word)
                word &= word - 1
                dst += 1
        first, last = offsets[c], offsets[c + 1]
        if hashed:
            _walk_block(items_out[first:last], perm_out[first:last], num_items, half_bits, keys, False)
        else:
            perm_out[first:last] = items_out[first:last]
        for t in range(first, last):
            owner_counts[c, perm_out[t] // range_len] += 1


@_kernel
def _scatter_owners(
    offsets: np.ndarray,
    items_in: np.ndarray,
    perm_in: np.ndarray,
    range_len: int,
    cursor: np.ndarray,
    items_out: np.ndarray,
    positions_out: np.ndarray,
) -> None:
    """Step 3: chunk c moves its items to their owner's next free slots cursor[c, owner] (stable)."""
    for c in numba.prange(cursor.shape[0]):
        for t in range(offsets[c], offsets[c + 1]):
            perm = perm_in[t]
            owner = perm // range_len
            dst = cursor[c, owner]
            cursor[c, owner] = dst + 1
            items_out[dst] = items_in[t]
            positions_out[dst] = perm - owner * range_len


def bucket_nonzero(x2d: torch.Tensor, part: Partition) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-zero items grouped by owner, their in-range positions and per-owner counts.

    Same results as ``reference.bucket_nonzero``, in three passes: Step 1 packs non-zero flags and
    counts them per chunk; Step 2 extracts, hashes and counts items per (chunk, owner); Step 3 scatters
    each chunk's items to prefix-summed (owner, chunk) slots, so owners come out ascending and items
    ascending within an owner whatever the chunking.
    """
    if x2d.dim() == 2 and x2d.shape[0] > min(part.num_items, part.num_owners * part.range_len):
        raise ValueError(
            f"bucket_nonzero: x2d has {x2d.shape[0]} items, more than part.num_items={part.num_items} "
            f"(or than num_owners * range_len = {part.num_owners * part.range_len}): owners would overflow"
        )
    scanned = _scan(x2d)
    if scanned is None:
        return reference.bucket_nonzero(x2d, part)
    # Step 1
    words, offsets, chunk_words, parallel = scanned
    num_nonzero = int(offsets[-1])
    # Step 2
    items_tmp = np.empty(num_nonzero, dtype=np.int64)
    perm_tmp = np.empty(num_nonzero, dtype=np.int64)
    owner_counts = np.zeros((offsets.shape[0] - 1, part.num_owners), dtype=np.int64)
    part_args = (part.num_items, part.half_bits, _keys(part), part.hashed, part.range_len)
    _hash_bits.pick(parallel)(words, chunk_words, offsets, part_args, items_tmp, perm_tmp, owner_counts)
    # Step 3: owner j's block starts after owners < j; chunk c's share of it after chunks < c.
    counts = owner_counts.sum(axis=0)
    owner_start = np.cumsum(counts) - counts
    cursor = owner_start[None, :] + np.cumsum(owner_counts, axis=0) - owner_counts
    items = np.empty(num_nonzero, dtype=np.int64)
    positions = np.empty(num_nonzero, dtype=np.int64)
    _scatter_owners.pick(parallel)(offsets, items_tmp, perm_tmp, part.range_len, cursor, items, positions)
    return torch.from_numpy(items), torch.from_numpy(positions), torch.from_numpy(counts)


# ---------------------------------------------------------------- aggregation


@_kernel
def _pack(keys: np.ndarray, low: int, index_bits: int, packed: np.ndarray) -> None:
    """packed[t] = (keys[t] - low) << index_bits | t: one int64 whose order is the stable order of keys."""
    for t in numba.prange(keys.shape[0]):
        packed[t] = ((keys[t] - low) << index_bits) | t


@_jit
def _count_runs(packed: np.ndarray, index_bits: int, first: int, last: int) -> int:
    """Runs of equal keys that start in packed[first:last] (keys are >= 0, so -1 never matches)."""
    previous = packed[first - 1] >> index_bits if first > 0 else -1
    block = packed[first:last]
    num_runs = 0
    for t in range(last - first):
        key = block[t] >> index_bits
        num_runs += key != previous
        previous = key
    return num_runs


@_kernel
def _run_starts(packed: np.ndarray, index_bits: int, chunk: int) -> np.ndarray:
    """Start of every run of equal keys in sorted ``packed``, with len(packed) appended."""
    size = packed.shape[0]
    num_chunks = max(1, (size + chunk - 1) // chunk)
    offsets = np.zeros(num_chunks + 1, dtype=np.int64)
    for c in numba.prange(num_chunks):
        offsets[c + 1] = _count_runs(packed, index_bits, c * chunk, min(size, (c + 1) * chunk))
    for c in range(num_chunks):
        offsets[c + 1] += offsets[c]
    starts = np.empty(offsets[num_chunks] + 1, dtype=np.int64)
    starts[offsets[num_chunks]] = size
    for c in numba.prange(num_chunks):
        dst = offsets[c]
        previous = packed[c * chunk - 1] >> index_bits if c > 0 else -1
        for t in range(c * chunk, min(size, (c + 1) * chunk)):
            key = packed[t] >> index_bits
            if key != previous:
                starts[dst] = t
                dst += 1
            previous = key
    return starts


@_kernel
def _run_sums(
    packed: np.ndarray,
    index_bits: int,
    keys: np.ndarray,
    values: np.ndarray,
    starts: np.ndarray,
    unique: np.ndarray,
    sums: np.ndarray,
    multiplicity: np.ndarray,
) -> None:
    """Sum each run's value rows into a zeroed row, in input order (as ``index_add_`` does)."""
    index_mask = (np.int64(1) << index_bits) - 1
    for s in numba.prange(starts.shape[0] - 1):
        first = starts[s]
        unique[s] = keys[packed[first] & index_mask]
        multiplicity[s] = starts[s + 1] - first
        if values.shape[1] == 1:
            total = sums[s, 0]  # a zero of the values' dtype: every addition rounds to that dtype
            for t in range(first, starts[s + 1]):
                total += values[packed[t] & index_mask, 0]
            sums[s, 0] = total
        else:
            for t in range(first, starts[s + 1]):
                row = packed[t] & index_mask
                for j in range(values.shape[1]):
                    sums[s, j] += values[row, j]


def _sorted_packed(keys: np.ndarray, parallel: bool) -> tuple[np.ndarray, int]:
    """(packed, index_bits): rank-or-offset << index_bits | input index, sorted; ties stay in input order."""
    size = keys.shape[0]
    index_bits = max(1, (size - 1).bit_length())
    low = int(keys.min()) if size else 0
    span = int(keys.max()) - low if size else 0
    packed = np.empty(size, dtype=np.int64)
    if span.bit_length() + index_bits <= 63:
        _pack.pick(parallel)(keys, low, index_bits, packed)
        packed.sort()  # numpy's vectorized quicksort; the index bits make every value distinct
        return packed, index_bits
    # Offsets too wide to pack beside the index: pack dense ranks (< size) instead.
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    ranks = np.zeros(size, dtype=np.int64)
    np.cumsum(sorted_keys[1:] != sorted_keys[:-1], out=ranks[1:])
    np.bitwise_or(ranks << index_bits, order, out=packed)
    return packed, index_bits


def aggregate(positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted unique positions, per-position sums of value rows, multiplicity; see ``reference.aggregate``.

    Step 1 sorts (position, input index) pairs packed into one int64 each, which is a stable sort of
    the positions with no table sized by the largest position; Step 2 finds the runs of equal
    positions; Step 3 sums each run's rows in input order within the values' dtype. Dtypes other
    than float32/float64 (callers upcast half types) go to the reference.
    """
    if values.dim() != 2 or positions.shape != values.shape[:1]:
        raise ValueError(
            f"aggregate: positions of shape {tuple(positions.shape)} must be (k,) and values of shape "
            f"{tuple(values.shape)} must be (k, item_numel)"
        )
    if values.dtype not in _SUM_DTYPES:
        return reference.aggregate(positions, values)
    keys = positions.detach().to(torch.int64).contiguous().numpy()
    rows = values.detach().contiguous().numpy()
    parallel = _use_parallel(keys.shape[0], _PARALLEL_MIN_SUM)
    # Step 1
    packed, index_bits = _sorted_packed(keys, parallel)
    # Step 2
    chunk = _chunk_size(keys.shape[0], _MIN_CHUNK_KEYS, parallel)
    starts = _run_starts.pick(parallel)(packed, index_bits, chunk)
    # Step 3
    num_unique = starts.shape[0] - 1
    unique = np.empty(num_unique, dtype=np.int64)
    multiplicity = np.empty(num_unique, dtype=np.int64)
    sums = np.zeros((num_unique, rows.shape[1]), dtype=rows.dtype)
    _run_sums.pick(parallel)(packed, index_bits, keys, rows, starts, unique, sums, multiplicity)
    return torch.from_numpy(unique).to(positions.dtype), torch.from_numpy(sums), torch.from_numpy(multiplicity)


# ---------------------------------------------------------------- bitmaps


@_jit
def _encode(positions: np.ndarray, words: np.ndarray) -> int:
    """OR each position's bit into the int32 words; returns the index of the first bad position or -1."""
    limit = words.shape[0] * 32
    for t in range(positions.shape[0]):
        p = positions[t]
        if p < 0 or p >= limit:
            return t
        words[p >> 5] |= np.int64(1) << (p & 31)  # bit 31 wraps to the int32 sign bit, as in the reference
    return -1


def bitmap_encode(positions: torch.Tensor, length: int) -> torch.Tensor:
    """int32 words with bit p % 32 of word p // 32 set for each position; see ``reference.bitmap_encode``.

    Serial: one pass of k random ORs into a small array is memory-bound, and threads would race on
    shared words.
    """
    reference._check_length("bitmap_encode", length)
    keys = positions.detach().to(torch.int64).contiguous().reshape(-1).numpy()
    words = np.zeros((length + 31) // 32, dtype=np.int32)
    bad = _encode(keys, words)
    if bad >= 0:
        raise IndexError(
            f"bitmap_encode: position {keys[bad]} is outside [0, {words.shape[0] * 32}) for length={length}"
        )
    return torch.from_numpy(words)


def _words64(words: torch.Tensor, num_words32: int) -> np.ndarray:
    """The first ``num_words32`` int32 words as little-endian int64 words (zero-padded to an even count)."""
    src = words.detach().contiguous().reshape(-1).numpy()[:num_words32]
    if num_words32 % 2 == 0 and src.ctypes.data % 8 == 0:
        return src.view(np.int64)
    padded = np.zeros(-(-num_words32 // 2), dtype=np.int64)
    padded.view(np.int32)[:num_words32] = src
    return padded


def bitmap_decode(words: torch.Tensor, length: int) -> torch.Tensor:
    """Ascending int64 positions of the set bits among the first ``length``; see ``reference.bitmap_decode``.

    Step 1 counts set bits per chunk (popcount); Step 2 extracts them at prefix-summed offsets.
    """
    reference._check_length("bitmap_decode", length)
    if words.dtype != torch.int32:
        return reference.bitmap_decode(words, length)
    num_bits = min(length, 32 * words.numel())
    words64 = _words64(words, -(-num_bits // 32))
    parallel = _use_parallel(num_bits, _PARALLEL_MIN_SCAN)
    chunk_words = _chunk_size(words64.shape[0], _MIN_CHUNK_WORDS, parallel)
    # Step 1
    counts = np.zeros(-(-words64.shape[0] // chunk_words), dtype=np.int64)
    _count_bits.pick(parallel)(words64, num_bits, chunk_words, counts)
    offsets = _offsets(counts)
    # Step 2
    out = np.empty(int(offsets[-1]), dtype=np.int64)
    _extract_bits.pick(parallel)(words64, num_bits, chunk_words, offsets, out)
    return torch.from_numpy(out)

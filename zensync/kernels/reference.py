"""Plain-torch reference kernels: the definitions every faster implementation is tested against.

Each op works on any device torch supports, and is what ``zensync.kernels`` runs where no faster
implementation applies. Items are rows of a 2-D view ``x2d`` of shape (num_items, item_numel): an
element (item_numel = 1) or an embedding row. An item is non-zero when any of its elements is
non-zero; NaN counts as non-zero and -0.0 as zero, exactly as ``x != 0``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zensync.kernels.hashing import Partition

__all__ = [
    "FEISTEL_MUL1",
    "FEISTEL_MUL2",
    "PACK_WIDTHS",
    "aggregate",
    "bitmap_decode",
    "bitmap_encode",
    "bucket_nonzero",
    "dequantize_add",
    "index_add",
    "nonzero_items",
    "pack_bits",
    "permute",
    "quantize_levels",
    "sampled_topk",
    "sampled_topk_abs",
    "scatter_add",
    "sign_decode_sum",
    "sign_encode",
    "sign_residual",
    "topk",
    "topk_abs",
    "unpack_bits",
    "unpermute",
]

MASK32 = 0xFFFFFFFF
FEISTEL_MUL1 = 0x2C1B3C6D
"""Round-function multipliers: below 2^30, so a 32-bit operand times either fits in int64."""
FEISTEL_MUL2 = 0x297A2D39


def _round(half: torch.Tensor, key: int, mask: int) -> torch.Tensor:
    x = (half ^ key) & MASK32
    x = (x * FEISTEL_MUL1) & MASK32
    x = x ^ (x >> 12)
    x = (x * FEISTEL_MUL2) & MASK32
    x = x ^ (x >> 15)
    return x & mask


def _feistel(v: torch.Tensor, part: Partition, inverse: bool) -> torch.Tensor:
    h = part.half_bits
    mask = (1 << h) - 1
    left, right = v >> h, v & mask
    if inverse:
        for key in reversed(part.keys):
            left, right = right ^ _round(left, key, mask), left
    else:
        for key in part.keys:
            left, right = right, left ^ _round(right, key, mask)
    return (left << h) | right


def _walk(items: torch.Tensor, part: Partition, inverse: bool) -> torch.Tensor:
    """Apply the Feistel permutation until the value lands in [0, num_items) (cycle walking)."""
    v = _feistel(items.to(torch.int64), part, inverse)
    pending = (v >= part.num_items).nonzero().squeeze(1)
    while pending.numel():
        stepped = _feistel(v[pending], part, inverse)
        v[pending] = stepped
        pending = pending[stepped >= part.num_items]
    return v


def permute(items: torch.Tensor, part: Partition) -> torch.Tensor:
    """perm(i): the perm-space position of each item (int64). Example: identity when not hashed."""
    if not part.hashed:
        return items.to(torch.int64)
    return _walk(items, part, inverse=False)


def unpermute(positions: torch.Tensor, part: Partition) -> torch.Tensor:
    """perm^-1(q): the item at each perm-space position (int64); unpermute(permute(i)) == i."""
    if not part.hashed:
        return positions.to(torch.int64)
    return _walk(positions, part, inverse=True)


def nonzero_items(x2d: torch.Tensor) -> torch.Tensor:
    """Ascending int64 indices of the non-zero items of ``x2d``.

    Example: rows [[0, 0], [0, 1], [nan, 0]] -> tensor([1, 2]).
    """
    return (x2d != 0).any(dim=1).nonzero().squeeze(1)


def bucket_nonzero(x2d: torch.Tensor, part: Partition) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-zero detection + hashing + bucketing by owner (Zen's push preparation).

    Returns:
        items: int64 non-zero item indices grouped by owner (owner 0 first), ascending within an owner.
        positions: int64 position of each item inside its owner's range (perm(i) - owner * range_len).
        counts: int64 tensor of num_owners counts (items per owner).

    Example: 4 items, 2 owners, identity partition of range_len 32: rows 1 and 3 non-zero ->
    items [1, 3], positions [1, 3], counts [2, 0].
    """
    items = nonzero_items(x2d)
    order, positions, counts = bucket_items(items, part)
    return items[order], positions, counts


def bucket_items(
    items: torch.Tensor, part: Partition, permute_fn: Callable[[torch.Tensor, Partition], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h0 and bucketing of known ascending items: (order grouping them by owner, positions, counts).

    ``items[order]`` is grouped by owner and ascending within an owner (the sort is stable);
    ``positions`` and ``counts`` are those of ``bucket_nonzero``, in that order: what Zen runs where
    the non-zero items are known without a scan. ``permute_fn``: the permutation to use (default
    this module's; ``zensync.kernels.bucket_items`` passes the dispatched, compiled one).
    """
    perm = (permute_fn or permute)(items, part)
    owners = perm // part.range_len
    order = torch.argsort(owners, stable=True)
    positions = perm[order] - owners[order] * part.range_len
    return order, positions, torch.bincount(owners, minlength=part.num_owners)


def aggregate(positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum the value rows of equal positions (owner-side aggregation).

    Args:
        positions: int64 (k,) positions, duplicates allowed, any order.
        values: (k, item_numel) values; summed in their own dtype, in input order per position.

    Returns:
        unique_positions: ascending int64 (u,).
        sums: (u, item_numel) sums.
        multiplicity: int64 (u,) number of contributions per position.

    Example: positions [5, 2, 5], values [[1], [2], [3]] -> [2, 5], [[2], [4]], [1, 2].
    """
    unique, inverse, multiplicity = torch.unique(positions, sorted=True, return_inverse=True, return_counts=True)
    sums = torch.zeros((unique.numel(), values.shape[1]), dtype=values.dtype, device=values.device)
    sums.index_add_(0, inverse, values)
    return unique, sums, multiplicity


def bitmap_encode(positions: torch.Tensor, length: int) -> torch.Tensor:
    """One bit per position of a range of ``length``: int32 words, bit p % 32 of word p // 32.

    Example: positions [0, 33], length 40 -> words [1, 2] (as int32).
    """
    num_words = (length + 31) // 32
    bits = torch.zeros(num_words * 32, dtype=torch.bool, device=positions.device)
    bits[positions] = True
    weights = torch.ones(32, dtype=torch.int64, device=positions.device) << torch.arange(32, device=positions.device)
    words = (bits.view(num_words, 32).to(torch.int64) * weights).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def bitmap_decode(words: torch.Tensor, length: int) -> torch.Tensor:
    """Ascending int64 positions of the set bits (inverse of ``bitmap_encode``)."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int64)
    bits = ((words.to(torch.int64).unsqueeze(1) >> shifts) & 1).view(-1)[:length]
    return bits.nonzero().squeeze(1)


# Argument checks shared by every implementation (``cpu*`` and ``cuda`` call them before choosing a path).


def _check_length(op: str, length: int) -> None:
    if length < 0:
        raise ValueError(f"{op}: length={length} must be >= 0 (it is the number of positions the bitmap covers)")


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} must be an int >= 0 (how many elements to select)")


def _check_sampled(k: int, relax_factor: float) -> None:
    _check_k(k)
    if not 0.0 < relax_factor < 1.0:
        raise ValueError(f"relax_factor={relax_factor!r} must be in (0, 1): it lowers the threshold")


def topk(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest entries of the 1-D ``magnitudes`` (canonical).

    Order: numbers as usual (-0.0 equals 0.0), NaN above every number (as ``torch.topk``). Where
    several entries tie at the k-th largest value the lowest positions win, so the result depends
    only on the input. k >= numel selects everything.

    Example: topk(tensor([1.0, 3.0, 2.0, 3.0, 2.0]), 3) -> tensor([1, 2, 3]).
    """
    _check_k(k)
    numel = magnitudes.numel()
    if k >= numel:
        return torch.arange(numel, device=magnitudes.device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=magnitudes.device)
    values, indices = torch.topk(magnitudes, k, sorted=False)
    numbers = values[~values.isnan()]  # host sync; min() would propagate a NaN
    if numbers.numel() == 0:  # the k-th largest is a NaN: NaNs tie, the lowest positions win
        return magnitudes.isnan().nonzero().squeeze(1)[:k]
    kth = numbers.min()
    # Host syncs: is the k-th value tied with an entry that torch.topk left out?
    if int(torch.count_nonzero(numbers == kth)) == int(torch.count_nonzero(magnitudes == kth)):
        return indices.sort().values
    above = ((magnitudes > kth) | magnitudes.isnan()).nonzero().squeeze(1)
    tied = (magnitudes == kth).nonzero().squeeze(1)[: k - above.numel()]
    return torch.cat([above, tied]).sort().values


def sampled_topk(
    magnitudes: torch.Tensor, k: int, threshold: float, *, relax_factor: float = 0.8, max_tries: int = 10
) -> torch.Tensor:
    """DGC's selection with exact-k output: ``topk(magnitudes, k)``, found through a threshold.

    Entries at or above ``threshold`` (NaN always passes) are the candidates; while fewer than k
    pass, the threshold is multiplied by ``relax_factor`` (at most ``max_tries`` thresholds), then
    the exact top-k of the candidates is taken; with still too few, the exact top-k of everything.
    Whenever k entries pass, the k-th largest value is >= the threshold, so every entry of the
    top-k (ties included) is a candidate: the result always equals ``topk(magnitudes, k)`` and
    only the cost depends on the threshold.

    Example: sampled_topk(tensor([1.0, 3.0, 2.0, 3.0, 2.0]), 3, threshold=2.5) -> tensor([1, 2, 3])
    (two pass at 2.5, all five at 2.0).
    """
    _check_sampled(k, relax_factor)
    if k == 0 or k >= magnitudes.numel():
        return topk(magnitudes, k)
    for _ in range(max_tries):
        passed = (magnitudes >= threshold) | magnitudes.isnan()
        if int(torch.count_nonzero(passed)) >= k:  # host sync
            candidates = passed.nonzero().squeeze(1)
            return candidates[topk(magnitudes[candidates], k)]
        threshold *= relax_factor
    return topk(magnitudes, k)


def topk_abs(values: torch.Tensor, k: int) -> torch.Tensor:
    """``topk(values.abs(), k)``: positions of the k largest absolute values (NaN above every number).

    Example: topk_abs(tensor([1.0, -3.0, 2.0, 3.0, -2.0]), 3) -> tensor([1, 2, 3]).
    """
    return topk(values.abs(), k)


def sampled_topk_abs(
    values: torch.Tensor, k: int, threshold: float, *, relax_factor: float = 0.8, max_tries: int = 10
) -> torch.Tensor:
    """``sampled_topk(values.abs(), k, threshold, ...)``: equal to ``topk_abs(values, k)``."""
    return sampled_topk(values.abs(), k, threshold, relax_factor=relax_factor, max_tries=max_tries)


def _check_pairs(op: str, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Shapes and index dtype of (index, value) pairs (no host sync)."""
    if indices.dim() != 1 or values.dim() != 1 or indices.numel() != values.numel():
        raise ValueError(
            f"{op}: indices and values must be 1-D of equal length, got {tuple(indices.shape)} and "
            f"{tuple(values.shape)}"
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: indices must be int32 or int64, got {indices.dtype}")


def _check_indices(op: str, indices: torch.Tensor, values: torch.Tensor, numel: int) -> None:
    _check_pairs(op, indices, values)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):  # host sync
        raise ValueError(f"{op}: indices must lie in [0, {numel}), got [{int(indices.min())}, {int(indices.max())}]")


def scatter_add(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """A dense tensor of ``numel`` zeros plus each value at its index (duplicates summed): decompression.

    Example: scatter_add(tensor([2, 0, 2]), tensor([1.0, 2.0, 3.0]), 4) -> tensor([2.0, 0.0, 4.0, 0.0]).
    """
    _check_indices("scatter_add", indices, values, numel)
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    return out.index_add_(0, indices.long(), values)


def index_add(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """In place, ``out[indices[t]] += values[t]`` for each t in order (duplicates summed); returns ``out``.

    ``out`` is 1-D and contiguous; ``values`` has its dtype. Decompression into a buffer: top-k's
    k values of each sender added into the sum.

    Example: index_add(tensor([1.0, 0.0, 0.0]), tensor([2, 0, 2]), tensor([1.0, 2.0, 3.0])) -> tensor([3.0, 0.0, 4.0]).
    """
    _check_index_add(out, indices, values)
    return out.index_add_(0, indices.long(), values)


def dequantize_add(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """In place, ``out[i] += codes[i] * scales[i // group]``, the product in out's dtype; returns ``out``.

    ``out`` is 1-D, contiguous, float32 or float64; ``codes`` int8 of its length; ``scales`` of its
    dtype, one per group of ``group`` consecutive elements (the last group may be shorter). QSGD's
    decode of one sender into the sum (codes sign * level, scales norm / s).

    Example: dequantize_add(tensor([1.0, 1.0, 1.0]), tensor([2, -1, 4], dtype=int8), tensor([0.5, 2.0]), 2)
    -> tensor([2.0, 0.5, 9.0]).
    """
    _check_dequantize(out, codes, scales, group)
    rows = scales.repeat_interleave(group)[: out.numel()]
    return out.add_(codes.to(out.dtype) * rows)


def quantize_levels(
    x: torch.Tensor, scales: torch.Tensor, dither: torch.Tensor, group: int, levels: int
) -> torch.Tensor:
    """int8 ``sign(x[i]) * clamp(floor(|x[i]| * scales[i // group] + dither[i]), 0, levels)``, in x's dtype.

    QSGD's stochastic rounding (``scales``: s / norm per group, ``dither``: U[0, 1) draws); a NaN
    element gives level 0 (its group's NaN norm carries it). ``x`` and ``dither`` are 1-D of one
    length and dtype (float32 or float64), ``scales`` of that dtype, one per group; levels <= 127.

    Example: quantize_levels(tensor([0.5, -1.0]), tensor([4.0]), tensor([0.25, 0.5]), 2, 4)
    -> tensor([2, -4], dtype=int8).
    """
    _check_quantize(x, scales, dither, group, levels)
    rows = scales.repeat_interleave(group)[: x.numel()]
    level = torch.nan_to_num(x.abs().mul_(rows).add_(dither).floor_(), nan=0.0).clamp_(0, levels)
    return level.mul_(x.sign()).to(torch.int8)


def _check_quantize(x: torch.Tensor, scales: torch.Tensor, dither: torch.Tensor, group: int, levels: int) -> None:
    if x.dim() != 1 or x.dtype not in (torch.float32, torch.float64) or dither.shape != x.shape:
        raise ValueError(
            f"quantize_levels: x must be 1-D float32 or float64 with a dither of its shape, got {x.dtype} "
            f"{tuple(x.shape)} and {tuple(dither.shape)}"
        )
    if dither.dtype != x.dtype or scales.dtype != x.dtype:
        raise ValueError(f"quantize_levels: dither and scales must be {x.dtype}, got {dither.dtype}, {scales.dtype}")
    if group < 1 or scales.dim() != 1 or scales.numel() != -(-x.numel() // group) or not 0 < levels <= 127:
        raise ValueError(
            f"quantize_levels: one scale per group of group={group} >= 1 elements and 1 <= levels={levels} "
            f"<= 127, got {tuple(scales.shape)} scales"
        )


def _check_dequantize(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int) -> None:
    if out.dim() != 1 or not out.is_contiguous() or out.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"dequantize_add: out must be 1-D, contiguous, float32 or float64, got {out.dtype} {tuple(out.shape)}"
        )
    if codes.shape != out.shape or codes.dtype != torch.int8:
        raise ValueError(
            f"dequantize_add: codes must be int8 of out's shape {tuple(out.shape)}, "
            f"got {codes.dtype} of shape {tuple(codes.shape)}"
        )
    if group < 1 or scales.dim() != 1 or scales.dtype != out.dtype or scales.numel() != -(-out.numel() // group):
        raise ValueError(
            f"dequantize_add: scales must be 1-D {out.dtype}, one per group of group={group} >= 1 elements "
            f"({-(-out.numel() // max(group, 1))}), got {scales.dtype} {tuple(scales.shape)}"
        )


def _check_index_add(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    _check_indices("index_add", indices, values, out.numel())
    if out.dim() != 1 or not out.is_contiguous() or values.dtype != out.dtype:
        raise ValueError(
            f"index_add: out must be 1-D, contiguous and of the values' dtype, got {out.dtype} of shape "
            f"{tuple(out.shape)} (contiguous: {out.is_contiguous()}) and {values.dtype} values"
        )


PACK_WIDTHS = (1, 2, 4, 8)
"""Code widths (bits) that ``pack_bits`` supports: a code never straddles two bytes."""


def _check_width(op: str, bits: int) -> None:
    if bits not in PACK_WIDTHS:
        raise ValueError(f"{op}: bits={bits!r} must be one of {PACK_WIDTHS}")


def _check_pack(codes: torch.Tensor, bits: int) -> None:
    _check_width("pack_bits", bits)
    if codes.dtype not in (torch.uint8, torch.bool) or codes.dim() != 1:
        raise ValueError(f"pack_bits: codes must be 1-D uint8 or bool, got {codes.dtype} of shape {tuple(codes.shape)}")


def _check_unpack(packed: torch.Tensor, bits: int, numel: int, levels: torch.Tensor | None) -> None:
    _check_width("unpack_bits", bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or not 0 <= numel <= packed.numel() * (8 // bits):
        raise ValueError(
            f"unpack_bits: packed must be 1-D uint8 holding at least numel={numel} codes of {bits} bits, got "
            f"{packed.dtype} of shape {tuple(packed.shape)}"
        )
    if levels is not None and (levels.dim() != 1 or levels.numel() != 1 << bits):
        raise ValueError(
            f"unpack_bits: levels must be 1-D with 2**bits = {1 << bits} entries, got {tuple(levels.shape)}"
        )


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """1-D uint8 codes (only the low ``bits`` bits count) -> ceil(numel * bits / 8) uint8 bytes.

    Code i sits in bits [(i * bits) % 8, (i * bits) % 8 + bits) of byte (i * bits) // 8, least
    significant first (``numpy.packbits(bitorder="little")`` for bits=1); padding bits are zero.

    Example: pack_bits(tensor([1, 0, 1], dtype=uint8), 1) -> tensor([5]); pack_bits(tensor([3, 1]), 2) -> tensor([7]).
    """
    _check_pack(codes, bits)
    per_byte = 8 // bits
    numel = codes.numel()
    padded = torch.zeros(-(-numel // per_byte) * per_byte, dtype=torch.uint8, device=codes.device)
    padded[:numel] = codes.to(torch.uint8) & ((1 << bits) - 1)
    columns = padded.view(-1, per_byte)
    packed = columns[:, 0].clone()
    for slot in range(1, per_byte):
        packed |= columns[:, slot] << (slot * bits)
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, numel: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first ``numel`` codes as uint8, or ``levels[code]`` when given.

    Args:
        packed: 1-D uint8 bytes from ``pack_bits``.
        bits: Code width, one of ``PACK_WIDTHS``.
        numel: Codes to unpack (at most 8 // bits per byte).
        levels: Optional 1-D table of 2**bits values; the output then takes its dtype (a quantizer's
            dequantization fused into the unpacking).

    Example: unpack_bits(tensor([7], dtype=uint8), 2, 2) -> tensor([3, 1]);
    unpack_bits(tensor([5], dtype=uint8), 1, 3, tensor([-1.0, 1.0])) -> tensor([1.0, -1.0, 1.0]).
    """
    _check_unpack(packed, bits, numel, levels)
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8) * bits
    codes = ((packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:numel].contiguous()
    return codes if levels is None else levels[codes.long()]


# ---------------------------------------------------------------- the sign family's passes


def _check_sign_input(op: str, x: torch.Tensor) -> None:
    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"{op}: x must be a 1-D floating-point tensor, got {x.dtype} of shape {tuple(x.shape)}")


def sign_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``pack_bits(x >= 0, 1)``, float64 [count of x >= 0, sum of max(x, 0), sum of min(x, 0)]).

    The scales of the sign compressors come from these (efsignsgd's mean |x| is (second - third) /
    numel; onebit's means are second / count and third / (numel - count)). A NaN is not >= 0 (bit
    0) and makes both sums NaN, as ``clamp`` does; +inf makes the second inf. Sums are float64 and
    an implementation may add in another order (the tests allow float64 rounding).

    Example: sign_encode(tensor([1.0, -2.0, 0.0])) -> (tensor([5]), tensor([2.0, 1.0, -2.0])).
    """
    _check_sign_input("sign_encode", x)
    nonnegative = x >= 0
    wide = x.double()
    stats = torch.stack([nonnegative.sum().double(), wide.clamp(min=0).sum(), wide.clamp(max=0).sum()])
    return pack_bits(nonnegative, 1), stats


def _check_sign_sum(packed: Sequence[torch.Tensor], levels: torch.Tensor, out: torch.Tensor) -> None:
    numel = out.numel()
    if levels.dim() != 2 or levels.shape != (len(packed), 2) or levels.dtype != out.dtype:
        raise ValueError(
            f"sign_decode_sum: levels must be [{len(packed)}, 2] of the output's dtype {out.dtype}, got "
            f"{levels.dtype} {tuple(levels.shape)}"
        )
    if out.dim() != 1 or not out.is_floating_point():
        raise ValueError(f"sign_decode_sum: out must be 1-D floating point, got {out.dtype} {tuple(out.shape)}")
    for p in packed:
        if p.dtype != torch.uint8 or p.dim() != 1 or p.numel() != -(-numel // 8):
            raise ValueError(
                f"sign_decode_sum: every packed tensor must be 1-D uint8 of ceil({numel} / 8) bytes, got "
                f"{p.dtype} {tuple(p.shape)}"
            )


def sign_decode_sum(packed: Sequence[torch.Tensor], levels: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[e] = sum over r, in order from 0, of levels[r, bit e of packed[r]]; returns ``out``.

    One decode of several senders' packed signs (``pack_bits(x >= 0, 1)`` each) into one output,
    summed from +0 in rank order in ``out``'s dtype, as adding each decoded sender in turn to a
    zero tensor does.

    Example: sign_decode_sum([tensor([1]), tensor([3])], tensor([[-1.0, 1.0], [-2.0, 2.0]]), empty(2))
    -> tensor([3.0, 1.0]).
    """
    _check_sign_sum(packed, levels, out)
    out.zero_()
    for p, pair in zip(packed, levels, strict=True):
        out += unpack_bits(p, 1, out.numel(), pair)
    return out


def sign_residual(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """In place: x[i] -= levels[1] where x[i] >= 0, else levels[0] (what a sign code dropped); returns x.

    Example: sign_residual(tensor([3.0, -1.0]), tensor([-2.0, 2.0])) -> tensor([1.0, 1.0]).
    """
    _check_sign_input("sign_residual", x)
    if levels.shape != (2,):
        raise ValueError(f"sign_residual: levels must hold 2 values, got shape {tuple(levels.shape)}")
    pair = levels.to(x.dtype)
    return x.sub_(torch.where(x >= 0, pair[1], pair[0]))

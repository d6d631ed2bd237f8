"""Property tests: numba ``scatter_add``, ``pack_bits`` and ``unpack_bits`` equal the torch reference.

``many_chunks`` makes the parallel pack/unpack run on tiny chunks, so chunk boundaries fall inside
every drawn input (byte boundaries of 2- and 4-bit codes included).
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import assert_identical, examples, force_many_chunks
from zensync import kernels
from zensync.kernels import cpu_codec, reference

_SETTINGS = settings(deadline=None, max_examples=examples(80), suppress_health_check=[HealthCheck.too_slow])
_LEVEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _tiny_chunks(enabled: bool) -> contextlib.AbstractContextManager[object]:
    if not enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(force_many_chunks())
    stack.enter_context(mock.patch.multiple(cpu_codec, _PARALLEL_MIN_CODES=0, _MIN_CHUNK_BYTES=1))
    return stack


@_SETTINGS
@given(
    numel=st.integers(1, 5000),
    num_values=st.integers(0, 400),
    dtype=st.sampled_from((torch.float32, torch.float64, torch.float16)),
    index_dtype=st.sampled_from((torch.int32, torch.int64)),
    seed=st.integers(0, 2**31),
    special=st.booleans(),
)
def test_scatter_add_matches_reference(
    numel: int, num_values: int, dtype: torch.dtype, index_dtype: torch.dtype, seed: int, special: bool
) -> None:
    """Duplicates are summed in input order, as index_add_ does: random floats compare bit for bit."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, min(numel, 7) if seed % 3 == 0 else numel, (num_values,), generator=g)
    values = torch.randn(num_values, generator=g, dtype=torch.float64)
    if special and num_values:
        values[torch.randint(0, num_values, (3,), generator=g)] = torch.tensor([math.nan, math.inf, -0.0]).double()
    indices, values = indices.to(index_dtype), values.to(dtype)
    assert_identical(cpu_codec.scatter_add(indices, values, numel), reference.scatter_add(indices, values, numel))


def test_scatter_add_sums_duplicates_exactly() -> None:
    """Integer-valued data: any summation order is exact, so the result is the float64 definition."""
    indices = torch.tensor([3, 0, 3, 3, 9, 0])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    expected = torch.zeros(10)
    expected[[0, 3, 9]] = torch.tensor([8.0, 8.0, 5.0])
    assert_identical(kernels.scatter_add(indices, values, 10), expected)
    assert_identical(kernels.scatter_add(indices[:0], values[:0], 4), torch.zeros(4))


@pytest.mark.parametrize("impl", [cpu_codec, reference])
@pytest.mark.parametrize(
    ("indices", "values", "numel", "message"),
    [
        (torch.tensor([5]), torch.tensor([1.0]), 3, r"indices must lie in \[0, 3\)"),
        (torch.tensor([-1]), torch.tensor([1.0]), 3, r"indices must lie in \[0, 3\)"),
        (torch.tensor([0, 1]), torch.tensor([1.0]), 3, "1-D of equal length"),
        (torch.tensor([0.0]), torch.tensor([1.0]), 3, "int32 or int64"),
    ],
)
def test_scatter_add_rejects_bad_input(impl, indices, values, numel, message) -> None:
    with pytest.raises(ValueError, match=message):
        impl.scatter_add(indices, values, numel)


@_SETTINGS
@given(
    numel=st.one_of(st.sampled_from([0, 1, 7, 8, 9, 15, 16, 17]), st.integers(0, 40_000)),
    bits=st.sampled_from(reference.PACK_WIDTHS),
    as_bool=st.booleans(),
    seed=st.integers(0, 2**31),
    many_chunks=st.booleans(),
)
def test_pack_and_unpack_match_reference(numel: int, bits: int, as_bool: bool, seed: int, many_chunks: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)  # high bits must be ignored
    if as_bool:
        codes = codes >= 128
    with _tiny_chunks(many_chunks):
        packed = cpu_codec.pack_bits(codes, bits)
        assert_identical(packed, reference.pack_bits(codes, bits))
        assert packed.numel() == math.ceil(numel * bits / 8)
        unpacked = cpu_codec.unpack_bits(packed, bits, numel)
    assert_identical(unpacked, reference.unpack_bits(packed, bits, numel))
    assert_identical(unpacked, codes.to(torch.uint8) & ((1 << bits) - 1))  # round trip


@_SETTINGS
@given(
    numel=st.integers(0, 5000),
    bits=st.sampled_from(reference.PACK_WIDTHS),
    dtype=st.sampled_from(_LEVEL_DTYPES),
    seed=st.integers(0, 2**31),
    many_chunks=st.booleans(),
)
def test_unpack_to_levels_matches_reference(
    numel: int, bits: int, dtype: torch.dtype, seed: int, many_chunks: bool
) -> None:
    """The fused dequantization equals levels[code] (the sign compressors' +-scale decode)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (numel,), generator=g, dtype=torch.uint8)
    levels = torch.randn(1 << bits, generator=g, dtype=torch.float64).to(dtype)
    packed = reference.pack_bits(codes, bits)
    with _tiny_chunks(many_chunks):
        actual = cpu_codec.unpack_bits(packed, bits, numel, levels)
    assert_identical(actual, reference.unpack_bits(packed, bits, numel, levels))
    assert_identical(actual, levels[codes.long()])


def test_pack_docstring_examples() -> None:
    assert_identical(kernels.pack_bits(torch.tensor([True, False, True]), 1), torch.tensor([5], dtype=torch.uint8))
    assert_identical(
        kernels.pack_bits(torch.tensor([3, 1], dtype=torch.uint8), 2), torch.tensor([7], dtype=torch.uint8)
    )
    assert_identical(
        kernels.unpack_bits(torch.tensor([5], dtype=torch.uint8), 1, 3, torch.tensor([-1.0, 1.0])),
        torch.tensor([1.0, -1.0, 1.0]),
    )


@pytest.mark.parametrize("impl", [cpu_codec, reference])
def test_pack_and_unpack_reject_bad_input(impl) -> None:
    with pytest.raises(ValueError, match=r"bits=3 must be one of \(1, 2, 4, 8\)"):
        impl.pack_bits(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="codes must be 1-D uint8 or bool"):
        impl.pack_bits(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="holding at least numel=17 codes"):
        impl.unpack_bits(torch.zeros(2, dtype=torch.uint8), 1, 17)
    with pytest.raises(ValueError, match="levels must be 1-D with 2\\*\\*bits = 4 entries"):
        impl.unpack_bits(torch.zeros(2, dtype=torch.uint8), 2, 8, torch.zeros(2))


@st.composite
def _signed(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = _LEVEL_DTYPES) -> torch.Tensor:
    """1-D values with +-0.0, +-inf and NaN sprinkled in (or none), of any length around byte edges."""
    numel = draw(st.one_of(st.sampled_from([0, 1, 7, 8, 9, 63, 64, 65]), st.integers(0, 3000)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    specials = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0], dtype=torch.float64)
    where = torch.rand(numel, generator=g) < draw(st.sampled_from([0.0, 0.0, 0.01, 0.5]))
    x[where] = specials[torch.randint(0, specials.numel(), (numel,), generator=g)][where]
    return x.to(draw(st.sampled_from(dtypes)))


def _sign_chunks(enabled: bool) -> contextlib.AbstractContextManager[object]:
    """``_tiny_chunks`` plus sign_encode's fixed sum chunks of 8 or more elements."""
    if not enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(_tiny_chunks(True))
    stack.enter_context(mock.patch.object(cpu_codec, "_SIGN_CHUNK", 16))
    return stack


@_SETTINGS
@given(x=_signed(), many_chunks=st.booleans())
def test_sign_encode_matches_reference(x: torch.Tensor, many_chunks: bool) -> None:
    """Bits and count exactly; the float64 sums to float64 rounding (another order), NaN and inf as the reference."""
    with _sign_chunks(many_chunks):
        packed, stats = cpu_codec.sign_encode(x)
    expected_packed, expected = reference.sign_encode(x)
    assert_identical(packed, expected_packed)
    assert torch.equal(packed, reference.pack_bits(x >= 0, 1))
    assert stats.dtype == torch.float64 and stats[0] == expected[0] == int((x >= 0).sum())
    assert torch.allclose(
        stats, expected, rtol=1e-12, atol=1e-12 * float(x.double().abs().nan_to_num().sum()), equal_nan=True
    )
    assert torch.equal(stats.isnan(), expected.isnan()) and torch.equal(stats.isinf(), expected.isinf())


@_SETTINGS
@given(
    numel=st.one_of(st.sampled_from([0, 1, 7, 8, 9, 65]), st.integers(0, 3000)),
    senders=st.integers(1, 6),
    dtype=st.sampled_from(_LEVEL_DTYPES),
    seed=st.integers(0, 2**31),
    many_chunks=st.booleans(),
)
def test_sign_decode_sum_matches_reference(
    numel: int, senders: int, dtype: torch.dtype, seed: int, many_chunks: bool
) -> None:
    """The one-pass decode of several senders equals adding each sender's levels[bit] to zeros in order."""
    g = torch.Generator().manual_seed(seed)
    packed = [torch.randint(0, 256, (-(-numel // 8),), generator=g, dtype=torch.uint8) for _ in range(senders)]
    levels = torch.randn(senders, 2, generator=g, dtype=torch.float64).to(dtype)
    levels[0, 0] = -0.0 if senders > 1 else levels[0, 0]
    out = torch.full((numel,), math.nan, dtype=dtype)
    with _tiny_chunks(many_chunks):
        actual = cpu_codec.sign_decode_sum(packed, levels, out)
    assert actual is out
    expected = torch.zeros(numel, dtype=dtype)
    for p, pair in zip(packed, levels, strict=True):
        expected += reference.unpack_bits(p, 1, numel, pair)
    assert_identical(out, expected)
    assert_identical(out, reference.sign_decode_sum(packed, levels, torch.empty(numel, dtype=dtype)))


@_SETTINGS
@given(x=_signed(), seed=st.integers(0, 2**31), many_chunks=st.booleans())
def test_sign_residual_matches_reference(x: torch.Tensor, seed: int, many_chunks: bool) -> None:
    """x minus the level of its own sign bit, in place: what decompress of its sign code drops."""
    levels = torch.randn(2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(x.dtype)
    expected = x - reference.unpack_bits(reference.pack_bits(x >= 0, 1), 1, x.numel(), levels)
    actual = x.clone()
    with _tiny_chunks(many_chunks):
        returned = cpu_codec.sign_residual(actual, levels)
    assert returned is actual
    assert_identical(actual, expected)
    assert_identical(reference.sign_residual(x.clone(), levels), expected)


@_SETTINGS
@given(
    numel=st.integers(1, 300),
    pairs=st.integers(0, 400),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_index_add_matches_an_in_order_loop(
    numel: int, pairs: int, seed: int, dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    """Each value added at its index, in order, into what ``out`` held (duplicates summed in order)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(numel, generator=g, dtype=dtype)
    indices = torch.randint(0, numel, (pairs,), generator=g).to(index_dtype)
    values = torch.randn(pairs, generator=g, dtype=dtype)
    expected = start.clone()
    for i, v in zip(indices.tolist(), values, strict=True):  # in order, in out's dtype
        expected[i] += v
    for impl in (cpu_codec, reference):
        out = start.clone()
        assert impl.index_add(out, indices, values) is out
        assert_identical(out, expected)


@_SETTINGS
@given(
    numel=st.integers(1, 3000),
    group=st.integers(1, 300),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    many_chunks=st.booleans(),
)
def test_dequantize_add_matches_reference_and_definition(
    numel: int, group: int, seed: int, dtype: torch.dtype, many_chunks: bool
) -> None:
    """Each code times its group's scale, added into out: bit for bit the reference (whatever the
    chunking), and the float64 definition up to the two roundings in out's dtype."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(numel, generator=g, dtype=dtype)
    codes = torch.randint(-127, 128, (numel,), generator=g, dtype=torch.int8)
    scales = torch.rand(-(-numel // group), generator=g, dtype=dtype)
    actual = start.clone()
    with _tiny_chunks(many_chunks):
        assert cpu_codec.dequantize_add(actual, codes, scales, group) is actual
    expected = reference.dequantize_add(start.clone(), codes, scales, group)
    assert_identical(actual, expected)
    definition = start.double() + codes.double() * scales.double().repeat_interleave(group)[:numel]
    eps = torch.finfo(dtype).eps
    assert ((actual.double() - definition).abs() <= 2 * eps * (definition.abs() + 127 * scales.max())).all()


@_SETTINGS
@given(
    x=_signed(),
    group=st.integers(1, 300),
    levels=st.integers(1, 127),
    seed=st.integers(0, 2**31),
    special=st.sampled_from([None, math.nan, -0.0, math.inf]),
    many_chunks=st.booleans(),
)
def test_quantize_levels_matches_reference(
    x: torch.Tensor, group: int, levels: int, seed: int, special: float | None, many_chunks: bool
) -> None:
    """QSGD's signed levels: bit for bit the reference, whatever the chunking, NaN (level 0), -0.0
    and infinity (clamped to the top level) included; and within 0..levels in magnitude."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    if special is not None and x.numel():
        x[0] = special
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(-(-x.numel() // group), generator=g, dtype=torch.float64) * levels).to(x.dtype)
    dither = torch.rand(x.numel(), generator=g, dtype=torch.float64).to(x.dtype)
    with _tiny_chunks(many_chunks):
        actual = cpu_codec.quantize_levels(x, scales, dither, group, levels)
    expected = reference.quantize_levels(x, scales, dither, group, levels)
    assert_identical(actual, expected)
    assert actual.dtype == torch.int8 and bool((actual.abs() <= levels).all())


@pytest.mark.parametrize("impl", [cpu_codec, reference])
def test_dequantize_add_rejects_bad_input(impl) -> None:
    out = torch.zeros(5)
    codes = torch.zeros(5, dtype=torch.int8)
    with pytest.raises(ValueError, match="one per group"):
        impl.dequantize_add(out, codes, torch.ones(2), 2)  # 5 elements in groups of 2: 3 scales
    with pytest.raises(ValueError, match="codes must be int8"):
        impl.dequantize_add(out, codes.float(), torch.ones(3), 2)
    with pytest.raises(ValueError, match="float32 or float64"):
        impl.dequantize_add(out.half(), codes, torch.ones(3).half(), 2)
    assert torch.equal(out, torch.zeros(5))


@pytest.mark.parametrize("impl", [cpu_codec, reference])
def test_index_add_rejects_bad_input(impl) -> None:
    out = torch.zeros(4)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 4\)"):
        impl.index_add(out, torch.tensor([1, 4]), torch.ones(2))
    with pytest.raises(ValueError, match="of the values' dtype"):
        impl.index_add(out, torch.tensor([1]), torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D, contiguous"):
        impl.index_add(torch.zeros(4, 2)[:, 0], torch.tensor([1]), torch.ones(1))
    assert torch.equal(out, torch.zeros(4))  # a bad call adds nothing


@pytest.mark.parametrize("impl", [cpu_codec, reference])
def test_sign_kernels_reject_bad_input(impl) -> None:
    with pytest.raises(ValueError, match="1-D floating-point"):
        impl.sign_encode(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"levels must be \[2, 2\]"):
        impl.sign_decode_sum(
            [torch.zeros(1, dtype=torch.uint8)] * 2, torch.zeros(2, 2, dtype=torch.float64), torch.zeros(8)
        )
    with pytest.raises(ValueError, match="ceil"):
        impl.sign_decode_sum([torch.zeros(2, dtype=torch.uint8)], torch.zeros(1, 2), torch.zeros(8))
    with pytest.raises(ValueError, match="2 values"):
        impl.sign_residual(torch.zeros(4), torch.zeros(3))


def test_sign_docstring_examples() -> None:
    packed, stats = kernels.sign_encode(torch.tensor([1.0, -2.0, 0.0]))
    assert packed.tolist() == [5] and stats.tolist() == [2.0, 1.0, -2.0]
    out = kernels.sign_decode_sum(
        [torch.tensor([1], dtype=torch.uint8), torch.tensor([3], dtype=torch.uint8)],
        torch.tensor([[-1.0, 1.0], [-2.0, 2.0]]),
        torch.empty(2),
    )
    assert out.tolist() == [3.0, 1.0]
    assert kernels.sign_residual(torch.tensor([3.0, -1.0]), torch.tensor([-2.0, 2.0])).tolist() == [1.0, 1.0]
    assert kernels.topk_abs(torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0]), 3).tolist() == [1, 2, 3]

"""Property tests: every numba CPU kernel returns exactly what the torch reference returns.

Each test also draws ``many_chunks``: when set, the kernels run their parallel version split into
many tiny chunks, so chunk boundaries fall inside the generated inputs.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import (
    all_in_one_owner,
    assert_identical,
    examples,
    force_many_chunks,
    partitions,
    positions_and_values,
    sparse_2d,
    sparse_tensor,
)
from zensync.kernels import cpu, reference

_SETTINGS = settings(deadline=None, max_examples=examples(60), suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(x2d=sparse_2d(), many_chunks=st.booleans())
def test_nonzero_items_matches_reference(x2d: torch.Tensor, many_chunks: bool) -> None:
    with force_many_chunks(many_chunks):
        actual = cpu.nonzero_items(x2d)
    assert_identical(actual, reference.nonzero_items(x2d))


@st.composite
def _wide_rows(draw: st.DrawFn) -> torch.Tensor:
    """Rows of 1..200 elements (the scan's narrow and wide paths) with one non-zero element at a drawn
    place of each non-zero row (first, last or between), the other elements 0.0 or -0.0."""
    num_items = draw(st.sampled_from([0, 1, 63, 64, 65, 130, 400]))
    item_numel = draw(st.one_of(st.integers(1, 16), st.integers(17, 200)))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    x2d = torch.where(torch.rand(num_items, item_numel, generator=generator) < 0.5, 0.0, -0.0).to(dtype)
    rows = torch.rand(num_items, generator=generator) < draw(st.sampled_from([0.0, 0.02, 0.3, 1.0]))
    where = draw(st.sampled_from(["first", "last", "any"]))
    for row in rows.nonzero().flatten().tolist():
        col = {"first": 0, "last": item_numel - 1}.get(where, int(torch.randint(item_numel, (1,), generator=generator)))
        x2d[row, col] = draw(st.sampled_from([1.0, -2.5, float("nan"), float("-inf"), torch.finfo(dtype).tiny / 4]))
    return x2d


@_SETTINGS
@given(x2d=_wide_rows(), many_chunks=st.booleans())
def test_nonzero_items_finds_one_element_anywhere_in_a_row(x2d: torch.Tensor, many_chunks: bool) -> None:
    """A row is non-zero when any one element is, wherever it sits; -0.0 is zero."""
    with force_many_chunks(many_chunks):
        actual = cpu.nonzero_items(x2d)
    assert_identical(actual, reference.nonzero_items(x2d))


@_SETTINGS
@given(data=st.data(), x2d=sparse_2d(), many_chunks=st.booleans())
def test_bucket_nonzero_matches_reference(data: st.DataObject, x2d: torch.Tensor, many_chunks: bool) -> None:
    part = data.draw(partitions(x2d.shape[0]))
    with force_many_chunks(many_chunks):
        actual = cpu.bucket_nonzero(x2d, part)
    assert_identical(actual, reference.bucket_nonzero(x2d, part))
    items, _, counts = actual
    assert int(counts.sum()) == items.numel()


@_SETTINGS
@given(
    data=st.data(),
    num_items=st.one_of(st.integers(1, 5000), st.integers(2**31 - 2, 2**31 + 2), st.integers(1, 2**62 - 1)),
    many_chunks=st.booleans(),
)
def test_permute_matches_reference_and_round_trips(data: st.DataObject, num_items: int, many_chunks: bool) -> None:
    part = data.draw(partitions(num_items))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    items = torch.randint(0, num_items, (data.draw(st.integers(0, 300)),), generator=generator)
    with force_many_chunks(many_chunks):
        perm = cpu.permute(items, part)
        back = cpu.unpermute(perm, part)
        inverse = cpu.unpermute(items, part)
    assert_identical(perm, reference.permute(items, part))
    assert_identical(inverse, reference.unpermute(items, part))
    assert_identical(back, items)
    assert bool(((perm >= 0) & (perm < num_items)).all())


@_SETTINGS
@given(data=st.data(), num_items=st.integers(1, 4000), item_numel=st.integers(1, 3), many_chunks=st.booleans())
def test_bucket_nonzero_all_in_one_owner(
    data: st.DataObject, num_items: int, item_numel: int, many_chunks: bool
) -> None:
    """Adversarial skew: every non-zero item hashes into one owner's range."""
    x2d, part, owner, positions = data.draw(all_in_one_owner(num_items, item_numel))
    with force_many_chunks(many_chunks):
        actual = cpu.bucket_nonzero(x2d, part)
    assert_identical(actual, reference.bucket_nonzero(x2d, part))
    expected_counts = torch.zeros(part.num_owners, dtype=torch.int64)
    expected_counts[owner] = positions.numel()
    assert_identical(actual[2], expected_counts)
    assert_identical(actual[0], reference.unpermute(positions, part).sort().values)


@_SETTINGS
@given(inputs=positions_and_values(), many_chunks=st.booleans())
def test_aggregate_matches_reference(inputs: tuple[torch.Tensor, torch.Tensor], many_chunks: bool) -> None:
    positions, values = inputs
    with force_many_chunks(many_chunks):
        actual = cpu.aggregate(positions, values)
    assert_identical(actual, reference.aggregate(positions, values))


@_SETTINGS
@given(
    length=st.integers(0, 5000),
    density=st.sampled_from([0.0, 0.01, 0.5, 1.0]),
    seed=st.integers(0, 2**31 - 1),
    many_chunks=st.booleans(),
)
def test_bitmap_round_trip_matches_reference(length: int, density: float, seed: int, many_chunks: bool) -> None:
    positions = reference.nonzero_items(sparse_tensor(length, 1, torch.float32, density, seed))
    with force_many_chunks(many_chunks):
        words = cpu.bitmap_encode(positions, length)
        decoded = cpu.bitmap_decode(words, length)
    assert_identical(words, reference.bitmap_encode(positions, length))
    assert_identical(decoded, positions)


@_SETTINGS
@given(
    num_words=st.integers(0, 200),
    length=st.integers(0, 7000),
    offset=st.integers(0, 1),
    seed=st.integers(0, 2**31 - 1),
    many_chunks=st.booleans(),
)
def test_bitmap_decode_of_any_words_matches_reference(
    num_words: int, length: int, offset: int, seed: int, many_chunks: bool
) -> None:
    """Arbitrary words (sign bit included), lengths shorter or longer than the words, odd/misaligned views."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (num_words + offset,), generator=generator, dtype=torch.int64)
    words = words.to(torch.int32)[offset:]
    with force_many_chunks(many_chunks):
        actual = cpu.bitmap_decode(words, length)
    assert_identical(actual, reference.bitmap_decode(words, length))

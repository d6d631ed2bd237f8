"""GPU tests: every CUDA kernel of ``zensync.kernels.cuda`` returns what the torch reference returns.

Inputs are drawn on the CPU (Hypothesis, ``tests/strategies.py``), the kernel runs on the GPU and the
oracle is ``zensync.kernels.reference`` on the CPU copy. Results must be identical, except that
``bucket_nonzero`` orders the items of an owner by hash slot: items are compared per owner after
sorting, positions item by item, counts exactly. Sums use integer-valued data, so the order of the
atomic additions cannot change them.

Every test takes the ``device`` fixture. Here it is the GPU, and every test is skipped, with the
reason, when torch sees no CUDA device or when the extension (prebuilt by setup.py or JIT-built from
cuda_ext/csrc) does not load. Run on a GPU machine with ``bash cuda_ext/gpu_check.sh`` or
``python -m pytest -q tests/gpu``. ``tests/emulated/test_cuda_emulated.py`` reruns these tests, unchanged,
on the CPU emulation of the same kernels (``cuda_ext/emulation``) by overriding ``device``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import (
    DENSE_DTYPES,
    all_in_one_owner,
    assert_identical,
    partitions,
    sparse_2d,
    sparse_tensor,
)
from zensync.kernels import cuda, reference
from zensync.sync.partition import make_partition

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"
)
"""Applies to the tests as collected here, not to their reruns in tests/emulated."""


@pytest.fixture(scope="module")
def device() -> torch.device:
    """Where the kernels under test run: the GPU, through ``zensync.kernels.cuda`` and the real extension.

    Every test takes it, so another module can rerun these tests on another backend by overriding
    this fixture (tests/emulated/test_cuda_emulated.py: the same kernels on CPU threads).
    """
    if not cuda.available():
        pytest.skip(f"the zensync CUDA extension did not load: {cuda.unavailable_reason()}")
    return torch.device("cuda")


_SETTINGS = settings(
    deadline=None,
    max_examples=int(os.environ.get("ZENSYNC_GPU_TEST_EXAMPLES", "50")),
    suppress_health_check=[HealthCheck.too_slow],
)
"""50 examples per property; ZENSYNC_GPU_TEST_EXAMPLES lowers it for slow backends (ThreadSanitizer runs)."""
_INTEGER_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


# ---------------------------------------------------------------- bucket_nonzero (Zen's hashing)


def _by_owner(items: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Items ascending within each owner (positions moved with their items), owners in order."""
    items, positions, counts = items.cpu(), positions.cpu(), counts.cpu()
    assert int(counts.sum()) == items.numel() == positions.numel()
    sorted_items, sorted_positions = [], []
    for owner_items, owner_positions in zip(
        items.split(counts.tolist()), positions.split(counts.tolist()), strict=True
    ):
        order = torch.argsort(owner_items)
        sorted_items.append(owner_items[order])
        sorted_positions.append(owner_positions[order])
    empty = torch.empty(0, dtype=torch.int64)
    return torch.cat([empty, *sorted_items]), torch.cat([empty, *sorted_positions]), counts


def _check_buckets(device: torch.device, x2d: torch.Tensor, part, **kwargs: int) -> None:
    actual = cuda.bucket_nonzero(x2d.to(device), part, **kwargs)
    assert all(t.device.type == device.type and t.dtype == torch.int64 for t in actual)
    assert_identical(_by_owner(*actual), reference.bucket_nonzero(x2d, part))


@_SETTINGS
@given(
    data=st.data(),
    x2d=sparse_2d(),
    num_hashes=st.integers(1, 4),
    parallel_slots=st.sampled_from([0, 0, 1, 2, 7]),
    serial_slots=st.sampled_from([0, 0, 1, 3]),
)
def test_bucket_nonzero_matches_reference(
    device: torch.device,
    data: st.DataObject,
    x2d: torch.Tensor,
    num_hashes: int,
    parallel_slots: int,
    serial_slots: int,
) -> None:
    """Any dtype, NaN/-0.0, empty and all-non-zero inputs; tiny regions force the serial path and its re-run."""
    part = data.draw(partitions(x2d.shape[0]))
    _check_buckets(device, x2d, part, num_hashes=num_hashes, parallel_slots=parallel_slots, serial_slots=serial_slots)


@_SETTINGS
@given(
    data=st.data(),
    num_items=st.integers(1, 20000),
    hashed=st.booleans(),
    serial_slots=st.sampled_from([0, 1, 5]),
)
def test_bucket_nonzero_adversarial_collisions_lose_nothing(
    device: torch.device, data: st.DataObject, num_items: int, hashed: bool, serial_slots: int
) -> None:
    """Every item non-zero and one parallel slot per owner: nearly all go serial; small r2 overflows and re-runs."""
    num_owners = data.draw(st.integers(1, 9))
    part = make_partition(num_items, num_owners, seed=data.draw(st.integers(0, 2**62)), hashed=hashed)
    x2d = torch.ones(num_items, 1)
    _check_buckets(
        device, x2d, part, num_hashes=data.draw(st.integers(1, 3)), parallel_slots=1, serial_slots=serial_slots
    )


@_SETTINGS
@given(data=st.data(), num_items=st.integers(1, 20000), item_numel=st.integers(1, 3))
def test_bucket_nonzero_all_in_one_owner(
    device: torch.device, data: st.DataObject, num_items: int, item_numel: int
) -> None:
    """Adversarial skew: every non-zero item hashes into one owner, far beyond its automatic r1 + r2."""
    x2d, part, _, _ = data.draw(all_in_one_owner(num_items, item_numel))
    _check_buckets(device, x2d, part)


@pytest.mark.parametrize("dtype", [*DENSE_DTYPES, *_INTEGER_DTYPES])
def test_bucket_nonzero_dtypes_and_empty_shapes(device: torch.device, dtype: torch.dtype) -> None:
    part = make_partition(3000, 5, seed=11)
    x2d = sparse_tensor(3000, 2, torch.float64, 0.3, seed=5).mul(3).to(dtype)
    _check_buckets(device, x2d, part)
    _check_buckets(device, torch.zeros(3000, 2, dtype=dtype), part)  # nothing non-zero
    _check_buckets(device, torch.ones(3000, 1, dtype=dtype), part)  # everything non-zero
    _check_buckets(device, torch.zeros(0, 2, dtype=dtype), make_partition(0, 3, seed=1))  # no items
    _check_buckets(device, torch.zeros(10, 0, dtype=dtype), make_partition(10, 3, seed=1))  # empty items


def test_bucket_nonzero_rejects_bad_arguments(device: torch.device) -> None:
    part = make_partition(10, 2, seed=0)
    with pytest.raises(ValueError, match=r"more than part\.num_items"):
        cuda.bucket_nonzero(torch.ones(11, 1).to(device), part)
    with pytest.raises(ValueError, match="num_hashes"):
        cuda.bucket_nonzero(torch.ones(10, 1).to(device), part, num_hashes=0)


# ---------------------------------------------------------------- bitmaps


@_SETTINGS
@given(
    length=st.one_of(st.sampled_from([0, 1, 31, 32, 33, 64]), st.integers(0, 100_000)),
    fraction=st.sampled_from([0.0, 0.01, 0.5, 1.0]),
    duplicates=st.booleans(),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_bitmap_round_trip_matches_reference(
    device: torch.device, length: int, fraction: float, duplicates: bool, index_dtype: torch.dtype, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    limit = 32 * -(-length // 32)  # positions up to the last word's end are valid, as in the reference
    count = int(fraction * limit)
    if duplicates and limit:
        positions = torch.randint(0, limit, (count,), generator=generator)
    else:
        positions = torch.randperm(limit, generator=generator)[:count]
    positions = positions.to(index_dtype)
    words = cuda.bitmap_encode(positions.to(device), length)
    assert_identical(words.cpu(), reference.bitmap_encode(positions, length))
    assert_identical(cuda.bitmap_decode(words, length).cpu(), reference.bitmap_decode(words.cpu(), length))


@_SETTINGS
@given(num_words=st.integers(0, 5000), length=st.integers(0, 200_000), seed=st.integers(0, 2**31 - 1))
def test_bitmap_decode_random_words(device: torch.device, num_words: int, length: int, seed: int) -> None:
    """Sign bits, bits past ``length`` and ``length`` past the words are all handled as the reference does."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (num_words,), generator=generator, dtype=torch.int64).to(torch.int32)
    assert_identical(cuda.bitmap_decode(words.to(device), length).cpu(), reference.bitmap_decode(words, length))


def test_bitmap_encode_rejects_positions_out_of_range(device: torch.device) -> None:
    with pytest.raises(IndexError, match="outside"):
        cuda.bitmap_encode(torch.tensor([3, 64]).to(device), 40)
    with pytest.raises(IndexError, match="outside"):
        cuda.bitmap_encode(torch.tensor([-1]).to(device), 40)


# ---------------------------------------------------------------- top-k


@st.composite
def _magnitudes(draw: st.DrawFn) -> torch.Tensor:
    """Values with heavy ties (few distinct), or wide random ones, plus NaN/Inf/-0.0 and subnormals."""
    numel = draw(st.one_of(st.sampled_from([0, 1, 2, 255, 256, 257, 2048, 2049]), st.integers(0, 20000)))
    dtype = draw(st.sampled_from(DENSE_DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    if draw(st.booleans()):
        generator = torch.Generator().manual_seed(seed)
        distinct = draw(st.integers(1, 5))
        x = torch.randint(-distinct, distinct + 1, (numel,), generator=generator).to(dtype)
    else:
        x = sparse_tensor(numel, 1, dtype, draw(st.sampled_from([0.05, 0.5, 1.0])), seed).reshape(-1)
    if draw(st.booleans()) and numel:
        specials = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0], dtype=torch.float64)
        where = torch.randint(0, numel, (max(1, numel // 50),), generator=torch.Generator().manual_seed(seed + 1))
        x[where] = specials[torch.arange(where.numel()) % specials.numel()].to(dtype)
    return x


def _draw_k(data: st.DataObject, numel: int) -> int:
    return data.draw(st.one_of(st.sampled_from([0, 1, max(0, numel - 1), numel, numel + 3]), st.integers(0, numel)))


@_SETTINGS
@given(data=st.data(), magnitudes=_magnitudes())
def test_topk_matches_reference(device: torch.device, data: st.DataObject, magnitudes: torch.Tensor) -> None:
    k = _draw_k(data, magnitudes.numel())
    assert_identical(cuda.topk(magnitudes.to(device), k).cpu(), reference.topk(magnitudes, k))


@_SETTINGS
@given(
    data=st.data(),
    magnitudes=_magnitudes(),
    threshold=st.one_of(st.sampled_from([0.0, -1.0, 1e30, math.inf, math.nan]), st.floats(-3.0, 3.0)),
    relax_factor=st.sampled_from([0.1, 0.5, 0.8, 0.99]),
    max_tries=st.integers(0, 10),
)
def test_sampled_topk_matches_reference(
    device: torch.device,
    data: st.DataObject,
    magnitudes: torch.Tensor,
    threshold: float,
    relax_factor: float,
    max_tries: int,
) -> None:
    k = _draw_k(data, magnitudes.numel())
    actual = cuda.sampled_topk(magnitudes.to(device), k, threshold, relax_factor=relax_factor, max_tries=max_tries)
    expected = reference.sampled_topk(magnitudes, k, threshold, relax_factor=relax_factor, max_tries=max_tries)
    assert_identical(actual.cpu(), expected)
    assert_identical(actual.cpu(), reference.topk(magnitudes, k))


def test_topk_worked_examples(device: torch.device) -> None:
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0])
    assert cuda.topk(x.to(device), 3).tolist() == [1, 2, 3]
    assert cuda.sampled_topk(x.to(device), 3, threshold=2.5).tolist() == [1, 2, 3]
    nan_ties = torch.tensor([math.nan, 1.0, math.nan, math.nan])
    assert cuda.topk(nan_ties.to(device), 2).tolist() == [0, 2]
    zeros = torch.tensor([-0.0, 0.0, -1.0, -0.0])
    assert cuda.topk(zeros.to(device), 2).tolist() == [0, 1]


# ---------------------------------------------------------------- scatter_add


@_SETTINGS
@given(
    numel=st.integers(0, 5000),
    num_values=st.integers(0, 3000),
    dtype=st.sampled_from(DENSE_DTYPES),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_scatter_add_matches_reference(
    device: torch.device, numel: int, num_values: int, dtype: torch.dtype, index_dtype: torch.dtype, seed: int
) -> None:
    """Integer values in [-3, 3] with at most 8 duplicates per index: sums stay exact in every dtype."""
    if numel == 0:
        num_values = 0
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(numel * 8, generator=generator)[:num_values] % max(numel, 1)
    values = torch.randint(-3, 4, (indices.numel(),), generator=generator).to(dtype)
    indices = indices.to(index_dtype)
    actual = cuda.scatter_add(indices.to(device), values.to(device), numel)
    assert_identical(actual.cpu(), reference.scatter_add(indices, values, numel))


def test_scatter_add_rejects_indices_out_of_range(device: torch.device) -> None:
    values = torch.ones(3).to(device)
    with pytest.raises(ValueError, match="must lie in"):
        cuda.scatter_add(torch.tensor([0, 4, 1]).to(device), values, 4)
    with pytest.raises(ValueError, match="must lie in"):
        cuda.scatter_add(torch.tensor([0, -1, 1], dtype=torch.int32).to(device), values, 4)


# ---------------------------------------------------------------- pack / unpack


@_SETTINGS
@given(
    numel=st.one_of(st.sampled_from([0, 1, 7, 8, 9]), st.integers(0, 50_000)),
    bits=st.sampled_from(reference.PACK_WIDTHS),
    as_bool=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_match_reference(device: torch.device, numel: int, bits: int, as_bool: bool, seed: int) -> None:
    """Codes carry junk above their low ``bits`` bits, which packing must drop."""
    codes = torch.randint(0, 256, (numel,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    if as_bool:
        codes = codes.bool()
    packed = cuda.pack_bits(codes.to(device), bits)
    expected = reference.pack_bits(codes, bits)
    assert_identical(packed.cpu(), expected)
    assert_identical(cuda.unpack_bits(packed, bits, numel).cpu(), reference.unpack_bits(expected, bits, numel))
    levels = torch.arange(1 << bits, dtype=torch.float32) - 0.5
    unpacked = cuda.unpack_bits(packed, bits, numel, levels.to(device))
    assert_identical(unpacked.cpu(), reference.unpack_bits(expected, bits, numel, levels))


# ---------------------------------------------------------------- int64 sizes


@pytest.mark.slow
def test_sizes_beyond_int32(device: torch.device) -> None:
    """2^31 + 100 elements: grid-stride loops, tiles and outputs index with int64 (about 12 GB of GPU memory)."""
    numel = 2**31 + 100
    codes = torch.zeros(numel, dtype=torch.uint8, device=device)
    codes[-3:] = torch.tensor([1, 0, 1], dtype=torch.uint8, device=device)
    packed = cuda.pack_bits(codes, 1)
    assert packed.numel() == -(-numel // 8)
    assert cuda.unpack_bits(packed, 1, numel)[-4:].tolist() == [0, 1, 0, 1]
    del codes
    tail = torch.tensor([numel - 5, numel - 1], device=device)
    assert cuda.bitmap_decode(cuda.bitmap_encode(tail, numel), numel).tolist() == tail.tolist()
    assert cuda.scatter_add(tail, torch.ones(2, device=device), numel)[-5:].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    magnitudes = torch.zeros(numel, dtype=torch.float16, device=device)
    magnitudes[tail] = 1.0
    assert cuda.topk(magnitudes, 2).tolist() == tail.tolist()
    assert cuda.sampled_topk(magnitudes, 2, threshold=0.5).tolist() == tail.tolist()

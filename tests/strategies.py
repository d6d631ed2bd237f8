"""Shared Hypothesis strategies and exact-equality helpers for the kernel tests.

Tensors are generated from a drawn seed with a ``torch.Generator`` (fast for thousands of items);
Hypothesis draws the shape, dtype, density, special values and partition.

Every property test sizes its run with ``examples(n)``: n examples, times ``ZENSYNC_HYPOTHESIS_SCALE``
(default 1) for a thorough run, e.g. ``ZENSYNC_HYPOTHESIS_SCALE=20 python -m pytest tests/property``.
An explicit ``@settings(max_examples=...)`` overrides any Hypothesis profile, hence the multiplier.
"""

from __future__ import annotations

import contextlib
import math
import os
from unittest import mock

import torch
from hypothesis import strategies as st

from zensync.kernels import reference
from zensync.kernels.hashing import Partition
from zensync.sync.partition import make_partition

__all__ = [
    "DENSE_DTYPES",
    "SCALE_ENV",
    "SUM_DTYPES",
    "all_in_one_owner",
    "assert_identical",
    "examples",
    "force_many_chunks",
    "partitions",
    "positions_and_values",
    "sparse_2d",
    "sparse_tensor",
]

DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SUM_DTYPES = (torch.float32, torch.float64)
_SPECIAL_VALUES = (math.nan, math.inf, -math.inf, -0.0, 0.0)
SCALE_ENV = "ZENSYNC_HYPOTHESIS_SCALE"
"""Environment variable: a positive integer that multiplies every property test's example count."""


def examples(n: int) -> int:
    """``n`` Hypothesis examples, times the positive integer in ``ZENSYNC_HYPOTHESIS_SCALE`` (default 1)."""
    text = os.environ.get(SCALE_ENV, "1")
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{SCALE_ENV}={text!r} must be a positive integer: the factor on each test's examples")
    return n * int(text)


def sparse_tensor(
    num_items: int,
    item_numel: int,
    dtype: torch.dtype,
    density: float,
    seed: int,
    special_fraction: float = 0.0,
) -> torch.Tensor:
    """(num_items, item_numel) with about ``density`` of elements non-zero, plus NaN/Inf/+-0.0 and subnormals."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_items, item_numel)
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    x[torch.rand(shape, generator=generator) >= density] = 0.0
    if special_fraction > 0.0:
        specials = torch.tensor([*_SPECIAL_VALUES, torch.finfo(dtype).tiny / 4], dtype=torch.float64)
        where = torch.rand(shape, generator=generator) < special_fraction
        picks = torch.randint(0, specials.numel(), shape, generator=generator)
        x[where] = specials[picks[where]]
    return x.to(dtype)


@st.composite
def sparse_2d(draw: st.DrawFn, max_items: int = 3000, max_item_numel: int = 4) -> torch.Tensor:
    """A 2-D tensor of items (rows): 0 items and all-zero / all-non-zero included."""
    num_items = draw(st.one_of(st.sampled_from([0, 1, 2, 63, 64, 65]), st.integers(0, max_items)))
    item_numel = draw(st.integers(1, max_item_numel))
    dtype = draw(st.sampled_from(DENSE_DTYPES))
    density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]))
    special_fraction = draw(st.sampled_from([0.0, 0.0, 0.1]))
    seed = draw(st.integers(0, 2**31 - 1))
    return sparse_tensor(num_items, item_numel, dtype, density, seed, special_fraction)


@st.composite
def partitions(draw: st.DrawFn, num_items: int) -> Partition:
    """A partition of ``num_items`` items over 1..9 owners, hashed or not."""
    num_owners = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**62))
    return make_partition(num_items, num_owners, seed=seed, hashed=draw(st.booleans()))


@st.composite
def all_in_one_owner(
    draw: st.DrawFn, num_items: int, item_numel: int
) -> tuple[torch.Tensor, Partition, int, torch.Tensor]:
    """Adversarial skew for bucketing: (x2d, part, owner, positions), every non-zero item of x2d (float16
    or float32) in that one owner's range, at those perm-space positions (any number, up to all)."""
    part = draw(partitions(num_items))
    owner = draw(st.integers(0, part.num_owners - 1))
    base, length = part.owner_range(owner)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    positions = base + torch.randperm(length, generator=generator)[: draw(st.integers(0, length))]
    x2d = torch.zeros(num_items, item_numel, dtype=draw(st.sampled_from([torch.float16, torch.float32])))
    x2d[reference.unpermute(positions, part), -1] = 1.0
    return x2d, part, owner, positions


@st.composite
def positions_and_values(draw: st.DrawFn, max_k: int = 5000) -> tuple[torch.Tensor, torch.Tensor]:
    """Aggregation input: heavy duplicates, all unique, or a huge span; values with wide magnitudes and specials."""
    k = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, max_k)))
    item_numel = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(SUM_DTYPES))
    layout = draw(st.sampled_from(["duplicates", "unique", "wide", "negative"]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if layout == "duplicates":
        positions = torch.randint(0, draw(st.integers(1, 20)), (k,), generator=generator)
    elif layout == "unique":
        positions = torch.randperm(k, generator=generator) * draw(st.integers(1, 1000))
    elif layout == "wide":
        positions = torch.randint(0, 2**62, (k,), generator=generator)
    else:
        positions = torch.randint(-(2**40), 2**40, (k,), generator=generator)
    # Magnitudes over 12 decades make the sum depend on the addition order.
    values = torch.randn(k, item_numel, generator=generator, dtype=torch.float64)
    values *= torch.logspace(-6, 6, max(k, 1), dtype=torch.float64)[torch.randperm(k, generator=generator)].unsqueeze(1)
    if draw(st.booleans()):
        values[torch.rand(k, item_numel, generator=generator) < 0.05] = draw(st.sampled_from(_SPECIAL_VALUES))
    return positions, values.to(dtype)


def _canonical_bits(x: torch.Tensor) -> torch.Tensor:
    """Integer bits of ``x`` with every NaN replaced by one NaN (payloads are not part of the contract)."""
    if not x.is_floating_point():
        return x
    bits_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return torch.where(x.isnan(), torch.full_like(x, math.nan), x).view(bits_dtype)


def assert_identical(actual: object, expected: object) -> None:
    """Same structure, dtypes, shapes and bits (NaNs compared as NaN, -0.0 distinct from 0.0)."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_identical(a, e)
        return
    assert isinstance(actual, torch.Tensor), type(actual)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(_canonical_bits(actual), _canonical_bits(expected)), (actual, expected)


def force_many_chunks(enabled: bool = True) -> contextlib.AbstractContextManager[object]:
    """Make ``cpu`` kernels take their parallel version with many tiny chunks, even for small inputs.

    This puts chunk boundaries (and the prefix sums that join chunks) inside every generated input.
    Effective only from the main thread; a no-op context when ``enabled`` is False.
    """
    if not enabled:
        return contextlib.nullcontext()
    from zensync.kernels import cpu

    return mock.patch.multiple(
        cpu,
        _PARALLEL_MIN_SCAN=0,
        _PARALLEL_MIN_HASH=0,
        _PARALLEL_MIN_SUM=0,
        _MIN_CHUNK_WORDS=1,
        _MIN_CHUNK_KEYS=1,
        _CHUNKS_PER_THREAD=8,
    )

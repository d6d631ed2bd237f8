"""The store's block hash (``resilience._compiled_blocks`` through ``blocks``): any one flipped bit of
a block, at any length and place, changes its hash; copying while hashing gives the same hash and
the same bytes; a payload round-trips blocks of any length."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.resilience import _compiled_blocks as kernels
from zensync.resilience.blocks import hash_of, payload_places


def _views(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return raw[: raw.size - raw.size % 8].view(np.uint64), raw


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=1, max_size=300), where=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_one_flipped_bit_changes_the_hash(data: bytes, where: int, bit: int) -> None:
    raw = np.frombuffer(data, dtype=np.uint8).copy()
    starts, lengths = np.zeros(1, np.int64), np.array([raw.size], np.int64)
    before = hash_of(*_views(raw), starts, lengths)
    raw[where % raw.size] ^= np.uint8(1 << bit)
    assert hash_of(*_views(raw), starts, lengths) != before


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(0, 70), min_size=1, max_size=8), seed=st.integers(0, 2**32 - 1))
def test_copy_and_hash_in_one_pass_equals_hash_then_copy(lengths: list[int], seed: int) -> None:
    sizes = np.array(lengths, np.int64)
    places, total = payload_places(sizes)
    src = np.random.default_rng(seed).integers(0, 256, max(total, 8), dtype=np.uint8)
    dst = np.zeros_like(src)
    out = np.empty(sizes.size, np.uint64)
    kernels.copy_hash_blocks(*_views(src), places, *_views(dst), places, sizes, out)
    assert (out == hash_of(*_views(src), places, sizes)).all()
    for start, size in zip(places, sizes, strict=True):
        assert (dst[start : start + size] == src[start : start + size]).all()
    assert len({int(h) for h, n in zip(out, sizes, strict=True) if n}) == len({
        bytes(src[s : s + n]) for s, n in zip(places, sizes, strict=True) if n})  # fmt: skip

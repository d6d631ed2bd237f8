"""The store's block hash (``resilience._compiled_blocks`` through ``blocks``): any one flipped bit of
a block, at any length and place, changes its hash; copying while hashing gives the same hash and
the same bytes; a payload round-trips blocks of any length; a tensor's words are its bytes; each
tensor's digest is its definition's."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.resilience import _compiled_blocks as kernels
from zensync.resilience.blocks import (
    _place_hash,
    entries_for,
    entry_digests,
    hash_bytes,
    hash_of,
    payload_places,
    tensor_words,
)


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


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8,
                              torch.uint8, torch.bool, torch.complex64]),
       shape=st.lists(st.integers(0, 5), max_size=3), seed=st.integers(0, 2**31 - 1),
       view=st.sampled_from(["plain", "transposed", "conj", "neg", "parameter"]))  # fmt: skip
def test_a_tensors_words_are_its_bytes_as_torch_lays_them_out(dtype, shape, seed, view: str) -> None:
    """``tensor_words`` (numpy's views where numpy has the dtype, torch's bytes otherwise) gives the
    bytes of the tensor's values in row-major order, whatever view it is handed."""
    gen = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    if view == "transposed" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif view == "conj" and dtype.is_complex:
        t = t.conj()
    elif view == "neg" and dtype.is_complex:
        t = torch._neg_view(t)
    elif view == "parameter" and dtype.is_floating_point:
        t = torch.nn.Parameter(t)
    words, raw = tensor_words(t)
    want = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()
    assert raw.tobytes() == want.tobytes()
    assert words.tobytes() == want.tobytes()[: want.size - want.size % 8]


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(1, 30), min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1))
def test_digests_hash_each_tensors_table_part_with_its_place(rows: list[int], seed: int) -> None:
    """``entry_digests`` (two compiled calls for every tensor) equals its definition, tensor by
    tensor: the hash of (the hash of the tensor's part of the sums table, the hash of its place)."""
    tensors = {f"t{i}": torch.zeros(n, 8) if n > 1 else torch.zeros(3) for i, n in enumerate(rows)}
    entries, _, nsums = entries_for(tensors)
    sums = np.random.default_rng(seed).integers(0, 2**63, nsums, dtype=np.int64).view(np.uint64)
    want = [hash_bytes(np.array([hash_bytes(sums[e.first : e.first + e.blocks]), _place_hash(e)], np.uint64))
            for e in entries]  # fmt: skip
    assert entry_digests(entries, sums).tolist() == want
    assert entry_digests([], sums).size == 0

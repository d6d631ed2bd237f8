"""Delta replication of a shard (``replicate.pack_delta`` / ``unpack``): a new version sent as the
blocks that changed since a version the receiver holds comes back bit for bit, and only those blocks
travel; a corrupt delta or a missing base is refused and nothing is kept."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.resilience.replicate import pack, pack_delta, unpack
from zensync.resilience.store import CorruptShard, ShardStore

BLOCK = 256


def _state(rows: torch.Tensor, step: int) -> dict:
    return {"model": {"emb": rows, "bias": torch.arange(5.0) + step}, "step": step}


@settings(max_examples=25, deadline=None)
@given(touched=st.sets(st.integers(0, 199), max_size=40), block=st.sampled_from([8, 64, 256, 1000]))
def test_a_delta_rebuilds_the_new_version_bit_for_bit(tmp_path_factory, touched: set[int], block: int) -> None:
    here, there = ShardStore(tmp_path_factory.mktemp("a")), ShardStore(tmp_path_factory.mktemp("b"))
    emb = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    here.save(0, 1, _state(emb, 1))
    unpack(there, pack(here, 0, 1))  # the receiver holds the base
    new = emb.clone()
    new[sorted(touched)] += 1.0
    here.save(0, 2, _state(new, 2))
    blob, fraction = pack_delta(here, 0, 2, 1, block)
    assert unpack(there, blob) == 2
    got = there.load(0, step=2)
    assert torch.equal(got["model"]["emb"], new) and torch.equal(got["model"]["bias"], torch.arange(5.0) + 2)
    # only the blocks holding a touched row or the bias travel (the data: emb, then bias)
    rows_per_block = {i * 256 // block for i in touched} | {(i * 256 + 255) // block for i in touched}
    spans = {b for i in touched for b in range(i * 256 // block, (i * 256 + 255) // block + 1)}
    spans |= set(range(200 * 256 // block, (200 * 256 + 20 - 1) // block + 1))  # the bias's 20 bytes
    nbytes = 200 * 256 + 20
    want = sum(min(block, nbytes - b * block) for b in spans)
    assert fraction == pytest.approx(want / nbytes) and rows_per_block <= spans


def test_a_delta_without_its_base_or_corrupt_is_refused(tmp_path) -> None:
    here, there = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    emb = torch.randn(20, 64)
    here.save(0, 1, _state(emb, 1))
    here.save(0, 2, _state(emb * 2, 2))
    blob, _ = pack_delta(here, 0, 2, 1, BLOCK)
    with pytest.raises(CorruptShard, match="not here"):
        unpack(there, blob)  # the receiver never got step 1
    unpack(there, pack(here, 0, 1))
    flipped = blob.clone()
    flipped[-1] ^= 0xFF
    with pytest.raises(CorruptShard, match="checksum"):
        unpack(there, flipped)
    assert [v.step for v in there.versions(0)] == [1]
    assert unpack(there, blob) == 2 and torch.equal(there.load(0)["model"]["emb"], emb * 2)


def test_versions_of_another_layout_go_whole(tmp_path) -> None:
    store = ShardStore(tmp_path)
    store.save(0, 1, _state(torch.zeros(4, 64), 1))
    store.save(0, 2, _state(torch.zeros(5, 64), 2))  # a row more: offsets moved
    blob, fraction = pack_delta(store, 0, 2, 1, BLOCK)
    assert fraction == 1.0
    other = ShardStore(tmp_path / "other")
    assert unpack(other, blob) == 2

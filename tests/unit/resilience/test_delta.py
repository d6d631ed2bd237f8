"""Delta replication of a shard (``replicate.pack_delta`` / ``unpack``): a chain of new versions, each
sent as the blocks whose hashes changed since a version the receiver holds, comes back bit for bit
on a receiver that overwrites its older versions in place; only those blocks travel; a corrupt delta
or a missing base is refused and nothing complete is kept. Tensors the receiver holds identically in
its own version of the step (data parallel ranks) are donated: not sent, copied there, and checked."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.resilience.replicate import pack, pack_delta, unpack
from zensync.resilience.store import CorruptShard, ShardStore

ROWS, DIM = 200, 64  # float32 rows of 256 bytes: one block each
DATA_BYTES = ROWS * DIM * 4 + 64  # the bias's 20 bytes padded to 64


def _state(rows: torch.Tensor, step: int) -> dict:
    return {"model": {"emb": rows, "bias": torch.arange(5.0) + step}, "step": step}


@settings(max_examples=25, deadline=None)
@given(chain=st.lists(st.sets(st.integers(0, ROWS - 1), max_size=40), min_size=1, max_size=5), listed=st.booleans())
def test_a_chain_of_deltas_rebuilds_every_version_bit_for_bit(tmp_path_factory, chain, listed: bool) -> None:
    here, there = ShardStore(tmp_path_factory.mktemp("a")), ShardStore(tmp_path_factory.mktemp("b"))
    emb = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    here.save(0, 1, _state(emb, 1))
    unpack(there, pack(here, 0, 1))  # the receiver holds the base
    for step, touched in enumerate(chain, start=2):
        emb = emb.clone()
        emb[sorted(touched)] += float(step)
        rows = {"model/emb": np.array(sorted(touched), dtype=np.int64)} if listed else None
        here.save(0, step, _state(emb, step), changed=rows, since=step - 1, audit_rows=8)
        blob, fraction, _ = pack_delta(here, 0, step, step - 1)
        assert unpack(there, blob) == step
        got = there.load(0, step=step)
        assert torch.equal(got["model"]["emb"], emb) and torch.equal(got["model"]["bias"], torch.arange(5.0) + step)
        assert torch.equal(here.load(0, step=step)["model"]["emb"], emb)
        # exactly the touched rows and the bias travel (each block padded to 8 bytes)
        assert fraction == pytest.approx((len(touched) * DIM * 4 + 24) / DATA_BYTES)
        assert [v.step for v in there.versions(0)] == [step - 1, step]  # keep=2: older ones overwritten


def test_a_delta_without_its_base_or_corrupt_is_refused(tmp_path) -> None:
    here, there = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    emb = torch.randn(20, DIM)
    here.save(0, 1, _state(emb, 1))
    here.save(0, 2, _state(emb * 2, 2))
    blob, _, _ = pack_delta(here, 0, 2, 1)
    with pytest.raises(CorruptShard, match="not here"):
        unpack(there, blob)  # the receiver never got step 1
    unpack(there, pack(here, 0, 1))
    flipped = blob.clone()
    flipped[-5] ^= 0xFF  # the bias's last byte (its block is padded to 24 bytes)
    with pytest.raises(CorruptShard, match="does not match its hash"):
        unpack(there, flipped)
    with pytest.raises(CorruptShard, match=r"cannot be read|bytes for"):
        unpack(there, blob[:-9])  # cut off
    assert [v.step for v in there.versions(0)] == [1]
    assert unpack(there, blob) == 2 and torch.equal(there.load(0)["model"]["emb"], emb * 2)


def test_a_delta_whose_hashes_do_not_make_the_manifests_table_is_refused(tmp_path) -> None:
    here, there = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    here.save(0, 1, _state(torch.zeros(20, DIM), 1))
    unpack(there, pack(here, 0, 1))
    here.save(0, 2, _state(torch.ones(20, DIM), 2))
    info = here.version(0, 2)
    base = here.version(0, 1)
    assert info is not None and base is not None
    delta = here.delta(info, base)
    assert delta is not None
    ids, sums, payload = delta
    with pytest.raises(CorruptShard, match="do not make the table"):
        there.put_delta(here.raw_manifest(info), 1, ids[1:], sums[1:], payload[1024:])  # a block left out
    assert [v.step for v in there.versions(0)] == [1]


def test_versions_of_another_layout_go_whole(tmp_path) -> None:
    store = ShardStore(tmp_path)
    store.save(0, 1, _state(torch.zeros(4, DIM), 1))
    store.save(0, 2, _state(torch.zeros(5, DIM), 2))  # a row more: offsets moved
    blob, fraction, _ = pack_delta(store, 0, 2, 1)
    assert fraction == 1.0
    other = ShardStore(tmp_path / "other")
    assert unpack(other, blob) == 2 and torch.equal(other.load(0)["model"]["emb"], torch.zeros(5, DIM))


def _digests(store: ShardStore, rank: int, step: int) -> np.ndarray:
    info = store.version(rank, step)
    assert info is not None
    found = store.digests(info)
    assert found is not None
    return found


@settings(max_examples=25, deadline=None)
@given(chain=st.lists(st.tuples(st.sets(st.integers(0, ROWS - 1), max_size=30), st.booleans()), min_size=1,
                      max_size=4),
       first_delta=st.booleans())  # fmt: skip
def test_donated_tensors_come_from_the_receivers_own_version_bit_for_bit(tmp_path_factory, chain,
                                                                         first_delta: bool) -> None:  # fmt: skip
    """Rank 0 replicates to a host whose rank 1 trains the same table (a data parallel peer) with its
    own bias; each step, rank 1's table equals rank 0's unless ``drift``. Only tensors whose digests
    agree are donated; the replica equals rank 0's version bit for bit, and a donated table costs no
    payload."""
    here, there = ShardStore(tmp_path_factory.mktemp("a")), ShardStore(tmp_path_factory.mktemp("b"))
    emb = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    here.save(0, 1, _state(emb, 1))
    there.save(1, 1, {"model": {"emb": emb, "bias": torch.full((5,), -1.0)}, "step": 1})
    if first_delta:  # the first replica donated too (no base): every other block is sent
        donated = np.flatnonzero(_digests(here, 0, 1) == _digests(there, 1, 1)).tolist()
        assert donated == [0]  # the table; the biases differ
        blob, fraction, given_ = pack_delta(here, 0, 1, None, donated, 2)
        assert given_ == pytest.approx(ROWS * DIM * 4 / DATA_BYTES) and fraction < 64 / DATA_BYTES
        assert unpack(there, blob, donor_rank=1) == 1
    else:
        assert unpack(there, pack(here, 0, 1)) == 1
    for step, (touched, drift) in enumerate(chain, start=2):
        emb = emb.clone()
        emb[sorted(touched)] += float(step)
        here.save(0, step, _state(emb, step))
        theirs = emb.clone()
        if drift:
            theirs[0] += 1.0  # rank 1's table is not rank 0's this step
        there.save(1, step, {"model": {"emb": theirs, "bias": torch.full((5,), -1.0)}, "step": step})
        donated = np.flatnonzero(_digests(here, 0, step) == _digests(there, 1, step)).tolist()
        assert donated == ([] if drift else [0])
        blob, fraction, given_ = pack_delta(here, 0, step, step - 1, donated, 2)
        assert unpack(there, blob, donor_rank=1) == step
        got = there.load(0, step=step)
        assert torch.equal(got["model"]["emb"], emb) and torch.equal(
            got["model"]["bias"], _state(emb, step)["model"]["bias"]
        )
        payload_rows = len(touched) if drift else 0
        assert fraction == pytest.approx((payload_rows * DIM * 4 + 24) / DATA_BYTES)
        assert given_ == (0.0 if drift else pytest.approx(ROWS * DIM * 4 / DATA_BYTES))


def test_a_donation_the_receiver_cannot_back_is_refused(tmp_path) -> None:
    here, there = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    emb = torch.randn(20, DIM)
    here.save(0, 1, _state(emb, 1))
    blob, _, _ = pack_delta(here, 0, 1, None, [0], 2)
    with pytest.raises(CorruptShard, match="not here"):
        unpack(there, blob, donor_rank=1)  # rank 1 has no version of step 1 here
    with pytest.raises(CorruptShard, match="no donor"):
        unpack(there, blob)
    there.save(1, 1, _state(emb + 1, 1))  # a version of step 1 whose table differs: the digests were wrong
    with pytest.raises(CorruptShard, match="do not make the table"):
        unpack(there, blob, donor_rank=1)
    other = ShardStore(tmp_path / "c")
    other.save(1, 1, {"model": {"bias": torch.zeros(5), "emb": emb}, "step": 1})  # the table elsewhere
    with pytest.raises(CorruptShard, match="lie elsewhere"):
        unpack(other, blob, donor_rank=1)
    assert there.versions(0) == [] and other.versions(0) == []
    fine = ShardStore(tmp_path / "d")
    fine.save(1, 1, _state(emb, 1))
    assert unpack(fine, blob, donor_rank=1) == 1 and torch.equal(fine.load(0)["model"]["emb"], emb)


def test_a_blob_whose_manifest_was_changed_is_refused(tmp_path) -> None:
    """The manifest's JSON values (the hook's counters, say) are outside the sums table: the blob's
    header carries the manifest's own checksum."""
    here, there = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    here.save(0, 1, {**_state(torch.zeros(4, DIM), 1), "count": 12345})
    blob = pack(here, 0, 1)
    at = bytes(blob.numpy()).index(b"12345")
    changed = blob.clone()
    changed[at] = ord("9")  # still valid JSON, a wrong value
    with pytest.raises(CorruptShard, match="manifest does not match its checksum"):
        unpack(there, changed)
    assert there.versions(0) == []
    assert unpack(there, blob) == 1 and there.load(0)["count"] == 12345


@settings(max_examples=15, deadline=None)
@given(chain=st.lists(st.sets(st.integers(0, ROWS - 1), max_size=30), min_size=2, max_size=7))
def test_a_wholly_donated_replica_links_the_donors_files_and_neither_is_written_over(tmp_path_factory, chain) -> None:
    """Rank 1 (the receiver's own) and rank 0 (its peer) hold the same state every step: each replica of
    rank 0 links rank 1's files (no bytes copied). Rank 1's later saves, which overwrite old versions in
    place, must never write into a linked one: every version either rank keeps still loads as it was
    saved, and a pruned linked replica is removed (never a spare whose bytes rank 1 still uses)."""
    here, there = ShardStore(tmp_path_factory.mktemp("a")), ShardStore(tmp_path_factory.mktemp("b"))
    emb = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    saved = {}

    def every_kept_version_loads_as_saved() -> None:
        for rank in (0, 1):
            for info in there.versions(rank):
                got = there.load(rank, step=info.step)
                assert torch.equal(got["model"]["emb"], saved[info.step]) and got["step"] == info.step

    for step, touched in enumerate(chain, start=1):
        emb = emb.clone()
        emb[sorted(touched)] += float(step)
        saved[step] = emb
        here.save(0, step, _state(emb, step))
        there.save(1, step, _state(emb, step))
        every_kept_version_loads_as_saved()  # the save wrote into no linked version
        assert (_digests(here, 0, step) == _digests(there, 1, step)).all()
        base = step - 1 if step > 1 else None
        blob, fraction, given_ = pack_delta(here, 0, step, base, [0, 1], 2)
        assert fraction == 0.0 and given_ == pytest.approx((ROWS * DIM * 4 + 20) / DATA_BYTES)
        assert unpack(there, blob, donor_rank=1) == step
        replica = there.version(0, step)
        assert replica is not None and (replica.path / "linked").exists()
        assert os.stat(replica.path / "data.bin").st_ino == os.stat(there._dir(1, step) / "data.bin").st_ino
        every_kept_version_loads_as_saved()
        assert not any(name.startswith("spare") for name in os.listdir(there.root / "rank0"))


def test_a_wholly_donated_replica_whose_donor_differs_is_refused(tmp_path) -> None:
    here, there = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    here.save(0, 1, _state(torch.ones(20, DIM), 1))
    there.save(1, 1, _state(torch.zeros(20, DIM), 1))  # the digests the sender was told were wrong
    blob, _, _ = pack_delta(here, 0, 1, None, [0, 1], 2)
    with pytest.raises(CorruptShard, match="do not make the table"):
        unpack(there, blob, donor_rank=1)
    assert there.versions(0) == [] and not (there.root / "rank0").exists()


def test_a_linked_replica_is_verified_with_its_donor_once_and_fails_with_it(tmp_path, monkeypatch) -> None:
    import zensync.resilience.store as store_module

    here, there = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    emb = torch.randn(20, DIM)
    here.save(0, 1, _state(emb, 1))
    there.save(1, 1, _state(emb, 1))
    unpack(there, pack_delta(here, 0, 1, None, [0, 1], 2)[0], donor_rank=1)
    checks = []
    real = store_module._check_blocks
    monkeypatch.setattr(store_module, "_check_blocks", lambda *a: checks.append(a[-1]) or real(*a))
    seen: dict = {}
    assert there.verified(1, seen) == [1] and there.verified(0, seen) == [1] and len(checks) == 1
    with open(there._dir(1, 1) / "data.bin", "r+b") as f:  # a flipped byte in the shared bytes
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    seen = {}
    assert there.verified(1, seen) == [] and there.verified(0, seen) == []

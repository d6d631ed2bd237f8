"""zensync.resilience.store: shards round-trip bit for bit (every dtype and shape, non-contiguous
views, nested states and JSON values); a cut-off write, a corrupt byte and a truncated file are
never loaded and the previous complete version is; old versions are pruned; bad states are refused."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.resilience import CorruptShard, ShardStore
from zensync.resilience import store as store_module
from zensync.resilience.store import flatten, unflatten

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]  # fmt: skip


def _tensor(seed: int, dtype: torch.dtype, shape: tuple[int, ...], transpose: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-100, 100, shape, generator=gen, dtype=torch.int64)
    if dtype.is_floating_point or dtype.is_complex:
        raw = torch.randn(shape, generator=gen, dtype=torch.float64) * 1e3
    t = raw.to(dtype)
    return t.transpose(0, -1) if transpose and t.dim() >= 2 else t


@st.composite
def states(draw):
    tensors = {}
    for i in range(draw(st.integers(0, 5))):
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
        tensors[f"t{i}"] = _tensor(draw(st.integers(0, 10**6)), draw(st.sampled_from(DTYPES)), shape,
                                   draw(st.booleans()))  # fmt: skip
    values = {"step": draw(st.integers(0, 10**9)), "name": draw(st.text(max_size=8)),
              "xs": draw(st.lists(st.floats(allow_nan=False), max_size=3)), "empty": {}}  # fmt: skip
    return {"model": tensors, "meta": values, "top": _tensor(1, torch.float32, (3,), False)}


def _assert_same(got, want) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            if value.numel():  # bit for bit (NaN payloads, -0.0 included)
                want_bytes = value.contiguous().view(-1).view(torch.uint8)
                assert torch.equal(got[key].view(-1).view(torch.uint8), want_bytes), key
        elif isinstance(value, dict) and value:
            _assert_same(got[key], value)
        else:
            assert got[key] == value, key


@settings(max_examples=40, deadline=None)
@given(state=states())
def test_a_shard_round_trips_bit_for_bit(tmp_path_factory, state) -> None:
    store = ShardStore(tmp_path_factory.mktemp("shm"))
    store.save(3, step=7, state=state)
    _assert_same(store.load(3), state)


def test_the_newest_complete_version_is_loaded_and_old_ones_pruned(tmp_path) -> None:
    store = ShardStore(tmp_path, keep=2)
    for step in (1, 2, 3):
        store.save(0, step, {"w": torch.full((4,), float(step)), "step": step})
    assert [v.step for v in store.versions(0)] == [2, 3]
    assert store.load(0)["step"] == 3 and store.load(0, step=2)["step"] == 2
    with pytest.raises(FileNotFoundError, match="at step 1"):
        store.load(0, step=1)
    with pytest.raises(ValueError, match="must be later"):
        store.save(0, 3, {"w": torch.zeros(1)})
    with pytest.raises(FileNotFoundError, match="rank 5"):
        store.load(5)


def test_a_corrupt_or_truncated_shard_is_skipped_for_the_previous_version(tmp_path) -> None:
    store = ShardStore(tmp_path, keep=3)
    store.save(0, 1, {"w": torch.arange(100.0)})
    newest = store.save(0, 2, {"w": torch.arange(100.0) * 2})
    data = newest.path / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[17] ^= 0x01  # one flipped bit
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptShard, match="checksum"):
        store.read(newest)
    assert torch.equal(store.load(0)["w"], torch.arange(100.0))  # the previous complete version
    data.write_bytes(bytes(raw[:50]))  # truncated
    with pytest.raises(CorruptShard, match="50 bytes"):
        store.read(newest)
    (store.versions(0)[0].path / "manifest.json").write_text("{not json")
    with pytest.raises(FileNotFoundError, match="skipped"):
        store.load(0)  # v2 corrupt, v1's manifest unreadable: nothing verifies


def _save_then_die(root: str) -> None:
    store = ShardStore(root)
    store.save(0, 1, {"w": torch.ones(1000)})
    real_replace = os.replace

    def die_before_the_manifest(src, dst):  # the worker is killed mid-save, before the rename
        os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    os.replace = die_before_the_manifest
    store.save(0, 2, {"w": torch.full((1000,), 2.0)})


def test_a_worker_killed_mid_save_leaves_the_previous_version(tmp_path) -> None:
    proc = multiprocessing.get_context("spawn").Process(target=_save_then_die, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    store = ShardStore(tmp_path)
    assert [v.step for v in store.versions(0)] == [1]  # step 2's data is there, its manifest is not
    assert (tmp_path / "rank0" / "v0000000002" / "data.bin").exists()
    assert torch.equal(store.load(0)["w"], torch.ones(1000))
    store.save(0, 2, {"w": torch.zeros(3)})  # the restarted worker writes step 2 again
    assert torch.equal(store.load(0)["w"], torch.zeros(3))


def test_states_that_cannot_be_stored_are_refused(tmp_path) -> None:
    store = ShardStore(tmp_path)
    with pytest.raises(ValueError, match="only tensors and JSON values"):
        store.save(0, 1, {"opt": object()})
    with pytest.raises(ValueError, match="without '/'"):
        store.save(0, 1, {"a/b": torch.zeros(1)})
    with pytest.raises(ValueError, match="not stored"):
        store.save(0, 1, {"s": torch.eye(2).to_sparse()})
    with pytest.raises(ValueError, match="start with '#'"):
        store.save(0, 1, {"#3": torch.zeros(1)})
    with pytest.raises(ValueError, match="keys are ints"):
        store.save(0, 1, {True: torch.zeros(1)})
    with pytest.raises(ValueError, match="keep=0"):
        ShardStore(tmp_path, keep=0)
    assert store.versions(0) == []  # nothing was written


def test_no_pickle_crosses_hosts_the_manifest_is_plain_json(tmp_path) -> None:
    info = ShardStore(tmp_path).save(1, 4, {"m": {"w": torch.zeros(2, 3)}, "lr": 0.1})
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["entries"][0] == {"key": "m/w", "dtype": "float32", "shape": [2, 3], "offset": 0, "nbytes": 24,
                                      "blocks": 1, "first": 0}  # fmt: skip
    assert manifest["values"] == {"lr": 0.1} and (info.path / "data.bin").stat().st_size == 64  # padded to 64
    assert (info.path / "sums.bin").stat().st_size == 8 and len(manifest["sums_hash"]) == 16
    assert unflatten({**flatten({"a": {"b": 1}})[1]}) == {"a": {"b": 1}}


def test_an_optimizers_int_keys_come_back_as_ints(tmp_path) -> None:
    """torch optimizers key their state by parameter index."""
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))], lr=0.1)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    store = ShardStore(tmp_path)
    store.save(0, 1, {"optimizer": opt.state_dict()})
    loaded = store.load(0)["optimizer"]
    assert set(loaded["state"]) == {0, 1}
    for index, fields in opt.state_dict()["state"].items():
        for key, value in fields.items():
            assert torch.equal(loaded["state"][index][key], value)
    again = torch.optim.Adam([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))], lr=0.1)
    again.load_state_dict(loaded)  # the JSON param_groups (betas as a list) load as torch's own
    assert again.param_groups[0]["lr"] == 0.1 and list(again.param_groups[0]["betas"]) == [0.9, 0.999]


def test_a_peers_copy_is_kept_only_once_it_verifies(tmp_path) -> None:
    here, there = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    info = here.save(2, 5, {"w": torch.arange(10.0)})
    manifest, sums, data = here.raw(info)
    flipped = bytearray(data)
    flipped[3] ^= 0x10
    with pytest.raises(CorruptShard, match="does not match its hash"):
        there.put_full(manifest, sums, bytes(flipped))
    assert there.versions(2) == [] and there.newest_verified(2) is None
    with pytest.raises(CorruptShard, match="unreadable"):
        there.put_full(b"{", sums, data)
    with pytest.raises(CorruptShard, match="do not make the table"):
        there.put_full(manifest, bytes(8), data)
    kept = there.put_full(manifest, sums, data)
    assert kept.step == 5 and there.ranks() == [2] and torch.equal(there.load(2)["w"], torch.arange(10.0))


def test_a_save_writes_only_the_changed_rows_and_loads_bit_for_bit(tmp_path) -> None:
    """A version overwrites the oldest one in place: the rows listed as changed since the previous
    version, plus the rows that differ between the previous and the overwritten one, are written."""
    store = ShardStore(tmp_path, keep=2)
    emb = torch.zeros(1000, 16)  # rows of 64 bytes: a block each
    written = []
    for step in range(1, 7):
        emb = emb.clone()
        emb[step * 10 : step * 10 + 3] = step  # 3 rows change per step
        rows = {"emb": np.arange(step * 10, step * 10 + 3)}
        pending = store.write(0, step, {"emb": emb}, changed=rows, since=step - 1)
        store.finish(pending)
        written.append(pending.written)
        assert torch.equal(store.load(0, step)["emb"], emb) and not pending.violations
    # steps 1-2 write fresh files; from step 3 on, the rows of the step and of the one before
    assert written[:2] == [64000, 64000] and written[2:] == [6 * 64] * 4


def test_a_listing_that_misses_a_change_is_caught_and_the_version_stays_right(tmp_path) -> None:
    store = ShardStore(tmp_path, keep=2)
    emb = torch.zeros(64, 16)
    for step in (1, 2):
        store.save(0, step, {"emb": emb})
    emb = emb + 1.0  # every row changed, the listing says none
    pending = store.write(0, 3, {"emb": emb}, changed={"emb": np.zeros(0, np.int64)}, since=2, audit_rows=4)
    store.finish(pending)
    assert pending.violations == ["emb"] and torch.equal(store.load(0)["emb"], emb)


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.tuples(st.sets(st.integers(0, 49), max_size=10), st.booleans()), min_size=1, max_size=6),
       keep=st.integers(1, 3))  # fmt: skip
def test_writes_in_place_equal_fresh_writes(tmp_path_factory, steps, keep: int) -> None:
    """Whatever mix of listed rows and hash comparisons, and however many versions are kept, each
    version loads as the state it saved."""
    store = ShardStore(tmp_path_factory.mktemp("shm"), keep=keep)
    emb, bias = torch.zeros(50, 8, dtype=torch.float64), torch.zeros(3)
    for step, (touched, listed) in enumerate(steps, start=1):
        emb, bias = emb.clone(), bias + 1
        emb[sorted(touched)] += step
        rows = {"m/emb": np.array(sorted(touched), dtype=np.int64)} if listed else None
        store.save(0, step, {"m": {"emb": emb, "bias": bias}}, changed=rows, since=step - 1)
        got = store.load(0)
        assert torch.equal(got["m"]["emb"], emb) and torch.equal(got["m"]["bias"], bias)


def test_a_pinned_version_leaves_a_spare_to_overwrite(tmp_path) -> None:
    """While a replicator holds a version (pinned), a save may have nothing to overwrite and writes a
    fresh file; once released, versions past ``keep`` become spares that the next saves overwrite in
    place (only the rows that differ). Spares are never listed or loaded."""
    store = ShardStore(tmp_path, keep=2)
    emb = torch.zeros(500, 16)  # rows of 64 bytes
    written = []

    def save(step: int) -> None:
        nonlocal emb
        emb = emb.clone()
        emb[step] = step
        pending = store.write(0, step, {"emb": emb}, changed={"emb": np.array([step])}, since=step - 1)
        store.finish(pending)
        written.append(pending.written // 64)
        assert torch.equal(store.load(0)["emb"], emb)

    save(1), save(2)
    with store.pinned(0, 2):
        save(3), save(4), save(5)
    save(6), save(7)
    # rows written: fresh files (500), step 3 over step 1 (rows 2, 3), step 4 fresh (2 and 3 are held),
    # step 6 over step 2 (rows 3-6), step 7 over the spare of step 4 (rows 5-7)
    assert written == [500, 500, 2, 500, 2, 4, 3]
    names = sorted(p.name for p in (tmp_path / "rank0").iterdir() if p.is_dir())
    assert names == ["spare0000000005", "v0000000006", "v0000000007"]
    assert [v.step for v in store.versions(0)] == [6, 7]


def test_discarding_a_future_forgets_its_completeness(tmp_path) -> None:
    """A restore to step 2 removes steps 3-4 and the mark that step 4 had its replicas: the step 4
    trained again is not complete until it is replicated again."""
    store = ShardStore(tmp_path, keep=5)
    for step in range(5):
        store.save(0, step, {"w": torch.full((2,), float(step))})
    store.mark_complete(0, 4)
    store.mark_complete(1, 1)  # a peer's replica, complete before the restored step: kept
    store.discard_after(2)
    assert [v.step for v in store.versions(0)] == [0, 1, 2]
    assert store.complete_step(0) is None and store.complete_step(1) == 1


_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)


@settings(max_examples=40, deadline=None)
@given(values=st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: "/" not in k and k[0] != "#"),
                              st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=3), max_leaves=6),
                              max_size=4))  # fmt: skip
def test_the_manifest_is_the_json_of_its_fields(tmp_path_factory, values) -> None:
    """``finish`` writes the manifest from the layout's and the values' JSON, encoded once each: the
    text is ``json.dumps`` of the manifest it parses to (NaN and infinities, unicode, nested lists)."""
    store = ShardStore(tmp_path_factory.mktemp("shm"))
    info = store.save(0, 1, {"w": torch.ones(4, 16), "v": values})
    text = (info.path / "manifest.json").read_text()
    manifest = json.loads(text)
    assert text == json.dumps(manifest)
    # the values load as saved (compared as JSON text: NaN != NaN)
    assert json.dumps(store.load(0)["v"], sort_keys=True) == json.dumps(values, sort_keys=True)


def test_a_value_that_is_not_json_is_refused_before_anything_is_written(tmp_path) -> None:
    """The save path flattens without checking values (``flatten(check=False)``); the store's one
    encoding of them refuses the same states, naming the value, and claims no version."""
    store = ShardStore(tmp_path)
    store.save(0, 1, {"w": torch.zeros(2)})
    state = {"w": torch.zeros(2), "opt": {"groups": [{"lr": 0.1, "bad": {1, 2}}]}}
    with pytest.raises(ValueError, match="'opt/groups' is a list: only tensors and JSON values"):
        store.write(0, 2, state, flat=flatten(state, check=False))
    assert [v.step for v in store.versions(0)] == [1] and sorted(os.listdir(tmp_path / "rank0")) == ["v0000000001"]


def test_pins_released_are_forgotten(tmp_path) -> None:
    """A pin per round over a long run: released pins leave nothing behind (they used to pile up,
    one per step, and every save walked them)."""
    store = ShardStore(tmp_path, keep=2)
    for step in range(50):
        with store.pinned(0, step):
            store.save(0, step, {"w": torch.full((2,), float(step))})
    assert store._pins == {}  # the leak had no other symptom than this table's size
    assert [v.step for v in store.versions(0)] == [48, 49]


@pytest.mark.parametrize("recycled", [False, True])
def test_a_prune_on_another_thread_never_takes_the_version_being_written(tmp_path, monkeypatch, recycled) -> None:
    """The replication thread completes (``finish``) and prunes a version while the training thread
    writes the next one. A prune that comes right after ``_claim`` chose the next version's
    directory (no manifest yet: it looks like a cut-off write) must leave it: the version is pinned
    before the store's lock is let go. Before, it was pinned only after, and such a prune removed
    the directory under the save (FileNotFoundError in the emulated bench)."""
    store = ShardStore(tmp_path, keep=2)
    for step in range(3 if recycled else 1):  # recycled: an older version of the layout to write over
        store.save(0, step, {"w": torch.full((64, 16), float(step))})
    claim = store._claim

    def claim_then_prune(*args, **kwargs):
        found = claim(*args, **kwargs)
        store._prune(0)  # the other thread's prune, between the claim and the write
        return found

    monkeypatch.setattr(store, "_claim", claim_then_prune)
    step = 3 if recycled else 1
    pending = store.write(0, step, {"w": torch.full((64, 16), float(step))})
    assert pending.info.path.name in os.listdir(tmp_path / "rank0")
    store.finish(pending)
    assert torch.equal(store.load(0)["w"], torch.full((64, 16), float(step)))
    assert store._pins == {}


def test_a_write_that_fails_releases_its_pin(tmp_path, monkeypatch) -> None:
    """A write that raises after claiming its version leaves no pin behind (the version is pruned
    as a cut-off write, not kept forever)."""
    store = ShardStore(tmp_path, keep=2)
    store.save(0, 1, {"w": torch.zeros(8)})

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_mapped", failing)
    with pytest.raises(OSError, match="No space left"):
        store.write(0, 2, {"w": torch.ones(8)})
    assert store._pins == {}
    monkeypatch.undo()
    store.save(0, 3, {"w": torch.full((8,), 3.0)})
    assert [v.step for v in store.versions(0)] == [1, 3] and "v0000000002" not in os.listdir(tmp_path / "rank0")


def test_the_complete_step_follows_every_mark_whoever_writes_it(tmp_path) -> None:
    """``complete_step`` rereads the mark only when the file changed, and sees another store
    object's (another process's) marks and removals at once."""
    mine, other = ShardStore(tmp_path), ShardStore(tmp_path)
    assert mine.complete_step(3) is None
    for step in range(5):
        (mine if step % 2 else other).mark_complete(3, step)
        assert mine.complete_step(3) == step and other.complete_step(3) == step
    other.discard_after(2)
    assert mine.complete_step(3) is None


def test_audited_rows_lie_in_the_tensor_and_move_with_the_step() -> None:
    rows = [store_module._audited(50_000, 16, step) for step in range(20)]
    assert all(r.size == 16 and r.min() >= 0 and r.max() < 50_000 for r in rows)
    assert len({tuple(r.tolist()) for r in rows}) == 20  # each save checks other rows
    assert all(0 <= row < 3 for step in range(10) for row in store_module._audited(3, 3, step).tolist())


def test_a_load_after_the_reports_check_hashes_nothing_again(tmp_path, monkeypatch) -> None:
    """Restore verifies every version for its report (``verified``), then loads one: with the files
    the report checked (``seen``), the load hashes no block again; without, it does."""
    store = ShardStore(tmp_path, keep=2)
    for step in (1, 2):
        store.save(0, step, {"w": torch.full((8, 16), float(step))})
    checked = []
    real = store_module._check_blocks
    monkeypatch.setattr(store_module, "_check_blocks", lambda *a: checked.append(a[-1]) or real(*a))
    seen: dict = {}
    assert store.verified(0, seen) == [1, 2] and len(checked) == 2
    assert torch.equal(store.load(0, 2, seen)["w"], torch.full((8, 16), 2.0)) and len(checked) == 2
    store.load(0, 2)
    assert len(checked) == 3

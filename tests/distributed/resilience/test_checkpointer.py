"""``Checkpointer`` on 4 gloo ranks that stand for 4 hosts (a store directory each): DDP with zensync's
hook, SGD with momentum, a checkpoint every step replicated to 1 peer (Gemini's group placement).

- Host 1 is replaced (its store wiped) after step 3: ``restore`` takes step 3 from rank 1's peer, and
  the run goes on as the uninterrupted one, bit for bit: losses, parameters, the hook's step (the
  first step after the restore syncs as the saved step's buckets: ``ZenSyncState.replay_groups``).
- A replica that fails its checksums mid-replication (step 3's copy of rank 1's shard, on its
  holder) leaves step 2 the newest complete version: host 1 replaced, every rank restores step 2
  (one step lost beyond the one in flight) and still goes on as the uninterrupted run.
- Every host's memory gone: the disk checkpoint (torch.distributed.checkpoint) is restored; with no
  disk checkpoint either, every rank raises the same FileNotFoundError.
- The per-step records account for what moved: the first version whole, each later one as a delta
  against the newest complete version (its blocks whose hashes changed).
- ``max_lag_steps=0``: every save returns with its own step replicated.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zensync
import zensync.resilience.replicate as replicate_module
from tests.distributed._launch import launch
from tests.distributed.resilience.test_memory import FIXED, _steps
from tests.distributed.resilience.test_memory import _setup as _memory_setup
from zensync.resilience import CheckpointConfig, Checkpointer, ShardStore

WORLD, STEPS, CRASH_AFTER = 4, 6, 4
REPLICATION_TIMEOUT_S = 30.0
MANIFEST_BYTES = 16 << 10
"""Above the JSON manifest of this model's state (about 7 KiB: 30-odd entries)."""
"""Far above one small model's replication (milliseconds); a hang fails the test instead."""


def _setup(strategy: str = "auto") -> tuple[nn.Module, Any, torch.optim.Optimizer, Any]:
    return _memory_setup(strategy)


def _train(ddp: Any, opt: torch.optim.Optimizer, rank: int, steps: range, ckpt: Checkpointer | None,
           model: nn.Module, state: Any) -> list[float]:  # fmt: skip
    def replicated(step: int) -> None:  # each version replicated before the next (the crash step's may not be)
        assert ckpt is not None and (ckpt.wait_replicated(REPLICATION_TIMEOUT_S) or step == CRASH_AFTER - 1)

    return _steps(ddp, opt, rank, steps, ckpt, model, state, replicated)


def _uninterrupted(rank: int, strategy: str = "auto") -> tuple[list[float], list[torch.Tensor]]:
    model, ddp, opt, state = _setup(strategy)
    losses = _train(ddp, opt, rank, range(STEPS), None, model, state)
    state.close()
    return losses, [p.detach().clone() for p in model.parameters()]


_REAL_PUT_DELTA = ShardStore.put_delta


def _corrupting(step: int):
    """The holder of rank 1's replicas (host 0) receives step ``step``'s copy with its table's hash
    changed, as a corrupt copy arrives (every replica, sent or donated, is kept through put_delta)."""

    def put_delta(store, manifest, *args, **kwargs):
        if store.root.name == "host0" and f'"rank": 1, "step": {step},'.encode() in manifest:
            manifest = manifest.replace(b'"sums_hash": "', b'"sums_hash": "0')
        return _REAL_PUT_DELTA(store, manifest, *args, **kwargs)

    return put_delta


def _run(rank: int, world_size: int, root: str, corrupt: bool, lag: int | None, strategy: str) -> dict[str, Any]:
    if strategy.endswith("/exchange"):  # manifests too large for the agreement: they go in the exchange
        strategy = strategy.removesuffix("/exchange")
        replicate_module.AGREEMENT_MANIFEST_BYTES = 0
    want_losses, want_params = _uninterrupted(rank, strategy)
    if corrupt:
        ShardStore.put_delta = _corrupting(CRASH_AFTER - 1)  # type: ignore[method-assign]
    config = CheckpointConfig(root=f"{root}/host{rank}", replicas=1, dcp_dir=f"{root}/disk", dcp_every=2,
                              max_lag_steps=lag)  # fmt: skip
    model, ddp, opt, state = _setup(strategy)
    ckpt = Checkpointer(config, hook_state=state)
    assert ckpt.restore(model=model, optimizer=opt, zensync=state) == 0
    before = _train(ddp, opt, rank, range(CRASH_AFTER), ckpt, model, state)
    if corrupt:  # the round of the last step ends incomplete on every rank
        assert not ckpt.wait_replicated(REPLICATION_TIMEOUT_S)
    records = list(ckpt.history)
    gate_windows = ckpt.gate.windows
    ckpt.close()
    state.close()
    ShardStore.put_delta = _REAL_PUT_DELTA  # type: ignore[method-assign]
    if rank == 1:  # host 1 is replaced: its memory is gone
        shutil.rmtree(config.root)
    model, ddp, opt, state = _setup(strategy)
    ckpt = Checkpointer(config, hook_state=state)
    start = ckpt.restore(model=model, optimizer=opt, zensync=state)
    after = _train(ddp, opt, rank, range(start, STEPS), ckpt, model, state)
    ckpt.close()
    shared = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # the model and its momentum
    return {"shared_bytes": shared, "want_losses": want_losses, "want_params": want_params,
            "losses": before[:start] + after,
            "params": [p.detach().clone() for p in model.parameters()], "start": start,
            "recovery": ckpt.recovery, "records": records, "windows": gate_windows,
            "hook_step": state.state_dict()["step"]}  # fmt: skip


@pytest.mark.parametrize(
    ("corrupt", "lag", "strategy"),
    [
        (False, None, "auto"),
        pytest.param(True, None, "auto", marks=pytest.mark.slow),
        pytest.param(False, 1, "auto", marks=pytest.mark.slow),
        pytest.param(False, None, "topk:0.1", marks=pytest.mark.slow),
        pytest.param(False, None, "auto/exchange", marks=pytest.mark.slow),
    ],
    ids=[
        "replaced-host",
        "corrupt-replica",
        "replaced-host-lag-bound",
        "replaced-host-own-residuals",
        "replaced-host-manifests-exchanged",
    ],
)  # the README's command stays under 6 minutes: the variants run in the slow tier (.ci/run)
def test_a_replaced_host_restores_from_its_peer_and_goes_on_bit_for_bit(tmp_path, corrupt: bool, lag,
                                                                        strategy: str) -> None:  # fmt: skip
    """With ``max_lag_steps`` the replaced host (no complete step) and its peers (step 3 complete)
    start from the same agreed coverage: their saves wait alike instead of in a cycle (a rank waiting
    in its save for a round whose chunks wait for a sync that waits for that rank).

    The ranks' models and momenta are equal (data parallel): a peer copies them from its own version
    (donated), and only the rest travels: nothing with a lossless strategy, each rank's own
    error-feedback residuals with top-k, which the replaced host gets back exactly."""
    results = launch(_run, WORLD, (str(tmp_path), corrupt, lag, strategy), tmp_path)
    restored = CRASH_AFTER - 1 if corrupt else CRASH_AFTER  # the next step to run
    for out in results:
        assert out["start"] == restored
        assert out["recovery"]["source"] == "peers" and out["recovery"]["step"] == restored - 1
        assert out["recovery"]["lost_steps"] == (1 if corrupt else 0)
        assert out["losses"] == out["want_losses"]
        for got, want in zip(out["params"], out["want_params"], strict=True):
            assert torch.equal(got, want)
        assert out["hook_step"] == STEPS
    fetched = [out["recovery"]["fetched_bytes"] for out in results]
    assert fetched[1] > 0 and fetched[0] == fetched[2] == fetched[3] == 0
    for out in results:
        records = out["records"]
        assert [r["step"] for r in records] == list(range(CRASH_AFTER))
        shard = records[-1]["bytes"]
        assert shard > 0 and all(r["max_delay_s"] >= 0 for r in records)
        sent = sum(r["replicated_bytes"] for r in records)
        fractions = [f for r in records for f in r["sent_fractions"]]
        donated = [f for r in records for f in r["donated_fractions"]]
        # every version before the last one was replicated before the next save (wait_replicated); of
        # each, the model and momentum were donated (64-byte alignment padding is neither sent nor
        # donated); the rest was sent, the first version whole, the others as the blocks that changed
        # (tests/unit/resilience/test_delta.py checks what a delta sends); a blob is that data plus
        # the manifest (a few KiB of JSON), block indices and hashes, and a header
        assert len(fractions) == len(donated) == CRASH_AFTER - 1
        assert all(out["shared_bytes"] / shard <= d <= 1 - f for d, f in zip(donated, fractions, strict=True))
        if strategy == "auto":  # the lossless hook keeps no tensors: only manifests travel, in the agreement
            assert fractions == [0.0] * (CRASH_AFTER - 1) and 0 < sent < MANIFEST_BYTES * (WORLD - 1) * CRASH_AFTER
            assert all(r["chunks"] == 0 for r in records)  # no exchange
        elif strategy == "auto/exchange":  # the same, each manifest sent to its peer only
            assert fractions == [0.0] * (CRASH_AFTER - 1) and 0 < sent < MANIFEST_BYTES * CRASH_AFTER
            assert sum(r["chunks"] for r in records) >= CRASH_AFTER - 1
        else:  # the residuals are each rank's own: sent, the first version's whole
            assert 0 < fractions[0] <= 1 - donated[0] and min(fractions) > 0
            assert shard * sum(fractions) < sent < (shard + MANIFEST_BYTES) * sum(fractions) + 16 * shard / 8
        assert all(r["windows_used"] <= 1 for r in records) and out["windows"] >= CRASH_AFTER
        assert [r["complete_step"] for r in records] == [None, *range(CRASH_AFTER - 1)]


def _every_host_gone(rank: int, world_size: int, root: str, with_disk: bool) -> dict[str, Any]:
    config = CheckpointConfig(root=f"{root}/host{rank}", replicas=1, dcp_dir=f"{root}/disk" if with_disk else None,
                              dcp_every=2 if with_disk else 0)  # fmt: skip
    model, ddp, opt, state = _setup()
    ckpt = Checkpointer(config, hook_state=state)
    ckpt.restore(model=model, optimizer=opt, zensync=state)
    _train(ddp, opt, rank, range(CRASH_AFTER), ckpt, model, state)
    ckpt.close()
    on_disk = [p.detach().clone() for p in model.parameters()] if with_disk else None
    shutil.rmtree(config.root)  # every host replaced
    model, ddp, opt, state = _setup()
    ckpt = Checkpointer(config, hook_state=state)
    try:  # a restart: a checkpoint is required (nothing anywhere is not a fresh start)
        start = ckpt.restore(require=True, model=model, optimizer=opt, zensync=state)
    except FileNotFoundError as exc:
        return {"error": str(exc)}
    after = _train(ddp, opt, rank, range(start, STEPS), ckpt, model, state)
    ckpt.close()
    return {"start": start, "recovery": ckpt.recovery, "after": after, "on_disk": on_disk,
            "params": [p.detach().clone() for p in model.parameters()], "want": _uninterrupted(rank)}  # fmt: skip


@pytest.mark.slow
def test_with_every_host_gone_the_disk_checkpoint_is_restored(tmp_path) -> None:
    results = launch(_every_host_gone, WORLD, (str(tmp_path), True), tmp_path)
    for out in results:
        # dcp_every=2 saved steps 0 and 2 to disk; memory is gone: step 2 from disk, step 3 lost
        assert out["recovery"]["source"] == "dcp" and out["recovery"]["step"] == 2 and out["start"] == 3
        want_losses, want_params = out["want"]
        assert out["after"] == want_losses[3:]
        for got, want in zip(out["params"], want_params, strict=True):
            assert torch.equal(got, want)


@pytest.mark.slow  # the README's run checks the same error on empty stores (the requirement test below)
def test_with_every_host_gone_and_no_disk_every_rank_raises_the_same_error(tmp_path) -> None:
    results = launch(_every_host_gone, WORLD, (str(tmp_path), False), tmp_path)
    errors = {out["error"] for out in results}
    assert len(errors) == 1 and "ranks [0, 1, 2, 3]" in errors.pop()


def _required_on_rank0(rank: int, world_size: int, root: str) -> str:
    model, _, opt, state = _setup()
    ckpt = Checkpointer(CheckpointConfig(root=f"{root}/host{rank}", replicas=1), hook_state=state)
    try:
        ckpt.restore(require=rank == 0, model=model, optimizer=opt, zensync=state)
    except FileNotFoundError as exc:
        return str(exc)
    return "restored"


def test_a_checkpoint_required_on_one_rank_is_required_on_every_rank(tmp_path) -> None:
    """Under torchrun the host whose worker failed counts a restart (``TORCHELASTIC_RESTART_COUNT`` 1:
    ``require`` defaults to True) and a healthy host restarted for the new membership does not (0).
    With nothing anywhere, every rank raises the same FileNotFoundError: before, rank 0 raised and
    rank 1 started afresh, into a collective rank 0 never joined (a hang until the timeout)."""
    said = launch(_required_on_rank0, 2, (str(tmp_path),), tmp_path)
    assert said[0] == said[1] and "no step's checkpoint is held for every rank" in said[0]


def _unwaited(rank: int, world_size: int, root: str, max_lag: int | None = None, dedup: bool = True) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(4000, 16), nn.Linear(16, 4))  # 256 KiB of rows, few touched per step
    ddp = DistributedDataParallel(model)
    state = zensync.register(ddp, strategy="auto", **FIXED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: untouched rows keep their bytes
    config = CheckpointConfig(root=f"{root}/host{rank}", replicas=1, max_lag_steps=max_lag, dedup=dedup)
    ckpt = Checkpointer(config, hook_state=state)
    ckpt.restore(model=model, optimizer=opt, zensync=state)
    fractions, covered = [], []
    for step in range(12):  # saves do not wait for replication: rounds overlap the next steps
        gen = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        nn.functional.cross_entropy(
            ddp(torch.randint(0, 4000, (4, 3), generator=gen)), torch.zeros(4).long()
        ).backward()
        opt.step()
        record = ckpt.save(step, model=model, optimizer=opt, zensync=state)
        fractions += record["sent_fractions"]
        assert ckpt.replicator is not None
        covered.append((step, ckpt.replicator.complete_step, record.get("lag_bound_met")))
    replicated = ckpt.wait_replicated(REPLICATION_TIMEOUT_S)
    fractions += ckpt.replicator.take_step().sent_fractions if ckpt.replicator else []
    ckpt.close()
    state.close()
    return {"fractions": fractions, "replicated": replicated, "covered": covered}


@pytest.mark.slow
def test_later_versions_travel_as_deltas_while_training_goes_on(tmp_path) -> None:
    # without dedup (with it nothing of this data parallel model travels: test_a_replaced_host_...)
    for out in launch(_unwaited, WORLD, (str(tmp_path), None, False), tmp_path):
        assert out["replicated"]
        first, *later = out["fractions"]
        # the first version whole; then 4 ranks x 4 bags x 3 rows of 64-byte rows per step (and the
        # Linear) change: a small part of the 256 KiB table, even over the steps a round overlaps
        assert first == 1.0 and later and max(later) < 0.25


@pytest.mark.slow
def test_a_lag_bound_of_0_replicates_each_version_before_its_save_returns(tmp_path) -> None:
    for out in launch(_unwaited, WORLD, (str(tmp_path), 0), tmp_path):
        assert out["covered"] == [(step, step, True) for step in range(12)]


def _unreadable_store(rank: int, world_size: int, root: str) -> str:
    model, _ddp, opt, state = _setup()
    ckpt = Checkpointer(CheckpointConfig(root=f"{root}/host{rank}", replicas=1), hook_state=state)
    if rank == 1:
        ckpt.store.save(1, 0, {"w": torch.zeros(1)})  # a shard to report

        def versions(*_: Any) -> list[Any]:
            raise PermissionError("the store is unreadable")

        ckpt.store.versions = versions  # type: ignore[method-assign]
    try:
        ckpt.restore(model=model, optimizer=opt, zensync=state)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "restored"


@pytest.mark.slow
def test_a_rank_that_cannot_read_its_store_fails_every_rank_alike(tmp_path) -> None:
    said = {out for out in launch(_unreadable_store, WORLD, (str(tmp_path),), tmp_path)}
    assert len(said) == 1 and "rank(s) [1]" in (only := said.pop()) and "PermissionError" in only


def _corrupt_newest(rank: int, world_size: int, root: str, where: str) -> dict[str, Any]:
    """Steps 0-3 saved and replicated; then a byte of a stored copy of step 3 flipped (``where``:
    rank 1's own on host 1, or that and its replica on host 0 as well); every rank restores."""
    config = CheckpointConfig(root=f"{root}/host{rank}", replicas=1)
    model, ddp, opt, state = _setup()
    ckpt = Checkpointer(config, hook_state=state)
    ckpt.restore(model=model, optimizer=opt, zensync=state)
    _train(ddp, opt, rank, range(CRASH_AFTER), ckpt, model, state)
    assert ckpt.wait_replicated(REPLICATION_TIMEOUT_S)
    ckpt.close()
    state.close()
    ckpt.transport.barrier()
    corrupt = {1: [1], 0: [1] if where == "both" else []}.get(rank, [])
    for owner in corrupt:  # on host 0, rank 1's replica links host 0's own files (dedup): corrupt those
        info = ckpt.store.version(owner, CRASH_AFTER - 1)
        assert info is not None
        with open(info.path / "data.bin", "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0x10]))
    ckpt.transport.barrier()
    model, ddp, opt, state = _setup()
    ckpt = Checkpointer(config, hook_state=state)
    start = ckpt.restore(require=True, model=model, optimizer=opt, zensync=state)
    after = _train(ddp, opt, rank, range(start, STEPS), ckpt, model, state)
    ckpt.close()
    state.close()
    return {"start": start, "recovery": ckpt.recovery, "after": after,
            "params": [p.detach().clone() for p in model.parameters()], "want": _uninterrupted(rank)}  # fmt: skip


@pytest.mark.parametrize("where", ["own", pytest.param("both", marks=pytest.mark.slow)])
def test_a_stored_copy_that_fails_its_checksums_is_never_loaded(tmp_path, where: str) -> None:
    """Restore checks only the versions its plan uses: rank 1's own step 3, corrupt, is struck and
    the plan made again, with step 3 from rank 1's replica on host 0; with that copy corrupt too
    (on host 0 it links host 0's own files: rank 0's step 3 is corrupt with it, and rank 0's replica
    on host 1 links rank 1's corrupt files), every rank restores step 2. Either way the run goes on
    as the uninterrupted one."""
    results = launch(_corrupt_newest, 2, (str(tmp_path), where), tmp_path)  # hosts 0 and 1 hold each other's
    step = CRASH_AFTER - 1 if where == "own" else CRASH_AFTER - 2
    for rank, out in enumerate(results):
        rec = out["recovery"]
        assert out["start"] == step + 1 and rec["step"] == step
        assert rec["source"] == ("peers" if where == "own" else "local")
        assert (rec["fetched_bytes"] > 0) == (where == "own" and rank == 1)
        want_losses, want_params = out["want"]
        assert out["after"] == want_losses[step + 1 :]
        for got, want in zip(out["params"], want_params, strict=True):
            assert torch.equal(got, want)

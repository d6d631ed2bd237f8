"""``Checkpointer`` with an FSDP2 model (``fully_shard``, zensync's ``register_fsdp``) on 2 gloo ranks
that stand for 2 hosts (HSDP: 4 ranks, 2 replicas of 2 shards, in the slow tier): Adam, a checkpoint
every step replicated to another host.

- The model's and the optimizer's DTensors are stored as each rank's local shard with their layout
  (``memory.state_of``) and come back as DTensors on the restarted run's mesh; zensync's FSDP state
  is kept as each rank's own (``local_state_dict``: error-feedback residuals, PowerSGD's bases).
  Restarted from its own memory, or with host 1 replaced (its store wiped) from its peer's, the run
  goes on as the uninterrupted one, bit for bit (losses and parameters), lossless or compressed.
- The shards are not alike across ranks: replicas travel (no dedup), and a save writes only the rows
  the step changed (``ChangeTracker`` on the shards).
- zensync's FSDP state tells the checkpointer its sync windows (``add_sync_listener``): one a step.
- A state saved on one mesh does not load on a mesh of another shape: the same ValueError, naming
  the tensor, on every rank; zensync's local state loads only on the rank that saved it.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import zensync
from tests.distributed._launch import launch
from tests.distributed.resilience.test_memory import _steps
from zensync.resilience import CheckpointConfig, Checkpointer
from zensync.resilience.memory import load_parts, state_of

WORLD, STEPS, CRASH_AFTER = 2, 6, 3
VOCAB, DIM, CLASSES = 256, 32, 5
"""Rows of 128 bytes: the embedding's shard is tracked by rows (``blocks.ROW_MIN_BYTES``)."""
REPLICATION_TIMEOUT_S = 30.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU())
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(ids).mean(1)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = (torch.rand(6, 5, generator=gen) ** 3 * VOCAB).long()  # a few rows a step, the first ones most
    return ids, torch.randint(0, CLASSES, (6,), generator=gen)


def _sharded(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Net()
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _setup(strategy: str = "auto", world: int = WORLD) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """FSDP over ``world`` ranks (2), or HSDP (4): 2 replicas of 2 shards, zensync syncing the replicas."""
    if world == WORLD:
        model, opt = _sharded(init_device_mesh("cpu", (WORLD,)))
        return model, opt, zensync.register_fsdp(model, strategy=strategy)
    hsdp = init_device_mesh("cpu", (world // WORLD, WORLD), mesh_dim_names=("replicate", "shard"))
    model, opt = _sharded(hsdp["shard"])
    return model, opt, zensync.register_fsdp(model, strategy=strategy, mesh=hsdp)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range, ckpt: Checkpointer | None,
           state: Any = None) -> list[float]:  # fmt: skip
    def replicated(step: int) -> None:  # each version replicated before the next
        assert ckpt is not None and ckpt.wait_replicated(REPLICATION_TIMEOUT_S)

    return _steps(model, opt, rank, steps, ckpt, model, state, replicated, batch=_batch)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _config(root: str, rank: int) -> CheckpointConfig:
    return CheckpointConfig(root=f"{root}/host{rank}", replicas=1, ranks_per_host=1)


def _run(rank: int, world_size: int, root: str, replaced: bool, strategy: str) -> dict[str, Any]:
    model, opt, state = _setup(strategy, world_size)
    uninterrupted = _train(model, opt, rank, range(STEPS), None)
    final = _params(model)
    # the run that stops after CRASH_AFTER steps, checkpointing every step (zensync's state too)...
    model, opt, state = _setup(strategy, world_size)
    ckpt = Checkpointer(_config(root, rank), hook_state=state)
    assert ckpt.restore(model=model, optimizer=opt, zensync=state) == 0
    before = _train(model, opt, rank, range(CRASH_AFTER), ckpt, state)
    records, windows = list(ckpt.history), (ckpt.gate.syncs, ckpt.gate.windows)
    ckpt.close()
    ckpt.transport.barrier()
    if replaced and rank == 1:  # host 1 replaced: its memory is gone
        shutil.rmtree(f"{root}/host1")
    ckpt.transport.barrier()
    # ... and its restart: everything built anew, restored from memory
    model, opt, state = _setup(strategy, world_size)
    ckpt = Checkpointer(_config(root, rank), hook_state=state)
    start = ckpt.restore(require=True, model=model, optimizer=opt, zensync=state)
    states = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    restored_as_dtensors = bool(states) and all(isinstance(t, DTensor) for t in states)
    after = _train(model, opt, rank, range(start, STEPS), ckpt, state)
    ckpt.close()
    return {"uninterrupted": uninterrupted, "resumed": before + after, "final": final, "restored": _params(model),
            "start": start, "source": ckpt.recovery and ckpt.recovery["source"], "records": records,
            "windows": windows, "dtensors": restored_as_dtensors}  # fmt: skip


@pytest.mark.parametrize(
    ("strategy", "replaced", "world"),
    [
        pytest.param("auto", False, WORLD, id="auto-restarted"),
        pytest.param("auto", True, WORLD, id="auto-host_replaced", marks=pytest.mark.slow),
        pytest.param("qsgd:127", False, WORLD, id="qsgd-restarted", marks=pytest.mark.slow),
        pytest.param("powersgd:2", True, WORLD, id="powersgd-host_replaced", marks=pytest.mark.slow),
        pytest.param("powersgd:2", True, 4, id="hsdp-powersgd-host_replaced", marks=pytest.mark.slow),
    ],
)
def test_an_fsdp2_run_goes_on_from_memory_as_the_uninterrupted_run(tmp_path, strategy: str, replaced: bool,
                                                                   world: int) -> None:  # fmt: skip
    """Lossless (auto: rows and dense paths), and compressed with error feedback (qsgd) and warm-start
    bases (PowerSGD), whose state the checkpoint keeps as each rank's own (``local_state_dict``); FSDP
    on 2 ranks, HSDP on 4 (PowerSGD over the replicas)."""
    results = launch(_run, world, [str(tmp_path / "shm"), replaced, strategy], tmp_path)
    for rank, r in enumerate(results):
        assert r["start"] == CRASH_AFTER and r["source"] == ("peers" if replaced else "local"), rank
        assert r["dtensors"], rank  # the optimizer's states came back sharded, on the mesh
        assert r["resumed"] == r["uninterrupted"], rank
        for name, want in r["final"].items():
            assert torch.equal(r["restored"][name], want), (rank, name)
        assert r["windows"] == (CRASH_AFTER, CRASH_AFTER), rank  # a sync window a step, from the FSDP hook
        # the shards differ across ranks: the replicas travel. The tracker lists the rows each step
        # changed in the shards, and a save over an older version (the third: two are kept) writes only those
        first, *later = r["records"]
        assert all(rec["listed"] > 0 for rec in later) and later[-1]["written_bytes"] < first["written_bytes"], rank
        assert any(rec["replicated_bytes"] > 0 for rec in r["records"]), rank


def _another_mesh(rank: int, world_size: int) -> str:
    model, opt, state = _setup()
    _train(model, opt, rank, range(1), None)  # Adam's states exist
    saved = {"model": state_of(model), "optimizer": state_of(opt)}  # what a save stores
    model, opt = _sharded(init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard")))  # HSDP's
    with pytest.raises(ValueError, match="saved as a DTensor on a mesh of shape \\[2\\]") as raised:
        load_parts(saved, {"model": model, "optimizer": opt})
    with pytest.raises(ValueError, match="has a key '__dtensors__'"):  # the key that lists a part's DTensors
        state_of({"__dtensors__": [], "w": next(model.parameters())})
    # zensync's local state is the saving rank's own: another rank's is refused, naming both
    other = {**state.local_state_dict(), "rank": 1 - rank}
    with pytest.raises(ValueError, match=f"saved by rank {1 - rank} of 2, loaded by rank {rank} of 2"):
        state.load_local_state_dict(other)
    return str(raised.value)


def test_a_state_saved_on_one_mesh_is_refused_on_another(tmp_path) -> None:
    said = launch(_another_mesh, WORLD, [], tmp_path)
    assert said[0] == said[1] and "part 'model': emb.weight" in said[0]

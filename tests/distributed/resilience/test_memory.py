"""``MemoryCheckpoint`` on 2 gloo ranks: DDP with zensync's hook and SGD with momentum, saved to shared
memory every step; after a simulated restart (fresh model, optimizer and hook, restored from memory):

- the run goes on bit for bit as the uninterrupted run: parameters, losses, the hook's step, for
  lossless strategies and for a fused compressor with error feedback (qsgd), whose residuals come
  back exactly: DDP's first iteration after a restart fuses every gradient into one bucket, and the
  hook syncs it as the saved step's buckets (``ZenSyncState.replay_groups``), so that step
  compresses the same groups as the uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zensync
from tests.distributed._launch import launch
from tests.distributed.hooks.test_fsdp import _batch, _Net
from zensync.resilience import MemoryCheckpoint

FIXED = {"adapt": False, "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e8}
"""auto's choices from a fixed network model, not from measured times: two runs choose alike."""
STEPS, CRASH_AFTER = 6, 3


def _setup(strategy: str) -> tuple[nn.Module, Any, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = _Net()
    ddp = DistributedDataParallel(model)
    state = zensync.register(ddp, strategy=strategy, **FIXED)
    return model, ddp, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), state


def _steps(ddp: Any, opt: torch.optim.Optimizer, rank: int, steps: range, ckpt: Any, model: nn.Module,
           state: Any, after_save: Callable[[int], None] = lambda step: None,
           batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] = _batch) -> list[float]:  # fmt: skip
    """Train ``steps`` on ``batch(rank, step)``; after each, ``ckpt.save`` (a MemoryCheckpoint or a
    Checkpointer; None: no checkpoints), then ``after_save(step)``."""
    losses = []
    for step in steps:
        opt.zero_grad()
        ids, target = batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(ids), target)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if ckpt is not None:
            ckpt.save(step, model=model, optimizer=opt, zensync=state)
            after_save(step)
    return losses


def _run(rank: int, world_size: int, root: str, strategy: str) -> dict[str, Any]:
    model, ddp, opt, state = _setup(strategy)
    uninterrupted = _steps(ddp, opt, rank, range(STEPS), None, model, state)
    final = [p.detach().clone() for p in model.parameters()]
    state.close()
    # The run that crashes after CRASH_AFTER steps, saving every step...
    model, ddp, opt, state = _setup(strategy)
    ckpt = MemoryCheckpoint(root, rank)
    before = _steps(ddp, opt, rank, range(CRASH_AFTER), ckpt, model, state)
    state.close()
    # ... and its restart: everything built anew, then restored from shared memory.
    model, ddp, opt, state = _setup(strategy)
    ckpt = MemoryCheckpoint(root, rank)
    last = ckpt.restore(model=model, optimizer=opt, zensync=state)
    after = _steps(ddp, opt, rank, range(last + 1, STEPS), ckpt, model, state)
    restored = [p.detach().clone() for p in model.parameters()]
    hook_step = state.state_dict()["step"]
    state.close()
    return {"uninterrupted": uninterrupted, "resumed": before + after, "final": final, "restored": restored,
            "last": last, "hook_step": hook_step}  # fmt: skip


@pytest.mark.parametrize(
    "strategy", ["auto", pytest.param("qsgd:127", marks=pytest.mark.slow), pytest.param("zen", marks=pytest.mark.slow)]
)
def test_a_restart_from_memory_goes_on_as_the_uninterrupted_run(tmp_path, strategy: str) -> None:
    results = launch(_run, 2, (str(tmp_path / "shm"), strategy), tmp_path)
    for out in results:
        assert out["last"] == CRASH_AFTER - 1
        assert out["resumed"] == out["uninterrupted"]
        for got, want in zip(out["restored"], out["final"], strict=True):
            assert torch.equal(got, want)
        assert out["hook_step"] == STEPS


def _residuals_after_restore(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, ddp, opt, state = _setup("topk:0.3")
    ckpt = MemoryCheckpoint(root, rank)
    _steps(ddp, opt, rank, range(CRASH_AFTER), ckpt, model, state)
    saved = state.state_dict()["compression"]
    state.close()
    model, ddp, opt, state = _setup("topk:0.3")
    MemoryCheckpoint(root, rank).restore(model=model, optimizer=opt, zensync=state)
    loaded = state.state_dict()["compression"]
    state.close()
    return {"saved": saved, "loaded": loaded}


def test_error_feedback_residuals_come_back_from_memory(tmp_path) -> None:
    for out in launch(_residuals_after_restore, 2, (str(tmp_path / "shm"),), tmp_path):
        (key,) = out["saved"]
        worker = out["saved"][key]["worker"]
        assert worker and any(bool(t.abs().sum() > 0) for t in worker.values())  # topk dropped something
        assert set(out["loaded"]) == {key} and set(out["loaded"][key]["worker"]) == set(worker)
        for name, residual in worker.items():
            assert torch.equal(out["loaded"][key]["worker"][name], residual), name

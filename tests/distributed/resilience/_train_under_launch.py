"""A training script for ``zensync launch`` (tests/distributed/resilience/test_launch.py).

    python -m zensync launch --ckpt-root DIR -- --standalone --nproc-per-node 2 --max-restarts 1 \\
        _train_under_launch.py OUT_DIR STEPS KILL_STEP KILL_RANK [REPLICAS]

DDP with zensync's hook ("auto"), SGD with momentum, a ``Checkpointer`` every step (REPLICAS peer
hosts hold a copy of each shard; default 0: this host's memory only). On its first run, rank
KILL_RANK SIGKILLs itself in step KILL_STEP, after its backward and before its optimizer step (-1:
never); torchrun restarts every worker, which restore from their agents' stores. Each rank writes
OUT_DIR/rank<r>.pt: its final parameters, losses by step, the restore's record, the restart count
and whether its last step had its replicas.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zensync
from zensync.resilience import CheckpointConfig, Checkpointer

FIXED = {"adapt": False, "latency_s": 1e-5, "bandwidth_bytes_per_s": 1e8}
"""auto's choices from a fixed network model, not from measured times: two runs choose alike."""


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.rand(8, 5, generator=gen) ** 3 * 500).long(), torch.randint(0, 4, (8,), generator=gen)


def main(out_dir: str, steps: int, kill_step: int, kill_rank: int, replicas: int = 0) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, restart = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(500, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    ddp = DistributedDataParallel(model)
    state = zensync.register(ddp, strategy="auto", **FIXED)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    ckpt = Checkpointer(CheckpointConfig(replicas=replicas), hook_state=state)
    start = ckpt.restore(model=model, optimizer=opt, zensync=state)
    losses = {}
    for step in range(start, steps):
        opt.zero_grad()
        ids, target = _batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(ids), target)
        loss.backward()
        if restart == 0 and step == kill_step and rank == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        losses[step] = float(loss)
        ckpt.save(step, model=model, optimizer=opt, zensync=state)
    replicated = ckpt.wait_replicated(60.0)
    ckpt.close()
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
                "recovery": ckpt.recovery, "restart": restart, "start": start, "replicated": replicated,
                "rounds": len(ckpt.history), "hook_step": state.state_dict()["step"]},
               f"{out_dir}/rank{rank}.pt")  # fmt: skip
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *map(int, sys.argv[5:6]))

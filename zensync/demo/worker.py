"""One demo worker: join the group, train ``steps`` steps of DDP under one strategy, save what it measured.

Started by ``zensync.demo.runner`` once per rank (``python -m zensync.demo.worker ...``) with the
env:// variables of ``ClusterBase.env_for_torch``. Per timed step it records:

- ``step_time_s``: wall time between two barriers around forward + backward + optimizer step;
- ``comm_time_s``: summed bucket communication time (see ``zensync.demo.meter``);
- ``bytes_sent``: counted by zensync's hook, modelled (ring) for torch's hooks;
- ``scheme_counts``: parameters synced by each scheme this step (see ``zensync.demo.meter``);
- ``wire_tx_bytes``: the host interface's tx byte delta over the timed steps (emulated hosts only).

Rank r writes ``<out>/rank<r>.json``; rank 0 also writes ``<out>/params.pt`` (final parameters) and,
with ``--progress FILE``, appends one line to FILE per finished step (the runner's progress bar).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zensync
from zensync.demo.config import TORCH_STRATEGIES, DemoConfig, split_strategy
from zensync.demo.meter import TorchHookMeter, ZenSyncMeter, timed_torch_hook
from zensync.demo.model import DemoModel, batch
from zensync.transport import launch

__all__ = ["attach_strategy", "main", "train"]

_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


def attach_strategy(
    ddp: DistributedDataParallel, strategy: str, world_size: int, config: DemoConfig
) -> tuple[Any, Any]:
    """Register ``strategy``'s comm hook on ``ddp``; returns (meter with ``pop_step()``, zensync state or None)."""
    strategy, _ = split_strategy(strategy)
    if strategy in TORCH_STRATEGIES:
        if strategy == "ddp":
            meter = TorchHookMeter(launch.allreduce_hook, world_size, 4, scheme="dense")
        else:
            meter = TorchHookMeter(launch.fp16_compress_hook, world_size, 2, scheme="fp16")
        ddp.register_comm_hook(meter, timed_torch_hook)
        return meter, None
    options = {"latency_s": config.latency_s, "bandwidth_bytes_per_s": config.bandwidth_bytes_per_s}
    state = zensync.register(ddp, strategy=strategy, **options)
    return ZenSyncMeter(state), state


def _tx_bytes() -> int | None:
    """This host's interface tx bytes (emulated hosts only: loopback is shared by every worker)."""
    iface = os.environ.get(_INTERFACE_ENV)
    if not iface or iface == "lo":
        return None
    return int(pathlib.Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def _one_step(
    ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[float, float]:
    """Forward, backward (DDP syncs here), SGD step between two barriers; returns (loss, wall seconds)."""
    loss_fn = nn.CrossEntropyLoss()
    launch.barrier()
    start = time.perf_counter()
    optimizer.zero_grad()  # set_to_none, torch's default: zensync's row hints need the cleared gradient
    logits = ddp(inputs)
    loss = loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    launch.barrier()
    return float(loss.item()), time.perf_counter() - start


def train(
    config: DemoConfig,
    strategy: str,
    corpus: torch.Tensor,
    rank: int,
    world_size: int,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train under ``strategy`` and return this rank's measurements and the final model.

    Step 1: identical seeded weights on every rank, DDP, the strategy's hook, plain SGD.
    Step 2: ``warmup_steps`` untimed steps, then ``steps`` timed steps on this rank's batches;
    ``on_step(step)`` after each.
    """
    sparse_embedding = split_strategy(strategy)[1]
    model = DemoModel(config, generator=torch.Generator().manual_seed(config.seed), sparse_embedding=sparse_embedding)
    ddp = DistributedDataParallel(model)
    meter, state = attach_strategy(ddp, strategy, world_size, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    steps: list[dict[str, Any]] = []
    tx_start = None
    try:
        for step in range(config.warmup_steps + config.steps):
            if step == config.warmup_steps:
                tx_start = _tx_bytes()
            inputs, targets = batch(corpus, config, rank, step)
            loss, step_time_s = _one_step(ddp, optimizer, inputs, targets)
            record = {"step": step, "loss": loss, "step_time_s": step_time_s, **meter.pop_step()}
            if step >= config.warmup_steps:
                steps.append(record)
            if on_step is not None:
                on_step(step)
    finally:
        if state is not None:
            state.close()
    tx_end = _tx_bytes()
    wire = None if tx_start is None or tx_end is None else tx_end - tx_start
    return {"rank": rank, "world_size": world_size, "steps": steps, "wire_tx_bytes": wire, "model": model}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m zensync.demo.worker --config C --strategy S --corpus P --out D``."""
    parser = argparse.ArgumentParser(prog="python -m zensync.demo.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="DemoConfig as JSON (DemoConfig.to_json)")
    parser.add_argument("--strategy", required=True, help="one strategy of the config")
    parser.add_argument("--corpus", required=True, help="token ids saved by the runner (torch.save)")
    parser.add_argument("--out", required=True, help="directory for rank<r>.json and params.pt")
    parser.add_argument("--progress", default=None, help="rank 0 appends a line per finished step here")
    args = parser.parse_args(argv)
    config = DemoConfig.from_json(pathlib.Path(args.config).read_text())
    torch.set_num_threads(1)
    # Half the launch limit: a stuck collective raises here (with a traceback) before the runner kills us.
    rank, world_size = launch.init_from_env("gloo", timeout_s=config.timeout_s / 2)
    try:
        corpus = torch.load(args.corpus)
        with _progress_writer(args.progress if rank == 0 else None) as on_step:
            result = train(config, args.strategy, corpus, rank, world_size, on_step)
        model = result.pop("model")
        out = pathlib.Path(args.out)
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "params.pt")
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        launch.barrier()
    finally:
        launch.destroy()
    return 0


@contextlib.contextmanager
def _progress_writer(path: str | None) -> Iterator[Callable[[int], None] | None]:
    """``on_step`` that appends a line per step to ``path`` (None without a path)."""
    if path is None:
        yield None
        return
    with open(path, "a", buffering=1) as progress:  # line-buffered: the runner sees each step at once
        yield lambda step: print(step, file=progress)


if __name__ == "__main__":
    sys.exit(main())

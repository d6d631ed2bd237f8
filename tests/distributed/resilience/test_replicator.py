"""``Replicator`` on 2 gloo ranks whose saves are out of step: rank 0 has saved steps 1 and 2 when the
first round agrees, rank 1 only step 1. That round replicates step 1; rank 0 must come back for step 2
once rank 1 has saved it. Before the fix, rank 0 counted step 2 as attempted (its newest at the
agreement) and never started its round: step 2 was never replicated, and every wait timed out."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.distributed._launch import launch
from zensync.resilience import IdleGate, Replicator, ShardStore
from zensync.transport import transport_for_group

WAIT_S = 20.0
"""Far above a round of this 1 KiB state (milliseconds); a round that never comes fails the test."""


def _state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((16, 16), float(10 * rank + step)), "step": step}


def _out_of_step(rank: int, world_size: int, root: str) -> dict[str, Any]:
    store = ShardStore(f"{root}/host{rank}")
    transport = transport_for_group(None).duplicate()
    replicator = Replicator(store, transport, m=1, placement="ring", ranks_per_host=1, chunk_bytes=1 << 20,
                            gate=IdleGate())  # fmt: skip
    store.save(rank, 1, _state(rank, 1))
    if rank == 0:
        store.save(rank, 2, _state(rank, 2))  # a save ahead: its newest at the first agreement is step 2
        replicator.notify(2)
    else:
        replicator.notify(1)
        first = replicator.wait_complete(1, WAIT_S)
        time.sleep(0.5)  # rank 0's thread is idle again by now
        store.save(rank, 2, _state(rank, 2))
        replicator.notify(2)
        assert first
    done = replicator.wait_complete(2, WAIT_S)
    replicator.close(WAIT_S)
    peer = 1 - rank
    held = store.load(peer, step=2) if done else None
    return {"done": done, "steps": [r.step for r in replicator.rounds if r.complete], "held": held}


@pytest.mark.slow  # the README's command stays under 6 minutes
def test_a_rank_a_save_ahead_comes_back_for_its_newer_step(tmp_path) -> None:
    for rank, out in enumerate(launch(_out_of_step, 2, (str(tmp_path),), tmp_path)):
        assert out["done"] and out["steps"][:2] == [1, 2]
        assert torch.equal(out["held"]["w"], _state(1 - rank, 2)["w"])  # the peer's step 2, bit for bit

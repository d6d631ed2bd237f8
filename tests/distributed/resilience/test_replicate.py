"""Replication of checkpoint shards to ring peers and recovery of a replaced host, on 3 gloo ranks that
stand for 3 hosts (a store directory each): after rank 1's store is wiped, rank 1 gets its newest
shard back from its ring peer bit for bit; a corrupt replica is never offered (the previous version
comes back); with no peer holding a verified copy every rank raises the same FileNotFoundError."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from tests.distributed._launch import launch
from zensync.resilience import ShardStore, fetch, replicate, ring_peers
from zensync.transport import transport_for_group


def _state(rank: int, step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return {"model": {"w": torch.randn(64, 8, generator=gen), "b": torch.randn(8, generator=gen)}, "step": step}


def _run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    transport = transport_for_group(None)
    store = ShardStore(f"{root}/host{rank}")
    moved = []
    for step in (1, 2):
        store.save(rank, step, _state(rank, step))
        moved.append(replicate(store, transport, m=1))
    holds = store.ranks()
    # Host 1 is replaced: its store is gone.
    if rank == 1:
        shutil.rmtree(store.root)
        store = ShardStore(store.root)
    got = fetch(store, transport, missing=rank == 1)
    back = store.load(rank) if rank == 1 else None
    # Replicas corrupted on their holder (rank 2 holds rank 1's): never offered. The newest one first:
    # the previous version comes back; then both: no peer can serve rank 1.
    outcomes = []
    for corrupt in (2, 1):
        if rank == 2:
            info = next(i for i in store.versions(1) if i.step == corrupt)
            raw = bytearray((info.path / "data.bin").read_bytes())
            raw[0] ^= 0xFF
            (info.path / "data.bin").write_bytes(bytes(raw))
        if rank == 1:
            shutil.rmtree(store.root)
            store = ShardStore(store.root)
        try:
            outcomes.append(fetch(store, transport, missing=rank == 1))
        except FileNotFoundError as exc:
            outcomes.append(str(exc))
    return {"moved": moved, "holds": holds, "got": got, "back": back, "outcomes": outcomes}


def test_a_replaced_host_gets_its_shards_back_from_its_ring_peer(tmp_path) -> None:
    results = launch(_run, 3, (str(tmp_path / "stores"),), tmp_path)
    for rank, out in enumerate(results):
        assert out["moved"][-1]["received"] == {(rank - 1) % 3: 2} and out["moved"][-1]["rejected"] == []
        assert out["holds"] == sorted([rank, (rank - 1) % 3])  # its own shards and its ring predecessor's
    assert results[1]["got"] == 2 and results[0]["got"] is None
    back, want = results[1]["back"], _state(1, 2)
    assert back["step"] == 2
    for key in ("w", "b"):
        assert torch.equal(back["model"][key], want["model"][key])
    assert results[1]["outcomes"][0] == 1  # v2's copy corrupt: the previous complete version
    errors = {out["outcomes"][1] for out in results}
    assert len(errors) == 1 and "ranks [1]" in errors.pop()  # none left: the same error on every rank


def test_ring_peers() -> None:
    assert ring_peers(3, 4, 2) == [0, 1]
    with pytest.raises(ValueError, match="m=4"):
        ring_peers(0, 4, 4)

"""Each rank's newest shard copied to peers' stores, and a replaced host's shards fetched back.

Hosts keep their own ranks' shards (``ShardStore``); ``replicate`` sends every rank's newest
complete shard to ``m`` peers in a ring (rank r's to r + 1, ..., r + m), over the engine's transport,
in one all-to-all. A peer keeps a replica only once its bytes verify against its manifest.
``fetch`` brings back the shards of ranks whose host was replaced (its store gone): every rank reports
the newest verified shard it holds of every rank, every rank computes the same plan (for each rank
that needs its shard, the holder of the newest one, lowest rank first), and the holders send them in
one all-to-all. A rank no peer can serve raises the same FileNotFoundError on every rank (fall back to
a checkpoint on disk).

Shards cross hosts as bytes: an 8-byte header length, the manifest's JSON, then the data (no pickle),
on a CPU transport (gloo's).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from zensync.resilience.store import CorruptShard, ShardStore
from zensync.transport import Transport

__all__ = ["fetch", "replicate", "ring_peers"]

_LENGTH = 8


def ring_peers(rank: int, world_size: int, m: int) -> list[int]:
    """The ranks that hold replicas of ``rank``'s shard: the next ``m`` in a ring.

    Raises:
        ValueError: If ``m`` is not in [1, world_size - 1].
    """
    if not 1 <= m < world_size:
        raise ValueError(f"m={m} replicas need 1 <= m < world_size={world_size}")
    return [(rank + k) % world_size for k in range(1, m + 1)]


def _pack(store: ShardStore, rank: int, step: int | None = None) -> torch.Tensor:
    infos = [i for i in store.versions(rank) if step is None or i.step == step]
    if not infos:
        raise FileNotFoundError(f"no complete shard of rank {rank} to send")
    manifest, data = store.raw(infos[-1])
    head = len(manifest).to_bytes(_LENGTH, "little")
    return torch.frombuffer(bytearray(head + manifest + data), dtype=torch.uint8)


def _unpack(store: ShardStore, blob: torch.Tensor) -> int:
    raw = blob.numpy().tobytes()
    length = int.from_bytes(raw[:_LENGTH], "little")
    return store.put_raw(raw[_LENGTH : _LENGTH + length], raw[_LENGTH + length :]).step


def _exchange(transport: Transport, blobs: dict[int, torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """Send ``blobs[j]`` to rank j (one all-to-all); returns the non-empty blobs received, by source."""
    n = transport.world_size
    parts = [blobs.get(j, torch.empty(0, dtype=torch.uint8)) for j in range(n)]
    received, counts = transport.all_to_all_v(torch.cat(parts), [p.numel() for p in parts])
    out, offset = [], 0
    for source, count in enumerate(counts):
        if count:
            out.append((source, received[offset : offset + count]))
        offset += count
    return out


def replicate(store: ShardStore, transport: Transport, m: int = 1) -> dict[str, Any]:
    """Send this rank's newest complete shard to its ``m`` ring peers and keep the ones sent here.

    A collective over ``transport``'s ranks. Returns what moved: {"sent_bytes", "received": {source
    rank: step}, "rejected": [source ranks whose copy did not verify]}.
    """
    rank, n = transport.rank, transport.world_size
    blob = _pack(store, rank)
    sent = _exchange(transport, {peer: blob for peer in ring_peers(rank, n, m)})
    received, rejected = {}, []
    for source, data in sent:
        try:
            received[source] = _unpack(store, data)
        except CorruptShard:
            rejected.append(source)
    return {"sent_bytes": blob.numel() * m, "received": received, "rejected": rejected}


def fetch(store: ShardStore, transport: Transport, *, missing: bool) -> int | None:
    """Bring back the newest shard of every rank that reports ``missing`` (its host replaced) from the
    peers that hold it; returns the step this rank got (None when it did not need one).

    A collective over ``transport``'s ranks.

    Raises:
        FileNotFoundError: On every rank, when a rank that needs its shard has no peer holding a
            verified one.
    """
    rank = transport.rank
    held = {}
    for source in store.ranks():
        info = store.newest_verified(source)
        if info is not None:
            held[source] = info.step
    report = json.dumps({"missing": missing, "held": held}).encode()
    reports = [
        json.loads(bytes(t.tolist())) for t in transport.all_gather_v(torch.tensor(list(report), dtype=torch.uint8))
    ]
    plan: dict[int, tuple[int, int]] = {}  # needy rank -> (holder, step)
    unserved = []
    for needy, mine in enumerate(reports):
        if not mine["missing"]:
            continue
        offers = [(int(r["held"][str(needy)]), -holder) for holder, r in enumerate(reports)
                  if holder != needy and str(needy) in r["held"]]  # fmt: skip
        if not offers:
            unserved.append(needy)
            continue
        step, holder = max(offers)
        plan[needy] = (-holder, step)
    if unserved:
        raise FileNotFoundError(
            f"ranks {unserved} need their checkpoint shards and no peer holds a verified one: load the last "
            f"checkpoint from disk"
        )
    blobs = {needy: _pack(store, needy, step) for needy, (holder, step) in plan.items() if holder == rank}
    got = None
    for _, data in _exchange(transport, blobs):
        got = _unpack(store, data)
    return got

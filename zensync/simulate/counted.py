"""Counted mode: Zen's calls from the ranks' index sets alone, byte for byte, with no values moved.

Where every rank's real gradient does not fit (a 10M-row embedding on 1024 simulated ranks), the
bytes of Zen's step depend only on which items each rank holds: ``zen_calls`` takes each rank's
non-zero item ids, runs Zen's own partition and bucketing on them (``make_partition``,
``kernels.bucket_items``: the owner of every item and its position, as ``ZenScheme`` computes them),
marks the union, and writes the ``Call`` records the full run's ``RecordingTransport`` would have
written for one steady-state step (``run_agreed``: no agreement exchange, sizes exchanged before the
push and the pull):

- push: one all_to_all_v, ``count[s][d] * (index + value bytes)`` from rank s to owner d;
- pull: one all_gather_v, each owner's 40-byte header plus the smallest of its COO, bitmap and dense
  encodings (``zen.pull_payload_bytes``) of its partition of the union.

``counted_calls`` adds AGsparse (one all_gather_v of each rank's COO records) and dense (one
all-reduce of the whole tensor).

``tests/unit/simulate/test_counted.py`` checks the records equal a full run's on the same index sets.
The index sets come one rank at a time from a callable, so memory holds one rank's ids, the
union's bitmap (one byte per item) and the n x n count matrix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zensync import kernels
from zensync.simulate.record import Call
from zensync.sync.partition import make_partition
from zensync.sync.zen import PULL_ENCODINGS, pull_payload_bytes
from zensync.types import index_dtype

__all__ = ["COUNTED_SCHEMES", "HEADER_BYTES", "counted_calls", "zen_calls"]

COUNTED_SCHEMES = ("zen", "sparse_ps", "agsparse", "dense")
"""The schemes whose records counted mode writes (the others need a full run)."""

HEADER_BYTES = 40
"""The pull header Zen puts before each owner's payload (5 int64 fields)."""


def zen_calls(
    items_of: Callable[[int], torch.Tensor],
    *,
    world_size: int,
    num_items: int,
    item_bytes: int,
    seed: int,
    hashed: bool = True,
) -> list[list[Call]]:
    """Every rank's records of one Zen step (``hashed=False``: sparse_ps) from its item ids.

    Args:
        items_of: Rank -> its ascending unique int64 non-zero item ids.
        world_size: Ranks.
        num_items: Items of the tensor (rows in row mode).
        item_bytes: Value bytes per item (row width times the dtype's size).
        seed: Zen's agreed hash seed (what ``SyncOptions.h0_seed`` or the agreement gives).
    """
    part = make_partition(num_items, world_size, seed=seed, hashed=hashed)
    idx_bytes = index_dtype(part.range_len).itemsize
    record = idx_bytes + item_bytes
    group = tuple(range(world_size))
    union = torch.zeros(num_items, dtype=torch.bool)
    push: list[Call] = []
    for rank in range(world_size):
        items = items_of(rank)
        if items.dtype != torch.int64 or items.dim() != 1:
            raise ValueError(f"zen_calls: rank {rank}'s items must be a 1-D int64 tensor, got {items.dtype}")
        if items.numel() and (int(items[0]) < 0 or int(items[-1]) >= num_items):
            raise ValueError(f"zen_calls: rank {rank}'s items must be ascending ids in [0, {num_items})")
        _, _, counts = kernels.bucket_items(items, part)
        sent = tuple(int(c) * record for c in counts.tolist())
        push.append(Call(op="all_to_all_v", group=group, phase="push", nbytes=sum(sent), sent=sent, sizes_first=True))
        union[items] = True
    _, _, unique = kernels.bucket_items(union.nonzero().squeeze(1), part)
    calls = []
    for rank, num_unique in enumerate(unique.tolist()):
        _, range_len = part.owner_range(rank)
        body = min(pull_payload_bytes(e, num_unique, range_len, idx_bytes, item_bytes) for e in PULL_ENCODINGS)
        pull = Call(op="all_gather_v", group=group, phase="pull", nbytes=HEADER_BYTES + body, sizes_first=True)
        calls.append([push[rank], pull])
    return calls


def counted_calls(
    scheme: str,
    items_of: Callable[[int], torch.Tensor],
    *,
    world_size: int,
    num_items: int,
    item_bytes: int,
    seed: int,
) -> list[list[Call]]:
    """Every rank's records of one step of ``scheme`` (one of ``COUNTED_SCHEMES``) from its item ids."""
    group = tuple(range(world_size))
    if scheme in ("zen", "sparse_ps"):
        return zen_calls(
            items_of, world_size=world_size, num_items=num_items, item_bytes=item_bytes, seed=seed,
            hashed=scheme == "zen",
        )  # fmt: skip
    if scheme == "dense":
        call = Call(op="all_reduce", group=group, phase="allreduce", nbytes=num_items * item_bytes)
        return [[call] for _ in range(world_size)]
    if scheme == "agsparse":
        record = index_dtype(num_items).itemsize + item_bytes
        out = []
        for rank in range(world_size):
            nbytes = items_of(rank).numel() * record
            out.append([Call(op="all_gather_v", group=group, phase="allgather", nbytes=nbytes, sizes_first=True)])
        return out
    raise ValueError(f"counted mode covers {', '.join(COUNTED_SCHEMES)}; {scheme!r} needs a full run")

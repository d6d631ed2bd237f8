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

``counted_calls`` adds AGsparse (one all_gather_v of each rank's COO records), dense (one
all-reduce of the whole tensor) and the two peers of Zen's evaluation, whose bytes also follow from
the index sets alone (every element of a listed item taken as non-zero, as in a row gradient):

- sparcml (``zensync.sync.sparcml``): the fold, recursive-doubling and hand-back send_recvs, each
  carrying its 16-byte header and the sender's partial sum, COO over the union of its group's items,
  or dense once a merged union's COO is larger than ``sparcml_dense_ratio`` of the dense tensor;
- omnireduce (``zensync.sync.omnireduce``): one all_to_all_v of each owner's block bitmap and the
  rank's non-zero blocks of ``omnireduce_block`` elements, then one all_gather_v of each owner's
  16-byte header, bitmap and the union's blocks in its range.

``tests/unit/simulate/test_counted.py`` checks the records equal a full run's on the same index sets.
The index sets come one rank at a time from a callable, so memory holds one rank's ids, the
union's bitmap (one byte per item) and the n x n count matrix; sparcml holds one merged union per
recursive-doubling block still waiting for its sibling (at most one per level), and the ids of the
ranks a folded rank merges into until it comes; omnireduce a byte per block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zensync import kernels
from zensync.simulate._counted_peers import OmniReduceCount, SparCMLCount
from zensync.simulate.record import Call
from zensync.sync.base import SyncOptions
from zensync.sync.partition import make_partition
from zensync.sync.zen import PULL_ENCODINGS, pull_payload_bytes
from zensync.types import index_dtype

__all__ = ["COUNTED_SCHEMES", "HEADER_BYTES", "Counter", "counted_calls", "zen_calls"]

COUNTED_SCHEMES = ("zen", "sparse_ps", "agsparse", "dense", "sparcml", "omnireduce")
"""The schemes whose records counted mode writes (the others need a full run)."""

HEADER_BYTES = 40
"""The pull header Zen puts before each owner's payload (5 int64 fields)."""


class Counter:
    """One counted point (scheme, world size): fed each rank's ids in rank order, then ``calls()``.

    Feeding ranks one at a time lets a sweep draw each rank's ids once for every point that has that
    rank (rank r's ids do not depend on the world size): ``zensync.simulate.sweep``.
    """

    def __init__(
        self,
        scheme: str,
        *,
        world_size: int,
        num_items: int,
        item_bytes: int,
        seed: int,
        value_bytes: int = 4,
        options: SyncOptions | None = None,
    ) -> None:
        if scheme not in COUNTED_SCHEMES:
            raise ValueError(f"counted mode covers {', '.join(COUNTED_SCHEMES)}; {scheme!r} needs a full run")
        if value_bytes < 1 or item_bytes % value_bytes:
            raise ValueError(f"item_bytes={item_bytes} must be a whole number of value_bytes={value_bytes} elements")
        options = SyncOptions() if options is None else options
        self.scheme = scheme
        self.world_size = world_size
        self.num_items = num_items
        self.item_bytes = item_bytes
        self.group = tuple(range(world_size))
        self._fed = 0
        self._per_rank: list[Call] = []
        self._union: torch.Tensor | None = None
        self._part = None
        self._record = 0
        self._peer: SparCMLCount | OmniReduceCount | None = None
        if scheme == "sparcml":
            self._peer = SparCMLCount(world_size=world_size, num_items=num_items, item_bytes=item_bytes,
                                      dense_ratio=options.sparcml_dense_ratio)  # fmt: skip
        elif scheme == "omnireduce":
            self._peer = OmniReduceCount(
                world_size=world_size, num_items=num_items, value_bytes=value_bytes,
                item_numel=item_bytes // value_bytes, block=options.omnireduce_block,
            )  # fmt: skip
        elif scheme in ("zen", "sparse_ps"):
            self._part = make_partition(num_items, world_size, seed=seed, hashed=scheme == "zen")
            self._idx_bytes = index_dtype(self._part.range_len).itemsize
            self._record = self._idx_bytes + item_bytes
            self._union = torch.zeros(num_items, dtype=torch.bool)
        elif scheme == "agsparse":
            self._record = index_dtype(num_items).itemsize + item_bytes

    @property
    def needs_items(self) -> bool:
        """Whether ``add`` reads the ids (dense does not)."""
        return self.scheme != "dense"

    def add(self, rank: int, items: torch.Tensor | None) -> None:
        """Rank ``rank``'s ascending unique int64 ids (the ranks in order; None for dense)."""
        if rank != self._fed:
            raise ValueError(f"Counter: rank {rank} fed after {self._fed} ranks (feed them in order)")
        self._fed += 1
        if self.scheme == "dense":
            call = Call(op="all_reduce", group=self.group, phase="allreduce", nbytes=self.num_items * self.item_bytes)
            self._per_rank.append(call)
            return
        if items is None or items.dtype != torch.int64 or items.dim() != 1:
            raise ValueError(f"counted mode: rank {rank}'s items must be a 1-D int64 tensor")
        if items.numel() and (int(items[0]) < 0 or int(items[-1]) >= self.num_items):
            raise ValueError(f"counted mode: rank {rank}'s items must be ascending ids in [0, {self.num_items})")
        if self._peer is not None:
            self._peer.add(items)
            return
        if self.scheme == "agsparse":
            nbytes = items.numel() * self._record
            self._per_rank.append(Call(op="all_gather_v", group=self.group, phase="allgather", nbytes=nbytes,
                                       sizes_first=True))  # fmt: skip
            return
        assert self._part is not None and self._union is not None
        _, _, counts = kernels.bucket_items(items, self._part)
        sent = tuple(int(c) * self._record for c in counts.tolist())
        call = Call(op="all_to_all_v", group=self.group, phase="push", nbytes=sum(sent), sent=sent, sizes_first=True)
        self._per_rank.append(call)
        self._union[items] = True

    def calls(self) -> list[list[Call]]:
        """Every rank's records, once every rank was fed."""
        if self._fed != self.world_size:
            raise ValueError(f"Counter: {self._fed} of {self.world_size} ranks fed")
        if self._peer is not None:
            return self._peer.calls()
        if self._part is None or self._union is None:
            return [[call] for call in self._per_rank]
        part = self._part
        _, _, unique = kernels.bucket_items(self._union.nonzero().squeeze(1), part)
        out = []
        for rank, num_unique in enumerate(unique.tolist()):
            _, range_len = part.owner_range(rank)
            sizes = (
                pull_payload_bytes(e, num_unique, range_len, self._idx_bytes, self.item_bytes) for e in PULL_ENCODINGS
            )
            pull = Call(op="all_gather_v", group=self.group, phase="pull", nbytes=HEADER_BYTES + min(sizes),
                        sizes_first=True)  # fmt: skip
            out.append([self._per_rank[rank], pull])
        return out


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
    scheme = "zen" if hashed else "sparse_ps"
    return counted_calls(scheme, items_of, world_size=world_size, num_items=num_items, item_bytes=item_bytes, seed=seed)


def counted_calls(
    scheme: str,
    items_of: Callable[[int], torch.Tensor],
    *,
    world_size: int,
    num_items: int,
    item_bytes: int,
    seed: int,
    value_bytes: int = 4,
    options: SyncOptions | None = None,
) -> list[list[Call]]:
    """Every rank's records of one step of ``scheme`` (one of ``COUNTED_SCHEMES``) from its item ids.

    ``value_bytes`` is the values' dtype size (omnireduce's blocks count elements); ``options`` the
    scheme's tunables (sparcml's dense ratio, omnireduce's block; default ``SyncOptions()``).
    """
    counter = Counter(scheme, world_size=world_size, num_items=num_items, item_bytes=item_bytes, seed=seed,
                      value_bytes=value_bytes, options=options)  # fmt: skip
    for rank in range(world_size):
        counter.add(rank, items_of(rank) if counter.needs_items else None)
    return counter.calls()

"""Counted mode for Zen's peers: SparCML's and OmniReduce's records from the ranks' index sets.

Both mirror the byte layout of the scheme's own code (``zensync.sync.sparcml``,
``zensync.sync.omnireduce``), taking every element of a listed item as non-zero and every sum of
non-zeros as non-zero (no cancellation: values of one sign, as a real gradient's overlapping rows
almost surely are). ``zensync.simulate.counted.Counter`` drives them one rank at a time;
tests/unit/simulate/test_counted.py checks their records equal the full runs'.
"""

from __future__ import annotations

import torch

from zensync.simulate.record import Call
from zensync.sync.omnireduce import block_ranges
from zensync.types import index_dtype

__all__ = ["OmniReduceCount", "SparCMLCount"]

_HEADER_BYTES = 16
"""Both schemes' per-payload header: two int64 fields."""


class SparCMLCount:
    """SparCML's send_recvs (fold, recursive doubling, hand back) from every rank's ids, one rank at a time.

    A state is the sorted union of its group's ids, or None once dense: a merge of two states is
    dense when either is, or when the union's COO (``index + item`` bytes per id) is larger than
    ``dense_ratio`` of the dense tensor. A rank's own, unmerged state is always COO.

    After the doubling stage with distance d every rank of an aligned block of 2d ranks holds the
    same state, so the count keeps one state per block (level k: blocks of 2^k of the first p
    ranks) and merges two sibling blocks as soon as both are in: p - 1 merges (and one per fold), at most
    one waiting block per level besides the folded ranks' ids. Only the payload bytes of each block
    stay (what its ranks send at that stage); a merged state is dropped once its parent is made.
    Holding a state per rank instead holds p/2 copies of each stage's union: at the last stage of
    10M rows, density 0.01, Zipf 1.1, overlap 0.3 on 1024 ranks, 512 unions of 8.2M int64 ids (33 GB)
    beside 512 of the stage before (6.4M ids, 26 GB).
    """

    def __init__(self, *, world_size: int, num_items: int, item_bytes: int, dense_ratio: float) -> None:
        self.world_size = world_size
        self.num_items = num_items
        self.item_bytes = item_bytes
        self.record_bytes = index_dtype(num_items).itemsize + item_bytes
        self.dense_limit = dense_ratio * num_items * item_bytes
        self.power = 1 << (world_size.bit_length() - 1)
        self._fed = 0
        self._fold_bytes: list[int] = []
        """Payload of each folded rank (power + i): its own ids."""
        self._unfolded: dict[int, torch.Tensor] = {}
        """Ids of the ranks < world_size - power, until their folded partner comes."""
        self._waiting: dict[tuple[int, int], torch.Tensor | None] = {}
        """(level, block) -> the block's state, until its sibling block is in."""
        self._block_bytes = [[0] * (self.power >> level) for level in range(self.power.bit_length())]
        """[level][block]: the payload each rank of the block sends at stage ``level`` (the top: hand back)."""

    def add(self, items: torch.Tensor) -> None:
        """The next rank's ascending unique ids."""
        rank = self._fed
        self._fed += 1
        num_folded = self.world_size - self.power
        if rank >= self.power:  # Step 1: the fold, into rank - power
            self._fold_bytes.append(self._payload(items))
            self._block_done(0, rank - self.power, self._merge(self._unfolded.pop(rank - self.power), items))
        elif rank < num_folded:
            self._unfolded[rank] = items
        else:
            self._block_done(0, rank, items)

    def _block_done(self, level: int, block: int, state: torch.Tensor | None) -> None:
        """Step 2, recursive doubling: a block's state is final; merge it up while its sibling is in."""
        top = len(self._block_bytes) - 1
        self._block_bytes[level][block] = self._payload(state)
        while level < top and (level, block ^ 1) in self._waiting:
            state = self._merge(self._waiting.pop((level, block ^ 1)), state)
            level, block = level + 1, block >> 1
            self._block_bytes[level][block] = self._payload(state)
        if level < top:
            self._waiting[(level, block)] = state

    def _payload(self, state: torch.Tensor | None) -> int:
        if state is None:
            return _HEADER_BYTES + self.num_items * self.item_bytes
        return _HEADER_BYTES + state.numel() * self.record_bytes

    def _merge(self, a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        if a is None or b is None:
            return None
        if 16 * (a.numel() + b.numel()) < self.num_items:
            union = torch.unique(torch.cat([a, b]))
        else:  # a pass over the items beats sorting once the sets are a sixteenth of them
            mask = torch.zeros(self.num_items, dtype=torch.bool)
            mask[a] = True
            mask[b] = True
            union = mask.nonzero().squeeze(1)
        return None if union.numel() * self.record_bytes > self.dense_limit else union

    def calls(self) -> list[list[Call]]:
        """Every rank's records (all ranks added)."""
        n, power = self.world_size, self.power
        group = tuple(range(n))
        out: list[list[Call]] = [[] for _ in range(n)]

        def send_recv(rank: int, nbytes: int, dst: int | None, src: int | None) -> None:
            sent = () if dst is None else (dst,)
            out[rank].append(Call(op="send_recv", group=group, phase="exchange", nbytes=nbytes, sent=sent, source=src))

        # Step 1: ranks >= power fold into rank - power.
        for rank in range(power, n):
            send_recv(rank, self._fold_bytes[rank - power], rank - power, None)
            send_recv(rank - power, 0, None, rank)
        # Step 2: recursive doubling; at the stage with distance 2^level each rank sends its block's state.
        for level in range(len(self._block_bytes) - 1):
            for rank in range(power):
                partner = rank ^ (1 << level)
                send_recv(rank, self._block_bytes[level][rank >> level], partner, partner)
        # Step 3: hand the result back to the folded ranks.
        for rank in range(power, n):
            send_recv(rank - power, self._block_bytes[-1][0], rank, None)
            send_recv(rank, 0, None, rank - power)
        return out


class OmniReduceCount:
    """OmniReduce's push all_to_all_v and pull all_gather_v from each rank's ids, one rank at a time.

    The flat tensor of ``num_items * item_numel`` elements is cut into blocks of ``block`` elements;
    owner j holds ``block_ranges``' j-th contiguous range. A payload for a range is its bitmap
    (``ceil(count / 32)`` int32 words) and ``block`` values per non-zero block, less the padding of
    the tensor's last, partial block when that block is sent.
    """

    def __init__(self, *, world_size: int, num_items: int, item_numel: int, value_bytes: int, block: int) -> None:
        self.world_size = world_size
        self.group = tuple(range(world_size))
        self.item_numel = item_numel
        self.value_bytes = value_bytes
        self.block = block
        self.numel = num_items * item_numel
        self.num_blocks = -(-self.numel // block)
        ranges = torch.tensor(block_ranges(self.num_blocks, world_size), dtype=torch.int64).view(-1, 2)
        self._counts = ranges[:, 1]
        self._firsts = ranges[:, 0].clamp(max=self.num_blocks)  # an empty owner's range may start past the end
        self._ends = self._firsts + self._counts
        self._last_owner = int((self._counts > 0).nonzero().max()) if self.num_blocks else 0
        self._union = torch.zeros(self.num_blocks, dtype=torch.bool)
        self._pushes: list[Call] = []

    def _blocks(self, items: torch.Tensor) -> torch.Tensor:
        """Bool per block: whether any element of ``items``' rows falls in it."""
        first = items * self.item_numel // self.block
        last = ((items + 1) * self.item_numel - 1) // self.block
        edges = torch.zeros(self.num_blocks + 1, dtype=torch.int64)
        edges.index_add_(0, first, torch.ones_like(first))
        edges.index_add_(0, last + 1, -torch.ones_like(last))
        return edges[:-1].cumsum(0) > 0

    def _range_bytes(self, nonzero: torch.Tensor) -> list[int]:
        """The encoded bytes of each owner's range of the per-block ``nonzero`` mask."""
        cumulative = torch.zeros(self.num_blocks + 1, dtype=torch.int64)
        torch.cumsum(nonzero, 0, out=cumulative[1:])
        nonzero_blocks = cumulative[self._ends] - cumulative[self._firsts]
        nbytes = (self._counts + 31) // 32 * 4 + nonzero_blocks * (self.block * self.value_bytes)
        tail_pad = self.num_blocks * self.block - self.numel  # padding of the tensor's last block
        if tail_pad and bool(nonzero[-1]):
            nbytes[self._last_owner] -= tail_pad * self.value_bytes
        return nbytes.tolist()

    def add(self, items: torch.Tensor) -> None:
        """The next rank's ascending unique ids."""
        nonzero = self._blocks(items)
        self._union |= nonzero
        sent = tuple(self._range_bytes(nonzero))
        self._pushes.append(Call(op="all_to_all_v", group=self.group, phase="push", nbytes=sum(sent), sent=sent,
                                 sizes_first=True))  # fmt: skip

    def calls(self) -> list[list[Call]]:
        """Every rank's records (all ranks added)."""
        pulls = [_HEADER_BYTES + b for b in self._range_bytes(self._union)]
        return [
            [push, Call(op="all_gather_v", group=self.group, phase="pull", nbytes=pull, sizes_first=True)]
            for push, pull in zip(self._pushes, pulls, strict=True)
        ]

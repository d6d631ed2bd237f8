"""Byte counts on the simulated world equal each scheme's closed-form volume.

The expected volumes are computed here from the inputs alone (sets of non-zero indices, the
partition arithmetic and the documented payload layouts), independently of the schemes' code paths.
"""

from __future__ import annotations

import math

import pytest
import torch

import zensync
from zensync.kernels import reference
from zensync.sync.partition import make_partition
from zensync.sync.zen import pull_payload_bytes

SEED = 1234
OPTIONS = zensync.SyncOptions(h0_seed=SEED)
HEADER_BYTES_ZEN = 40  # five int64 header fields per owner's pull payload


def _inputs(n: int, shape: tuple[int, ...], density: float, skewed: bool, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(1, 4, shape, generator=gen).to(torch.float32)
        keep = torch.rand(shape, generator=gen) < density
        if skewed:  # all non-zeros in the first eighth of the items
            keep[shape[0] // 8 :] = False
        out.append(x * keep)
    return out


def _run(xs: list[torch.Tensor], scheme: str) -> list[zensync.SyncStats]:
    def body(t: zensync.Transport) -> zensync.SyncStats:
        stats = zensync.SyncStats()
        zensync.sparse_allreduce(xs[t.rank], group=t, scheme=scheme, stats=stats, options=OPTIONS)
        return stats

    return zensync.SimulatedWorld(len(xs), timeout_s=60).run(body)


def _items(x: torch.Tensor) -> torch.Tensor:
    x2d = x.reshape(x.shape[0], -1) if x.dim() == 2 else x.reshape(-1, 1)
    return reference.nonzero_items(x2d)


CASES = [
    (n, shape, density, skewed)
    for n in (2, 3, 5, 8)
    for shape in ((4000,), (300, 5))
    for density, skewed in ((0.02, False), (0.3, False), (0.05, True))
]


@pytest.mark.parametrize(("n", "shape", "density", "skewed"), CASES)
def test_dense_agsparse_bytes(n: int, shape: tuple[int, ...], density: float, skewed: bool) -> None:
    xs = _inputs(n, shape, density, skewed)
    numel = xs[0].numel()
    for rank, stats in enumerate(_run(xs, "dense")):
        chunk = numel // n + (1 if rank < numel % n else 0)
        assert stats.phases["allreduce"].bytes_recv == 2 * (numel - chunk) * 4
    item_bytes = 4 * (shape[1] if len(shape) == 2 else 1)
    nnz = [_items(x).numel() for x in xs]
    for rank, stats in enumerate(_run(xs, "agsparse")):
        assert stats.phases["allgather"].bytes_recv == sum(k for j, k in enumerate(nnz) if j != rank) * (4 + item_bytes)
        assert stats.phases["allgather"].bytes_sent == nnz[rank] * (4 + item_bytes) * (n - 1)


@pytest.mark.parametrize(("n", "shape", "density", "skewed"), CASES)
@pytest.mark.parametrize("scheme", ["zen", "sparse_ps"])
def test_balanced_parallelism_bytes(scheme: str, n: int, shape: tuple[int, ...], density: float, skewed: bool) -> None:
    xs = _inputs(n, shape, density, skewed)
    item_bytes = 4 * (shape[1] if len(shape) == 2 else 1)
    part = make_partition(shape[0] if len(shape) == 2 else xs[0].numel(), n, seed=SEED, hashed=scheme == "zen")
    owners = [reference.permute(_items(x), part) // part.range_len for x in xs]
    union_per_owner = [
        torch.unique(torch.cat([_items(x)[o == j] for x, o in zip(xs, owners, strict=True)])).numel() for j in range(n)
    ]
    pull_bodies = [
        min(
            pull_payload_bytes(e, union_per_owner[j], part.owner_range(j)[1], 4, item_bytes)
            for e in ("coo", "bitmap", "dense")
        )
        + HEADER_BYTES_ZEN
        for j in range(n)
    ]
    all_stats = _run(xs, scheme)
    for rank, stats in enumerate(all_stats):
        push_expected = sum(int((o == rank).sum()) for j, o in enumerate(owners) if j != rank) * (4 + item_bytes)
        assert stats.phases["push"].bytes_recv == push_expected
        assert stats.phases["pull"].bytes_recv == sum(b for j, b in enumerate(pull_bodies) if j != rank)
        assert stats.global_nnz == sum(union_per_owner)
    if all(v["bitmap"] == n for v in [all_stats[0].pull_encodings]):
        assert all_stats[0].pull_bitmap_words == math.ceil(part.num_items / 32)


def test_zen_bitmap_words_exactly_ceil_items_over_32() -> None:
    """At moderate density every owner pulls as a hash bitmap: ceil(|G|/32) words in total."""
    for num_items, n in ((10_000, 4), (10_001, 7), (1_000, 3), (100_000, 16)):
        density = 1 - 0.5 ** (1 / n)  # union density ~50 %: the bitmap beats COO (>11 %) and dense (<97 %)
        xs = _inputs(n, (num_items,), density, False, seed=num_items)
        stats = _run(xs, "zen")[0]
        assert stats.pull_encodings["bitmap"] == n, stats.pull_encodings
        assert stats.pull_bitmap_words == math.ceil(num_items / 32)


def _union(xs: list[torch.Tensor], ranks: range) -> set[int]:
    return set().union(*(set(_items(xs[r]).tolist()) for r in ranks))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("density", [0.01, 0.2, 0.45])
def test_sparcml_bytes(n: int, density: float) -> None:
    """Recursive doubling: each stage receives the partner group's union (or dense once past the switch)."""
    num_items = 2000
    xs = _inputs(n, (num_items,), density, False, seed=n)
    record, dense = 8, num_items * 4

    def message(ranks: range) -> int:
        size = len(_union(xs, ranks))
        merged = len(ranks) > 1  # a rank's own data is never switched to dense before a merge
        return 16 + (dense if merged and size * record > dense else size * record)

    power = 1 << (n.bit_length() - 1)

    def group(rank: int, size: int) -> range:
        # ranks < power that rank's block of `size` covers, plus the folded partners of those ranks
        start = rank - rank % size
        members = [r for r in range(start, start + size)] + [
            r + power for r in range(start, start + size) if r + power < n
        ]
        return members  # type: ignore[return-value]

    all_stats = _run(xs, "sparcml")
    for rank, stats in enumerate(all_stats):
        expected = 0
        if rank >= power:
            expected += message(group(rank - power, power))  # type: ignore[arg-type]
        else:
            if rank + power < n:
                expected += message(range(rank + power, rank + power + 1))
            size = 1
            while size < power:
                expected += message(group(rank ^ size, size))  # type: ignore[arg-type]
                size *= 2
        assert stats.phases["exchange"].bytes_recv == expected, (rank, n)


@pytest.mark.parametrize("n", [1, 2, 3, 6])
@pytest.mark.parametrize("numel", [256 * 20, 256 * 20 + 77, 100])
def test_omnireduce_bytes(n: int, numel: int) -> None:
    xs = _inputs(n, (numel,), 0.002, False, seed=numel)
    block = 256
    num_blocks = -(-numel // block)
    per = -(-num_blocks // n)
    ranges = [(j * per, max(0, min(per, num_blocks - j * per))) for j in range(n)]

    def block_elems(x: torch.Tensor, first: int, count: int) -> int:
        total = 0
        for b in range(first, first + count):
            seg = x[b * block : (b + 1) * block]
            total += seg.numel() if bool((seg != 0).any()) else 0
        return total

    total = sum(xs)
    all_stats = _run(xs, "omnireduce")
    for rank, stats in enumerate(all_stats):
        first, count = ranges[rank]
        words = 4 * (-(-count // 32))
        push = sum(words + 4 * block_elems(xs[j], first, count) for j in range(n) if j != rank)
        assert stats.phases["push"].bytes_recv == push
        pull = sum(
            16 + 4 * (-(-ranges[j][1] // 32)) + 4 * block_elems(total, *ranges[j]) for j in range(n) if j != rank
        )
        assert stats.phases["pull"].bytes_recv == pull

"""zensync.simulate.analysis against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from zensync.simulate.analysis import counted_points, crossover, densification, imbalance, overlap_ratio
from zensync.simulate.counted import counted_calls
from zensync.simulate.record import Call

GROUP = (0, 1, 2)


def _push(sent: tuple[int, ...]) -> Call:
    return Call(op="all_to_all_v", group=GROUP, phase="push", nbytes=sum(sent), sent=sent, sizes_first=True)


def _pull(nbytes: int) -> Call:
    return Call(op="all_gather_v", group=GROUP, phase="pull", nbytes=nbytes, sizes_first=True)


def test_imbalance_by_hand() -> None:
    # Received: rank 0 gets 4 + 6 = 10, rank 1 gets 2 + 8 = 10, rank 2 gets 3 + 37 = 40 (the
    # diagonal stays local): mean 20, max 40 -> 2.0. Pull blocks 10, 20, 30: mean 20, max 30 -> 1.5.
    calls = [
        [_push((100, 2, 3)), _pull(10)],
        [_push((4, 100, 37)), _pull(20)],
        [_push((6, 8, 100)), _pull(30)],
    ]
    assert imbalance(calls) == (2.0, 1.5)


def test_imbalance_without_push_or_pull_is_one() -> None:
    dense = [[Call(op="all_reduce", group=(0, 1), phase="allreduce", nbytes=40)] for _ in range(2)]
    assert imbalance(dense) == (1.0, 1.0)


def test_imbalance_of_counted_sparse_ps_by_hand() -> None:
    # sparse_ps on 2 ranks owns rows [0, 32) and [32, 64) (ranges of whole 32-bit bitmap words);
    # rows of 4 bytes with int32 indices: 8-byte records. Rank 0 holds {0, 1, 2, 40}: sends rank 1
    # one record; rank 1 holds {0, 1, 2, 3}: sends rank 0 four. Received 32 and 8: 32 / 20 = 1.6.
    sets = [torch.tensor([0, 1, 2, 40]), torch.tensor([0, 1, 2, 3])]
    calls = counted_calls("sparse_ps", lambda r: sets[r], world_size=2, num_items=64, item_bytes=4, seed=0)
    push, _ = imbalance(calls)
    assert push == pytest.approx(1.6)


def test_crossover_interpolates_in_log2() -> None:
    assert crossover([16, 64], [1.0, 3.0], [2.0, 2.0]) == pytest.approx(32.0)
    # a - b: -3 at 4, +1 at 8: a quarter of the way from log2 4 = 2 to 3: 2 ** 2.75.
    assert crossover([2, 4, 8], [1.0, 1.0, 5.0], [2.0, 4.0, 4.0]) == pytest.approx(2**2.75)
    assert crossover([2, 4], [3.0, 5.0], [2.0, 4.0]) == 2.0
    assert crossover([2, 4], [1.0, 1.0], [2.0, 4.0]) is None
    with pytest.raises(ValueError, match="2 ranks but 1"):
        crossover([2, 4], [1.0], [2.0, 4.0])


def test_densification_and_overlap_by_hand() -> None:
    assert densification([torch.tensor([0, 1]), torch.tensor([1, 2])]) == 1.5
    assert overlap_ratio(torch.tensor([0, 1, 2]), torch.tensor([2, 3])) == 0.5
    assert overlap_ratio(torch.tensor([0]), torch.tensor([], dtype=torch.int64)) == 0.0


def test_counted_points_draw_each_rank_once_and_equal_counted_calls() -> None:
    gen = torch.Generator().manual_seed(0)
    sets = [torch.unique(torch.randint(0, 500, (40,), generator=gen)) for _ in range(5)]
    drawn: list[int] = []

    def items_of(rank: int) -> torch.Tensor:
        drawn.append(rank)
        return sets[rank]

    schemes = ["zen", "sparcml", "omnireduce", "dense"]
    seen = list(counted_points(schemes, [3, 5], items_of, num_items=500, item_bytes=8, seed=7))
    assert drawn == [0, 1, 2, 3, 4]
    assert sorted((n, s) for n, s, _ in seen) == sorted((n, s) for n in (3, 5) for s in schemes)
    for n, scheme, calls in seen:
        assert calls == counted_calls(scheme, lambda r: sets[r], world_size=n, num_items=500, item_bytes=8, seed=7)

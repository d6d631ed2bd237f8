"""Reading a sweep: push/pull imbalance from recorded calls, crossovers, densification, and counted
points streamed with each rank's ids drawn once.

- ``imbalance(calls)``: Zen's Def. 8 / Theorem 2 ratios (reference/zen.md 1.4, 1.5) from the records:
  push, the largest rank's bytes received in the push all-to-all over the mean; pull, the largest
  owner's pull block (what every rank receives from it, and what a ring all-gather's step time
  follows) over the mean block. 1 is perfect balance.
- ``crossover(ranks, a_seconds, b_seconds)``: the world size at which scheme a becomes slower than b
  (Fig. 8's "AGsparse is worse than AllReduce beyond 40 GPUs"), interpolated in log2(n).
- ``densification(sets)``: C2's gamma = |union| / mean |I_i|, and ``overlap_ratio`` C1's
  |I1 & I2| / min(|I1|, |I2|).
- ``counted_points``: every (world size, scheme) point's counted records, as
  ``zensync.simulate.sweep.simulate_sweep`` counts them (rank r's ids drawn once for all points),
  yielded as each completes, so a caller can price one record on several topologies and read it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from zensync.simulate.counted import Counter
from zensync.simulate.record import Call

__all__ = ["counted_points", "crossover", "densification", "imbalance", "overlap_ratio"]


def _ratio(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def imbalance(calls: Sequence[Sequence[Call]]) -> tuple[float, float]:
    """(push, pull) imbalance of one step's records (module docstring); 1.0 where a phase is absent.

    Push: over ranks, bytes received in ``push``-phase all_to_all_v calls from other ranks. Pull:
    over ranks, the bytes each put into ``pull``-phase all_gather_v calls.

    Example: two ranks where rank 0 sends rank 1 30 bytes and rank 1 sends rank 0 10 bytes receive
    10 and 30 (mean 20): push imbalance 1.5.
    """
    ranks = len(calls)
    received = [0.0] * ranks
    pull = [0.0] * ranks
    has_push = has_pull = False
    for rank, per_rank in enumerate(calls):
        for call in per_rank:
            if call.op == "all_to_all_v" and call.phase == "push":
                has_push = True
                for dst, nbytes in zip(call.group, call.sent, strict=True):
                    if dst != rank:
                        received[dst] += nbytes
            elif call.op == "all_gather_v" and call.phase == "pull":
                has_pull = True
                pull[rank] += call.nbytes
    return (_ratio(received) if has_push else 1.0), (_ratio(pull) if has_pull else 1.0)


def crossover(ranks: Sequence[int], a_seconds: Sequence[float], b_seconds: Sequence[float]) -> float | None:
    """The world size at which a's time first exceeds b's, interpolated in log2(n); None if never.

    Between the last measured size where a <= b and the first where a > b, the difference a - b is
    taken as linear in log2(n). If a > b at the first size, that size is returned.

    Example: ranks [16, 64], a [1, 3], b [2, 2]: a - b goes -1 -> 1, halfway in log2 between 16 and
    64, so 32.0.
    """
    if not len(ranks) == len(a_seconds) == len(b_seconds):
        raise ValueError(f"crossover: {len(ranks)} ranks but {len(a_seconds)} and {len(b_seconds)} times")
    previous: tuple[int, float] | None = None
    for n, a, b in zip(ranks, a_seconds, b_seconds, strict=True):
        diff = a - b
        if diff > 0:
            if previous is None:
                return float(n)
            n0, d0 = previous
            share = -d0 / (diff - d0)
            return 2 ** (math.log2(n0) + share * (math.log2(n) - math.log2(n0)))
        previous = (n, diff)
    return None


def densification(sets: Sequence[torch.Tensor]) -> float:
    """C2's densification ratio gamma^n: distinct ids of all ``sets`` over their mean size.

    Example: {0, 1} and {1, 2}: 3 distinct ids over a mean of 2, gamma 1.5.
    """
    mean = sum(s.numel() for s in sets) / len(sets)
    return torch.unique(torch.cat(list(sets))).numel() / mean if mean else 1.0


def overlap_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """C1's overlap |a & b| / min(|a|, |b|) of two id sets (0 when either is empty).

    Example: {0, 1, 2} and {2, 3}: one shared id over min(3, 2): 0.5.
    """
    smaller = min(a.numel(), b.numel())
    return int(torch.isin(a, b).sum()) / smaller if smaller else 0.0


def counted_points(
    schemes: Sequence[str],
    ranks: Sequence[int],
    items_of: Callable[[int], torch.Tensor],
    *,
    num_items: int,
    item_bytes: int,
    seed: int,
    spent: dict[tuple[int, str], float] | None = None,
) -> Iterator[tuple[int, str, list[list[Call]]]]:
    """Each (world size, scheme)'s counted records, yielded as its last rank is counted.

    ``items_of(r)`` is called once per rank r < max(ranks) and fed to every point with more than r
    ranks (rank r's ids must not depend on the world size, as ``ZipfWorkload.items``'s do not).
    ``spent``, if given, gets each point's own counting seconds (the shared draws not included).
    """
    counters = {(n, s): Counter(s, world_size=n, num_items=num_items, item_bytes=item_bytes, seed=seed)
                for n in ranks for s in schemes}  # fmt: skip
    for rank in range(max(ranks, default=0)):
        live = [(key, counter) for key, counter in counters.items() if key[0] > rank]
        items = items_of(rank) if any(counter.needs_items for _, counter in live) else None
        for (n, scheme), counter in live:
            start = time.perf_counter()
            counter.add(rank, items if counter.needs_items else None)
            if spent is not None:
                spent[(n, scheme)] = spent.get((n, scheme), 0.0) + time.perf_counter() - start
            if rank == n - 1:
                del counters[(n, scheme)]
                yield n, scheme, counter.calls()

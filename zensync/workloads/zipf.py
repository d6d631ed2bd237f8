"""Synthetic sparse gradients with controllable density, overlap and skew (Zen's C1-C3, reference/zen.md 1.1).

Each rank holds exactly ``round(density * num_items)`` non-zero items. Item ids are drawn without
replacement from a Zipf law over the item space in natural order, P(item i) ~ (i + 1) ** -zipf_s,
so item 0 is the most frequent and contiguous-range partitioning (sparse_ps) is skewed; zipf_s = 0
is uniform. A fraction ``overlap`` of every rank's items comes from one pool shared by all ranks;
the rest is drawn per rank (and may still coincide across ranks, more so at high skew).

Sampling uses Efraimidis-Spirakis keys: item i gets key log(u_i) * (i + 1) ** zipf_s with u_i
uniform (computed in log space), and the k largest keys are a weighted sample without replacement:
one pass of ``rand`` and ``topk`` over the item space, about 0.2 s for 10M items on one CPU core.

A rank's tensor depends only on (seed, rank, parameters), not on how many ranks exist, so
``zipf_gradient`` builds one rank's tensor alone (a 128-rank simulation need not hold all of them)
and rank r's tensor is the same in a 4-rank and a 128-rank world.

Example::

    grads = zipf_gradients(1_000_000, 1, 4, density=0.01, zipf_s=1.0, overlap=0.2, seed=0)
    [int(g.count_nonzero()) for g in grads]  # [10000, 10000, 10000, 10000]
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from zensync.workloads._seeding import mix_seed

__all__ = [
    "ZipfSparse",
    "zipf_gradient",
    "zipf_gradients",
    "zipf_items",
    "zipf_sparse",
]

_SHARED_POOL_STREAM = -1
"""Stream id of the shared pool's generator (ranks use their rank, >= 0)."""

ZipfSparse = tuple[torch.Tensor, torch.Tensor]
"""(item ids: int64 of shape (k,), sorted; values: (k,) or (k, item_numel), all non-zero)."""


def _check(num_items: int, item_numel: int, density: float, zipf_s: float, overlap: float, dtype: torch.dtype) -> None:
    if num_items < 1:
        raise ValueError(f"num_items={num_items} must be >= 1")
    if item_numel < 1:
        raise ValueError(f"item_numel={item_numel} must be >= 1")
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density={density} must be in [0, 1]: it is the fraction of non-zero items per rank")
    if not 0.0 <= zipf_s <= 8.0:
        raise ValueError(f"zipf_s={zipf_s} must be in [0, 8]: 0 is uniform, larger is more skewed")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap} must be in [0, 1]: it is the shared fraction of each rank's items")
    if dtype.is_complex or dtype == torch.bool or (not dtype.is_floating_point and not dtype.is_signed):
        raise ValueError(f"dtype={dtype} must be a real floating or signed integer dtype (values are +-non-zero)")


@functools.lru_cache(maxsize=2)
def _log_weight(num_items: int, zipf_s: float) -> torch.Tensor:
    """zipf_s * log(i + 1) for every item, float32 (cached: it is the same for every rank)."""
    return torch.arange(1, num_items + 1, dtype=torch.float64).log_().mul_(zipf_s).to(torch.float32)


def _zipf_sample(
    num_items: int, num_samples: int, zipf_s: float, generator: torch.Generator, exclude: torch.Tensor | None
) -> torch.Tensor:
    """``num_samples`` distinct item ids, Zipf-weighted without replacement, avoiding ``exclude``."""
    if num_samples == 0:
        return torch.empty(0, dtype=torch.long)
    # Step 1: Efraimidis-Spirakis keys in log space (stable in float32 for any zipf_s): item i's
    # key log(u) / w_i orders like -(log(-log u) - log w_i) = -(log E_i + s * log(i + 1)).
    keys = torch.rand(num_items, generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    keys = keys.log_().neg_().log_()
    if zipf_s != 0.0:
        keys.add_(_log_weight(num_items, zipf_s))
    keys.neg_()
    if exclude is not None and exclude.numel() > 0:
        keys[exclude] = -float("inf")
    # Step 2: the k largest keys are the sample.
    return keys.topk(num_samples, sorted=False).indices


@functools.lru_cache(maxsize=4)
def _shared_pool(num_items: int, num_shared: int, zipf_s: float, seed: int) -> torch.Tensor:
    """The pool every rank draws ``overlap`` of its items from (cached; do not modify)."""
    generator = torch.Generator().manual_seed(mix_seed(seed, _SHARED_POOL_STREAM))
    return _zipf_sample(num_items, num_shared, zipf_s, generator, exclude=None)


_MIN_DRAWS = 1 << 14
"""The smallest batch of draws of ``_successive_sample``."""


@functools.lru_cache(maxsize=2)
def _cdf(num_items: int, zipf_s: float) -> torch.Tensor:
    """Cumulative Zipf weights (i + 1) ** -zipf_s, float64, last entry the total (cached)."""
    return torch.arange(1, num_items + 1, dtype=torch.float64).pow_(-zipf_s).cumsum_(0)


def _successive_sample(
    num_items: int, num_samples: int, zipf_s: float, generator: torch.Generator, exclude: torch.Tensor
) -> torch.Tensor:
    """``num_samples`` distinct ids by successive sampling: Zipf draws with replacement, in order,
    each kept unless drawn before or in ``exclude``; the same law as ``_zipf_sample`` without its
    pass over the whole item space per rank (batches of draws, ``searchsorted`` on the CDF)."""
    cdf = _cdf(num_items, zipf_s)
    taken = torch.zeros(num_items, dtype=torch.bool)
    taken[exclude] = True
    kept: list[torch.Tensor] = []
    have = 0
    while have < num_samples:
        need = num_samples - have
        # Draws: a quarter more than needed, and never fewer than _MIN_DRAWS (the last few ids
        # of a sample would otherwise come from tiny batches that mostly hit taken ids).
        u = torch.rand(max(need + need // 4, _MIN_DRAWS), generator=generator, dtype=torch.float64).mul_(cdf[-1])
        draws = torch.searchsorted(cdf, u, right=True).clamp_(max=num_items - 1)
        # First occurrence of each id in draw order, then the ones not taken, in draw order.
        unique, inverse = torch.unique(draws, return_inverse=True)
        first = torch.full((unique.numel(),), draws.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(draws.numel()), reduce="amin")
        fresh = ~taken[unique]
        num_fresh = int(fresh.sum())
        new = unique[fresh][torch.argsort(first[fresh])][:need]
        taken[new] = True
        kept.append(new)
        have += new.numel()
        if have < num_samples and num_fresh * 8 < draws.numel():
            # Most draws hit taken ids (heavy skew, high density): the rest, given what is taken, is
            # a weighted sample without replacement of the others, which one key per item draws.
            rest = _zipf_sample(num_items, num_samples - have, zipf_s, generator, exclude=taken.nonzero().squeeze(1))
            kept.append(rest)
            break
    return torch.cat(kept) if kept else torch.empty(0, dtype=torch.long)


def zipf_items(
    rank: int, num_items: int, *, density: float, zipf_s: float = 1.0, overlap: float = 0.0, seed: int = 0
) -> torch.Tensor:
    """One rank's sorted non-zero item ids, as ``zipf_sparse`` defines them, drawn faster.

    The same shared pool and the same law for the private items (a Zipf sample without replacement
    outside the pool), drawn by successive sampling instead of one key per item: about 60 ms instead
    of 0.4 s for 100k of 10M items on this repository's machine, which is what ``zensync simulate``'s
    counted mode needs for 1024 ranks. Other random draws than ``zipf_sparse``'s, so other ids: the
    same distribution, not the same sample (tests/unit/workloads/test_workloads.py compares
    inclusion frequencies).
    """
    _check(num_items, 1, density, zipf_s, overlap, torch.float32)
    return _ids(rank, num_items, density, zipf_s, overlap, seed, _successive_sample)[0]


def _ids(
    rank: int,
    num_items: int,
    density: float,
    zipf_s: float,
    overlap: float,
    seed: int,
    sample: Callable[[int, int, float, torch.Generator, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Generator]:
    """Rank ``rank``'s sorted ids: the shared pool (the same generator stream on every rank), then its
    private items drawn by ``sample`` from everything outside the pool; and the rank's generator."""
    if rank < 0:
        raise ValueError(f"rank={rank} must be >= 0")
    num_nonzero = round(density * num_items)
    num_shared = round(overlap * num_nonzero)
    shared = _shared_pool(num_items, num_shared, float(zipf_s), seed)
    rank_gen = torch.Generator().manual_seed(mix_seed(seed, rank))
    private = sample(num_items, num_nonzero - num_shared, float(zipf_s), rank_gen, shared)
    return torch.cat([shared, private]).sort().values, rank_gen


def _random_values(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Values with |v| in [0.5, 1.5) (floats) or [1, 9] (integers) and a random sign: never zero."""
    sign = torch.randint(0, 2, shape, generator=generator).mul_(2).sub_(1)
    if dtype.is_floating_point:
        magnitude = torch.rand(shape, generator=generator, dtype=torch.float32).add_(0.5)
    else:
        magnitude = torch.randint(1, 10, shape, generator=generator)
    return (magnitude * sign).to(dtype)


def zipf_sparse(
    rank: int,
    num_items: int,
    item_numel: int = 1,
    *,
    density: float,
    zipf_s: float = 1.0,
    overlap: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> ZipfSparse:
    """One rank's non-zeros in compact form: sorted item ids and their values (see ``zipf_gradient``)."""
    _check(num_items, item_numel, density, zipf_s, overlap, dtype)
    # Steps 1-2: the shared pool and this rank's private items, Zipf-drawn outside it.
    ids, rank_gen = _ids(rank, num_items, density, zipf_s, overlap, seed, _zipf_sample)
    num_nonzero = ids.numel()
    # Step 3: random non-zero values for every element of every chosen item.
    value_shape = (num_nonzero,) if item_numel == 1 else (num_nonzero, item_numel)
    return ids, _random_values(value_shape, dtype, rank_gen)


def zipf_gradient(
    rank: int,
    num_items: int,
    item_numel: int = 1,
    *,
    density: float,
    zipf_s: float = 1.0,
    overlap: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One rank's dense sparse-gradient tensor, built alone (no other rank's tensor is made).

    Args:
        rank: Rank whose tensor to build (>= 0); the result does not depend on the world size.
        num_items: Items in the tensor (elements when item_numel == 1, else rows).
        item_numel: Elements per item.
        density: Fraction of non-zero items; exactly round(density * num_items) items are non-zero.
        zipf_s: Zipf exponent over item ids in natural order (0 = uniform; item 0 most frequent).
        overlap: Fraction of each rank's items taken from a pool shared by all ranks.
        seed: Seed of all draws (no global RNG is touched).
        dtype: Real floating or signed integer dtype of the values.

    Returns:
        A tensor of shape (num_items,) if item_numel == 1 else (num_items, item_numel) whose non-zero
        items (every element of a chosen row is non-zero) are exactly the drawn ids.

    Example::

        g = zipf_gradient(3, 10_000_000, density=0.01, zipf_s=1.1, seed=0)
        int(g.count_nonzero())  # 100000
    """
    ids, values = zipf_sparse(
        rank, num_items, item_numel, density=density, zipf_s=zipf_s, overlap=overlap, seed=seed, dtype=dtype
    )
    shape = (num_items,) if item_numel == 1 else (num_items, item_numel)
    out = torch.zeros(shape, dtype=dtype)
    out[ids] = values
    return out


def zipf_gradients(
    num_items: int,
    item_numel: int,
    num_ranks: int,
    *,
    density: float,
    zipf_s: float = 1.0,
    overlap: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """``zipf_gradient`` for ranks 0..num_ranks-1 (all tensors in memory at once).

    Example::

        grads = zipf_gradients(1000, 8, 2, density=0.05, zipf_s=0.0, seed=1)
        grads[0].shape  # torch.Size([1000, 8])
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1")
    return [
        zipf_gradient(r, num_items, item_numel, density=density, zipf_s=zipf_s, overlap=overlap, seed=seed, dtype=dtype)
        for r in range(num_ranks)
    ]

"""alpha-beta time of each collective over ``ranks`` ranks (reference/backends.md; reference/espresso.md 1.6).

Time = alpha * messages + volume * nbytes / bandwidth. ``nbytes`` is each rank's input (allreduce,
reduce-scatter) or each rank's own payload (allgather, alltoall, gather, broadcast); one rank costs
nothing. The volumes are ring-style; a ring allreduce moves ``2 (k-1)/k * nbytes`` per rank in
``2 (k-1)`` sequential steps (``_ring_allreduce_fraction``, ``_ring_allreduce_steps``).

Two latency conventions share these volumes, on purpose:

- the planner's functions here charge alpha once per collective, as Espresso does: its alpha is a
  per-collective overhead (launch, synchronization), fitted at that level;
- the sync engine's ``zensync.cost.sparse.predict_time("dense", ...)`` charges alpha per ring step,
  ``2 (k-1)`` times, because ``zensync.cost.calibrate`` fits alpha per message from timed ring
  allreduces, and its sparse schemes are priced per message too.

Both take the volume from the same ring helper, so the byte term agrees bit for bit.

Example::

    allreduce_s(100e6, ranks=8, bandwidth_bytes_per_s=3.125e9, latency_s=150e-6)  # 0.05615 s

Every time function accepts a float or a float64 numpy array (the planner prices all tensors at once).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "FloatArray",
    "Num",
    "allgather_s",
    "allreduce_s",
    "alltoall_s",
    "broadcast_s",
    "gather_s",
    "reduce_scatter_s",
]

FloatArray = npt.NDArray[np.float64]
Num = TypeVar("Num", float, FloatArray)


def _ring_allreduce_steps(ranks: int) -> int:
    """Sequential messages on a ring allreduce's critical path: ``2 (k-1)`` (reduce-scatter, allgather)."""
    return 2 * (ranks - 1)


def _ring_allreduce_fraction(ranks: int) -> float:
    """Bytes a ring allreduce moves per rank, per byte of input: ``2 (k-1)/k``."""
    return 2.0 * (ranks - 1) / ranks


def _alpha_beta(nbytes: Num, ranks: int, bandwidth_bytes_per_s: float, latency_s: float, volume: float) -> Num:
    """``alpha + volume * nbytes / B`` over ``ranks`` ranks; nothing when there is one rank."""
    if ranks <= 1:
        return nbytes * 0.0
    return latency_s + volume * nbytes / bandwidth_bytes_per_s


def allreduce_s(nbytes: Num, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> Num:
    """Ring allreduce: ``alpha + 2 (k-1)/k * nbytes / B``."""
    return _alpha_beta(nbytes, ranks, bandwidth_bytes_per_s, latency_s, _ring_allreduce_fraction(ranks))


def reduce_scatter_s(nbytes: Num, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> Num:
    """Ring reduce-scatter of ``nbytes`` per rank into 1/k shards: ``alpha + (k-1)/k * nbytes / B``."""
    return _alpha_beta(nbytes, ranks, bandwidth_bytes_per_s, latency_s, (ranks - 1) / ranks)


def allgather_s(nbytes: Num, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> Num:
    """Ring allgather of ``nbytes`` from each rank: every rank receives ``(k-1) * nbytes``."""
    return _alpha_beta(nbytes, ranks, bandwidth_bytes_per_s, latency_s, (ranks - 1))


def alltoall_s(nbytes: Num, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> Num:
    """Alltoall of ``nbytes`` per rank split in k chunks: each rank sends and receives ``(k-1)/k * nbytes``."""
    return _alpha_beta(nbytes, ranks, bandwidth_bytes_per_s, latency_s, (ranks - 1) / ranks)


def gather_s(nbytes: Num, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> Num:
    """Gather of ``nbytes`` from each rank to one root: the root receives ``(k-1) * nbytes``."""
    return _alpha_beta(nbytes, ranks, bandwidth_bytes_per_s, latency_s, (ranks - 1))


def broadcast_s(nbytes: Num, ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> Num:
    """Pipelined (chain) broadcast of ``nbytes`` from one root: ``alpha + nbytes / B``."""
    return _alpha_beta(nbytes, ranks, bandwidth_bytes_per_s, latency_s, 1.0)

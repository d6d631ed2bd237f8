"""Closed-form traffic and alpha-beta time of each sync scheme (reference/zen.md 1.3; backends.md).

Volumes are bytes received per rank, in the transport's byte model (``zensync.transport.base``).
Inputs describe one tensor: n ranks, ``num_items`` items of ``item_bytes`` value bytes, indices of
``index_bytes``, mean local non-zero items ``nnz``, and ``union(m)``: expected non-zero items after
aggregating m ranks (gamma_m * nnz). ``independent_union`` estimates union(m) when only the
density is known (independent uniform placement); ``measured_union`` fits it to a measured gamma.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from zensync.cost.collectives import _ring_allreduce_fraction, _ring_allreduce_steps
from zensync.cost.network import CostModel

__all__ = [
    "TensorShape",
    "independent_union",
    "measured_union",
    "predict_bytes",
    "predict_time",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorShape:
    """What the formulas need to know about one tensor and group."""

    world_size: int
    num_items: int
    item_bytes: int
    index_bytes: int
    nnz: float
    """Mean non-zero items per rank (K = d * num_items)."""


def independent_union(shape: TensorShape) -> Callable[[int], float]:
    """union(m) = num_items * (1 - (1 - d)^m): no overlap beyond chance."""
    density = shape.nnz / shape.num_items if shape.num_items else 0.0
    return lambda m: shape.num_items * (1.0 - (1.0 - density) ** m)


def measured_union(shape: TensorShape, gamma: float) -> Callable[[int], float]:
    """union(m) consistent with a measured union gamma * K at m = n.

    Models each rank's items as drawn with per-item probability d' chosen so that the union of n
    ranks matches the measurement: union(m) = N * (1 - (1 - d')^m), never below K.
    """
    n, items, nnz = shape.world_size, shape.num_items, shape.nnz
    if items == 0 or nnz == 0:
        return lambda m: 0.0
    union_n = min(float(items), gamma * nnz)
    fraction = min(union_n / items, 1.0 - 1e-12)
    per_rank = 1.0 - (1.0 - fraction) ** (1.0 / n)
    return lambda m: max(nnz, items * (1.0 - (1.0 - per_rank) ** m)) if m > 1 else nnz


def _zen_pull(shape: TensorShape, union: float) -> float:
    """Smallest of COO, hash bitmap and dense for the whole aggregated tensor."""
    coo = union * (shape.index_bytes + shape.item_bytes)
    bitmap = union * shape.item_bytes + shape.num_items / 8
    dense = shape.num_items * shape.item_bytes
    return min(coo, bitmap, dense)


def predict_bytes(scheme: str, shape: TensorShape, union: Callable[[int], float]) -> float:
    """Bytes received per rank by ``scheme`` (payload only)."""
    n = shape.world_size
    record = shape.index_bytes + shape.item_bytes
    dense_bytes = shape.num_items * shape.item_bytes
    if n == 1:
        return 0.0
    if scheme == "dense":
        return _ring_allreduce_fraction(n) * dense_bytes
    if scheme == "agsparse":
        return (n - 1) * shape.nnz * record
    if scheme in ("zen", "sparse_ps"):
        # Eq. 1 with the pull's encoding choice; sparse_ps is the balanced ideal here (no skew model).
        return (n - 1) / n * (shape.nnz * record + _zen_pull(shape, union(n)))
    if scheme == "sparcml":
        # Eq. 2, each stage capped by the dense switch; a fold stage each way when n is not 2^k.
        power = 1 << (n.bit_length() - 1)
        total = sum(min(union(2**s) * record, dense_bytes) for s in range(int(math.log2(power))))
        if power != n:
            total += min(shape.nnz * record, dense_bytes) + min(union(n) * record, dense_bytes)
        return total
    if scheme == "omnireduce":
        return (n - 1) / n * (shape.nnz + union(n)) * shape.item_bytes * 2  # blocks: no index, padding ~x2
    raise ValueError(f"no cost formula for scheme {scheme!r}")


def _messages(scheme: str, n: int) -> float:
    """Sequential message latencies on the critical path.

    A variable-size collective exchanges sizes first: one more round of n - 1 messages. Zen's push
    counts ride on the exchange the call makes anyway (``sparse_allreduce``'s agreement, the hook's
    detection gather: ``zensync.sync.zen.PreparedPush``), so Zen pays its push and its pull's sizes
    and payload; the first call on a group, which agrees the hash seed, pays one more round.
    """
    if n == 1:
        return 0.0
    if scheme == "dense":
        return _ring_allreduce_steps(n)  # alpha per ring step (see zensync.cost.collectives)
    if scheme == "sparcml":
        return 2 * math.ceil(math.log2(n))
    if scheme == "agsparse":
        return 2 * (n - 1)  # sizes + payload
    if scheme in ("zen", "sparse_ps"):
        return 3 * (n - 1)  # push (counts folded), pull sizes + pull
    return 4 * (n - 1)  # omnireduce: counts + push, sizes + pull


def predict_time(scheme: str, shape: TensorShape, union: Callable[[int], float], model: CostModel) -> float:
    """alpha * messages + bytes / bandwidth, in seconds: rounds (latency) and volume both count.

    Every message on the critical path pays alpha: dense pays ``2 (n-1)`` latencies where the planner's
    ``allreduce_s`` pays one (``zensync.cost.collectives`` says why); the byte terms are the same.
    """
    return (
        model.latency_s * _messages(scheme, shape.world_size)
        + predict_bytes(scheme, shape, union) / model.bandwidth_bytes_per_s
    )

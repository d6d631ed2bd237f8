"""Closed-form traffic and alpha-beta time of each scheme (reference/zen.md 1.3; backends.md).

Volumes are bytes received per rank, in the transport's byte model (``zensync.transport.base``).
Inputs describe one tensor: n ranks, ``num_items`` items of ``item_bytes`` value bytes, indices of
``index_bytes``, mean local non-zero items ``nnz``, and ``union(m)``: expected non-zero items after
aggregating m ranks (gamma_m * nnz). ``independent_union`` estimates union(m) when only the
density is known (independent uniform placement); callers with measurements pass their own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "CostModel",
    "TensorShape",
    "fit_affine",
    "independent_union",
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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """alpha-beta: a message costs latency_s, a byte 1 / bandwidth_bytes_per_s."""

    latency_s: float
    bandwidth_bytes_per_s: float


def independent_union(shape: TensorShape) -> Callable[[int], float]:
    """union(m) = num_items * (1 - (1 - d)^m): no overlap beyond chance."""
    density = shape.nnz / shape.num_items if shape.num_items else 0.0
    return lambda m: shape.num_items * (1.0 - (1.0 - density) ** m)


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
        return 2 * (n - 1) / n * dense_bytes
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
    """Sequential message latencies on the critical path."""
    if n == 1:
        return 0.0
    if scheme == "dense":
        return 2 * (n - 1)
    if scheme == "sparcml":
        return 2 * math.ceil(math.log2(n))
    if scheme == "agsparse":
        return 2 * (n - 1)
    return 4 * (n - 1)  # zen, sparse_ps, omnireduce: counts + push, sizes + pull


def predict_time(scheme: str, shape: TensorShape, union: Callable[[int], float], model: CostModel) -> float:
    """alpha * messages + bytes / bandwidth, in seconds."""
    return (
        model.latency_s * _messages(scheme, shape.world_size)
        + predict_bytes(scheme, shape, union) / model.bandwidth_bytes_per_s
    )


def fit_affine(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y ~ intercept + slope * x, in float64.

    Example::

        fit_affine([1, 2, 3], [3.0, 5.0, 7.0])  # (1.0, 2.0) up to rounding
    """
    xs = torch.tensor(x, dtype=torch.float64)
    design = torch.stack([torch.ones_like(xs), xs], dim=1)
    solution = torch.linalg.lstsq(design, torch.tensor(y, dtype=torch.float64).unsqueeze(1)).solution
    intercept, slope = solution.squeeze(1).tolist()
    return intercept, slope

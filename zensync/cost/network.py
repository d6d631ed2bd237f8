"""The alpha-beta network model and the least-squares fit that calibrates it (reference/backends.md).

A message costs ``latency_s`` (alpha), a byte ``1 / bandwidth_bytes_per_s`` (1 / beta). Checkpoints
store the model with ``dataclasses.asdict``, so its field names are part of the file format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["CostModel", "fit_affine"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """alpha-beta: a message costs latency_s, a byte 1 / bandwidth_bytes_per_s."""

    latency_s: float
    bandwidth_bytes_per_s: float


def fit_affine(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y ~ intercept + slope * x, in float64.

    Example::

        fit_affine([1, 2, 3], [3.0, 5.0, 7.0])  # (1.0, 2.0) up to rounding
    """
    import torch  # here, so that importing zensync.cost loads neither torch nor torch.distributed

    xs = torch.tensor(x, dtype=torch.float64)
    design = torch.stack([torch.ones_like(xs), xs], dim=1)
    solution = torch.linalg.lstsq(design, torch.tensor(y, dtype=torch.float64).unsqueeze(1)).solution
    intercept, slope = solution.squeeze(1).tolist()
    return intercept, slope

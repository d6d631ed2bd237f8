"""The inputs of the MPI cases (_mpi_worker.py), which test_mpi.py recomputes without importing MPI."""

from __future__ import annotations

import torch


def ints(seed: int, numel: int, dtype: torch.dtype, high: int = 8) -> torch.Tensor:
    """``numel`` integers in [0, high) drawn from ``seed``, as ``dtype``: sums of a few stay exact in any dtype."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (numel,), generator=gen).to(dtype)

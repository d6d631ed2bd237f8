"""One dispatch point for every kernel: CUDA tensors -> (later) cuda_ext, CPU -> numba, else torch.

The engine calls only these functions. The choice is by device and can be forced with the
environment variable ``ZENSYNC_KERNELS`` = ``reference`` | ``cpu`` (default: fastest available).
numba kernels run multi-threaded when called from the main thread and single-threaded (GIL released)
from other threads, where the caller already provides the parallelism (e.g. the simulated world).
"""

from __future__ import annotations

import os

import torch

from zensync.kernels import reference
from zensync.types import Partition

__all__ = [
    "aggregate",
    "bitmap_decode",
    "bitmap_encode",
    "bucket_nonzero",
    "implementation_for",
    "nonzero_items",
    "permute",
    "unpermute",
]

_VALID_CHOICES = ("auto", "reference", "cpu")


def _forced() -> str:
    choice = os.environ.get("ZENSYNC_KERNELS", "auto")
    if choice not in _VALID_CHOICES:
        raise ValueError(f"ZENSYNC_KERNELS={choice!r} is not one of {_VALID_CHOICES}")
    return choice


def implementation_for(device: torch.device) -> str:
    """Which implementation runs for tensors on ``device``: 'cpu' (numba) or 'reference' (torch)."""
    choice = _forced()
    if choice == "reference" or device.type != "cpu":
        return "reference"
    return "cpu"


def _impl(device: torch.device):  # noqa: ANN202 - returns a module
    if implementation_for(device) == "cpu":
        from zensync.kernels import cpu

        return cpu
    return reference


def permute(items: torch.Tensor, part: Partition) -> torch.Tensor:
    """See ``reference.permute``."""
    return _impl(items.device).permute(items, part)


def unpermute(positions: torch.Tensor, part: Partition) -> torch.Tensor:
    """See ``reference.unpermute``."""
    return _impl(positions.device).unpermute(positions, part)


def nonzero_items(x2d: torch.Tensor) -> torch.Tensor:
    """See ``reference.nonzero_items``."""
    return _impl(x2d.device).nonzero_items(x2d)


def bucket_nonzero(x2d: torch.Tensor, part: Partition) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``reference.bucket_nonzero``."""
    return _impl(x2d.device).bucket_nonzero(x2d, part)


def aggregate(positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``reference.aggregate``."""
    return _impl(values.device).aggregate(positions, values)


def bitmap_encode(positions: torch.Tensor, length: int) -> torch.Tensor:
    """See ``reference.bitmap_encode``."""
    return _impl(positions.device).bitmap_encode(positions, length)


def bitmap_decode(words: torch.Tensor, length: int) -> torch.Tensor:
    """See ``reference.bitmap_decode``."""
    return _impl(words.device).bitmap_decode(words, length)

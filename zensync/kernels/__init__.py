"""Kernels behind one dispatcher: ``reference`` (torch), ``cpu`` (numba), ``cuda`` (cuda_ext).

Only this package imports numba, torch.cuda and cuda_ext.
"""

from __future__ import annotations

from zensync.kernels.device import device_name, synchronize
from zensync.kernels.dispatch import (
    aggregate,
    bitmap_decode,
    bitmap_encode,
    bucket_nonzero,
    implementation_for,
    nonzero_items,
    pack_bits,
    permute,
    sampled_topk,
    scatter_add,
    topk,
    unpack_bits,
    unpermute,
)

__all__ = [
    "aggregate",
    "bitmap_decode",
    "bitmap_encode",
    "bucket_nonzero",
    "device_name",
    "implementation_for",
    "nonzero_items",
    "pack_bits",
    "permute",
    "sampled_topk",
    "scatter_add",
    "synchronize",
    "topk",
    "unpack_bits",
    "unpermute",
]

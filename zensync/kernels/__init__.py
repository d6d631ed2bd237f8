"""Kernels behind one dispatcher: ``reference`` (torch), ``cpu`` (numba), ``cuda`` (cuda_ext).

Only this package imports torch.cuda and cuda_ext; numba also runs in the compiled module of a
package that owns its algorithm (``zensync.planner._compiled_timeline``, the planner's event loop).
"""

from __future__ import annotations

from zensync.kernels.device import caller_stream, device_name, synchronize, zeros
from zensync.kernels.dispatch import (
    aggregate,
    bitmap_decode,
    bitmap_encode,
    bucket_items,
    bucket_nonzero,
    dequantize_add,
    implementation_for,
    index_add,
    nonzero_items,
    pack_bits,
    permute,
    quantize_levels,
    reset_dispatch_cache,
    sampled_topk,
    sampled_topk_abs,
    scatter_add,
    sign_decode_sum,
    sign_encode,
    sign_residual,
    topk,
    topk_abs,
    unpack_bits,
    unpermute,
)

__all__ = [
    "aggregate",
    "bitmap_decode",
    "bitmap_encode",
    "bucket_items",
    "bucket_nonzero",
    "caller_stream",
    "dequantize_add",
    "device_name",
    "implementation_for",
    "index_add",
    "nonzero_items",
    "pack_bits",
    "permute",
    "quantize_levels",
    "reset_dispatch_cache",
    "sampled_topk",
    "sampled_topk_abs",
    "scatter_add",
    "sign_decode_sum",
    "sign_encode",
    "sign_residual",
    "synchronize",
    "topk",
    "topk_abs",
    "unpack_bits",
    "unpermute",
    "zeros",
]

"""One dispatch point for every kernel: CUDA tensors -> cuda_ext, CPU tensors -> numba, else torch.

The engine and the compressors call only these functions. The choice is by device:

- ``cuda``: the ``cuda_ext`` extension (``zensync.kernels.cuda``), prebuilt by ``setup.py`` or
  compiled on first use; when it cannot be loaded, one warning says why and CUDA tensors take the
  torch reference;
- ``cpu``: the numba kernels (``cpu``, ``cpu_select``, ``cpu_codec``), except exact top-k on small
  inputs, where the torch reference is faster (``_CPU_MIN_NUMEL``);
- anything else (or ``ZENSYNC_KERNELS=reference``): ``reference``, the plain-torch definitions every
  other implementation is tested against.

The implementation is resolved once per (op, device type, size class) and cached: a kernel call costs
a dictionary lookup, not an environment read and an import. ``ZENSYNC_KERNELS`` and the CUDA
extension's availability are read when an entry is first resolved; ``reset_dispatch_cache`` forgets
every entry (tests that change either call it).

numba kernels run multi-threaded when called from the main thread and single-threaded (GIL released)
from other threads, where the caller already provides the parallelism (e.g. the simulated world).
"""

from __future__ import annotations

import functools
import importlib
import os
import types
from collections.abc import Sequence

import torch

from zensync.kernels import reference
from zensync.kernels.hashing import Partition

__all__ = [
    "aggregate",
    "bitmap_decode",
    "bitmap_encode",
    "bucket_nonzero",
    "dequantize_add",
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
    "topk",
    "topk_abs",
    "unpack_bits",
    "unpermute",
]

_VALID_CHOICES = ("auto", "reference", "cpu")
"""``ZENSYNC_KERNELS``: ``auto`` (fastest available; ``cpu`` is an older spelling of it) or ``reference``."""
_CPU_MODULE = {
    "topk": "cpu_select",
    "topk_abs": "cpu_select",
    "sampled_topk": "cpu_select",
    "sampled_topk_abs": "cpu_select",
    "scatter_add": "cpu_codec",
    "index_add": "cpu_codec",
    "dequantize_add": "cpu_codec",
    "quantize_levels": "cpu_codec",
    "sign_encode": "cpu_codec",
    "sign_decode_sum": "cpu_codec",
    "sign_residual": "cpu_codec",
    "pack_bits": "cpu_codec",
    "unpack_bits": "cpu_codec",
}
"""numba module of each op not in ``cpu``."""
_CPU_MIN_NUMEL = {"topk": 1 << 15, "topk_abs": 1 << 15}
"""Ops whose numba kernel loses to the torch reference on small CPU inputs: below this many elements
they run the reference (same result). The exact selection makes a few passes, each a numba call plus
numpy bookkeeping: 27 us at 64 elements against 15 us for the reference (torch.topk and a sort).
Measured with ``python benchmarks/select_cpu_timing.py --small --rounds 25``: the crossover lies
between 16K elements (reference 55 us, numba 77 us) and 32K (113 us, 90 us). ``sampled_topk``'s numba
kernel is as fast or faster from 64 elements on (one counting pass at a DGC threshold)."""
_CUDA_OPS = frozenset(
    [
        "bucket_nonzero",
        "bitmap_encode",
        "bitmap_decode",
        "topk",
        "sampled_topk",
        "scatter_add",
        "pack_bits",
        "unpack_bits",
    ]
)
"""Ops with a CUDA kernel; the others (permute, unpermute, nonzero_items, aggregate) run the torch
reference on CUDA tensors, where torch's own kernels already run on the GPU."""


def _forced() -> str:
    choice = os.environ.get("ZENSYNC_KERNELS", "auto")
    if choice not in _VALID_CHOICES:
        raise ValueError(f"ZENSYNC_KERNELS={choice!r} is not one of {_VALID_CHOICES}")
    return choice


def _cuda_loaded() -> bool:
    from zensync.kernels import cuda

    return cuda.available()  # warns once when the extension cannot be loaded


def implementation_for(device: torch.device, op: str = "topk", numel: int | None = None) -> str:
    """Which implementation runs ``op`` on ``numel`` elements (None: large) on ``device``: 'cuda', 'cpu'
    (numba) or 'reference'. Cached per (op, device type, size class): see ``reset_dispatch_cache``."""
    return _resolve(op, device.type, _is_small(op, numel))[0]


def reset_dispatch_cache() -> None:
    """Forget every resolved implementation, so the next kernel call re-reads ``ZENSYNC_KERNELS`` and
    re-checks the CUDA extension. For tests that change either (``monkeypatch.setenv``, a stubbed
    ``cuda.available``); a process sets the variable before its first kernel call.

    Example::

        monkeypatch.setenv("ZENSYNC_KERNELS", "reference")
        reset_dispatch_cache()
        implementation_for(torch.device("cpu"), "topk")  # 'reference'
    """
    _resolve.cache_clear()


def _is_small(op: str, numel: int | None) -> bool:
    """Whether ``numel`` is below ``op``'s numba crossover on CPU (``_CPU_MIN_NUMEL``): the size class."""
    return numel is not None and numel < _CPU_MIN_NUMEL.get(op, 0)


def _choose(op: str, device_type: str, small: bool) -> str:
    if _forced() == "reference":
        return "reference"
    if device_type == "cpu":
        return "reference" if small else "cpu"
    if device_type == "cuda" and op in _CUDA_OPS and _cuda_loaded():
        return "cuda"
    return "reference"


@functools.cache
def _resolve(op: str, device_type: str, small: bool) -> tuple[str, types.ModuleType]:
    """(implementation name, module) for ``op``; an invalid ``ZENSYNC_KERNELS`` raises and caches nothing."""
    kind = _choose(op, device_type, small)
    if kind == "reference":
        return kind, reference
    module = _CPU_MODULE.get(op, "cpu") if kind == "cpu" else "cuda"
    return kind, importlib.import_module(f"zensync.kernels.{module}")


def _impl(device: torch.device, op: str, numel: int | None = None) -> types.ModuleType:
    return _resolve(op, device.type, _is_small(op, numel))[1]


def permute(items: torch.Tensor, part: Partition) -> torch.Tensor:
    """See ``reference.permute``."""
    return _impl(items.device, "permute").permute(items, part)


def bucket_items(items: torch.Tensor, part: Partition) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``reference.bucket_items``; the permutation is the dispatched one.

    A composite of dispatched ops, not an op of its own (no numba build, not in ``__all__``).
    """
    return reference.bucket_items(items, part, permute)


def unpermute(positions: torch.Tensor, part: Partition) -> torch.Tensor:
    """See ``reference.unpermute``."""
    return _impl(positions.device, "unpermute").unpermute(positions, part)


def nonzero_items(x2d: torch.Tensor) -> torch.Tensor:
    """See ``reference.nonzero_items``."""
    return _impl(x2d.device, "nonzero_items").nonzero_items(x2d)


def bucket_nonzero(x2d: torch.Tensor, part: Partition) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``reference.bucket_nonzero``; on CUDA, Zen's hierarchical hashing (order within an owner arbitrary)."""
    return _impl(x2d.device, "bucket_nonzero").bucket_nonzero(x2d, part)


def aggregate(positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``reference.aggregate``."""
    return _impl(values.device, "aggregate").aggregate(positions, values)


def bitmap_encode(positions: torch.Tensor, length: int) -> torch.Tensor:
    """See ``reference.bitmap_encode``."""
    return _impl(positions.device, "bitmap_encode").bitmap_encode(positions, length)


def bitmap_decode(words: torch.Tensor, length: int) -> torch.Tensor:
    """See ``reference.bitmap_decode``."""
    return _impl(words.device, "bitmap_decode").bitmap_decode(words, length)


def topk(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """See ``reference.topk``."""
    return _impl(magnitudes.device, "topk", magnitudes.numel()).topk(magnitudes, k)


def sampled_topk(
    magnitudes: torch.Tensor, k: int, threshold: float, *, relax_factor: float = 0.8, max_tries: int = 10
) -> torch.Tensor:
    """See ``reference.sampled_topk``."""
    impl = _impl(magnitudes.device, "sampled_topk", magnitudes.numel())
    return impl.sampled_topk(magnitudes, k, threshold, relax_factor=relax_factor, max_tries=max_tries)


def topk_abs(values: torch.Tensor, k: int) -> torch.Tensor:
    """See ``reference.topk_abs``: numba orders the raw bits without the sign (no ``abs`` pass);
    elsewhere ``topk(values.abs(), k)`` (the CUDA radix select on CUDA tensors)."""
    if values.device.type != "cpu":
        return topk(values.abs(), k)
    return _impl(values.device, "topk_abs", values.numel()).topk_abs(values, k)


def sampled_topk_abs(
    values: torch.Tensor, k: int, threshold: float, *, relax_factor: float = 0.8, max_tries: int = 10
) -> torch.Tensor:
    """See ``reference.sampled_topk_abs`` (as ``topk_abs``: no ``abs`` pass on CPU)."""
    if values.device.type != "cpu":
        return sampled_topk(values.abs(), k, threshold, relax_factor=relax_factor, max_tries=max_tries)
    impl = _impl(values.device, "sampled_topk_abs", values.numel())
    return impl.sampled_topk_abs(values, k, threshold, relax_factor=relax_factor, max_tries=max_tries)


def sign_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference.sign_encode``."""
    return _impl(x.device, "sign_encode").sign_encode(x)


def sign_decode_sum(packed: Sequence[torch.Tensor], levels: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """See ``reference.sign_decode_sum``."""
    return _impl(out.device, "sign_decode_sum").sign_decode_sum(packed, levels, out)


def sign_residual(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """See ``reference.sign_residual``."""
    return _impl(x.device, "sign_residual").sign_residual(x, levels)


def scatter_add(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """See ``reference.scatter_add``."""
    return _impl(values.device, "scatter_add").scatter_add(indices, values, numel)


def dequantize_add(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """See ``reference.dequantize_add``."""
    return _impl(out.device, "dequantize_add").dequantize_add(out, codes, scales, group)


def quantize_levels(
    x: torch.Tensor, scales: torch.Tensor, dither: torch.Tensor, group: int, levels: int
) -> torch.Tensor:
    """See ``reference.quantize_levels``."""
    return _impl(x.device, "quantize_levels").quantize_levels(x, scales, dither, group, levels)


def index_add(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """See ``reference.index_add``."""
    return _impl(out.device, "index_add").index_add(out, indices, values)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """See ``reference.pack_bits``."""
    return _impl(codes.device, "pack_bits").pack_bits(codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """See ``reference.unpack_bits``."""
    return _impl(packed.device, "unpack_bits").unpack_bits(packed, bits, numel, levels)

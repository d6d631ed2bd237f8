"""CUDA kernels of ``cuda_ext`` (the ``zensync_cuda_ext`` extension): the device twins of ``reference``.

The only module that touches the extension. It is loaded on first use, never at import:

1. ``import zensync_cuda_ext``, the build ``setup.py`` makes when it finds nvcc and a CUDA torch;
2. else, with a CUDA torch, a visible GPU and nvcc, a JIT build of ``cuda_ext/csrc`` by
   ``torch.utils.cpp_extension.load`` (a minute or two the first time, cached afterwards);
3. else (or when that fails) one ``RuntimeWarning`` names the reason, and every function here
   returns the torch reference's result: "CUDA tensors use the torch reference kernels".

Each function has its reference's signature and results, and runs the CUDA kernel when the
extension is loaded and its tensors are on a CUDA device; other devices and dtypes the kernels do
not cover go to ``reference`` (CPU tensors never trigger the load). One difference by design:
``bucket_nonzero`` returns the items of an owner in hash-table order, not ascending (grouping by
owner, positions and counts are as in the reference). Inputs are detached: no op is differentiable.

Example::

    from zensync.kernels import cuda

    if cuda.available():  # warns once when the extension cannot be loaded
        positions = cuda.topk(grad.abs(), k)
"""

from __future__ import annotations

import importlib
import subprocess
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from zensync.kernels import reference
from zensync.kernels.hashing import Partition

__all__ = [
    "EXTENSION_NAME",
    "FALLBACK",
    "available",
    "bitmap_decode",
    "bitmap_encode",
    "bucket_nonzero",
    "pack_bits",
    "sampled_topk",
    "scatter_add",
    "topk",
    "unavailable_reason",
    "unpack_bits",
]

EXTENSION_NAME = "zensync_cuda_ext"
FALLBACK = "CUDA tensors use the torch reference kernels"
"""What happens when the extension cannot be loaded (quoted in the warning)."""
_SOURCES_DIR = Path(__file__).resolve().parents[2] / "cuda_ext" / "csrc"
_SLOT_HASH_SEED = 0x2545F4914F6CDD1D
"""Seed of Zen's second-level hashes h_1..h_k (slot choice only: results never depend on it)."""
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_NONZERO_DTYPES = (*_FLOAT_DTYPES, torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_LOAD_ERRORS = (ImportError, OSError, RuntimeError, ValueError, subprocess.SubprocessError)
"""What a failed import or JIT build raises (cpp_extension reports compiler errors as RuntimeError,
a bad TORCH_CUDA_ARCH_LIST as ValueError)."""


def _jit_build() -> tuple[ModuleType | None, str]:
    """Step 2: compile cuda_ext/csrc with torch's JIT loader; (module, '') or (None, reason)."""
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return None, "no CUDA device is visible"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return None, "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    # The same sources as setup.py's build: ops.cpp and every cuda/*.cu.
    sources = [_SOURCES_DIR / "ops.cpp", *sorted((_SOURCES_DIR / "cuda").glob("*.cu"))]
    if not sources[0].is_file() or len(sources) == 1:
        return None, f"the sources are not at {_SOURCES_DIR} (an installed wheel carries no cuda_ext/)"
    try:
        module = cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(path) for path in sources],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"],
            verbose=False,
        )
    except _LOAD_ERRORS as error:
        return None, f"the JIT build of {_SOURCES_DIR} failed: {str(error).splitlines()[0] if str(error) else error!r}"
    return module, ""


def _load() -> tuple[ModuleType | None, str]:
    """(module, '') when the extension and its ops are loaded, else (None, the reason)."""
    # Step 1
    module: ModuleType | None = None
    prebuilt_problem = ""
    try:
        module = importlib.import_module("zensync_cuda_ext")
    except _LOAD_ERRORS as error:  # not built, built against another torch, or without the CUDA runtime
        if not (isinstance(error, ModuleNotFoundError) and error.name == EXTENSION_NAME):
            prebuilt_problem = f"the prebuilt {EXTENSION_NAME} failed to import ({error}); "
    # Step 2
    if module is None:
        module, reason = _jit_build()
        if module is None:
            return None, prebuilt_problem + reason
    try:
        torch.ops.zensync_cuda.topk  # noqa: B018 - raises when the library registered no ops
    except (AttributeError, RuntimeError) as error:
        return None, f"{EXTENSION_NAME} loaded but registered no zensync_cuda ops ({error})"
    return module, ""


class _Loader:
    """Loads the extension once (thread-safe) and warns once when it cannot."""

    __slots__ = ("_done", "_lock", "module", "reason")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self.module: ModuleType | None = None
        self.reason = ""

    def get(self) -> ModuleType | None:
        with self._lock:
            if not self._done:
                self.module, self.reason = _load()
                self._done = True
                if self.module is None:
                    # Step 3
                    message = f"zensync: the CUDA kernels (cuda_ext) are unavailable: {self.reason}; {FALLBACK}"
                    warnings.warn(message, RuntimeWarning, stacklevel=3)
        return self.module


_LOADER = _Loader()


def available() -> bool:
    """Whether the CUDA kernels are loaded (loads them on the first call; warns once if they cannot be)."""
    return _LOADER.get() is not None


def unavailable_reason() -> str:
    """Why the extension is not loaded ('' when it is); loads it first, like ``available``."""
    _LOADER.get()
    return _LOADER.reason


def _ops(*tensors: torch.Tensor) -> Any:
    """``torch.ops.zensync_cuda`` when every tensor is on a CUDA device and the extension is loaded, else None."""
    if not all(t.is_cuda for t in tensors) or _LOADER.get() is None:
        return None
    return torch.ops.zensync_cuda


def bucket_nonzero(
    x2d: torch.Tensor, part: Partition, *, num_hashes: int = 3, parallel_slots: int = 0, serial_slots: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-zero items grouped by owner, their in-range positions and per-owner counts (Zen's hierarchical hashing).

    As ``reference.bucket_nonzero``, except that items come out in hash-table order within an owner.

    Args:
        x2d: (num_items, item_numel) items; rows beyond part.num_items are rejected.
        part: Zen's first-level hash h0.
        num_hashes: Second-level hash functions tried before the serial region (the paper's k).
        parallel_slots: Parallel-region slots per owner (r1); 0 = max(32, ceil(2 nnz / num_owners)).
        serial_slots: Serial-region slots per owner (r2); 0 = max(32, r1 / 10). Too few costs one
            more hashing pass, never an item.

    Returns:
        (items, positions, counts), int64, as ``reference.bucket_nonzero``.
    """
    for name, value, low in (("num_hashes", num_hashes, 1), ("parallel_slots", parallel_slots, 0),
                             ("serial_slots", serial_slots, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"bucket_nonzero: {name}={value!r} must be an int >= {low}")
    if x2d.dim() == 2 and x2d.shape[0] > min(part.num_items, part.num_owners * part.range_len):
        raise ValueError(
            f"bucket_nonzero: x2d has {x2d.shape[0]} items, more than part.num_items={part.num_items} "
            f"(or than num_owners * range_len = {part.num_owners * part.range_len}): owners would overflow"
        )
    ops = _ops(x2d)
    if ops is None or x2d.dim() != 2 or x2d.dtype not in _NONZERO_DTYPES:
        return reference.bucket_nonzero(x2d, part)
    items, positions, counts = ops.bucket_nonzero(
        x2d.detach(), part.num_items, part.num_owners, part.range_len, part.half_bits, list(part.keys),
        part.hashed, num_hashes, parallel_slots, serial_slots, _SLOT_HASH_SEED,
    )  # fmt: skip
    return items, positions, counts


def bitmap_encode(positions: torch.Tensor, length: int) -> torch.Tensor:
    """int32 words with bit p % 32 of word p // 32 set for each position; see ``reference.bitmap_encode``.

    A position outside [0, 32 * ceil(length / 32)) raises IndexError (one host sync).
    """
    reference._check_length("bitmap_encode", length)
    ops = _ops(positions)
    if ops is None or positions.dtype not in _INDEX_DTYPES:
        return reference.bitmap_encode(positions, length)
    flat = positions.detach().reshape(-1)
    words, first = ops.bitmap_encode(flat, length)
    bad = int(first)  # host sync
    if bad < flat.numel():
        raise IndexError(
            f"bitmap_encode: position {int(flat[bad])} (at index {bad}) is outside "
            f"[0, {32 * ((length + 31) // 32)}) for length={length}"
        )
    return words


def bitmap_decode(words: torch.Tensor, length: int) -> torch.Tensor:
    """Ascending int64 positions of the set bits among the first ``length``; see ``reference.bitmap_decode``."""
    reference._check_length("bitmap_decode", length)
    ops = _ops(words)
    if ops is None or words.dtype != torch.int32:
        return reference.bitmap_decode(words, length)
    return ops.bitmap_decode(words.detach().reshape(-1), length)


def topk(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest entries (canonical ties); see ``reference.topk``.

    Exact radix select on the raw bits (one host sync per 8-bit digit), then an ordered compaction.
    """
    reference._check_k(k)
    ops = _ops(magnitudes)
    if ops is None or magnitudes.dim() != 1 or magnitudes.dtype not in _FLOAT_DTYPES:
        return reference.topk(magnitudes, k)
    return ops.topk(magnitudes.detach(), k)


def sampled_topk(
    magnitudes: torch.Tensor, k: int, threshold: float, *, relax_factor: float = 0.8, max_tries: int = 10
) -> torch.Tensor:
    """``topk(magnitudes, k)`` found through DGC's threshold; see ``reference.sampled_topk``.

    One counting pass (and host sync) per threshold tried, a compaction of the candidates, then
    ``topk`` on them.
    """
    reference._check_sampled(k, relax_factor)
    ops = _ops(magnitudes)
    if ops is None or magnitudes.dim() != 1 or magnitudes.dtype not in _FLOAT_DTYPES:
        return reference.sampled_topk(magnitudes, k, threshold, relax_factor=relax_factor, max_tries=max_tries)
    return ops.sampled_topk(magnitudes.detach(), k, float(threshold), float(relax_factor), int(max_tries))


def scatter_add(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Dense ``numel`` zeros plus each value at its index (duplicates summed); see ``reference.scatter_add``.

    Indices are range-checked on the device: one outside [0, numel) raises ValueError (one host sync).
    """
    reference._check_pairs("scatter_add", indices, values)
    ops = _ops(indices, values)
    if ops is None or values.dtype not in _FLOAT_DTYPES or indices.device != values.device:
        return reference.scatter_add(indices, values, numel)
    out, first = ops.scatter_add(indices.detach(), values.detach(), numel)
    bad = int(first)  # host sync
    if bad < indices.numel():
        raise ValueError(f"scatter_add: indices must lie in [0, {numel}), got {int(indices[bad])} at position {bad}")
    return out


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """1-D uint8/bool codes -> bytes of ``bits``-bit codes, least significant first; see ``reference.pack_bits``."""
    reference._check_pack(codes, bits)
    ops = _ops(codes)
    if ops is None:
        return reference.pack_bits(codes, bits)
    return ops.pack_bits(codes.detach(), bits)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``numel`` codes of ``packed`` as uint8, or ``levels[code]``; see ``reference.unpack_bits``."""
    reference._check_unpack(packed, bits, numel, levels)
    ops = _ops(packed)
    if ops is None:
        return reference.unpack_bits(packed, bits, numel, levels)
    codes = ops.unpack_bits(packed.detach(), bits, numel)
    return codes if levels is None else levels[codes.long()]

"""Device helpers that touch ``torch.cuda`` (kept inside ``zensync.kernels`` like every CUDA call)."""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable, Iterator

import torch

__all__ = ["LAZY_ZEROS_MIN_BYTES", "caller_stream", "device_name", "synchronize", "zeros"]

LAZY_ZEROS_MIN_BYTES = 1 << 20
"""CPU tensors of at least this many bytes are fresh anonymous memory mappings, zero without a write."""


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose zeros cost nothing until a page is touched (CPU, large sizes).

    ``torch.zeros`` allocates and then writes every byte: on a fresh allocation each 4 KiB page
    takes a write fault plus the fill, about 47 ms for 51 MB on this repository's 2-core machine,
    where a sparse result writes a few thousand rows. Large CPU tensors here are a fresh anonymous
    mapping, which the kernel guarantees to be zero and fills page by page on first write: only
    the pages a scheme writes are ever touched, and a page the caller only reads maps the kernel's
    shared zero page. Transparent huge pages are declined for the mapping (a 2 MiB page is zeroed
    whole on its first write: a few hundred scattered rows would touch every page). The tensor is
    an ordinary contiguous CPU tensor that owns the mapping (unmapped when the tensor is freed);
    its storage is not resizable. Small tensors and other devices (CUDA: one memset at memory
    bandwidth) use ``torch.zeros``.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < LAZY_ZEROS_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def synchronize(device: torch.device) -> None:
    """Wait for every queued kernel on ``device`` (no-op on CPU), so a host clock reads true times."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """A readable name: ``"cpu"`` or ``"cuda:NVIDIA H200"``."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def caller_stream(device: torch.device) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context factory that puts device work back on the caller's current CUDA stream.

    Call it on the thread that owns the data (DDP's autograd thread in the comm hook): it captures
    that thread's current stream of ``device``. Entering the returned factory's context on any other
    thread (a backend's completion callback) first makes the captured stream wait for the thread's
    current stream, on which the finished collective's data is ready (torch's ``Future.then``
    semantics), then makes the captured stream current, so kernels launched inside stay ordered
    after the collective and before whatever the caller enqueues after the hook. No host
    synchronization. On a CPU device the context does nothing.

    Unmeasured on a GPU in this repository's CI (no GPU there): correct by construction.
    """
    if device.type != "cuda":
        return contextlib.nullcontext
    stream = torch.cuda.current_stream(device)

    @contextlib.contextmanager
    def on_caller_stream() -> Iterator[None]:
        with torch.cuda.device(device):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                yield

    return on_caller_stream

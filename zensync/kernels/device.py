"""Device helpers that touch ``torch.cuda`` (kept inside ``zensync.kernels`` like every CUDA call)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

__all__ = ["caller_stream", "device_name", "synchronize"]


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

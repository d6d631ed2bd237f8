"""Device helpers that touch ``torch.cuda`` (kept inside ``zensync.kernels`` like every CUDA call)."""

from __future__ import annotations

import torch

__all__ = ["device_name", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for every queued kernel on ``device`` (no-op on CPU), so a host clock reads true times."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """A readable name: ``"cpu"`` or ``"cuda:NVIDIA H200"``."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type

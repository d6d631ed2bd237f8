"""Process-group setup for launched workers, and torch's built-in DDP hooks, behind zensync.transport.

Code outside ``zensync/transport/`` may not import ``torch.distributed`` (tests/unit/test_architecture.py),
so a worker process that joins a group, fences with barriers and registers one of torch's own comm hooks
does it through these helpers.

Example::

    init_from_env(timeout_s=120)  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the launcher
    ddp.register_comm_hook(None, fp16_compress_hook)
    barrier()
    destroy()
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook

__all__ = [
    "allreduce_hook",
    "barrier",
    "destroy",
    "fp16_compress_hook",
    "get_rank",
    "get_world_size",
    "init_from_env",
    "is_initialized",
]

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def init_from_env(backend: str = "gloo", timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the default process group from the env:// variables; returns (rank, world_size).

    Args:
        backend: "gloo" (CPU) or "nccl" (GPU).
        timeout_s: Collective timeout: a collective stuck this long raises in this process instead of hanging.

    Returns:
        This process's rank and the world size.

    Raises:
        ValueError: If an env:// variable is missing or ``timeout_s`` is not positive.
    """
    missing = [key for key in _ENV_KEYS if key not in os.environ]
    if missing:
        raise ValueError(
            f"init_from_env: environment variables {missing} are not set; a launcher sets "
            f"{', '.join(_ENV_KEYS)} (e.g. zensync.testbed's env_for_torch, or torchrun)"
        )
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def is_initialized() -> bool:
    """Whether this process has joined a default process group."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Rank in the default group."""
    return dist.get_rank()


def get_world_size() -> int:
    """Size of the default group."""
    return dist.get_world_size()


def barrier() -> None:
    """Block until every rank of the default group reaches this point."""
    dist.barrier()


def destroy() -> None:
    """Leave the default process group (and every group made from it); a no-op when none was joined."""
    if is_initialized():
        dist.destroy_process_group()

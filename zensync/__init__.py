"""zensync: gradient synchronization that moves only what it must.

Public API::

    zensync.sparse_allreduce(tensor, group=None, *, scheme="zen", average=False) -> Tensor
    zensync.register(ddp_model, strategy="auto")  # DDP comm hook, one line
    zensync.register_fsdp(fsdp_model, strategy="auto")  # FSDP2's reduce-scatter, one line
    zensync.profile_group(ddp_model, make_batch, loss_fn)  # a step profile for auto / predict_step
    zensync.SimulatedWorld(num_ranks).run(fn)     # p logical ranks in one process
    zensync.SyncStats, zensync.SyncOptions, zensync.SCHEMES
"""

from __future__ import annotations

from typing import Any

from zensync.api import sparse_allreduce
from zensync.hooks import HookConfig, ZenSyncState, register, zensync_hook
from zensync.profiling import profile_group
from zensync.sync import SCHEMES, SyncOptions
from zensync.transport import SimulatedWorld, TorchTransport, Transport
from zensync.types import PhaseTraffic, SyncStats

__all__ = [
    "SCHEMES",
    "FSDPSyncState",
    "HookConfig",
    "PhaseTraffic",
    "SimulatedWorld",
    "SyncOptions",
    "SyncStats",
    "TorchTransport",
    "Transport",
    "ZenSyncState",
    "profile_group",
    "register",
    "register_fsdp",
    "sparse_allreduce",
    "zensync_hook",
]

__version__ = "0.1.0"

_LAZY = {"FSDPSyncState", "register_fsdp"}
"""Names from zensync.hooks.fsdp, imported on first use: torch.distributed.fsdp costs about 1 s to import."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from zensync.hooks import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module 'zensync' has no attribute {name!r}")

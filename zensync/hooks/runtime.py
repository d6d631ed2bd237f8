"""The hook's runtime objects: its process group, DDP's own group, the lane, the hierarchy and the cost model.

Nothing here is checkpointed or compared between ranks except the cost model (``ZenSyncState``
does both); everything here is rebuilt by ``zensync.register``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from zensync import kernels
from zensync.compress import Hierarchy
from zensync.cost import CostModel
from zensync.cost.calibrate import calibrate_async
from zensync.hooks.config import HookConfig
from zensync.transport import Lane, MPITransport, TorchTransport, Transport

__all__ = ["Runtime"]

logger = logging.getLogger(__name__)


class Runtime:
    """Where the hook's collectives run.

    Args:
        base: The DDP model's group as a Transport.
        config: The hook options (timeout, fixed alpha-beta parts).
        h0_seed: Zen's hash seed, agreed by ``register``.
        device: The device of the model's parameters.
    """

    __slots__ = ("cost_model", "dense_transport", "device", "h0_seed", "hierarchy", "lane", "transport")

    def __init__(self, base: Transport, config: HookConfig, h0_seed: int, device: torch.device) -> None:
        # A group of its own: the hook's collectives must not interleave with DDP's.
        # It inherits the DDP group's timeout (or ``config.timeout``), not torch's 30-minute default.
        self.transport: Transport = base
        if config.transport == "mpi":
            self.transport = MPITransport(timeout=config.timeout_delta or getattr(base, "timeout", None))
        elif isinstance(base, TorchTransport):
            self.transport = base.duplicate(timeout=config.timeout_delta)
        self.dense_transport: Transport = self.transport if config.transport == "mpi" else base
        """DDP's own group: buckets that need no detection are allreduced on it straight from the
        hook, asynchronously, as torch's allreduce hook does (when it is not ``transport`` itself);
        with ``transport="mpi"``, MPI: every collective of the hook goes there."""
        threaded = device.type == "cuda" if config.comm_thread is None else config.comm_thread
        self.lane = Lane(thread_name="zensync-lane" if threaded else None)
        """Every step job of the hook (per-step check, buckets) runs here in order (one at a time
        until it hands on); on a GPU, or with ``comm_thread``, they start on a thread of the lane's
        own (see ``Lane``), as NCCL's futures complete when the work is queued and the jobs would
        otherwise run inline on the autograd thread."""
        self.h0_seed = h0_seed
        self.device = device
        self.hierarchy: Hierarchy | None = None
        self.cost_model: CostModel | None = None
        if config.latency_s is not None and config.bandwidth_bytes_per_s is not None:
            self.cost_model = CostModel(latency_s=config.latency_s, bandwidth_bytes_per_s=config.bandwidth_bytes_per_s)

    async def ensure_cost_model(self, config: HookConfig) -> CostModel:
        """The alpha-beta model: user-given parts, the rest measured on ``transport`` (collectives, once)."""
        if self.cost_model is None:
            measured = await calibrate_async(self.transport, self.device)
            self.cost_model = CostModel(
                latency_s=config.latency_s or measured.latency_s,
                bandwidth_bytes_per_s=config.bandwidth_bytes_per_s or measured.bandwidth_bytes_per_s,
            )
            if self.transport.rank == 0:
                logger.info("zensync hook: calibrated %s", self.cost_model)
        return self.cost_model

    def segment_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """Entered around each segment of a step job: the hook caller's CUDA stream (CPU: nothing).

        Captured on the autograd thread when DDP calls the hook, so the job's kernels, which run on
        backend completion threads, stay ordered after the gradients on the caller's stream.
        """
        return kernels.caller_stream(self.device)

    def control_device(self) -> torch.device:
        """The transport's control device, as the model's own GPU when it is CUDA (NCCL).

        Step jobs run on backend threads, whose current CUDA device is not the one the user
        selected on the main thread: a bare "cuda" would name GPU 0 on every rank.
        """
        device = self.transport.control_device
        return self.device if device.type == "cuda" else device

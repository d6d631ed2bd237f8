"""The hook's runtime objects: its process group, DDP's own group, the lane, the hierarchy and the cost model.

Nothing here is checkpointed or compared between ranks except the cost model (``ZenSyncState``
does both); everything here is rebuilt by ``zensync.register``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch

from zensync import kernels
from zensync.compress import Hierarchy
from zensync.cost import CostModel
from zensync.cost.calibrate import calibrate_async
from zensync.hooks.config import HookConfig
from zensync.transport import Lane, MixedTransport, MPITransport, TorchTransport, Transport, TuningTable, tune

__all__ = ["Runtime", "load_tuning"]

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

    def __init__(
        self,
        base: Transport,
        config: HookConfig,
        h0_seed: int,
        device: torch.device,
        *,
        tuning: TuningTable | None = None,
    ) -> None:
        # A group of its own: the hook's collectives must not interleave with DDP's.
        # It inherits the DDP group's timeout (or ``config.timeout``), not torch's 30-minute default.
        self.transport: Transport = base
        timeout = config.timeout_delta or getattr(base, "timeout", None)
        if config.transport == "mpi":
            self.transport = MPITransport(timeout=timeout)
        elif config.transport == "mixed":
            self.transport = _mixed(base, MPITransport(timeout=timeout), config, tuning)
        elif isinstance(base, TorchTransport):
            self.transport = base.duplicate(timeout=config.timeout_delta)
        self.dense_transport: Transport = self.transport if config.transport in ("mpi", "mixed") else base
        """DDP's own group: buckets that need no detection are allreduced on it straight from the
        hook, asynchronously, as torch's allreduce hook does (when it is not ``transport`` itself);
        with ``transport="mpi"`` or "mixed", that transport: every collective of the hook goes there."""
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


def load_tuning(tuning: TuningTable | str | os.PathLike[str] | None, world_size: int) -> TuningTable | None:
    """``HookConfig.tuning`` as a table (None stays None: measured later), checked against the group size.

    Raises:
        ValueError: If the file is not a tuning table, or the table was measured on another group size.
        OSError: If the file cannot be read.
    """
    if tuning is None:
        return None
    table = tuning if isinstance(tuning, TuningTable) else TuningTable.from_json(pathlib.Path(tuning).read_text())
    if table.world_size is not None and table.world_size != world_size:
        raise ValueError(
            f"tuning: the table was measured on {table.world_size} ranks, this group has {world_size}; "
            f"measure it here: mpiexec -n {world_size} python -m mpi4py -m zensync tune"
        )
    return table


def _mixed(base: Transport, mpi: MPITransport, config: HookConfig, table: TuningTable | None) -> MixedTransport:
    """The hook's mixed dispatch: a duplicate of the DDP group (under its backend's name) and ``mpi``,
    routed by ``table`` or, without one, by a table measured here (a collective of every rank)."""
    if not isinstance(base, TorchTransport):
        raise ValueError(f"transport='mixed' needs a torch.distributed DDP group, got {type(base).__name__}")
    torch_side = base.duplicate(timeout=config.timeout_delta)
    backends: dict[str, Transport] = {torch_side.backend: torch_side, "mpi": mpi}
    if table is None:
        table, _ = tune(backends, reps=3)
        if base.rank == 0:
            logger.info("zensync hook: measured the mixed dispatch's table %s", table.to_json())
    return MixedTransport(backends, table)

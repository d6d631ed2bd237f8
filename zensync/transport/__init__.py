"""Transports: the only package that imports torch.distributed and mpi4py.

Every sync algorithm is written against ``Transport``; ``resolve`` turns what a user passes as
``group`` (a ProcessGroup, None for the default group, or a Transport) into one.
"""

from __future__ import annotations

from typing import Any

from zensync.transport import launch
from zensync.transport.base import CONTROL_BYTES_PER_COUNT, TrafficLog, Transport
from zensync.transport.comms import CommRecord, CommsLogger
from zensync.transport.handle import Handle, Lane, Task, gather, hand_on, handed_on, run_sync
from zensync.transport.mixed import MixedTransport, TuningTable, tune
from zensync.transport.mpi import MPITransport, init_torch_distributed
from zensync.transport.simulated import SimulatedTransport, SimulatedWorld, WorldAborted
from zensync.transport.torch_dist import GradBucket, TorchTransport, transport_for_group

__all__ = [
    "CONTROL_BYTES_PER_COUNT",
    "CommRecord",
    "CommsLogger",
    "GradBucket",
    "Handle",
    "Lane",
    "MPITransport",
    "MixedTransport",
    "SimulatedTransport",
    "SimulatedWorld",
    "Task",
    "TorchTransport",
    "TrafficLog",
    "Transport",
    "TuningTable",
    "WorldAborted",
    "gather",
    "hand_on",
    "handed_on",
    "init_torch_distributed",
    "launch",
    "resolve",
    "run_sync",
    "transport_for_group",
    "tune",
]


def resolve(group: Any) -> Transport:
    """A Transport for ``group``: a Transport as is, else a torch.distributed group (None = default)."""
    if isinstance(group, Transport):
        return group
    return transport_for_group(group)

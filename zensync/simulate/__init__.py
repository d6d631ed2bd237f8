"""Simulated scaling: zensync's real algorithms on the in-process world, priced on a modelled network.

``simulate(fn, world_size, topology)`` runs ``fn(transport)`` on ``world_size`` logical ranks of a
``SimulatedWorld`` (the same code as training, on real data), records every collective each rank
issues with its real sizes (``record``), and replays the records on ``topology``, a two-level
alpha-beta network (``zensync.cost.topology``; ``timeline``). It returns every rank's result, the
priced time and, per rank, the bytes the transport accounted (its ``TrafficLog``).

Only the network is priced: local work between the calls (kernels, compression) is not part of the
time (``Simulation.compute_charged`` is False), and point-to-point messages that leave one node at
the same time do not share its link in the model (collectives do).

Example::

    topo = Topology(8, Link(5e-6, 150e9), Link(10e-6, 12.5e9))  # 8 GPUs per node, 100 Gbit/s between
    sim = simulate(lambda t: zensync.sparse_allreduce(grads[t.rank], group=t), 64, topo)
    sim.priced.seconds, sim.priced.phase_seconds["push"]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from zensync.cost.topology import Link, Topology
from zensync.simulate.record import Call, RecordingTransport
from zensync.simulate.timeline import Priced, price
from zensync.transport import SimulatedWorld, TrafficLog, Transport

__all__ = ["Call", "Link", "Priced", "RecordingTransport", "Simulation", "Topology", "price", "record", "simulate"]


@dataclasses.dataclass(frozen=True, slots=True)
class Simulation:
    """What ``simulate`` returns."""

    results: list[Any]
    """``fn``'s return value on each rank."""
    priced: Priced
    calls: list[list[Call]]
    """Each rank's recorded collectives, in issue order."""
    traffic: list[TrafficLog]
    """Each rank's bytes per phase, as the transport accounted them."""
    compute_charged: bool = False
    """Whether local work is part of ``priced`` (not yet: the network only)."""


def record(
    fn: Callable[[Transport], Any], world_size: int, *, timeout_s: float = 600.0
) -> tuple[list[Any], list[list[Call]], list[TrafficLog]]:
    """Run ``fn`` on ``world_size`` simulated ranks: each rank's result, recorded calls and traffic."""
    calls: list[list[Call]] = [[] for _ in range(world_size)]
    logs = [TrafficLog() for _ in range(world_size)]

    def body(transport: Transport) -> Any:
        recording = RecordingTransport(transport, calls[transport.rank])
        with recording.recording(logs[transport.rank]):
            return fn(recording)

    results = SimulatedWorld(world_size, timeout_s=timeout_s).run(body)
    return list(results), calls, logs


def simulate(
    fn: Callable[[Transport], Any], world_size: int, topology: Topology, *, timeout_s: float = 600.0
) -> Simulation:
    """Run ``fn`` on ``world_size`` simulated ranks and price its collectives on ``topology``."""
    results, calls, logs = record(fn, world_size, timeout_s=timeout_s)
    return Simulation(results=results, priced=price(calls, topology), calls=calls, traffic=logs)

"""Simulated scaling: zensync's real algorithms on the in-process world, priced on a modelled network.

``simulate(fn, world_size, topology)`` runs ``fn(transport)`` on ``world_size`` logical ranks of a
``SimulatedWorld`` (the same code as training, on real data), records every collective each rank
issues with its real sizes (``record``), and replays the records on ``topology``, a two-level
alpha-beta network (``zensync.cost.topology``; ``timeline``). It returns every rank's result, the
priced time and, per rank, the bytes the transport accounted (its ``TrafficLog``).

Local work is charged as measured: each recorded call carries the CPU seconds its rank spent
preparing it (``Call.compute_s``: one core of this machine, the thread's CPU clock), and the rank's
clock advances by that, times ``compute_scale``, before the call (``compute_scale=0`` prices the
network alone; a faster device is a smaller factor). With ``cores``, the ranks share that many cores
(a processor-sharing CPU: n emulated hosts on one machine, or ranks compressing on a host's shared
CPU), and with ``transport_cpu`` each collective costs its ranks CPU work per byte as well (the
backend's copies, the kernel's network stack; ``timeline``). Point-to-point messages that leave one
node at the same time do not share its link in the model (collectives do).

Example::

    topo = Topology(8, Link(5e-6, 150e9), Link(10e-6, 12.5e9))  # 8 GPUs per node, 100 Gbit/s between
    sim = simulate(lambda t: zensync.sparse_allreduce(grads[t.rank], group=t), 64, topo)
    sim.priced.seconds, sim.priced.phase_seconds["push"], sim.priced.compute_seconds
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from zensync.cost.topology import Link, Topology
from zensync.simulate.record import Call, RecordingTransport, network_calls
from zensync.simulate.timeline import Priced, price
from zensync.transport import SimulatedWorld, TrafficLog, Transport

__all__ = [
    "Call",
    "Link",
    "Priced",
    "RecordingTransport",
    "Simulation",
    "Topology",
    "network_calls",
    "price",
    "record",
    "simulate",
]


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
    compute_scale: float = 1.0
    """The factor on the measured local work in ``priced`` (0: the network alone)."""
    cores: float | None = None
    """The cores the ranks' local work shared in ``priced`` (None: one per rank)."""
    transport_cpu: Mapping[str, float] | None = None
    """Per collective op, the CPU seconds per byte moved charged in ``priced`` (None: none)."""


def record(
    fn: Callable[..., Any],
    world_size: int,
    *,
    inputs: Callable[[int], Any] | None = None,
    warmup: bool = False,
    repeats: int = 1,
    timeout_s: float = 600.0,
) -> tuple[list[Any], list[list[Call]], list[TrafficLog]]:
    """Run ``fn`` on ``world_size`` simulated ranks: each rank's result, recorded calls and traffic.

    With ``inputs``, rank r runs ``fn(transport, inputs(r))`` and builds its input before the
    recording starts, so building it is not local work of the step. With ``warmup``, every rank
    first runs ``fn`` once unrecorded (on an input of its own), so compiling the kernels and
    first-call allocations are not measured as local work either; ``fn`` must then be repeatable.
    With ``repeats`` > 1 the step is recorded that many times (``fn`` must be repeatable and issue
    the same calls each time) and each call's local work is the median over the repeats: the
    measured step, not one sample of this machine's noise. Results and traffic are the first run's.

    Raises:
        ValueError: If ``repeats`` < 1, or the repeats issued different calls.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    runs: list[list[list[Call]]] = [[[] for _ in range(world_size)] for _ in range(repeats)]
    logs = [TrafficLog() for _ in range(world_size)]

    def body(transport: Transport) -> Any:
        rank = transport.rank
        if warmup:
            fn(transport) if inputs is None else fn(transport, inputs(rank))
        result = None
        for k, calls in enumerate(runs):
            given = () if inputs is None else (inputs(rank),)
            recording = RecordingTransport(transport, calls[rank])  # its local-work clock starts here
            with recording.recording(logs[rank] if k == 0 else TrafficLog()):
                out = fn(recording, *given)
            recording.finish()
            result = out if k == 0 else result
        return result

    results = SimulatedWorld(world_size, timeout_s=timeout_s).run(body)
    return list(results), _median_local_work(runs), logs


def _median_local_work(runs: list[list[list[Call]]]) -> list[list[Call]]:
    """The first run's calls, each with the median over the runs of its ``compute_s``."""
    merged = []
    for rank, calls in enumerate(runs[0]):
        if len({tuple(dataclasses.replace(c, compute_s=0.0) for c in run[rank]) for run in runs}) != 1:
            raise ValueError(f"record: rank {rank} issued different calls on repeats of the step (fn must repeat)")
        merged.append([
            dataclasses.replace(call, compute_s=statistics.median(run[rank][i].compute_s for run in runs))
            for i, call in enumerate(calls)
        ])  # fmt: skip
    return merged


def simulate(
    fn: Callable[..., Any],
    world_size: int,
    topology: Topology,
    *,
    compute_scale: float = 1.0,
    cores: float | None = None,
    transport_cpu: Mapping[str, float] | None = None,
    inputs: Callable[[int], Any] | None = None,
    warmup: bool = False,
    repeats: int = 1,
    timeout_s: float = 600.0,
) -> Simulation:
    """Run ``fn`` on ``world_size`` simulated ranks and price its collectives and local work on
    ``topology`` (``compute_scale``, ``cores``, ``transport_cpu``: as ``price``'s; ``inputs``, ``warmup``,
    ``repeats``: as ``record``'s)."""
    results, calls, logs = record(fn, world_size, inputs=inputs, warmup=warmup, repeats=repeats, timeout_s=timeout_s)
    priced = price(calls, topology, compute_scale=compute_scale, cores=cores, transport_cpu=transport_cpu)
    return Simulation(
        results=results, priced=priced, calls=calls, traffic=logs, compute_scale=compute_scale, cores=cores,
        transport_cpu=transport_cpu,
    )  # fmt: skip

"""Event-driven timeline of one training iteration under a compression strategy (Espresso 1.4 / 1.5).

Three kinds of streams:

- compute: forward, then the backward pass; a tensor's gradient is ready at its profiled ``ready_s``
  plus the GPU encode time charged by earlier tensors (a GPU compression kernel runs on the compute
  stream and delays every later gradient, as Espresso charges encode);
- comm: one FIFO stream; a request joins it when the tensor is ready (and compressed) and runs when
  the stream is free, in the order requests were made (ties: backward order);
- cpu: ``cluster.cpu_workers`` workers for offloaded compress/decompress and GPU<->CPU copies, each
  request taking the earliest free worker.

A strategy gives one ``TensorOption`` per tensor and optional fusion groups (consecutive tensors with
the same option, compressed and communicated as one, ready when the last is). The iteration ends at
forward + max(end of backward, end of the last tensor's pipeline)::

    result = simulate(profile, cluster, model, Strategy.uniform(FP32_OPTION, len(profile.tensors)))
    print(render_timeline(result))
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from zensync.cost import FP16_MODEL, CompressorModel
from zensync.planner._render import render_timeline
from zensync.planner.cluster import ClusterSpec
from zensync.planner.options import Resource, TensorOption, option_costs
from zensync.planner.profile import ModelProfile

__all__ = [
    "SimResult",
    "Strategy",
    "TimelineEvent",
    "Unit",
    "iteration_time",
    "price_units",
    "render_timeline",
    "simulate",
    "simulate_units",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """One option per tensor (backward order) and optional fusion groups."""

    options: tuple[TensorOption, ...]
    """Option of each tensor, in the profile's order."""
    groups: tuple[int, ...] | None = None
    """Group id of each tensor: 0, 1, 2, ... over runs of consecutive tensors; None: every tensor alone."""

    def __post_init__(self) -> None:
        if self.groups is None:
            return
        if len(self.groups) != len(self.options):
            raise ValueError(f"Strategy.groups has {len(self.groups)} ids for {len(self.options)} tensors")
        previous = -1
        for index, (group, option) in enumerate(zip(self.groups, self.options, strict=True)):
            if group not in (previous, previous + 1) or (index == 0 and group != 0):
                raise ValueError(
                    f"Strategy.groups[{index}]={group} after {previous}: ids must start at 0 and grow by 0 or 1 "
                    f"(a group is a run of consecutive tensors)"
                )
            if group == previous and option != self.options[index - 1]:
                raise ValueError(
                    f"Strategy group {group} mixes options {self.options[index - 1].code} and {option.code}"
                )
            previous = group

    @classmethod
    def uniform(cls, option: TensorOption, num_tensors: int) -> Strategy:
        """Every tensor with ``option``, no fusion."""
        return cls(options=(option,) * num_tensors)

    def units(self) -> list[tuple[int, int]]:
        """(first, end) tensor index ranges of the fusion groups, in order (end exclusive)."""
        if self.groups is None:
            return [(i, i + 1) for i in range(len(self.options))]
        bounds = [i for i in range(1, len(self.groups)) if self.groups[i] != self.groups[i - 1]]
        starts, ends = [0, *bounds], [*bounds, len(self.groups)]
        return list(zip(starts, ends, strict=True))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TimelineEvent:
    """One interval on one stream; times in seconds from the start of the iteration (forward)."""

    label: str
    """Tensor name, or ``first+N`` for a fused group of N + 1 tensors."""
    stream: str
    """``compute``, ``comm`` or ``cpuN``."""
    start_s: float
    end_s: float
    kind: str
    """``forward``, ``backward``, ``encode``, ``comm`` or ``cpu``."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """Predicted timeline of one iteration."""

    iteration_s: float
    """Forward + max(backward end, completion of every tensor's communication and decompression)."""
    forward_s: float
    backward_end_s: float
    """End of the backward pass on the compute stream, from the start of the iteration (with encode delays)."""
    comm_busy_s: float
    """Total time the comm stream is busy (collectives plus GPU kernels on the comm path)."""
    exposed_comm_s: float
    """Comm-stream busy time after the backward pass ends (not overlapped with computation)."""
    gpu_compress_s: float
    """Compress + decompress kernel time on the GPU."""
    cpu_compress_s: float
    """Compress + decompress time on the CPU workers (without the copies)."""
    events: tuple[TimelineEvent, ...] = ()
    """Every interval, when recorded."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """One tensor or fusion group, priced: what ``simulate_units`` schedules."""

    label: str
    """Tensor name, or ``first+N`` for a group of N + 1 tensors."""
    ready_s: float
    """Profiled ready time of its (last) gradient, seconds after the start of backward."""
    compute_s: float = 0.0
    """Charged to the compute stream at the ready time (GPU encode); delays every later unit."""
    stages: tuple[tuple[Resource, float], ...] = ()
    """After the ready time, in order: ``wait`` (no shared resource), ``comm`` or ``cpu`` (seconds)."""
    gpu_kernel_s: float = 0.0
    """GPU compress + decompress time (statistics only)."""
    cpu_kernel_s: float = 0.0
    """CPU compress + decompress time (statistics only)."""


def price_units(
    profile: ModelProfile,
    cluster: ClusterSpec,
    model: CompressorModel,
    strategy: Strategy,
    *,
    upper_bound: bool = False,
    fp16_model: CompressorModel = FP16_MODEL,
) -> list[Unit]:
    """The strategy's units (fusion groups) priced by ``option_costs``, one vectorised call per option.

    Args:
        profile: Tensors in backward order.
        cluster: The cluster.
        model: The compressor of ``comp`` options.
        strategy: Options and fusion groups.
        upper_bound: Zero-cost compression, no compute interference.
        fp16_model: The compressor of ``fp16`` options.

    Returns:
        One ``Unit`` per group, in order.

    Raises:
        ValueError: If the strategy does not have one option per tensor.
    """
    if len(strategy.options) != len(profile.tensors):
        raise ValueError(f"strategy has {len(strategy.options)} options for {len(profile.tensors)} tensors")
    spans = strategy.units()
    numel = np.array([float(sum(t.numel for t in profile.tensors[a:b])) for a, b in spans])
    unit_options = [strategy.options[a] for a, _ in spans]
    units: list[Unit | None] = [None] * len(spans)
    cache: dict[int, int] = {}
    for option in dict.fromkeys(unit_options):
        index = [u for u, o in enumerate(unit_options) if o == option]
        costs = option_costs(
            option,
            numel[index],
            cluster,
            model,
            dtype_bytes=profile.dtype_bytes,
            upper_bound=upper_bound,
            fp16_model=fp16_model,
            cache=cache,
        )
        on_cpu = option.device == "cpu"
        for j, u in enumerate(index):
            first, end = spans[u]
            kernel_s = float(costs.kernel_s[j])
            units[u] = Unit(
                label=profile.tensors[first].name
                if end - first == 1
                else f"{profile.tensors[first].name}+{end - first - 1}",
                ready_s=profile.tensors[end - 1].ready_s,
                compute_s=float(costs.compute_s[j]),
                stages=tuple((resource, float(seconds[j])) for resource, seconds in costs.stages),
                gpu_kernel_s=0.0 if on_cpu else kernel_s,
                cpu_kernel_s=kernel_s if on_cpu else 0.0,
            )
    return [u for u in units if u is not None]


def simulate(
    profile: ModelProfile,
    cluster: ClusterSpec,
    model: CompressorModel,
    strategy: Strategy,
    *,
    upper_bound: bool = False,
    record_events: bool = True,
    fp16_model: CompressorModel = FP16_MODEL,
) -> SimResult:
    """Simulate one iteration: ``price_units`` then ``simulate_units``.

    Args:
        profile: Tensors in backward order with ready times, forward and backward durations.
        cluster: Nodes, GPUs, links and CPU workers.
        model: The compressor of ``comp`` options.
        strategy: One option per tensor, optional fusion groups.
        upper_bound: Zero-cost compression and no compute interference (Espresso's Upper Bound).
        record_events: Keep every interval in ``SimResult.events`` (for ``render_timeline``).
        fp16_model: The compressor of ``fp16`` options.

    Returns:
        The ``SimResult``.

    Example::

        simulate(profile, cluster, model, Strategy.uniform(FP32_OPTION, len(profile.tensors))).iteration_s
    """
    units = price_units(profile, cluster, model, strategy, upper_bound=upper_bound, fp16_model=fp16_model)
    return simulate_units(
        units,
        forward_s=profile.forward_s,
        backward_s=profile.backward_s,
        cpu_workers=cluster.cpu_workers,
        record_events=record_events,
    )


def simulate_units(
    units: Sequence[Unit], *, forward_s: float, backward_s: float, cpu_workers: int = 1, record_events: bool = True
) -> SimResult:
    """Schedule priced units on the compute, comm and CPU streams.

    Steps:

    1. compute stream: each unit is ready at forward + its ready time + the ``compute_s`` of every
       earlier unit (GPU encodes run on the compute stream when their gradient is ready);
    2. serve stage requests in time order (ties: unit order): ``wait`` just takes time, ``comm``
       queues on the one FIFO comm stream, ``cpu`` takes the earliest free of ``cpu_workers``;
    3. iteration = max(backward end, last completion); collect the statistics.

    Args:
        units: In backward order (``ready_s`` non-decreasing).
        forward_s: Forward duration (comm cannot overlap it).
        backward_s: Backward duration without encode delays.
        cpu_workers: CPU workers.
        record_events: Keep every interval in ``SimResult.events``.

    Returns:
        The ``SimResult`` (times from the start of the iteration).

    Example::

        unit = Unit(label="w", ready_s=0.0, stages=(("comm", 1e-3),))
        simulate_units([unit], forward_s=0.0, backward_s=2e-3).iteration_s  # 2e-3
    """
    events: list[TimelineEvent] | None = [] if record_events else None
    backward_end, done, comm_intervals = _timeline(units, forward_s, backward_s, cpu_workers, events)
    return SimResult(
        iteration_s=max(backward_end, *done) if done else backward_end,
        forward_s=forward_s,
        backward_end_s=backward_end,
        comm_busy_s=sum(end - start for start, end in comm_intervals),
        exposed_comm_s=sum(max(0.0, end - max(start, backward_end)) for start, end in comm_intervals),
        gpu_compress_s=sum(u.gpu_kernel_s for u in units),
        cpu_compress_s=sum(u.cpu_kernel_s for u in units),
        events=tuple(events or ()),
    )


def iteration_time(units: Sequence[Unit], *, forward_s: float, backward_s: float, cpu_workers: int = 1) -> float:
    """``simulate_units(...).iteration_s`` without the statistics (the planner calls it in its loops)."""
    backward_end, done, _ = _timeline(units, forward_s, backward_s, cpu_workers, None)
    return max(backward_end, *done) if done else backward_end


def _timeline(
    units: Sequence[Unit], forward_s: float, backward_s: float, cpu_workers: int, events: list[TimelineEvent] | None
) -> tuple[float, list[float], list[tuple[float, float]]]:
    """Steps 1-2 of ``simulate_units``: backward end, each unit's completion, the comm intervals."""
    if events is not None:
        events.append(TimelineEvent(label="forward", stream="compute", start_s=0.0, end_s=forward_s, kind="forward"))
    # Step 1: the compute stream.
    delay, previous_end, heap = 0.0, forward_s, []
    for index, unit in enumerate(units):
        ready = forward_s + unit.ready_s + delay
        if events is not None:
            _compute_events(events, unit, previous_end, ready)
            previous_end = max(previous_end, ready + unit.compute_s)
        delay += unit.compute_s
        heap.append((ready, index, 0))
    backward_end = forward_s + backward_s + delay
    if events is not None and backward_end > previous_end:
        events.append(
            TimelineEvent(label="", stream="compute", start_s=previous_end, end_s=backward_end, kind="backward")
        )
    # Step 2: stage requests in time order.
    done, comm_intervals = _run_stages(units, heap, cpu_workers, events)
    return backward_end, done, comm_intervals


def _compute_events(events: list[TimelineEvent], unit: Unit, previous_end: float, ready: float) -> None:
    if ready > previous_end:
        events.append(
            TimelineEvent(label=unit.label, stream="compute", start_s=previous_end, end_s=ready, kind="backward")
        )
    if unit.compute_s > 0:
        end = ready + unit.compute_s
        events.append(TimelineEvent(label=unit.label, stream="compute", start_s=ready, end_s=end, kind="encode"))


def _run_stages(
    units: Sequence[Unit],
    requests: list[tuple[float, int, int]],
    num_workers: int,
    events: list[TimelineEvent] | None,
) -> tuple[list[float], list[tuple[float, float]]]:
    """Serve every stage request in time order; returns each unit's completion and the comm intervals.

    A ``wait`` stage uses no shared resource, so it is applied as soon as it is reached (the request
    for the stage after it enters the queue at the same time it would have anyway).
    """
    # First requests arrive (almost) in unit order, so they are sorted once (Timsort: linear here)
    # and merged with a heap that holds only the follow-up requests.
    first = sorted(_skip_waits(units[index].stages, time, index, stage) for time, index, stage in requests)
    heap: list[tuple[float, int, int]] = []
    position = 0
    comm_free, workers = 0.0, [0.0] * num_workers
    done = [0.0] * len(units)
    comm_intervals: list[tuple[float, float]] = []
    while position < len(first) or heap:
        if heap and (position == len(first) or heap[0] < first[position]):
            time, index, stage = heapq.heappop(heap)
        else:
            time, index, stage = first[position]
            position += 1
        stages = units[index].stages
        if stage >= len(stages):
            done[index] = time
            continue
        resource, seconds = stages[stage]
        if resource == "comm":
            start = comm_free if comm_free > time else time
            comm_free = start + seconds
            comm_intervals.append((start, comm_free))
            stream = "comm"
        else:
            worker = min(range(num_workers), key=workers.__getitem__)
            start = workers[worker] if workers[worker] > time else time
            workers[worker] = start + seconds
            stream = f"cpu{worker}"
        end = start + seconds
        if events is not None and seconds > 0:
            events.append(
                TimelineEvent(label=units[index].label, stream=stream, start_s=start, end_s=end, kind=resource)
            )
        following = _skip_waits(stages, end, index, stage + 1)
        if following[2] < len(stages):
            heapq.heappush(heap, following)
        else:
            done[index] = following[0]
    return done, comm_intervals


def _skip_waits(
    stages: tuple[tuple[Resource, float], ...], time: float, index: int, stage: int
) -> tuple[float, int, int]:
    while stage < len(stages) and stages[stage][0] == "wait":
        time += stages[stage][1]
        stage += 1
    return time, index, stage

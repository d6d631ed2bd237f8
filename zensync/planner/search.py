"""Espresso's plan search (Algorithms 1 and 2, reference/espresso.md 1.5) plus Cupcake-style fusion.

``plan`` starts from the float32 timeline, compresses tensors on the GPU one at a time (largest first,
ties latest-in-backward first, skipping tensors before the last comm bubble) keeping each choice only
if the simulated iteration gets faster, optionally offloads compression of some tensors to the CPU,
fuses consecutive tensors into groups, and never returns a plan predicted slower than float32 or fp16
allreduce::

    result = plan(profile, cluster, model, cpu_offload=True)
    result.predicted.speedup_vs_fp32, result.option_for("fc.weight").code

What is exact and what is heuristic (all "exact" is relative to the simulator's model):

- Pricing a single-tensor change on the GPU is exact and O(1): with GPU-only options the comm stream
  is a FIFO queue whose arrivals come in backward order, so its end is a max-plus expression
  max_j (arrival_j + sum of durations from j on), kept as prefix/suffix maxima (``MaxPlus`` in
  ``_pricing.py``; the unit tests check it against the event loop). The predicted times a ``Plan``
  reports come from ``simulate`` (the event loop), not from this expression. ``espresso_algorithm1``
  runs the same pass the way the paper states it, one full simulation F(S) per variant (the
  reference the unit tests compare the O(1) price with, and the timing of Table 5's column).
- Bubble pruning (Espresso Property 1) is exact: a tensor without encode cost queued before the last
  idle gap of the comm stream cannot shorten the iteration by being compressed (it only adds delay).
- Algorithm 1 itself is greedy (one pass in Espresso's order, then up to ``REFINE_SWEEPS`` passes that
  revisit every tensor): a local search, not optimal in general; the unit tests compare it with
  brute force on tiny models (it found the optimum on 145 of 150 seeded random 3-4 tensor models,
  missing by at most 13.7 %).
- Algorithm 2 enumerates per (size, option) group how many tensors to offload, earliest-ready first.
  Its candidates are Espresso's (tensors Algorithm 1 compressed on the GPU) plus, beyond the paper,
  uncompressed tensors of at least ``MIN_CPU_EXTRA_NUMEL`` elements with their cheapest CPU option
  (GPU encoding that delays backward is what kept them uncompressed; CPU encoding does not)
  (Espresso Lemma 1, which holds in Espresso's model and is not re-proved for this simulator). When the
  product of (group size + 1) is at most ``EXACT_OFFLOAD_LIMIT`` the enumeration is complete (exact
  given Lemma 1); above it, coordinate descent over groups (largest tensors first, at most
  ``MAX_OFFLOAD_SWEEPS`` sweeps) replaces it: a heuristic that finds a per-group local optimum.
- With CPU offload, a joint local search (``_joint_pass``) follows from each of the two passes' results:
  coordinate descent over every option, GPU and CPU, for tensors of at least ``MIN_JOINT_NUMEL``
  elements, each trial a full simulation by the compiled event loop (``zensync.planner._compiled_timeline``,
  identical to the Python one). It ends in a local optimum (no single-tensor change is faster),
  which the two-stage decomposition of Algorithms 1 and 2 does not guarantee.
- Fusion of a GPU-only choice is exact: the fastest partition into contiguous groups under the
  planner's timeline (``_fusion.fuse_optimal``, ``cupcake.py``: a dynamic programme over cut points,
  checked against brute force), for models of at most ``EXACT_FUSION_MAX_TENSORS`` tensors; above
  that, and when some tensors compress on the CPU, one greedy left-to-right pass. Groups are runs of
  one compressed option; a float32 tensor may join a compressed group (taking its option). Fusion
  is never worse than no fusion under the simulator.
- With CPU offload and GPU compression both allowed, the plan of the CPU-only space (GPU
  compression off) is a candidate too, so allowing GPU compression never yields a slower plan than
  forbidding it (the two-stage search could otherwise miss it: Espresso's ablation, reference/
  espresso.md 1.7). It is searched on the prices already computed (``without_gpu_compression``),
  with the baselines and no upper bound of its own: the plan that space's own ``plan`` call returns.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable

import numpy as np

from zensync.cost import CompressorModel, Device
from zensync.planner import _compiled_timeline as timeline
from zensync.planner._fusion import fuse_gpu, fuse_optimal, fuse_simulated
from zensync.planner._pricing import MaxPlus, PricedOptions
from zensync.planner.cluster import ClusterSpec
from zensync.planner.options import SCHEMES, Scheme
from zensync.planner.plan import Plan, PlanTensor, Predictions
from zensync.planner.profile import ModelProfile
from zensync.planner.simulator import Strategy, Unit, iteration_time, simulate

__all__ = [
    "EXACT_FUSION_MAX_TENSORS",
    "EXACT_OFFLOAD_LIMIT",
    "MAX_JOINT_SWEEPS",
    "MAX_OFFLOAD_SWEEPS",
    "MIN_CPU_EXTRA_NUMEL",
    "MIN_JOINT_NUMEL",
    "REFINE_SWEEPS",
    "espresso_algorithm1",
    "plan",
]

EXACT_FUSION_MAX_TENSORS = 256
"""GPU-only choices of at most this many tensors are fused exactly, larger ones greedily: the exact
fusion prices O(n^2) spans (35-210 ms at 148-199 tensors on this 2-core machine, 1.2 s at 314)."""
EXACT_OFFLOAD_LIMIT = 256
"""Algorithm 2 enumerates every offload count combination up to this many simulations."""
MAX_OFFLOAD_SWEEPS = 4
"""Coordinate-descent sweeps over the offload groups when the enumeration is too large."""
MIN_CPU_EXTRA_NUMEL = 2**20
"""Uncompressed tensors at least this large are CPU-offload candidates too (see ``_cpu_pass``)."""
REFINE_SWEEPS = 2
"""Extra sweeps after Algorithm 1's single pass, revisiting every tensor (a local search; 0: Espresso)."""
MIN_JOINT_NUMEL = 2**17
"""Tensors at least this large (Espresso's fp16 threshold) are revisited by the joint pass."""
MAX_JOINT_SWEEPS = 16
"""Sweeps of the joint pass at most (it stops at the first sweep that changes nothing)."""
_EPS = 1e-12
"""Seconds: a change must gain more than this (float noise) to count as faster."""


def _gpu_pass(
    priced: PricedOptions,
    choice: np.ndarray,
    sweeps: int = 1 + REFINE_SWEEPS,
    simulated: _SimulatedVariants | None = None,
) -> np.ndarray:
    """Espresso Algorithm 1 from ``choice`` (float32 everywhere), then up to ``sweeps - 1`` revisits.

    Steps:

    1. order tensors by size, descending, ties latest-in-backward first (Property 2);
    2. skip what cannot gain: in the first sweep stop once the iteration is compute-bound (every
       tensor not yet visited is float32, so compressing it only adds encode time); in every sweep
       skip a tensor without encode cost that queues before the last comm bubble (Property 1,
       re-checked after every decision);
    3. price every GPU option for the tensor in O(1) and keep the fastest if it beats the current one
       (with ``simulated``, price each variant by a full simulation F(S) instead, as the paper states
       Algorithm 1: the reference for the O(1) price, about n times slower).

    Returns:
        Option indices (into ``priced.options``), one per tensor.
    """
    n = len(choice)
    rows = np.array([priced.gpu_row(k) for k in choice])
    columns = np.arange(n)
    timeline = MaxPlus(
        priced.ready,
        priced.compute[rows, columns],
        priced.wait[rows, columns],
        priced.comm[rows, columns],
        priced.profile.forward_s,
        priced.profile.backward_s,
    )
    if simulated is not None:
        simulated.start(rows)
    # Step 1: Property 2's order.
    order = sorted(range(n), key=lambda t: (-priced.numel[t], -t))
    for sweep in range(sweeps):
        changed = False
        for i in order:
            # Step 2: nothing to gain when compute-bound (first sweep) or before the last bubble.
            if sweep == 0 and timeline.compute_bound:
                break
            if i < timeline.last_peak and timeline.e[i] == 0:
                continue
            # Step 3: argmin over the GPU options.
            if simulated is None:
                times = timeline.times_with(i, priced.compute[:, i], priced.wait[:, i], priced.comm[:, i])
                now = timeline.time
            else:
                times, now = simulated.times_with(i), simulated.time
            best = int(np.argmin(times))
            if times[best] < now - _EPS:
                timeline.apply(i, priced.compute[best, i], priced.wait[best, i], priced.comm[best, i])
                rows[i], changed = best, True
                if simulated is not None:
                    simulated.apply(i, best, float(times[best]))
        if not changed:
            break
    return priced.gpu[rows]


class _SimulatedVariants:
    """F(S) of every single-tensor variant of a GPU-only choice, each by the Python event loop."""

    def __init__(self, priced: PricedOptions) -> None:
        self.priced = priced
        self.unit = functools.cache(lambda t, r: priced.unit(t, int(priced.gpu[r])))
        """Tensor t on GPU option row r, priced when first needed."""
        self.rows, self.time, self.simulations = np.zeros(0, np.int64), 0.0, 0

    def start(self, rows: np.ndarray) -> None:
        """Begin from GPU option rows ``rows``, one per tensor."""
        self.rows = rows.copy()
        self.time = self._simulate([self.unit(t, r) for t, r in enumerate(self.rows)])

    def _simulate(self, units: list[Unit]) -> float:
        self.simulations += 1
        profile, workers = self.priced.profile, self.priced.cluster.cpu_workers
        return iteration_time(units, forward_s=profile.forward_s, backward_s=profile.backward_s, cpu_workers=workers)

    def times_with(self, i: int) -> np.ndarray:
        """Iteration time with tensor ``i`` on each GPU option (a full simulation each)."""
        current = [self.unit(t, r) for t, r in enumerate(self.rows)]
        times = np.empty(len(self.priced.gpu))
        for r in range(len(times)):
            current[i] = self.unit(i, r)
            times[r] = self._simulate(current)
        return times

    def apply(self, i: int, row: int, seconds: float) -> None:
        self.rows[i], self.time = row, seconds


def _cpu_pass(priced: PricedOptions, choice: np.ndarray) -> np.ndarray:
    """Espresso Algorithm 2: how many GPU-compressed tensors of each (size, option) group go to the CPU.

    Steps:

    1. group the GPU-compressed tensors by (size, option); within a group the earliest-ready are
       offloaded first (Lemma 1), so a group's decision is a count;
    2. enumerate every count combination when there are at most ``EXACT_OFFLOAD_LIMIT``, else run
       coordinate descent over the groups, largest tensors first;
    3. return the choice with the fastest simulated iteration (ties: fewer offloads).
    """
    options = priced.options
    # Step 1: the groups of candidate tensors and their CPU options. Besides Espresso's candidates
    # (GPU-compressed tensors, moved to the CPU with the same scheme), large uncompressed tensors may
    # be compressed on the CPU with their cheapest CPU option: the GPU pass left them uncompressed
    # because GPU encoding would delay backward, which CPU compression does not.
    groups: dict[tuple[float, int], list[int]] = {}
    cheapest_cpu = _cheapest_cpu_options(priced)
    for i, k in enumerate(choice):
        if options[k].kind == "comp" and options[k].device == "gpu":
            target = priced.index[options[k].on("cpu")]
        elif options[k].kind != "comp" and cheapest_cpu is not None and priced.numel[i] >= MIN_CPU_EXTRA_NUMEL:
            target = int(cheapest_cpu[i])
        else:
            continue
        groups.setdefault((float(priced.numel[i]), target), []).append(i)
    if not groups:
        return choice
    keys = sorted(groups, key=lambda key: (-key[0], key[1]))
    members = [sorted(groups[key], key=lambda t: (priced.ready[t], t)) for key in keys]
    on_cpu = [key[1] for key in keys]

    @functools.cache  # coordinate descent revisits count tuples; each is a full simulation
    def evaluate(counts: tuple[int, ...]) -> float:
        trial = choice.copy()
        for group, count, target in zip(members, counts, on_cpu, strict=True):
            trial[group[:count]] = target
        return priced.iteration_s(trial)

    # Step 2: exhaustive or coordinate descent.
    sizes = [len(group) for group in members]
    if math.prod(size + 1 for size in sizes) <= EXACT_OFFLOAD_LIMIT:
        combos = itertools.product(*(range(size + 1) for size in sizes))
        best = min(combos, key=lambda counts: (evaluate(counts), sum(counts)))
    else:
        best = _coordinate_descent(evaluate, sizes)
    # Step 3: apply.
    choice = choice.copy()
    for g, (group, count) in enumerate(zip(members, best, strict=True)):
        for i in group[:count]:
            choice[i] = on_cpu[g]
    return choice


def _joint_pass(priced: PricedOptions, choice: np.ndarray) -> np.ndarray:
    """Local search over the whole option space (GPU and CPU) from ``choice``, by full simulation.

    Algorithms 1 and 2 decide GPU compression first and offloading second; the best mix can need a
    tensor moved between fp16, GPU and CPU compression, and a scheme or level changed on the way
    (on GPT-2 with EF-signSGD the two passes stop 4-5 % above what this finds). Every tensor of at
    least ``MIN_JOINT_NUMEL`` elements, largest first (ties latest in backward first, Property 2),
    takes in turn the option with the fastest simulated iteration, others fixed; sweeps repeat until
    one changes nothing (at most ``MAX_JOINT_SWEEPS``). Each trial re-runs the event loop compiled by
    ``zensync.planner._compiled_timeline`` (identical to ``simulator.iteration_time``).
    """
    candidates = [i for i in range(len(choice)) if priced.numel[i] >= MIN_JOINT_NUMEL]
    if not candidates:
        return choice
    candidates.sort(key=lambda t: (-priced.numel[t], -t))
    choice = choice.astype(np.int64)  # a copy: descend updates it in place
    timeline.descend(
        priced.profile.forward_s,
        priced.profile.backward_s,
        priced.ready,
        *priced.stage_arrays,
        choice,
        np.array(candidates, np.int64),
        priced.cluster.cpu_workers,
        MAX_JOINT_SWEEPS,
        _EPS,
    )
    return choice


def _cheapest_cpu_options(priced: PricedOptions) -> np.ndarray | None:
    """Per tensor, the CPU-compressed option with the least work after the ready time (None: no CPU options)."""
    cpu = [k for k, option in enumerate(priced.options) if option.device == "cpu" and option.kind == "comp"]
    if not cpu:
        return None
    after_ready = np.stack([sum(seconds for _, seconds in priced.costs[k].stages) for k in cpu])
    return np.array(cpu)[np.argmin(after_ready, axis=0)]


def _coordinate_descent(evaluate: Callable[[tuple[int, ...]], float], sizes: list[int]) -> tuple[int, ...]:
    """Per group in turn, the best count with the others fixed; sweeps until nothing changes."""
    counts = [0] * len(sizes)
    current = evaluate(tuple(counts))
    for _ in range(MAX_OFFLOAD_SWEEPS):
        changed = False
        for g, size in enumerate(sizes):
            for count in range(size + 1):
                if count == counts[g]:
                    continue
                trial = [*counts[:g], count, *counts[g + 1 :]]
                value = evaluate(tuple(trial))
                if value < current - _EPS:
                    counts, current, changed = trial, value, True
        if not changed:
            break
    return tuple(counts)


def plan(
    profile: ModelProfile,
    cluster: ClusterSpec,
    compressor_model: CompressorModel,
    *,
    cpu_offload: bool = False,
    two_level: bool = False,
    fusion: bool = True,
    gpu_compression: bool = True,
    schemes: tuple[Scheme, ...] = SCHEMES,
    hierarchical: bool = True,
) -> Plan:
    """Choose an option (and fusion group) for every tensor of ``profile``.

    Steps:

    1. price every candidate option for every tensor; the float32 baseline takes, per tensor, the
       faster of flat and two-level allreduce (fp16 likewise);
    2. Espresso Algorithm 1 from float32: GPU compression, tensor by tensor (``_gpu_pass``);
    3. with ``cpu_offload``, Espresso Algorithm 2 (``_cpu_pass``) on Step 2's choice gives a second
       candidate, and a joint local search over GPU and CPU options (``_joint_pass``) from the
       faster of the two a third;
    4. with ``fusion``, Cupcake-style fusion of each candidate, kept only if the simulator says it
       is not slower; the faster candidate wins; with ``cpu_offload`` and ``gpu_compression``, the
       plan of the CPU-only space (this function with ``gpu_compression=False``) competes too;
    5. simulate the plan, both baselines and the zero-cost upper bound; fall back to the faster
       baseline when the plan is predicted slower than it.

    Args:
        profile: Tensors in backward order with ready times.
        cluster: Nodes, GPUs, links, CPU workers.
        compressor_model: The compressor to plan for (``compressor_model("dgc:0.01")`` or explicit).
        cpu_offload: Allow compression on the CPU workers.
        two_level: Allow compressing the intra-node phase too (``hier2`` options).
        fusion: Fuse consecutive tensors.
        gpu_compression: Allow compression on the GPU (with ``cpu_offload`` and without this, compression
            runs on the CPU only; without either, the plan mixes fp32 and fp16 allreduce).
        schemes: Schemes allowed for compressed options (``("ar",)``: allreduce-compatible only).
        hierarchical: Allow two-level communication; False keeps every option flat, baselines included.

    The last three restrict the option space (Espresso's ablation, reference/espresso.md 1.7); the
    plan file records the options chosen, not the restrictions (``Plan.flags`` names the first three).

    Returns:
        The ``Plan`` (``selection_s`` is this call's wall time).

    Example::

        result = plan(profile, ClusterSpec.from_strings(nodes=8, gpus_per_node=8, inter="25Gbit"), model)
        result.predicted.plan_s <= min(result.predicted.fp32_s, result.predicted.fp16_s)  # True
    """
    started = time.perf_counter()
    # Step 1: prices and baselines.
    devices: list[Device] = ["gpu"] if gpu_compression else []
    devices += ["cpu"] if cpu_offload else []
    priced = PricedOptions(
        profile,
        cluster,
        compressor_model,
        devices=tuple(devices),
        two_level=two_level,
        schemes=schemes,
        hierarchical=hierarchical,
    )
    baselines = _Baselines.of(priced)
    # Steps 2-4: Algorithms 1 and 2, the joint search, fusion.
    strategy, plan_s = _search(priced, cpu_offload, fusion)
    # Step 4b: the CPU-only space's plan competes too (module docstring), as that space's plan() would
    # return it (after its own baseline fallback), from the prices already computed.
    if cpu_offload and gpu_compression:
        cpu_strategy, cpu_s, _ = baselines.fallback(*_search(priced.without_gpu_compression(), True, fusion))
        if cpu_s < plan_s - _EPS:
            strategy, plan_s = cpu_strategy, cpu_s
    # Step 5: baselines, upper bound, fallback.
    return _finish(priced, strategy, plan_s, baselines, started, cpu_offload, two_level, fusion)


def espresso_algorithm1(
    profile: ModelProfile, cluster: ClusterSpec, compressor_model: CompressorModel, *, full_timeline: bool = True
) -> tuple[Strategy, int]:
    """Espresso's Algorithm 1 as the paper states it (reference/espresso.md 1.5), for timing and checks.

    From float32 everywhere, one pass over the tensors in Property 2's order (Property 1's pruning as
    in ``plan``), each tensor taking the GPU option (flat or hierarchical, inter-node compression only)
    with the fastest iteration F(S), each single-tensor variant simulated in full by the Python event
    loop (``simulator.iteration_time``). ``plan`` runs the same pass with the O(1) max-plus price
    (``full_timeline=False`` here), then ``REFINE_SWEEPS`` more, CPU offload and fusion.

    Args:
        profile: Tensors in backward order with ready times.
        cluster: The cluster.
        compressor_model: The compressor.
        full_timeline: Price each variant by a full simulation (False: by the O(1) max-plus price).

    Returns:
        One option per tensor (unfused), and the number of full simulations run (0 without ``full_timeline``).

    Example::

        strategy, simulations = espresso_algorithm1(profile, cluster, compressor_model("dgc:0.01"))
        simulate(profile, cluster, model, strategy).iteration_s
    """
    priced = PricedOptions(profile, cluster, compressor_model)
    simulated = _SimulatedVariants(priced) if full_timeline else None
    choice = _gpu_pass(priced, priced.best_level("fp32"), sweeps=1, simulated=simulated)
    return _strategy(priced, choice, None), 0 if simulated is None else simulated.simulations


def _search(priced: PricedOptions, cpu_offload: bool, fusion: bool) -> tuple[Strategy, float]:
    """Steps 2-4 of ``plan`` in ``priced``'s option space: the fastest candidate, fused, with its time."""
    fp32 = priced.best_level("fp32")
    # Step 2: Algorithm 1.
    candidates = [_gpu_pass(priced, fp32)]
    # Step 3: Algorithm 2, as a second candidate (so offloading can never make the plan slower).
    if cpu_offload:
        offloaded = _cpu_pass(priced, candidates[0])
        if not np.array_equal(offloaded, candidates[0]):
            candidates.append(offloaded)
        # Step 3b: the joint local search from each; a choice reached twice is fused and simulated once.
        for start in list(candidates):
            joint = _joint_pass(priced, start)
            if not any(np.array_equal(joint, seen) for seen in candidates):
                candidates.append(joint)
    # Step 4: fusion of each candidate, kept only if the simulator agrees it is not slower.
    return min((_fused(priced, choice, fusion) for choice in candidates), key=lambda pair: pair[1])


@dataclasses.dataclass(frozen=True, slots=True)
class _Baselines:
    """Every tensor float32 (or fp16) allreduce at its faster level: the choices and simulated times."""

    fp32_s: float
    fp16_s: float
    strategies: tuple[Strategy, Strategy]

    @classmethod
    def of(cls, priced: PricedOptions) -> _Baselines:
        fp32, fp16 = priced.best_level("fp32"), priced.best_level("fp16")
        strategies = (_strategy(priced, fp32, None), _strategy(priced, fp16, None))
        return cls(priced.iteration_s(fp32), priced.iteration_s(fp16), strategies)

    def fallback(self, strategy: Strategy, plan_s: float) -> tuple[Strategy, float, str]:
        """The faster baseline when ``plan_s`` is slower than it, else the plan: (strategy, seconds, chosen)."""
        if plan_s <= min(self.fp32_s, self.fp16_s):
            return strategy, plan_s, "search"
        if self.fp32_s <= self.fp16_s:
            return self.strategies[0], self.fp32_s, "fp32"
        return self.strategies[1], self.fp16_s, "fp16"


def _fused(priced: PricedOptions, choice: np.ndarray, fusion: bool) -> tuple[Strategy, float]:
    """The choice as a strategy, fused when ``fusion`` and not slower; with its simulated time."""
    strategy = _strategy(priced, choice, None)
    plan_s = priced.iteration_s(choice)
    if fusion:
        on_cpu = any(priced.options[k].device == "cpu" for k in choice)
        if on_cpu:
            fused, groups = fuse_simulated(priced, choice)
        elif len(choice) <= EXACT_FUSION_MAX_TENSORS:
            fused, groups = fuse_optimal(priced, choice)
        else:
            fused, groups = fuse_gpu(priced, choice)
        fused_strategy = _strategy(priced, fused, groups)
        fused_s = _simulate(priced, fused_strategy)
        if fused_s <= plan_s:
            return fused_strategy, fused_s
    return strategy, plan_s


def _strategy(priced: PricedOptions, choice: np.ndarray, groups: list[int] | None) -> Strategy:
    return Strategy(options=tuple(priced.options[k] for k in choice), groups=None if groups is None else tuple(groups))


def _simulate(priced: PricedOptions, strategy: Strategy, upper_bound: bool = False) -> float:
    result = simulate(
        priced.profile, priced.cluster, priced.model, strategy, upper_bound=upper_bound, record_events=False
    )
    return result.iteration_s


def _upper_bound(priced: PricedOptions, strategy: Strategy) -> float:
    """Zero-cost compression: per tensor the option with the shortest comm is optimal among unfused
    strategies (the comm end is monotone in each duration); the plan's own strategy at zero cost
    covers fusion. The minimum bounds every strategy considered from below."""
    bound = priced.gpu_upper_bound()
    best_s = bound.iteration_s(np.argmin(bound.comm, axis=0))  # the compiled event loop, as simulate's
    return min(best_s, _simulate(priced, strategy, upper_bound=True))


def _finish(
    priced: PricedOptions,
    strategy: Strategy,
    plan_s: float,
    baselines: _Baselines,
    started: float,
    cpu_offload: bool,
    two_level: bool,
    fusion: bool,
) -> Plan:
    """Step 5 of ``plan``: predictions, fallback to the faster baseline, the ``Plan``."""
    upper_s = _upper_bound(priced, strategy)
    strategy, plan_s, chosen = baselines.fallback(strategy, plan_s)
    groups = strategy.groups if strategy.groups is not None else tuple(range(len(strategy.options)))
    tensors = tuple(
        PlanTensor(name=t.name, numel=t.numel, option=option, group=group)
        for t, option, group in zip(priced.profile.tensors, strategy.options, groups, strict=True)
    )
    predicted = Predictions(plan_s=plan_s, fp32_s=baselines.fp32_s, fp16_s=baselines.fp16_s, upper_bound_s=upper_s)
    return Plan(
        model=priced.profile.model,
        cluster=priced.cluster,
        compressor=priced.model.spec,
        tensors=tensors,
        predicted=predicted,
        selection_s=time.perf_counter() - started,
        chosen=chosen,
        flags={"cpu_offload": cpu_offload, "two_level": two_level, "fusion": fusion},
    )

"""Cupcake (MLSys'23; reference/espresso.md 2): the fastest fusion of compressed gradients into contiguous groups.

What is Cupcake's (from the paper's abstract and the zhuangwang93/Cupcake code, reference/espresso.md 2):

- the problem: layer-wise compression pays one compress/decompress overhead per tensor; Cupcake cuts the
  gradients, in backward order, into contiguous groups, compresses each group once when its last
  gradient is ready and communicates the groups in order, and chooses the cuts that maximise
  throughput ("provably optimal fusion strategy");
- the code's partition: ``fusion_num`` groups of equal tensor count (``equal_count_cuts``; 0 means
  layer-wise), the cut index tuned online by measuring iteration times (``scheduler/``, called
  obsolete in its README).

The paper's own algorithm and proof were not available to us (neither the PDF nor the scheduler source
is in the corpora searched), so the optimiser here is ours: an exact dynamic programme over cut points
in backward order under this planner's timeline (``simulator.py``). It is optimal for the model it
prices with, which is how we read Cupcake's claim; it is not a transcription of the paper's algorithm.

The timeline of GPU options (``options.option_costs``): group g, made of tensors ``i..j-1``, has encode
``e`` charged to the compute stream, a ``wait`` ``w`` (at most ``e``) and a comm time ``d``; it joins
the one FIFO comm stream at ``c = forward + ready[j-1] + E + w`` where E is the encode of the groups
before it, so the stream serves groups in order and ``C' = max(C, c) + d``. The iteration takes
``max(forward + backward + E_total, C_last)``. After a cut the future depends only on ``(E, C)`` and
both enter monotonically (max and +), so a prefix ending at a cut can be dropped when another prefix
ending at the same cut has E and C both no larger: keeping the Pareto front at every cut is exact.
Cost: O(n^2) spans priced and stored (``[n, n + 1]`` arrays: ResNet-101's 314 tensors, 50k spans),
then O(n x labels kept) work (0.05 s for ResNet-101 on one CPU core). Whether the paper's cost model
matches ours (e.g. encode charged to the compute stream, one FIFO comm stream) is not known to us.

Example::

    fusion = cupcake_fusion(profile, cluster, model, TensorOption(kind="comp", scheme="ag"))
    fusion.cuts, fusion.iteration_s
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from zensync.cost import FP16_MODEL, CompressorModel, FloatArray
from zensync.planner.cluster import ClusterSpec
from zensync.planner.options import TensorOption, option_costs
from zensync.planner.profile import ModelProfile
from zensync.planner.simulator import Strategy, iteration_time, price_units

__all__ = [
    "MAX_BRUTE_FORCE_TENSORS",
    "CupcakeFusion",
    "SpanCosts",
    "brute_force_fusion",
    "cupcake_fusion",
    "equal_count_cuts",
    "fusion_iteration_s",
    "groups_from_cuts",
    "optimal_partition",
    "uniform_span_costs",
]

MAX_BRUTE_FORCE_TENSORS = 16
"""``brute_force_fusion`` simulates 2**(L-1) partitions; 16 tensors is 32,768 simulations."""
_WAIT_SLACK_S = 1e-15
"""Seconds: float noise allowed when checking wait <= encode (the FIFO-order precondition)."""
_PRUNE_SLACK = 1e-12
"""Relative slack on the no-fusion upper bound, so float noise never prunes the optimum."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SpanCosts:
    """Every contiguous span ``start..end-1`` priced as one group; arrays ``[n, n + 1]`` indexed ``[start, end]``."""

    compute_s: FloatArray
    """Encode charged to the compute stream when the group is ready."""
    wait_s: FloatArray
    """Kernels before the first collective (no shared resource); at most ``compute_s``."""
    comm_s: FloatArray
    """Time on the FIFO comm stream (collectives and the kernels between and after them)."""
    valid: np.ndarray
    """Bool: the span may form one group (``end > start``; and, for mixed options, fusable)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CupcakeFusion:
    """A fusion of the tensors (backward order) into contiguous groups, with its simulated time."""

    cuts: tuple[int, ...]
    """First tensor index of every group but the first, increasing; ``()`` fuses everything."""
    groups: tuple[int, ...]
    """Group id of each tensor (0, 0, 1, ...), as ``Strategy.groups`` takes them."""
    iteration_s: float
    """Iteration time of this fusion under ``simulator.simulate`` (seconds)."""
    num_labels: int
    """Pareto labels the dynamic programme kept (its work), or partitions enumerated (brute force)."""


def groups_from_cuts(num_tensors: int, cuts: tuple[int, ...]) -> tuple[int, ...]:
    """Group ids of ``num_tensors`` tensors cut before each index in ``cuts``.

    Example::

        groups_from_cuts(5, (2, 3))  # (0, 0, 1, 2, 2)
    """
    if any(not 0 < c < num_tensors for c in cuts) or list(cuts) != sorted(set(cuts)):
        raise ValueError(f"cuts={cuts} must be increasing indices in 1..{num_tensors - 1} (num_tensors={num_tensors})")
    bounds = [0, *cuts, num_tensors]
    return tuple(g for g, (a, b) in enumerate(itertools.pairwise(bounds)) for _ in range(a, b))


def equal_count_cuts(num_tensors: int, num_groups: int) -> tuple[int, ...]:
    """Cupcake's code default: ``num_groups`` groups of ``num_tensors // num_groups`` tensors (the last takes the rest).

    Example::

        equal_count_cuts(10, 3)  # (3, 6)
    """
    if not 1 <= num_groups <= num_tensors:
        raise ValueError(f"num_groups={num_groups} must be in 1..num_tensors={num_tensors}")
    step = num_tensors // num_groups
    return tuple(step * k for k in range(1, num_groups))


def optimal_partition(
    ready_s: FloatArray, spans: SpanCosts, *, forward_s: float, backward_s: float
) -> tuple[tuple[int, ...], float, int]:
    """The contiguous partition with the shortest iteration, by dynamic programming over cut points.

    Steps:

    1. upper bound: every tensor alone (always valid), priced by the same recurrence;
    2. for each cut ``end`` = 1..n in backward order, extend every kept label ``(E, C)`` at a cut
       ``start < end`` by the group ``start..end-1``: ``E' = E + e``, ``C' = max(C, c) + d``;
    3. drop labels whose bound ``max(forward + backward + E', C')`` exceeds the upper bound (E and C
       only grow), then keep the Pareto front of ``(E', C')`` (exact: see the module docstring);
    4. at ``end = n`` take the label with the smallest ``max(forward + backward + E, C)``; backtrack.

    Args:
        ready_s: Ready time of each tensor (seconds after the start of backward), non-decreasing.
        spans: Every span priced as one group.
        forward_s: Forward duration.
        backward_s: Backward duration without encode delays.

    Returns:
        (cuts, iteration seconds under the recurrence, labels kept).

    Raises:
        ValueError: If a valid span waits longer than it encodes (the comm queue would not be in group order).
    """
    n = len(ready_s)
    wait_excess = np.where(spans.valid, spans.wait_s - spans.compute_s, 0.0)
    if float(wait_excess.max()) > _WAIT_SLACK_S:
        raise ValueError(
            f"optimal_partition: a span waits {float(wait_excess.max()):.3g} s longer than it encodes; the recurrence "
            f"assumes wait <= encode so the comm queue is fed in group order (GPU options only; use fuse_simulated)"
        )
    # Step 1: every tensor alone.
    e_sum, c_end = 0.0, -np.inf
    for k in range(n):
        request = forward_s + ready_s[k] + e_sum + spans.wait_s[k, k + 1]
        c_end = max(c_end, request) + spans.comm_s[k, k + 1]
        e_sum += spans.compute_s[k, k + 1]
    upper = max(forward_s + backward_s + e_sum, c_end) * (1 + _PRUNE_SLACK)
    label_e, label_c = np.zeros(1), np.full(1, -np.inf)
    label_pos, label_parent = np.zeros(1, np.int64), np.full(1, -1, np.int64)
    for end in range(1, n + 1):
        # Step 2: extend every label by the group ending at this cut.
        src = np.flatnonzero(spans.valid[label_pos, end])
        start = label_pos[src]
        request = forward_s + ready_s[end - 1] + label_e[src] + spans.wait_s[start, end]
        c_new = np.maximum(label_c[src], request) + spans.comm_s[start, end]
        e_new = label_e[src] + spans.compute_s[start, end]
        # Step 3: bound, then the Pareto front (sorted by E then C; keep each C below all before it).
        keep = np.maximum(forward_s + backward_s + e_new, c_new) <= upper
        src, e_new, c_new = src[keep], e_new[keep], c_new[keep]
        order = np.lexsort((c_new, e_new))
        c_sorted = c_new[order]
        best_before = np.minimum.accumulate(np.concatenate(([np.inf], c_sorted[:-1])))
        front = order[c_sorted < best_before]
        label_e = np.concatenate((label_e, e_new[front]))
        label_c = np.concatenate((label_c, c_new[front]))
        label_pos = np.concatenate((label_pos, np.full(len(front), end, np.int64)))
        label_parent = np.concatenate((label_parent, src[front]))
    # Step 4: the best complete partition, and its cuts.
    final = np.flatnonzero(label_pos == n)
    totals = np.maximum(forward_s + backward_s + label_e[final], label_c[final])
    best = int(final[np.argmin(totals)])
    cuts, label = [], int(label_parent[best])
    while label > 0:
        cuts.append(int(label_pos[label]))
        label = int(label_parent[label])
    return tuple(reversed(cuts)), float(totals.min()), len(label_e)


def uniform_span_costs(
    profile: ModelProfile,
    cluster: ClusterSpec,
    model: CompressorModel,
    option: TensorOption,
    *,
    fp16_model: CompressorModel = FP16_MODEL,
) -> SpanCosts:
    """Every span of ``profile`` priced under one GPU ``option`` (one vectorised ``option_costs`` call)."""
    if option.device != "gpu":
        raise ValueError(f"option {option.code!r}: Cupcake fusion here prices GPU options only (device='gpu')")
    n = len(profile.tensors)
    cum_numel = np.concatenate(([0.0], np.cumsum([float(t.numel) for t in profile.tensors])))
    start, end = np.triu_indices(n + 1, k=1)
    costs = option_costs(
        option,
        cum_numel[end] - cum_numel[start],
        cluster,
        model,
        dtype_bytes=profile.dtype_bytes,
        fp16_model=fp16_model,
        cache={},
    )
    (wait_name, wait), (comm_name, comm) = costs.stages
    assert (wait_name, comm_name) == ("wait", "comm"), costs.stages  # GPU options run (wait, comm)
    matrices = [np.zeros((n, n + 1)) for _ in range(3)]
    for matrix, values in zip(matrices, (costs.compute_s, wait, comm), strict=True):
        matrix[start, end] = values
    valid = np.zeros((n, n + 1), bool)
    valid[start, end] = True
    return SpanCosts(compute_s=matrices[0], wait_s=matrices[1], comm_s=matrices[2], valid=valid)


def fusion_iteration_s(
    profile: ModelProfile,
    cluster: ClusterSpec,
    model: CompressorModel,
    option: TensorOption,
    cuts: tuple[int, ...],
    *,
    fp16_model: CompressorModel = FP16_MODEL,
) -> float:
    """Iteration time of every tensor under ``option``, fused at ``cuts``, by ``simulator.simulate``'s event loop.

    ``cuts=tuple(range(1, n))`` is layer-wise compression (every tensor alone).
    """
    n = len(profile.tensors)
    strategy = Strategy(options=(option,) * n, groups=groups_from_cuts(n, cuts))
    units = price_units(profile, cluster, model, strategy, fp16_model=fp16_model)
    return iteration_time(
        units, forward_s=profile.forward_s, backward_s=profile.backward_s, cpu_workers=cluster.cpu_workers
    )


def cupcake_fusion(
    profile: ModelProfile,
    cluster: ClusterSpec,
    model: CompressorModel,
    option: TensorOption,
    *,
    fp16_model: CompressorModel = FP16_MODEL,
) -> CupcakeFusion:
    """The fastest contiguous fusion of every tensor compressed with ``option`` (``optimal_partition``).

    Args:
        profile: Tensors in backward order, with ready times.
        cluster: The cluster.
        model: The compressor of ``comp`` options.
        option: A GPU option applied to every tensor/group (e.g. ``TensorOption(kind="comp", scheme="ag")``).
        fp16_model: The compressor of ``fp16`` options.

    Returns:
        The ``CupcakeFusion``; ``iteration_s`` is re-simulated by the event loop, not the recurrence.

    Example::

        cupcake_fusion(profile, cluster, model, TensorOption(kind="comp", scheme="ag")).iteration_s
    """
    spans = uniform_span_costs(profile, cluster, model, option, fp16_model=fp16_model)
    ready = np.array([t.ready_s for t in profile.tensors])
    cuts, _, num_labels = optimal_partition(ready, spans, forward_s=profile.forward_s, backward_s=profile.backward_s)
    return CupcakeFusion(
        cuts=cuts,
        groups=groups_from_cuts(len(ready), cuts),
        iteration_s=fusion_iteration_s(profile, cluster, model, option, cuts, fp16_model=fp16_model),
        num_labels=num_labels,
    )


def brute_force_fusion(
    profile: ModelProfile,
    cluster: ClusterSpec,
    model: CompressorModel,
    option: TensorOption,
    *,
    fp16_model: CompressorModel = FP16_MODEL,
) -> CupcakeFusion:
    """The fastest of all 2**(L-1) contiguous fusions, each simulated (the oracle for ``cupcake_fusion``).

    Ties go to the partition enumerated first (fewest cuts, then lexicographically smallest).

    Raises:
        ValueError: If the profile has more than ``MAX_BRUTE_FORCE_TENSORS`` tensors.
    """
    n = len(profile.tensors)
    if n > MAX_BRUTE_FORCE_TENSORS:
        raise ValueError(
            f"brute_force_fusion: {n} tensors means 2**{n - 1} partitions; at most MAX_BRUTE_FORCE_TENSORS="
            f"{MAX_BRUTE_FORCE_TENSORS}"
        )
    best: tuple[float, tuple[int, ...]] = (np.inf, ())
    for count in range(n):
        for cuts in itertools.combinations(range(1, n), count):
            seconds = fusion_iteration_s(profile, cluster, model, option, cuts, fp16_model=fp16_model)
            if seconds < best[0]:
                best = (seconds, cuts)
    return CupcakeFusion(
        cuts=best[1], groups=groups_from_cuts(n, best[1]), iteration_s=best[0], num_labels=2 ** (n - 1)
    )

"""Cupcake-style fusion (reference/espresso.md 2): consecutive tensors compressed and sent as one group.

One greedy left-to-right pass: a tensor joins the group before it when that does not slow the
simulated iteration and either speeds it up or lowers the total work. Groups are runs of one
compressed option; on the GPU a float32 tensor may join a compressed group (taking its option).
The greedy passes claim no optimality; ``fuse_optimal`` is the exact counterpart of ``fuse_gpu``
(the dynamic programme of ``zensync.planner.cupcake``, ours: Cupcake's own algorithm is not transcribed).
"""

from __future__ import annotations

import numpy as np

from zensync.cost import FloatArray
from zensync.planner._pricing import PricedOptions
from zensync.planner.cupcake import SpanCosts, groups_from_cuts, optimal_partition
from zensync.planner.options import TensorOption
from zensync.planner.simulator import Unit, iteration_time

__all__ = ["fuse_gpu", "fuse_optimal", "fuse_simulated"]

_EPS = 1e-12
"""Seconds: a merge must gain more than this (float noise) to count as faster."""
_FUSION_WINDOW = 64
"""Fused-group sizes priced at once when a group starts (more are priced on demand)."""


def _merge_option(options: tuple[TensorOption, ...], group_option: int, tensor_option: int) -> int | None:
    """The option (index) of a group extended by the next tensor, or None when they may not be fused."""
    a, b = options[group_option], options[tensor_option]
    if a.device == "cpu" or b.device == "cpu":
        return group_option if group_option == tensor_option else None
    if group_option == tensor_option:
        return group_option if a.kind != "fp32" else None
    if a.kind == "comp" and b.kind == "fp32":
        return group_option
    if a.kind == "fp32" and b.kind == "comp":
        return tensor_option
    return None


class _SpanPricer:
    """(compute, wait, comm) of tensors ``start..end`` fused under one GPU option, priced in batches."""

    def __init__(self, priced: PricedOptions) -> None:
        self.priced = priced
        self.cum_numel = np.concatenate(([0.0], np.cumsum(priced.numel)))
        self.batches: dict[tuple[int, int], tuple[FloatArray, FloatArray, FloatArray]] = {}

    def costs(self, option_index: int, start: int, end: int) -> tuple[float, float, float]:
        length = end - start + 1
        batch = self.batches.get((option_index, start))
        if batch is None or len(batch[0]) < length:
            stop = min(len(self.priced.numel), start + max(_FUSION_WINDOW, 2 * length))
            numel = self.cum_numel[start + 1 : stop + 1] - self.cum_numel[start]
            costs = self.priced.price(self.priced.options[option_index], numel)
            batch = (costs.compute_s, costs.stages[0][1], costs.stages[1][1])
            self.batches = {(option_index, start): batch}
        return float(batch[0][length - 1]), float(batch[1][length - 1]), float(batch[2][length - 1])


def fuse_gpu(priced: PricedOptions, choice: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """One left-to-right fusion pass over a GPU-only choice, each merge priced in O(1).

    Steps:

    1. the max-plus quantities of the unfused timeline (arrivals, suffix sums and maxima);
    2. for each next tensor that may join the current group (``_merge_option``), compare the
       iteration time with and without the merge: groups before the current one shift by the change
       in comm time, untouched later tensors by the change in encode time;
    3. merge when not slower and (faster or less total work), else close the group.
    """
    n, options = len(choice), priced.options
    rows = np.array([priced.gpu_row(k) for k in choice])
    e, w, d = (table[rows, np.arange(n)] for table in (priced.compute, priced.wait, priced.comm))
    # Step 1: unfused quantities; suffix arrays have a sentinel at n.
    ready, forward, backward = priced.ready, priced.profile.forward_s, priced.profile.backward_s
    e_before = np.cumsum(e) - e
    e_total = float(e.sum())
    suffix_d = np.append(np.cumsum(d[::-1])[::-1], 0.0)
    x = ready + e_before + w + suffix_d[:n]
    suffix_x = np.append(np.maximum.accumulate(x[::-1])[::-1], -np.inf)
    spans = _SpanPricer(priced)
    groups, group_options = [0] * n, [int(choice[0])]
    start, ge, gw, gd = 0, float(e[0]), float(w[0]), float(d[0])
    before, e_groups = -np.inf, 0.0  # max arrival+work of closed groups; their encode total
    for nxt in range(1, n):
        # Step 2: with and without the merge.
        merged = _merge_option(options, group_options[-1], int(choice[nxt]))
        if merged is not None:
            shift = e_groups + ge - e_before[nxt]
            rest = suffix_x[nxt + 1] + shift
            x_group = ready[nxt - 1] + e_groups + gw + gd + suffix_d[nxt]
            now = forward + max(backward + e_total + shift, before, x_group, x[nxt] + shift, rest)
            em, wm, dm = spans.costs(merged, start, nxt)
            de, dd = em - ge - e[nxt], dm - gd - d[nxt]
            x_merged = ready[nxt] + e_groups + wm + dm + suffix_d[nxt + 1]
            new = forward + max(backward + e_total + shift + de, before + dd, x_merged, rest + de)
            # Step 3: merge, or close the group.
            if new < now - _EPS or (new <= now and de + dd < 0):
                before, (ge, gw, gd) = before + dd, (em, wm, dm)
                groups[nxt], group_options[-1] = groups[nxt - 1], merged
                continue
        before = max(before, ready[nxt - 1] + e_groups + gw + gd + suffix_d[nxt])
        e_groups += ge
        groups[nxt] = groups[nxt - 1] + 1
        group_options.append(int(choice[nxt]))
        start, ge, gw, gd = nxt, float(e[nxt]), float(w[nxt]), float(d[nxt])
    fused = np.array([group_options[g] for g in groups])
    return fused, groups


def _group_unit(priced: PricedOptions, option_index: int, start: int, end: int) -> Unit:
    """The unit of tensors ``start..end - 1`` fused under one option."""
    numel = np.array([float(priced.numel[start:end].sum())])
    costs, option = priced.price(priced.options[option_index], numel), priced.options[option_index]
    kernel_s = float(costs.kernel_s[0])
    label = priced.profile.tensors[start].name + (f"+{end - start - 1}" if end - start > 1 else "")
    return Unit(
        label=label,
        ready_s=float(priced.ready[end - 1]),
        compute_s=float(costs.compute_s[0]),
        stages=tuple((resource, float(seconds[0])) for resource, seconds in costs.stages),
        gpu_kernel_s=kernel_s if option.device == "gpu" else 0.0,
        cpu_kernel_s=kernel_s if option.device == "cpu" else 0.0,
    )


def fuse_simulated(priced: PricedOptions, choice: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Left-to-right fusion of equal consecutive compressed options, each merge checked by simulation.

    Used when some tensors are compressed on the CPU (the O(1) pricing of ``fuse_gpu`` assumes the
    comm queue is fed in backward order, which CPU stages break).
    """
    profile, options = priced.profile, priced.options
    units = [priced.unit(i, int(k)) for i, k in enumerate(choice)]
    spans = [(i, i + 1) for i in range(len(choice))]

    def run(candidate: list[Unit]) -> float:
        return iteration_time(
            candidate,
            forward_s=profile.forward_s,
            backward_s=profile.backward_s,
            cpu_workers=priced.cluster.cpu_workers,
        )

    current, g = run(units), 0
    while g + 1 < len(spans):
        k, (a, _), (_, b) = int(choice[spans[g][0]]), spans[g], spans[g + 1]
        if options[k].kind != "fp32" and int(choice[spans[g + 1][0]]) == k:
            merged = _group_unit(priced, k, a, b)
            trial = [*units[:g], merged, *units[g + 2 :]]
            value = run(trial)
            work = (
                merged.gpu_kernel_s
                + merged.cpu_kernel_s
                - sum(u.gpu_kernel_s + u.cpu_kernel_s for u in units[g : g + 2])
            )
            if value < current - _EPS or (value <= current and work < 0):
                units, current = trial, value
                spans[g : g + 2] = [(a, b)]
                continue
        g += 1
    groups = [g for g, (a, b) in enumerate(spans) for _ in range(a, b)]
    return choice, groups


def _span_options(options: tuple[TensorOption, ...], choice: np.ndarray) -> np.ndarray:
    """``[n, n + 1]``: the option index a span ``start..end-1`` takes as one group, or -1 if it may not be one.

    A span of several tensors is a group when its non-fp32 options are one option X, and X is ``comp``
    where the span also holds fp32 tensors (every group ``fuse_gpu`` can build, and more).
    """
    n = len(choice)
    merged = np.full((n, n + 1), -1, np.int64)
    for start in range(n):
        merged[start, start + 1] = choice[start]
        first = options[int(choice[start])]
        single: int | None = None if first.kind == "fp32" else int(choice[start])
        has_fp32 = first.kind == "fp32"
        for end in range(start + 2, n + 1):
            k = int(choice[end - 1])
            if options[k].kind == "fp32":
                has_fp32 = True
            elif single is None:
                single = k
            elif single != k:
                break
            if single is not None and has_fp32 and options[single].kind != "comp":
                break
            if single is not None:
                merged[start, end] = single
    return merged


def fuse_optimal(priced: PricedOptions, choice: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """The fastest contiguous fusion of a GPU-only choice under the planner's timeline (exact; see ``cupcake``).

    Steps:

    1. the option each span would take as one group (``_span_options``);
    2. every valid span priced under its option, one vectorised call per option;
    3. ``cupcake.optimal_partition`` over the spans; each tensor takes its group's option.
    """
    options, n = priced.options, len(choice)
    if any(options[int(k)].device != "gpu" for k in choice):
        raise ValueError("fuse_optimal prices GPU options only; use fuse_simulated when some tensors run on the CPU")
    # Step 1: the option of each span.
    merged = _span_options(options, choice)
    # Step 2: prices.
    cum_numel = np.concatenate(([0.0], np.cumsum(priced.numel)))
    matrices = [np.zeros((n, n + 1)) for _ in range(3)]
    for option_index in np.unique(merged[merged >= 0]):
        start, end = np.nonzero(merged == option_index)
        costs = priced.price(options[int(option_index)], cum_numel[end] - cum_numel[start])
        for matrix, values in zip(matrices, (costs.compute_s, costs.stages[0][1], costs.stages[1][1]), strict=True):
            matrix[start, end] = values
    spans = SpanCosts(compute_s=matrices[0], wait_s=matrices[1], comm_s=matrices[2], valid=merged >= 0)
    # Step 3: the partition.
    profile = priced.profile
    cuts, _, _ = optimal_partition(priced.ready, spans, forward_s=profile.forward_s, backward_s=profile.backward_s)
    groups = list(groups_from_cuts(n, cuts))
    starts, ends = (0, *cuts), (*cuts, n)
    fused = np.array([merged[starts[g], ends[g]] for g in groups])
    return fused, groups

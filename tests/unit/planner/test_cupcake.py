"""Cupcake fusion (``zensync.planner.cupcake``, ``_fusion.fuse_optimal``): exact against brute force.

Oracles: a 3-tensor case computed by hand (and re-checked by the simulator's event loop), and the
minimum over all 2**(L-1) contiguous partitions, each simulated, for random small models (Hypothesis).
The greedy pass (``fuse_gpu``) is never faster than the dynamic programme. Compressor models and
clusters are explicit, so nothing depends on the built-in profiles or the registered compressors.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from tests.unit.planner.test_search import resnet101_like
from zensync.cost import AffineCost, CompressorModel
from zensync.planner._fusion import _span_options, fuse_gpu, fuse_optimal
from zensync.planner._pricing import PricedOptions
from zensync.planner.cluster import ClusterSpec
from zensync.planner.cupcake import (
    MAX_BRUTE_FORCE_TENSORS,
    SpanCosts,
    brute_force_fusion,
    cupcake_fusion,
    equal_count_cuts,
    fusion_iteration_s,
    groups_from_cuts,
    optimal_partition,
)
from zensync.planner.options import TensorOption
from zensync.planner.profile import ModelProfile, TensorProfile
from zensync.planner.simulator import Strategy, Unit, iteration_time, simulate

REL_TOL = 1e-12
"""The recurrence and the event loop add the same floats in the same order (equal in practice); this
allows for a last-bit difference should numpy's vectorised sums ever round differently."""
DP_BOUND_S = 5.0
"""Generous CI bound for the 314-tensor dynamic programme (about 0.05 s unloaded)."""
COMP_AG = TensorOption(kind="comp", scheme="ag")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


# Hand-computed case: 3 tensors ready at 1, 2, 10 s (forward 0, backward 10); every group encodes in
# 0.5 s (charged to compute, and its wait), and communicates in 0.25 + 1 s per tensor.
#   alone:          comm ends 2.75, 4.25, 12.75; encode 1.5 -> max(11.5, 12.75) = 12.75
#   {0,1,2}:        request 10 + 0.5 = 10.5, comm 3.25 -> 13.75
#   {0,1},{2}:      request 2.5, ends 4.75; request 10 + 0.5 + 0.5 = 11, ends 12.25 -> 12.25 (best)
#   {0},{1,2}:      ends 2.75; request 11, comm 2.25 -> 13.25
HAND_READY_S = np.array([1.0, 2.0, 10.0])
HAND_BEST_S = 12.25


def _hand_spans() -> SpanCosts:
    n = len(HAND_READY_S)
    valid = np.triu(np.ones((n, n + 1), bool), k=1)
    count = np.arange(n + 1)[None, :] - np.arange(n)[:, None]
    encode = np.where(valid, 0.5, 0.0)
    return SpanCosts(compute_s=encode, wait_s=encode, comm_s=np.where(valid, 0.25 + count, 0.0), valid=valid)


def test_hand_computed_three_tensors() -> None:
    cuts, seconds, _ = optimal_partition(HAND_READY_S, _hand_spans(), forward_s=0.0, backward_s=10.0)
    assert cuts == (2,)
    assert seconds == HAND_BEST_S
    # The same fusion through the simulator's event loop.
    units = [
        Unit(label="g0", ready_s=2.0, compute_s=0.5, stages=(("wait", 0.5), ("comm", 2.25))),
        Unit(label="g1", ready_s=10.0, compute_s=0.5, stages=(("wait", 0.5), ("comm", 1.25))),
    ]
    assert iteration_time(units, forward_s=0.0, backward_s=10.0) == HAND_BEST_S


def test_cuts_and_groups() -> None:
    assert equal_count_cuts(10, 3) == (3, 6)
    assert equal_count_cuts(4, 1) == ()
    assert groups_from_cuts(5, (2, 3)) == (0, 0, 1, 2, 2)
    assert groups_from_cuts(3, ()) == (0, 0, 0)
    with pytest.raises(ValueError, match="cuts="):
        groups_from_cuts(3, (2, 1))
    with pytest.raises(ValueError, match="num_groups=5"):
        equal_count_cuts(4, 5)


def test_wait_longer_than_encode_is_refused() -> None:
    spans = _hand_spans()
    longer = SpanCosts(compute_s=spans.compute_s, wait_s=spans.wait_s * 2, comm_s=spans.comm_s, valid=spans.valid)
    with pytest.raises(ValueError, match="wait <= encode"):
        optimal_partition(HAND_READY_S, longer, forward_s=0.0, backward_s=10.0)


@st.composite
def small_cases(draw: st.DrawFn, max_tensors: int) -> tuple[ModelProfile, ClusterSpec, CompressorModel]:
    """A random model of 1..max_tensors tensors, compressor costs and cluster (every knob drawn)."""
    n = draw(st.integers(1, max_tensors))
    # Sizes log-uniform over 1..4M elements, so fixed and per-element costs both matter.
    numel = [round(4e6**u) for u in draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))]
    gaps = draw(st.lists(st.floats(0.0, 2e-3), min_size=n, max_size=n))
    ready = np.cumsum(gaps)
    tensors = tuple(
        TensorProfile(name=f"t{i}", shape=(x,), ready_s=float(r))
        for i, (x, r) in enumerate(zip(numel, ready, strict=True))
    )
    profile = ModelProfile(
        model="random",
        tensors=tensors,
        forward_s=draw(st.floats(0.0, 0.02)),
        backward_s=float(ready[-1]) + draw(st.floats(0.0, 0.01)),
    )
    model = CompressorModel.family(
        "dgc",
        bits_per_element=draw(st.floats(0.05, 16.0)),
        allreduce_compatible=draw(st.booleans()),
        gpu_compress=AffineCost(
            fixed_s=draw(st.floats(0.0, 1e-3)),
            per_element_s=draw(st.floats(0.0, 1e-9)),
            knee_elements=draw(st.integers(0, 2**21)),
        ),
        gpu_decompress=AffineCost(fixed_s=draw(st.floats(0.0, 1e-3)), per_element_s=draw(st.floats(0.0, 1e-9))),
    )
    cluster = ClusterSpec(
        nodes=draw(st.integers(1, 4)),
        gpus_per_node=draw(st.integers(1, 8)),
        intra_bandwidth_bytes_per_s=draw(st.floats(1e9, 5e10)),
        inter_bandwidth_bytes_per_s=draw(st.floats(1e9, 2e10)),
        inter_latency_s=draw(st.floats(0.0, 3e-4)),
    )
    return profile, cluster, model


def _cuts(groups: list[int]) -> tuple[int, ...]:
    return tuple(i for i in range(1, len(groups)) if groups[i] != groups[i - 1])


def _gpu_comp_options(priced: PricedOptions) -> list[int]:
    return [int(k) for k in priced.gpu if priced.options[k].kind == "comp"]


@settings(max_examples=examples(40), deadline=None)
@given(case=small_cases(max_tensors=8), pick=st.integers(0, 100))
def test_cupcake_equals_brute_force_and_beats_greedy(
    case: tuple[ModelProfile, ClusterSpec, CompressorModel], pick: int
) -> None:
    profile, cluster, model = case
    priced = PricedOptions(profile, cluster, model)
    comp = _gpu_comp_options(priced)
    k = comp[pick % len(comp)]
    option = priced.options[k]
    fusion = cupcake_fusion(profile, cluster, model, option)
    brute = brute_force_fusion(profile, cluster, model, option)
    assert _close(fusion.iteration_s, brute.iteration_s), (fusion, brute)
    assert fusion.groups == groups_from_cuts(len(profile.tensors), fusion.cuts)
    # The planner-facing entry point finds the same time on the same all-compressed choice.
    fused, groups = fuse_optimal(priced, np.full(len(profile.tensors), k))
    assert set(fused.tolist()) == {k}
    assert _close(fusion_iteration_s(profile, cluster, model, option, _cuts(groups)), fusion.iteration_s)
    # The greedy pass on the same choice is never faster.
    fused, groups = fuse_gpu(priced, np.full(len(profile.tensors), k))
    greedy_s = simulate(
        profile, cluster, model, Strategy(options=tuple(priced.options[j] for j in fused), groups=tuple(groups))
    ).iteration_s
    assert fusion.iteration_s <= greedy_s * (1 + REL_TOL)


def test_twelve_tensors_against_brute_force() -> None:
    """One L = 12 case (2,048 partitions): equal to the oracle and strictly better than both extremes."""
    numel = [9408, 64, 64, 36864, 64, 64, 2_359_296, 512, 512, 1_048_576, 2048, 2_050_000]
    ready = np.linspace(1e-3, 30e-3, len(numel))
    tensors = tuple(
        TensorProfile(name=f"t{i}", shape=(x,), ready_s=float(r))
        for i, (x, r) in enumerate(zip(numel, ready, strict=True))
    )
    profile = ModelProfile(model="twelve", tensors=tensors, forward_s=10e-3, backward_s=31e-3)
    model = CompressorModel.family("dgc", bits_per_element=0.64, allreduce_compatible=False)
    cluster = ClusterSpec.from_strings(nodes=2, gpus_per_node=4, inter="10Gbit", intra="pcie")
    fusion = cupcake_fusion(profile, cluster, model, COMP_AG)
    brute = brute_force_fusion(profile, cluster, model, COMP_AG)
    assert brute.num_labels == 2048
    assert _close(fusion.iteration_s, brute.iteration_s)
    layer_wise = fusion_iteration_s(profile, cluster, model, COMP_AG, tuple(range(1, 12)))
    one_group = fusion_iteration_s(profile, cluster, model, COMP_AG, ())
    assert fusion.iteration_s < min(layer_wise, one_group)


def test_brute_force_refuses_large_models() -> None:
    tensors = tuple(TensorProfile(name=f"t{i}", shape=(1,), ready_s=0.0) for i in range(MAX_BRUTE_FORCE_TENSORS + 1))
    profile = ModelProfile(model="big", tensors=tensors, forward_s=0.0, backward_s=0.0)
    model = CompressorModel.family("dgc", bits_per_element=0.64, allreduce_compatible=False)
    cluster = ClusterSpec.from_strings(nodes=1, gpus_per_node=2, inter="10Gbit")
    with pytest.raises(ValueError, match="MAX_BRUTE_FORCE_TENSORS"):
        brute_force_fusion(profile, cluster, model, COMP_AG)


def _mixed_brute_force(priced: PricedOptions, choice: np.ndarray) -> float:
    """Every partition whose spans ``_span_options`` accepts, simulated; the fastest."""
    n, merged = len(choice), _span_options(priced.options, choice)
    best = np.inf
    for count in range(n):
        for cuts in itertools.combinations(range(1, n), count):
            bounds = [0, *cuts, n]
            spans = list(itertools.pairwise(bounds))
            if any(merged[a, b] < 0 for a, b in spans):
                continue
            options = tuple(priced.options[merged[a, b]] for a, b in spans for _ in range(a, b))
            strategy = Strategy(options=options, groups=groups_from_cuts(n, cuts))
            best = min(best, simulate(priced.profile, priced.cluster, priced.model, strategy).iteration_s)
    return float(best)


@settings(max_examples=examples(30), deadline=None)
@given(case=small_cases(max_tensors=7), picks=st.lists(st.integers(0, 100), min_size=7, max_size=7))
def test_fuse_optimal_mixed_choice(case: tuple[ModelProfile, ClusterSpec, CompressorModel], picks: list[int]) -> None:
    """Mixed fp32/fp16/comp choices: equal to the brute force over fusable partitions, never worse than greedy."""
    profile, cluster, model = case
    priced = PricedOptions(profile, cluster, model)
    choice = np.array([int(priced.gpu[p % len(priced.gpu)]) for p in picks[: len(profile.tensors)]])
    fused, groups = fuse_optimal(priced, choice)
    strategy = Strategy(options=tuple(priced.options[k] for k in fused), groups=tuple(groups))
    optimal_s = simulate(profile, cluster, model, strategy).iteration_s
    assert _close(optimal_s, _mixed_brute_force(priced, choice))
    greedy, greedy_groups = fuse_gpu(priced, choice)
    greedy_strategy = Strategy(options=tuple(priced.options[k] for k in greedy), groups=tuple(greedy_groups))
    assert optimal_s <= simulate(profile, cluster, model, greedy_strategy).iteration_s * (1 + REL_TOL)
    assert optimal_s <= priced.iteration_s(choice) * (1 + REL_TOL)


def test_resnet101_sized_model() -> None:
    """314 tensors: fast, and no slower than layer-wise, one group, the code's 2 groups or the greedy pass."""
    profile = resnet101_like()
    model = CompressorModel.family("dgc", bits_per_element=0.64, allreduce_compatible=False)
    cluster = ClusterSpec.from_strings(nodes=1, gpus_per_node=8, inter="25Gbit", intra="pcie")
    started = time.perf_counter()
    fusion = cupcake_fusion(profile, cluster, model, COMP_AG)
    assert time.perf_counter() - started < DP_BOUND_S
    n = len(profile.tensors)
    for cuts in (tuple(range(1, n)), (), equal_count_cuts(n, 2)):
        assert fusion.iteration_s <= fusion_iteration_s(profile, cluster, model, COMP_AG, cuts) * (1 + REL_TOL)
    priced = PricedOptions(profile, cluster, model)
    k = priced.index[COMP_AG]
    fused, groups = fuse_gpu(priced, np.full(n, k))
    greedy_s = simulate(
        profile, cluster, model, Strategy(options=tuple(priced.options[j] for j in fused), groups=tuple(groups))
    ).iteration_s
    assert fusion.iteration_s <= greedy_s * (1 + REL_TOL)

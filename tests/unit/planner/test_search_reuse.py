"""The plan search's shortcuts give the plans the long way gives, and Algorithm 1 as the paper states it.

``plan`` searches the CPU-only space (its competing candidate) on the prices it already has and
simulates the upper bound's per-tensor best choice on the compiled event loop; before, it called
``plan(gpu_compression=False)`` (pricing everything again, with baselines and an upper bound of its
own) and ``simulate``. These tests pin that the shortcuts change no plan: equal prices, equal times
bit for bit, the same plan as the recursive call chose. ``espresso_algorithm1`` prices every
single-tensor variant by a full simulation F(S); it must take the decisions the O(1) price takes.

Profiles are synthetic and compressor models explicit (as in test_search.py).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from tests.unit.planner.cases import random_case
from zensync.cost import AffineCost, CompressorModel
from zensync.planner._pricing import PricedOptions
from zensync.planner.cluster import ClusterSpec
from zensync.planner.profile import ModelProfile
from zensync.planner.search import _gpu_pass, _search, _SimulatedVariants, espresso_algorithm1, plan
from zensync.planner.simulator import Strategy, simulate

CHEAP_CPU = AffineCost(fixed_s=1e-5, per_element_s=2e-10)
"""CPU compression cheap enough that the CPU-only space sometimes wins (its branch is exercised)."""


def _random_case(rng: random.Random, max_tensors: int = 8) -> tuple[ModelProfile, ClusterSpec, CompressorModel]:
    """2 to ``max_tensors`` tensors, some ready together; half the time CPU compression cheap enough
    that the CPU-only space can win."""
    profile, cluster, model = random_case(
        rng, counts=range(2, max_tensors + 1), sizes=[2**10, 2**14, 2**18, 2**20, 2**22],
        gap=lambda r: r.choice([0.0, r.uniform(0, 0.004)]), forward_s=0.003, cpu_workers=[1, 2],
    )  # fmt: skip
    if rng.random() < 0.5:
        model = dataclasses.replace(model, cpu_compress=CHEAP_CPU, cpu_decompress=CHEAP_CPU)
    return profile, cluster, model


@pytest.mark.parametrize("two_level", [False, True])
def test_without_gpu_compression_equals_fresh_prices(two_level: bool) -> None:
    """The CPU-only space cut from the full one: same options in the same order, same prices, same times."""
    rng = random.Random(11)
    for _ in range(20):
        profile, cluster, model = _random_case(rng)
        full = PricedOptions(profile, cluster, model, devices=("gpu", "cpu"), two_level=two_level)
        fresh = PricedOptions(profile, cluster, model, devices=("cpu",), two_level=two_level)
        cut = full.without_gpu_compression()
        assert cut.options == fresh.options and cut.index == fresh.index
        assert np.array_equal(cut.gpu, fresh.gpu)
        for mine, theirs in zip(cut.costs, fresh.costs, strict=True):
            assert np.array_equal(mine.compute_s, theirs.compute_s) and np.array_equal(mine.kernel_s, theirs.kernel_s)
            assert [r for r, _ in mine.stages] == [r for r, _ in theirs.stages]
            assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(mine.stages, theirs.stages, strict=True))
        for _ in range(5):
            choice = np.array([rng.randrange(len(cut.options)) for _ in profile.tensors])
            assert cut.iteration_s(choice) == fresh.iteration_s(choice)
        assert len(full.options) > len(cut.options)  # the full space is left as it was


def test_gpu_upper_bound_times_equal_simulate() -> None:
    """The compiled loop on zero-cost prices gives ``simulate(upper_bound=True)``'s time bit for bit."""
    rng = random.Random(12)
    for _ in range(40):
        profile, cluster, model = _random_case(rng, max_tensors=12)
        bound = PricedOptions(profile, cluster, model, two_level=True).gpu_upper_bound()
        for _ in range(3):
            rows = np.array([rng.randrange(len(bound.options)) for _ in profile.tensors])
            strategy = Strategy(options=tuple(bound.options[k] for k in rows))
            expected = simulate(profile, cluster, model, strategy, upper_bound=True, record_events=False)
            assert bound.iteration_s(rows) == expected.iteration_s


@pytest.mark.parametrize("fusion", [True, False])
def test_cpu_only_candidate_is_the_cpu_only_plan(fusion: bool) -> None:
    """``plan`` with GPU and CPU compression returns what it returned when it called
    ``plan(gpu_compression=False)`` for its CPU-only candidate: that plan when it is faster than the
    search of the full space (options and groups as that plan lists them), else the search's."""
    rng, cpu_won, checked = random.Random(13), 0, 0
    for _ in range(60):
        profile, cluster, model = _random_case(rng)
        flags = {"cpu_offload": True, "two_level": rng.random() < 0.5, "fusion": fusion}
        result = plan(profile, cluster, model, **flags)
        cpu_only = plan(profile, cluster, model, gpu_compression=False, **flags)
        priced = PricedOptions(profile, cluster, model, devices=("gpu", "cpu"), two_level=flags["two_level"])
        searched, searched_s = _search(priced, True, fusion)
        checked += 1
        if cpu_only.predicted.plan_s < searched_s - 1e-12:
            cpu_won += 1
            assert result.predicted.plan_s == cpu_only.predicted.plan_s
            assert [(t.option, t.group) for t in result.tensors] == [(t.option, t.group) for t in cpu_only.tensors]
            assert result.chosen == "search"
        else:
            assert result.predicted.plan_s == min(searched_s, result.predicted.fp32_s, result.predicted.fp16_s)
            if result.chosen == "search":
                assert tuple(t.option for t in result.tensors) == searched.options
        baselines = (result.predicted.fp32_s, result.predicted.fp16_s)
        assert baselines == (cpu_only.predicted.fp32_s, cpu_only.predicted.fp16_s)
    assert checked == 60 and cpu_won >= 1  # 2 of these 60 (each fusion setting) when measured


def test_algorithm1_as_stated_takes_the_max_plus_decisions() -> None:
    """Every variant simulated in full (F(S), the paper's statement) or priced in O(1) (max-plus):
    the same choices, one pass (``espresso_algorithm1``) and with ``plan``'s refinement sweeps."""
    rng, simulations = random.Random(14), 0
    for _ in range(60):
        profile, cluster, model = _random_case(rng, max_tensors=12)
        as_stated, count = espresso_algorithm1(profile, cluster, model)
        assert espresso_algorithm1(profile, cluster, model, full_timeline=False) == (as_stated, 0)
        simulations += count
        priced = PricedOptions(profile, cluster, model, two_level=True)
        fp32 = priced.best_level("fp32")
        assert np.array_equal(_gpu_pass(priced, fp32, simulated=_SimulatedVariants(priced)), _gpu_pass(priced, fp32))
    assert simulations > 60  # at least the starting timeline each time, and variants besides

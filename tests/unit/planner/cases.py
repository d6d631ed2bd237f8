"""Synthetic planner inputs shared by the search tests: compressor models with explicit costs and
random small profiles on random clusters."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

from zensync.cost import CompressorModel
from zensync.planner.cluster import ClusterSpec
from zensync.planner.profile import ModelProfile, TensorProfile

MODELS = {
    # Specs that build (Plan.from_json builds the compressor); costs stay the family defaults.
    "dgc": CompressorModel.family("dgc", bits_per_element=0.64, allreduce_compatible=False, spec="dgc:0.01"),
    "randomk": CompressorModel.family("randomk", bits_per_element=0.32, allreduce_compatible=True, spec="randomk:0.01"),
    "efsignsgd": CompressorModel.family(
        "efsignsgd", bits_per_element=1.0, fixed_payload_bytes=4, allreduce_compatible=False
    ),
}


def random_case(
    rng: random.Random,
    *,
    counts: Sequence[int],
    sizes: Sequence[int],
    gap: Callable[[random.Random], float],
    forward_s: float,
    cpu_workers: Sequence[int] = (1,),
) -> tuple[ModelProfile, ClusterSpec, CompressorModel]:
    """A profile of ``rng.choice(counts)`` tensors of ``sizes`` elements, ready ``gap(rng)`` apart, on
    a random 1-4 x 1-4 cluster, with one of ``MODELS``."""
    n = rng.choice(counts)
    numels = [rng.choice(sizes) for _ in range(n)]
    ready = list(itertools.accumulate(gap(rng) for _ in range(n)))
    tensors = tuple(
        TensorProfile(name=f"t{i}", shape=(s,), ready_s=r) for i, (s, r) in enumerate(zip(numels, ready, strict=True))
    )
    profile = ModelProfile(
        model="random", tensors=tensors, forward_s=forward_s, backward_s=ready[-1] + rng.uniform(0, 0.005)
    )
    cluster = ClusterSpec.from_strings(
        nodes=rng.choice([1, 2, 4]),
        gpus_per_node=rng.choice([1, 2, 4]),
        inter=rng.choice(["10Gbit", "25Gbit", "100Gbit"]),
        intra=rng.choice(["pcie", "nvlink"]),
        cpu_workers=rng.choice(cpu_workers),
    )
    return profile, cluster, MODELS[rng.choice(sorted(MODELS))]

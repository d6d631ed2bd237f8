"""Restricting the option space (Espresso's ablation, reference/espresso.md 1.7): ``candidate_options`` and
``plan`` keep only what the restriction allows, and the restrictions that are subsets of the full
search by construction (GPU-only, no fusion) are never faster than the full plan.

Profiles are synthetic and every compressor model explicit, as in test_search.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from zensync.cost import AffineCost, CompressorModel
from zensync.planner.cluster import ClusterSpec
from zensync.planner.options import SCHEMES, candidate_options
from zensync.planner.profile import ModelProfile, TensorProfile
from zensync.planner.search import plan

CLUSTER = ClusterSpec.from_strings(nodes=4, gpus_per_node=4, inter="25Gbit", intra="pcie")
SPARSE = CompressorModel.family("dgc", bits_per_element=0.64, allreduce_compatible=False)
"""A divisible, not allreduce-compatible compressor (DGC 1 %: values + indices)."""
SUMMABLE = CompressorModel.family("randomk", bits_per_element=0.32, allreduce_compatible=True)
"""An allreduce-compatible one (random-k with a shared seed)."""
CPU_CHEAP = CompressorModel.family(
    "efsignsgd",
    bits_per_element=1.0,
    allreduce_compatible=False,
    cpu_compress=AffineCost(fixed_s=1e-5, per_element_s=1e-10),
    cpu_decompress=AffineCost(fixed_s=1e-5, per_element_s=1e-10),
)
"""Cheap CPU kernels, so CPU compression pays and the CPU-only planner compresses."""


def _profile() -> ModelProfile:
    """Twelve tensors, large and small, ready through a 60 ms backward."""
    numels = [4_000_000, 512, 2_000_000, 2_000_000, 1024, 8_000_000, 300_000, 64, 1_000_000, 6_000_000, 128, 3_000_000]
    ready = np.cumsum(np.array(numels, float) + 1e5) / (sum(numels) + 1.2e6) * 0.057
    tensors = tuple(
        TensorProfile(name=f"t{i}", shape=(n,), ready_s=float(r))
        for i, (n, r) in enumerate(zip(numels, ready, strict=True))
    )
    return ModelProfile(model="mixed", tensors=tensors, forward_s=0.02, backward_s=0.06)


def test_schemes_restrict_compressed_options_only() -> None:
    options = candidate_options(CLUSTER, SPARSE, devices=("gpu", "cpu"), two_level=True, schemes=("ag",))
    assert {o.scheme for o in options if o.kind == "comp"} == {"ag"}
    assert {o.kind for o in options if o.scheme == "ar"} == {"fp32", "fp16"}
    # An allreduce-only space has no compressed option for a compressor that cannot be summed.
    assert {o.kind for o in candidate_options(CLUSTER, SPARSE, schemes=("ar",))} == {"fp32", "fp16"}
    assert {(o.kind, o.scheme) for o in candidate_options(CLUSTER, SUMMABLE, schemes=("ar",))} == {
        ("fp32", "ar"),
        ("fp16", "ar"),
        ("comp", "ar"),
    }


def test_defaults_are_the_full_space() -> None:
    full = candidate_options(CLUSTER, SPARSE, devices=("gpu", "cpu"), two_level=True)
    same = candidate_options(
        CLUSTER, SPARSE, devices=("gpu", "cpu"), two_level=True, schemes=SCHEMES, hierarchical=True
    )
    assert full == same
    assert {o.level for o in full} == {"flat", "hier", "hier2"}


def test_flat_only_has_no_two_level_option() -> None:
    options = candidate_options(CLUSTER, SPARSE, devices=("gpu", "cpu"), two_level=True, hierarchical=False)
    assert {o.level for o in options} == {"flat"}


def test_unknown_scheme_is_named() -> None:
    with pytest.raises(ValueError, match=r"\['ring'\] unknown; valid"):
        candidate_options(CLUSTER, SPARSE, schemes=("ring",))  # type: ignore[arg-type]


def test_restricted_plans_use_only_allowed_options() -> None:
    profile = _profile()
    cpu_only = plan(profile, CLUSTER, CPU_CHEAP, cpu_offload=True, gpu_compression=False)
    assert all(t.option.device == "gpu" for t in cpu_only.tensors if t.option.kind != "comp")
    assert all(t.option.device == "cpu" for t in cpu_only.tensors if t.option.kind == "comp")
    assert any(t.option.kind == "comp" for t in cpu_only.tensors), "cheap CPU kernels should pay here"
    baselines = plan(profile, CLUSTER, SPARSE, gpu_compression=False)
    assert {t.option.kind for t in baselines.tensors} <= {"fp32", "fp16"}
    flat = plan(profile, CLUSTER, SPARSE, two_level=True, hierarchical=False)
    assert {t.option.level for t in flat.tensors} == {"flat"}
    gathered = plan(profile, CLUSTER, SPARSE, two_level=True, schemes=("ag",))
    assert {t.option.scheme for t in gathered.tensors if t.option.kind == "comp"} <= {"ag"}


@pytest.mark.parametrize("model", [SPARSE, SUMMABLE, CPU_CHEAP], ids=["dgc", "randomk", "efsignsgd"])
def test_subset_restrictions_never_beat_the_full_plan(model: CompressorModel) -> None:
    """GPU-only and no-fusion searches are steps of the full one, and the CPU-only plan is one of its
    candidates, so the full plan is at least as fast as each."""
    profile = _profile()
    full = plan(profile, CLUSTER, model, cpu_offload=True, two_level=True).predicted.plan_s
    gpu_only = plan(profile, CLUSTER, model, two_level=True).predicted.plan_s
    no_fusion = plan(profile, CLUSTER, model, cpu_offload=True, two_level=True, fusion=False).predicted.plan_s
    cpu_only = plan(profile, CLUSTER, model, cpu_offload=True, two_level=True, gpu_compression=False).predicted.plan_s
    assert full <= gpu_only
    assert full <= no_fusion
    assert full <= cpu_only

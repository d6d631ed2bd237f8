"""Mirrored steps: one rank's records, replicated, are a full run's for symmetric compressed syncs,
and a plan's step is the hook's collectives for its groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from zensync.compress import CompressedSync, Hierarchy, build, hierarchy
from zensync.compress.collectives.base import COMPRESSED_SCHEMES
from zensync.planner import ClusterSpec, Plan
from zensync.planner.options import FP16_OPTION, FP32_OPTION, TensorOption
from zensync.planner.plan import PlanTensor, Predictions
from zensync.simulate import Call, Link, Topology, network_calls, price, record
from zensync.simulate.mirror import MirrorTransport, replicate
from zensync.simulate.planned import DDP_BUCKET_BYTES, ddp_buckets, plan_step, plan_step_calls, plan_sweep
from zensync.simulate.record import RecordingTransport
from zensync.transport import Transport

SPECS = ("fp16", "topk:0.05", "dgc:0.05", "randomk:0.05", "efsignsgd", "qsgd:16", "onebit")
TOPO = Topology(2, Link(1e-6, 1e11), Link(50e-6, 125e6))


def _full(spec: str, scheme: str, n: int, per_node: int, numel: int) -> list[list[Call]]:
    def body(t: Transport) -> torch.Tensor:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(t.rank))
        levels = hierarchy(t, per_node) if per_node else None
        return CompressedSync(spec, scheme).sync(x, t, name="w", step=0, hierarchy=levels)

    return network_calls(record(body, n)[1])


def _mirrored(spec: str, scheme: str, n: int, per_node: int, numel: int) -> list[list[Call]]:
    calls: list[Call] = []
    mirror = MirrorTransport(0, n)
    world = RecordingTransport(mirror, calls)
    levels = None
    if per_node:
        intra, inter, intra_members, inter_members = mirror.groups(per_node)
        levels = Hierarchy(intra=world.subgroup(intra, intra_members), inter=world.subgroup(inter, inter_members))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    CompressedSync(spec, scheme).sync(x, world, name="w", step=0, hierarchy=levels)
    return network_calls(replicate([calls], n, per_node or n))


@settings(max_examples=examples(30), deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    scheme=st.sampled_from(COMPRESSED_SCHEMES),
    shape=st.sampled_from([(2, 0), (3, 0), (4, 2), (6, 2), (6, 3), (8, 4)]),
    per_rank=st.integers(1, 300),
)
def test_mirrored_records_equal_a_full_run(spec: str, scheme: str, shape: tuple[int, int], per_rank: int) -> None:
    """Where the world size divides the tensor, every rank's records are rank 0's, shifted."""
    if scheme == "allreduce" and not build(spec).allreduce_compatible:
        return
    n, per_node = shape
    numel = n * per_rank
    full = _full(spec, scheme, n, per_node, numel)
    assert _mirrored(spec, scheme, n, per_node, numel) == full
    assert price(_mirrored(spec, scheme, n, per_node, numel), TOPO) == price(full, TOPO)


def test_replicate_shifts_groups_by_node_and_local_rank() -> None:
    world, node, column = (0, 1, 2, 3), (0, 1), (0, 2)
    calls = [Call("all_reduce", world, "p", 8), Call("all_gather", node, "p", 4), Call("barrier", column, "p")]
    out = replicate([calls], 4, 2)
    assert [[c.group for c in per_rank] for per_rank in out] == [
        [world, (0, 1), (0, 2)],
        [world, (0, 1), (1, 3)],
        [world, (2, 3), (0, 2)],
        [world, (2, 3), (1, 3)],
    ]
    assert all(c.nbytes == r.nbytes for per_rank in out for c, r in zip(per_rank, calls, strict=True))
    with pytest.raises(ValueError, match="point-to-point"):
        replicate([[Call("send_recv", world, "p", 8, sent=(1,), source=3)]], 4, 2)
    with pytest.raises(ValueError, match="divide"):
        replicate([calls], 4, 3)
    with pytest.raises(ValueError, match="divide"):
        MirrorTransport(0, 6).groups(4)


def _plan(n: int, per_node: int, tensors: list[tuple[int, TensorOption, int]], compressor: str = "topk:0.05") -> Plan:
    cluster = ClusterSpec(
        nodes=n // per_node, gpus_per_node=per_node, intra_bandwidth_bytes_per_s=1e11, inter_bandwidth_bytes_per_s=1e9
    )
    entries = tuple(
        PlanTensor(name=f"t{i}", numel=numel, option=option, group=group)
        for i, (numel, option, group) in enumerate(tensors)
    )
    predicted = Predictions(plan_s=1.0, fp32_s=1.0, fp16_s=1.0, upper_bound_s=1.0)
    return Plan(
        model="m", cluster=cluster, compressor=compressor, tensors=entries, predicted=predicted, selection_s=0.0
    )


def test_a_plans_step_is_the_hooks_collectives_per_group() -> None:
    """Groups: two fp32 tensors fused, an fp16 two-level one, a compressed allgather; a full run of
    the same syncs on 4 ranks (2 per node) records what the mirrored step does, sizes padded to 4."""
    comp_ag = TensorOption(kind="comp", scheme="ag", level="flat")
    hier16 = dataclasses.replace(FP16_OPTION, level="hier")
    plan = _plan(4, 2, [(30, FP32_OPTION, 0), (50, FP32_OPTION, 0), (101, hier16, 1), (64, comp_ag, 2)])

    def body(t: Transport) -> None:
        gen = torch.Generator().manual_seed(0)
        levels = hierarchy(t, 2)
        with t.phase("fp32-ar-gpu-flat"):
            t.all_reduce(torch.randn(80, generator=gen), inplace=True)
        x = torch.randn(104, generator=gen)
        with (
            t.phase("fp16-ar-gpu-hier"),
            levels.intra.phase("fp16-ar-gpu-hier"),
            levels.inter.phase("fp16-ar-gpu-hier"),
        ):
            CompressedSync("fp16", "allreduce").sync(x, t, name="group1", step=0, hierarchy=levels)
        with t.phase("comp-ag-gpu-flat"):
            CompressedSync("topk:0.05", "allgather").sync(torch.randn(64, generator=gen), t, name="group2", step=0)

    full = network_calls(record(body, 4)[1])
    # The splits' own agreements are the full run's, not the hook's step (it splits at registration).
    full = [[c for c in per_rank if c.phase != "other"] for per_rank in full]
    mirrored = network_calls(replicate([plan_step_calls(plan)], 4, 2))
    assert mirrored == full
    row = plan_step(plan, TOPO, compute_scale=0.0)
    assert row["seconds"] == pytest.approx(price(full, TOPO).seconds, rel=1e-12)
    assert row["mode"] == "mirror" and row["groups"] == 3


def test_ddp_buckets_fill_25_mib_in_backward_order() -> None:
    quarter = DDP_BUCKET_BYTES // 16  # elements: a quarter of a bucket in float32
    plan = _plan(4, 2, [(quarter, FP32_OPTION, i) for i in range(5)] + [(5 * quarter, FP32_OPTION, 5)])
    buckets = ddp_buckets(plan, "fp16")
    assert [t.group for t in buckets.tensors] == [0, 0, 0, 0, 1, 2]
    assert {t.option for t in buckets.tensors} == {FP16_OPTION} and buckets.chosen == "fp16"


def test_a_sweep_needs_whole_nodes_and_refuses_powersgd() -> None:
    from zensync.planner import builtin_profile

    profile = builtin_profile("lstm")
    with pytest.raises(ValueError, match="multiples of ranks_per_node"):
        plan_sweep(profile, "dgc:0.01", [4, 12], Topology(8, Link(1e-6, 1e11), Link(1e-5, 1e9)))
    plan = _plan(2, 1, [(40, TensorOption(kind="comp", scheme="ar"), 0)], compressor="powersgd:2")
    with pytest.raises(ValueError, match="PowerSGD"):
        plan_step_calls(plan)

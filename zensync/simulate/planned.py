"""One gradient step of a compression plan at any world size: the hook's real collectives, mirrored.

``plan_step(plan, topology)`` runs what the DDP hook runs for a plan's step (``zensync.hooks``'
decider: per fusion group, in backward order) on representative rank 0 of a ``MirrorTransport``
world of the plan's size, records it (collectives and measured local work, ``zensync.simulate``),
writes every rank's records with ``replicate`` and prices them on ``topology``:

1. float32 groups: one allreduce of the group (the hook leaves them to a dense allreduce);
2. fp16 and compressed groups: ``CompressedSync(spec, scheme).sync`` on the group as one 1-D
   vector, flat, or two-level on the node and local-rank groups when the option's level is
   ``hier`` or ``hier2`` (the hook runs both with an uncompressed intra-node phase); error feedback
   as the compressor needs, at its first step (an empty residual: sizes do not depend on it).

Each group's tensor is padded to a multiple of the world size (fewer than n elements), so every
rank's shard has the representative's size and the records are exactly a full run's of the padded
tensor (``zensync.simulate.mirror``). The data are standard normal, seeded. Compression runs on
this machine's CPU whatever the option's device; ``compute_scale`` scales that local work.

The price is the step's synchronization alone, groups one after another: the planner's iteration
time also overlaps them with backward compute, which this does not model.

``plan_sweep`` runs the planner at each world size (``zensync.planner.plan`` on the cluster the
topology describes) and prices three strategies side by side: DDP's default (float32 allreduce of
25 MB buckets), the same buckets in fp16, and the plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zensync.compress import CompressedSync, Hierarchy
from zensync.cost import compressor_model
from zensync.cost.topology import Topology
from zensync.planner import ClusterSpec, ModelProfile, Plan, plan
from zensync.planner.options import FP16_OPTION, FP32_OPTION
from zensync.simulate.mirror import MirrorTransport, replicate
from zensync.simulate.record import Call, RecordingTransport
from zensync.simulate.sweep import payload_sent
from zensync.simulate.timeline import price

__all__ = ["DDP_BUCKET_BYTES", "ddp_buckets", "plan_groups", "plan_step", "plan_step_calls", "plan_sweep"]

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket_cap_mb (25 MiB of float32 gradients)."""


def plan_groups(plan: Plan) -> list[tuple[int, int, str, str | None, str | None, str]]:
    """The plan's fusion groups in backward order: (group id, elements, option code, compressor
    spec or None for float32, ``zensync.compress`` scheme or None, level)."""
    groups: list[tuple[int, int, str, str | None, str | None, str]] = []
    for tensor in plan.tensors:
        if groups and groups[-1][0] == tensor.group:
            gid, numel, code, spec, scheme, level = groups[-1]
            groups[-1] = (gid, numel + tensor.numel, code, spec, scheme, level)
            continue
        compression = plan.compression_for(tensor.name)
        spec, scheme = compression if compression is not None else (None, None)
        groups.append((tensor.group, tensor.numel, tensor.option.code, spec, scheme, tensor.option.level))
    return groups


def plan_step_calls(plan: Plan, *, seed: int = 0) -> list[Call]:
    """Representative rank 0's records of the plan's step (module docstring, steps 1-2)."""
    n, per_node = plan.cluster.world_size, plan.cluster.gpus_per_node
    calls: list[Call] = []
    mirror = MirrorTransport(0, n)
    world = RecordingTransport(mirror, calls)
    intra, inter, intra_members, inter_members = mirror.groups(per_node)
    levels = Hierarchy(intra=world.subgroup(intra, intra_members), inter=world.subgroup(inter, inter_members))
    gen = torch.Generator().manual_seed(seed)
    syncs: dict[tuple[str, str], CompressedSync] = {}
    for gid, numel, code, spec, scheme, level in plan_groups(plan):
        padded = -(-numel // n) * n
        x = torch.randn(padded, generator=gen)
        with contextlib.ExitStack() as phases:
            for transport in (world, levels.intra, levels.inter):
                phases.enter_context(transport.phase(code))
            if spec is None or scheme is None:
                world.all_reduce(x, inplace=True)
                continue
            if spec.startswith("powersgd"):
                raise ValueError("plan_step: PowerSGD factors each matrix of a group; its shapes are not in a plan")
            sync = syncs.setdefault((spec, scheme), CompressedSync(spec, scheme))
            sync.sync(x, world, name=f"group{gid}", step=0, hierarchy=None if level == "flat" else levels)
    world.finish()
    return calls


def plan_step(
    plan: Plan,
    topology: Topology,
    *,
    compute_scale: float = 1.0,
    cores: float | None = None,
    transport_cpu: Mapping[str, float] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """The plan's step priced on ``topology`` (every rank's records from rank 0's), as a report row.

    Raises:
        ValueError: If the topology's ranks per node differ from the plan cluster's.
    """
    if topology.ranks_per_node != plan.cluster.gpus_per_node:
        raise ValueError(
            f"topology has {topology.ranks_per_node} ranks per node, the plan's cluster {plan.cluster.gpus_per_node}"
        )
    start = time.perf_counter()
    mine = plan_step_calls(plan, seed=seed)
    calls = replicate([mine], plan.cluster.world_size, plan.cluster.gpus_per_node)
    priced = price(calls, topology, compute_scale=compute_scale, cores=cores, transport_cpu=transport_cpu)
    sent = payload_sent(calls[0], 0)
    return {
        "ranks": plan.cluster.world_size,
        "mode": "mirror",
        "seconds": priced.seconds,
        "phase_seconds": priced.phase_seconds,
        "compute_seconds": priced.compute_seconds,
        "max_sent_bytes": sent,
        "mean_sent_bytes": sent,
        "groups": len(plan_groups(plan)),
        "wall_s": time.perf_counter() - start,
    }


def ddp_buckets(plan: Plan, kind: str) -> Plan:
    """``plan``'s tensors all float32 (``kind`` "fp32") or all fp16 ("fp16"), fused in backward order
    into buckets of at most ``DDP_BUCKET_BYTES`` float32 bytes (a tensor larger than that alone), as
    DDP's default buckets."""
    option = {"fp32": FP32_OPTION, "fp16": FP16_OPTION}[kind]
    tensors, group, filled = [], 0, 0
    for tensor in plan.tensors:
        nbytes = 4 * tensor.numel
        if filled and filled + nbytes > DDP_BUCKET_BYTES:
            group, filled = group + 1, 0
        filled += nbytes
        tensors.append(dataclasses.replace(tensor, option=option, group=group))
    return dataclasses.replace(plan, tensors=tuple(tensors), chosen=kind)


def plan_sweep(
    profile: ModelProfile,
    compressor: str,
    ranks: Sequence[int],
    topology: Topology,
    *,
    compute_scale: float = 1.0,
    cores: float | None = None,
    transport_cpu: Mapping[str, float] | None = None,
    seed: int = 0,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Per world size (a multiple of the topology's ranks per node): the planner's plan for the
    cluster ``topology`` describes, and the priced step of DDP fp32 buckets, fp16 buckets and the
    plan (module docstring), rows labelled ``scheme`` "fp32", "fp16", "plan".

    Raises:
        ValueError: If a world size is not a multiple of the ranks per node.
    """
    per_node = topology.ranks_per_node
    bad = [n for n in ranks if n < 1 or n % per_node]
    if bad:
        raise ValueError(f"world sizes {bad} are not multiples of ranks_per_node={per_node}")
    model = compressor_model(compressor)
    cpu: dict[str, Any] = {"compute_scale": compute_scale, "cores": cores, "transport_cpu": transport_cpu}
    rows = []
    for n in ranks:
        cluster = ClusterSpec(
            nodes=n // per_node, gpus_per_node=per_node,
            intra_bandwidth_bytes_per_s=topology.intra.bandwidth_bytes_per_s, intra_latency_s=topology.intra.latency_s,
            inter_bandwidth_bytes_per_s=topology.inter.bandwidth_bytes_per_s, inter_latency_s=topology.inter.latency_s,
        )  # fmt: skip
        chosen = plan(profile, cluster, model)
        for label, strategy in (("fp32", ddp_buckets(chosen, "fp32")), ("fp16", ddp_buckets(chosen, "fp16"))):
            step = plan_step(strategy, topology, **cpu, seed=seed)
            row = {"scheme": label, **step}
            rows.append(row)
            if on_point is not None:
                on_point(row)
        row = {
            "scheme": "plan",
            **plan_step(chosen, topology, **cpu, seed=seed),
            "selection_s": chosen.selection_s,
            "planned": chosen.chosen,
            "options": sorted({code for _, _, code, *_ in plan_groups(chosen)}),
        }
        rows.append(row)
        if on_point is not None:
            on_point(row)
    return rows

"""A training step predicted from what its own group measured (``zensync.profiling.profile_group``).

The planner's default inputs describe one idle process and the cluster's nominal links. A step runs
every rank at once: ranks that share a machine slow each other's compute, the links deliver what the
collective library gets out of them, and each compressor costs what it costs at the buckets' real
sizes, on those shared cores. ``StepProfile`` holds those inputs as the group measured them, in a
separate calibration run:

- ``profile``: forward, backward and per-parameter ready times, every rank running at once;
- ``other_s``: the rest of the step (optimizer, zeroing the gradients), which no sync overlaps;
- ``buckets``: DDP's buckets (parameter names), the units the hook syncs and compresses;
- ``allreduce`` (float32; ``allreduce_half``: float16 payloads) and ``allgather``: alpha (s per
  collective) and beta (bytes/s) of each, fitted to timed collectives of the group
  (``latency_s + volume * nbytes / bandwidth``, the volumes of ``zensync.cost.collectives``);
- ``round_s``: one small all-gather, what the hook's agreement check adds to the comm stream on the
  steps that compare (the first, then every ``check_every``: hidden behind the backward here);
- ``compressor_costs``: each compressor's local work before the first collective (``compress``:
  error feedback's compensation, the encode) and after it (``decompress``: the decode of every
  rank's payload, the residual, the finite check), fitted per element;
- ``bucket_costs``: for compressors whose work and payload follow each tensor's matrix shape
  (PowerSGD), the same two times measured on each bucket's real tensors, with the bytes of each
  of the bucket's collectives (``BucketCost``).

``predict_step`` runs the planner's timeline simulator on them for one strategy, with DDP's buckets as
the fusion groups; ``choose_compression`` is "auto"'s choice among compressors on a dense model. In
the planner's vocabulary the training device's own stream is "gpu" (where compression delays later
gradients), also when the training device is a CPU.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from zensync.cost import (
    FP16_MODEL,
    FP32_MODEL,
    AffineCost,
    CompressorModel,
    allgather_s,
    allreduce_s,
    compressor_model,
    read_measured_costs,
    shape_priced,
)
from zensync.planner._reader import Fields, parse_json
from zensync.planner.cluster import ClusterSpec
from zensync.planner.options import FP16_OPTION, FP32_OPTION, TensorOption
from zensync.planner.profile import ModelProfile
from zensync.planner.simulator import SimResult, Strategy, Unit, price_units, simulate_units

__all__ = [
    "AUTO_COMPRESSORS",
    "STEP_PROFILE_VERSION",
    "AutoChoice",
    "BucketCost",
    "LinkFit",
    "StepPrediction",
    "StepProfile",
    "choose_compression",
    "predict_step",
]

STEP_PROFILE_VERSION = 1
AUTO_COMPRESSORS = ("fp16", "topk:0.01", "dgc:0.01", "efsignsgd", "onebit", "powersgd:4")
"""What "auto" may compress dense parameters with, given a step profile (and what ``profile_group``
times by default): the cast and the lossy compressors whose error feedback (or rounding) the
compression tests bound the loss of."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkFit:
    """One collective's alpha-beta: ``latency_s + volume * nbytes / bandwidth_bytes_per_s``."""

    latency_s: float
    bandwidth_bytes_per_s: float
    sizes: tuple[int, ...] = ()
    """Bytes per rank of the timed calls."""
    seconds: tuple[float, ...] = ()
    """Their median times (of the slowest rank's, per call)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BucketCost:
    """A shape-priced compressor's measured work on one bucket, around the bucket's collectives.

    PowerSGD's payload and matrix products follow each tensor's (n, m) view, not the bucket's size,
    so it is timed on the bucket's real tensors (the sizes of the other compressors' fits do not
    describe it): ``before_s`` is the work before the first collective (error feedback's
    compensation, the concatenation of the tensors sent as they are), ``after_s`` the rest (the
    products M Q and M^T P, the orthogonalization, P Q^T, the residual, the finite check), which
    runs between and after the collectives, on the comm stream.
    """

    before_s: float
    after_s: float
    rounds: tuple[tuple[str, int], ...]
    """Each collective of the bucket in issue order: ("allreduce" or "allgather", bytes per rank)."""

    def __post_init__(self) -> None:
        if not (self.before_s >= 0 and self.after_s >= 0):
            raise ValueError(f"BucketCost: before_s={self.before_s} and after_s={self.after_s} must be >= 0")
        for op, nbytes in self.rounds:
            if op not in ("allreduce", "allgather") or int(nbytes) != nbytes or nbytes < 0:
                raise ValueError(f"BucketCost: round ({op!r}, {nbytes!r}) must be (allreduce|allgather, bytes >= 0)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepProfile:
    """What ``profile_group`` measured (module docstring); JSON via ``to_json`` / ``from_json``."""

    profile: ModelProfile
    world_size: int
    other_s: float
    buckets: tuple[tuple[str, ...], ...]
    """DDP's buckets in the order they become ready, each its parameters' names (no ``module.``)."""
    allreduce: LinkFit
    allgather: LinkFit
    round_s: float
    compressor_costs: Mapping[str, Mapping[str, Mapping[str, float]]]
    """spec -> {"gpu_compress"/"gpu_decompress": ``AffineCost`` fields}: the training device's stream."""
    allreduce_half: LinkFit | None = None
    """The allreduce of float16 payloads (the fp16 and bf16 casts' collective), where it was measured:
    a backend may sum half precision at another speed than float32 (gloo's sum is software)."""
    bucket_costs: Mapping[str, tuple[BucketCost, ...]] = dataclasses.field(default_factory=dict)
    """spec -> one ``BucketCost`` per bucket (in ``buckets`` order), for shape-priced compressors."""

    def __post_init__(self) -> None:
        names = {t.name for t in self.profile.tensors}
        bucketed = [n for b in self.buckets for n in b]
        if sorted(bucketed) != sorted(names):
            raise ValueError(
                f"StepProfile: the buckets hold {len(bucketed)} names and the profile {len(names)} tensors; "
                f"every profiled tensor must be in exactly one bucket"
            )
        if self.world_size < 1 or self.other_s < 0 or self.round_s < 0:
            raise ValueError(
                f"StepProfile: world_size={self.world_size} must be >= 1, other_s={self.other_s} and "
                f"round_s={self.round_s} >= 0"
            )
        for spec, costs in self.bucket_costs.items():
            if len(costs) != len(self.buckets):
                raise ValueError(
                    f"StepProfile: bucket_costs[{spec!r}] has {len(costs)} entries for {len(self.buckets)} buckets"
                )

    def measured(self, spec: str) -> bool:
        """Whether ``predict_step`` can price ``spec`` from this profile."""
        if spec in ("fp32", "none"):
            return True
        try:
            keyed = shape_priced(spec)
            if keyed is not None:
                return keyed in self.bucket_costs
            self.compressor(spec)
        except ValueError:
            return False
        return True

    def compressor(self, spec: str) -> CompressorModel:
        """The compressor's model with the costs measured here (fp32: free; the others need a measurement)."""
        if spec in ("fp32", "none"):
            return FP32_MODEL
        key = FP16_MODEL.spec if spec == "fp16" else compressor_model(spec).spec
        costs = self.compressor_costs.get(key)
        if costs is None:
            raise ValueError(
                f"StepProfile has no measured costs for {spec!r}; measured: {', '.join(sorted(self.compressor_costs))}"
            )
        fits: dict[str, Any] = {name: AffineCost(**fit) for name, fit in costs.items()}  # type: ignore[arg-type]
        if key == FP16_MODEL.spec:
            return dataclasses.replace(FP16_MODEL, **fits)
        return compressor_model(spec, fits)

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "version": STEP_PROFILE_VERSION,
            "profile": json.loads(self.profile.to_json()),
            "world_size": self.world_size,
            "other_s": self.other_s,
            "buckets": [list(b) for b in self.buckets],
            "allreduce": dataclasses.asdict(self.allreduce),
            "allreduce_half": None if self.allreduce_half is None else dataclasses.asdict(self.allreduce_half),
            "allgather": dataclasses.asdict(self.allgather),
            "round_s": self.round_s,
            "compressor_costs": {k: {n: dict(f) for n, f in v.items()} for k, v in self.compressor_costs.items()},
            "bucket_costs": {
                k: [{"before_s": c.before_s, "after_s": c.after_s, "rounds": [list(r) for r in c.rounds]} for c in v]
                for k, v in self.bucket_costs.items()
            },
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> StepProfile:
        data = parse_json(text, what="step profile")  # the size and nesting caps of every reader
        if not isinstance(data, dict) or data.get("version") != STEP_PROFILE_VERSION:
            raise ValueError(f"not a step profile of version {STEP_PROFILE_VERSION}")
        return cls(
            profile=ModelProfile.from_dict(data["profile"], what="step profile", field="profile"),
            world_size=int(data["world_size"]),
            other_s=float(data["other_s"]),
            buckets=tuple(tuple(b) for b in data["buckets"]),
            allreduce=_link(data["allreduce"]),
            allreduce_half=_link(data["allreduce_half"]) if data.get("allreduce_half") else None,
            allgather=_link(data["allgather"]),
            round_s=float(data["round_s"]),
            compressor_costs=_costs(data["compressor_costs"]),
            bucket_costs={
                str(spec): tuple(
                    BucketCost(
                        before_s=float(c["before_s"]),
                        after_s=float(c["after_s"]),
                        rounds=tuple((str(op), int(nbytes)) for op, nbytes in c["rounds"]),
                    )
                    for c in costs
                )
                for spec, costs in dict(data.get("bucket_costs") or {}).items()
            },
        )


def _costs(data: object) -> dict[str, dict[str, dict[str, float]]]:
    """``compressor_costs`` checked as every measured-costs reader checks them (``read_measured_costs``)."""
    fields = Fields("step profile")
    costs = fields.mapping(
        data, "compressor_costs", required=(), optional=data.keys() if isinstance(data, dict) else ()
    )
    return {spec: read_measured_costs(fits, fields, f"compressor_costs.{spec}") for spec, fits in costs.items()}


def _link(data: Mapping[str, Any]) -> LinkFit:
    return LinkFit(
        latency_s=float(data["latency_s"]),
        bandwidth_bytes_per_s=float(data["bandwidth_bytes_per_s"]),
        sizes=tuple(int(s) for s in data.get("sizes", ())),
        seconds=tuple(float(s) for s in data.get("seconds", ())),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepPrediction:
    """``predict_step``'s answer: the step and the simulated iteration it contains."""

    spec: str
    step_s: float
    """Forward + backward with the sync + ``other_s``."""
    result: SimResult


def predict_step(step: StepProfile, spec: str, *, hooked: bool = True) -> StepPrediction:
    """The step time of syncing every bucket with ``spec`` ("fp32", "fp16" or a compressor spec).

    Steps:

    1. one option for every tensor: the fp32 or fp16 allreduce, or the compressor over its scheme
       (allreduce when its payloads sum, else allgather), on the training device's stream, flat;
       DDP's buckets are the fusion groups (the hook compresses a bucket as one vector); a
       shape-priced compressor (PowerSGD) takes each bucket's measured ``BucketCost`` instead:
       ``before_s`` delays the backward, its collectives and ``after_s`` hold the comm stream;
    2. price the groups with the measured compressor costs, on a cluster whose one link is the
       collective's measured alpha-beta (allreduce's for allreduce schemes, of float16 payloads for
       the casts where measured; allgather's otherwise). The hook's CPU cast pipeline
       (``FP16Compressor.allreduce_sync``) is priced as one allreduce after the whole cast: what it
       hides depends on whether the collective leaves the CPU free (4 emulated hosts at 1 Gbit/s:
       0.966x torch's fp16 hook; on loopback the pieces' sums take the cores the cast needs, and
       priced as hidden, auto chose fp16 there and measured 1.13x the warm-up's dense step);
    3. ``hooked``: the zensync hook's agreement round joins the comm stream ahead of the first
       bucket (whose collectives wait for it); the hook issues it at the forward, and it is charged
       from the start of the backward (the forward's overlap is not counted);
    4. simulate; the step adds ``other_s``.

    Args:
        step: The group's measurements.
        spec: "fp32", "fp16" or a compressor spec measured in ``step`` (``"topk:0.01"``).
        hooked: Charge the zensync hook's per-step round (False: torch's own hooks, or no hook).

    Returns:
        The ``StepPrediction``.

    Raises:
        ValueError: If ``spec`` was not measured in ``step``.
    """
    keyed = shape_priced(spec) if spec not in ("fp32", "none", "fp16") else None
    if keyed is not None:
        return _predict_measured_buckets(step, keyed, hooked=hooked)
    # Step 1: the options and groups.
    model = step.compressor(spec)
    option: TensorOption
    if spec in ("fp32", "none"):
        option, link = FP32_OPTION, step.allreduce
    elif spec == "fp16":
        option, link = FP16_OPTION, step.allreduce_half or step.allreduce
    else:
        summed = model.allreduce_compatible
        option = TensorOption(kind="comp", scheme="ar" if summed else "ag", device="gpu", level="flat")
        link = step.allreduce if summed else step.allgather
        if model.spec == "bf16":  # a half-precision payload as fp16's
            link = step.allreduce_half or link
    profile, groups = _bucket_order(step.profile, step.buckets)
    strategy = Strategy(options=(option,) * len(groups), groups=groups)
    # Step 2: price with the measured link.
    cluster = ClusterSpec(
        nodes=step.world_size,
        gpus_per_node=1,
        intra_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
        inter_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
        inter_latency_s=link.latency_s,
    )
    units = price_units(profile, cluster, model, strategy, fp16_model=model if spec == "fp16" else FP16_MODEL)
    return _simulate(step, spec, profile, units, hooked=hooked)


def _simulate(
    step: StepProfile, spec: str, profile: ModelProfile, units: list[Unit], *, hooked: bool
) -> StepPrediction:
    """Steps 3 and 4 of ``predict_step``."""
    # Step 3: the agreement round, ahead of the first bucket.
    if hooked and step.world_size > 1:
        units.insert(0, Unit(label="agreement", ready_s=0.0, stages=(("comm", step.round_s),)))
    # Step 4: the timeline.
    result = simulate_units(units, forward_s=profile.forward_s, backward_s=profile.backward_s)
    return StepPrediction(spec=spec, step_s=result.iteration_s + step.other_s, result=result)


def _predict_measured_buckets(step: StepProfile, spec: str, *, hooked: bool) -> StepPrediction:
    """``predict_step`` of a shape-priced compressor: each bucket's ``BucketCost`` as its unit."""
    costs = step.bucket_costs.get(spec)
    if costs is None:
        raise ValueError(
            f"StepProfile has no measured bucket costs for {spec!r} (its work follows the matrix shapes: "
            f"profile_group(specs=[{spec!r}]) times it on the buckets); measured: "
            f"{', '.join(sorted(step.bucket_costs)) or 'none'}"
        )
    profile, groups = _bucket_order(step.profile, step.buckets)
    ranked = _ranked(step.profile, step.buckets)  # group g is bucket ranked[g]
    members: list[list[str]] = [[] for _ in ranked]
    for tensor, group in zip(profile.tensors, groups, strict=True):
        members[group].append(tensor.name)
    ready = {t.name: t.ready_s for t in profile.tensors}
    n = step.world_size
    units = []
    for names, index in zip(members, ranked, strict=True):
        cost = costs[index]
        comm = 0.0
        for op, nbytes in cost.rounds:
            fit, seconds = (step.allreduce, allreduce_s) if op == "allreduce" else (step.allgather, allgather_s)
            comm += seconds(float(nbytes), n, fit.bandwidth_bytes_per_s, fit.latency_s)
        units.append(
            Unit(
                label=names[0] if len(names) == 1 else f"{names[0]}+{len(names) - 1}",
                ready_s=ready[names[-1]],
                compute_s=cost.before_s,
                stages=(("wait", cost.before_s), ("comm", comm + cost.after_s)),
                gpu_kernel_s=cost.before_s + cost.after_s,
            )
        )
    return _simulate(step, spec, profile, units, hooked=hooked)


def _ranked(profile: ModelProfile, buckets: Sequence[Sequence[str]]) -> list[int]:
    """The buckets' indices by when their last gradient is ready (then their first)."""
    ready = {t.name: t.ready_s for t in profile.tensors}
    return sorted(
        range(len(buckets)), key=lambda i: (max(ready[n] for n in buckets[i]), min(ready[n] for n in buckets[i]))
    )


def _bucket_order(profile: ModelProfile, buckets: Sequence[Sequence[str]]) -> tuple[ModelProfile, tuple[int, ...]]:
    """The profile with each bucket's tensors next to each other, and the group id of each tensor.

    Buckets are ordered by when their last gradient is ready (when DDP hands them to the hook), their
    tensors by ready time; a tensor's ready time becomes the running maximum, so that a bucket is
    ready when its last tensor is, as ``price_units`` takes it.
    """
    ready = {t.name: t for t in profile.tensors}
    tensors, groups, latest = [], [], 0.0
    for g, index in enumerate(_ranked(profile, buckets)):
        for name in sorted(buckets[index], key=lambda n: ready[n].ready_s):
            latest = max(latest, ready[name].ready_s)
            tensors.append(dataclasses.replace(ready[name], ready_s=latest))
            groups.append(g)
    return dataclasses.replace(profile, tensors=tuple(tensors)), tuple(groups)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AutoChoice:
    """``choose_compression``'s answer: the spec ("fp32": no compression) and every candidate's prediction."""

    spec: str
    predicted_s: Mapping[str, float]
    """Predicted step time of "fp32" and of every candidate, seconds."""

    @property
    def step_s(self) -> float:
        """The chosen spec's predicted step time."""
        return self.predicted_s[self.spec]


def choose_compression(step: StepProfile, candidates: Sequence[str], *, margin: float = 0.0) -> AutoChoice:
    """The candidate ``predict_step`` (hooked) predicts fastest, or "fp32" when none pays.

    A compressor is chosen only if predicted more than ``margin`` (a fraction) faster than the fp32
    allreduce, also through the hook: a prediction within the model's error of dense is not worth a
    lossy gradient. Ties go to the earlier candidate. Deterministic: ranks holding the same profile
    choose the same.

    Raises:
        ValueError: If a candidate has no measured costs in ``step``, or ``margin`` < 0.
    """
    if margin < 0:
        raise ValueError(f"margin={margin} must be >= 0 (a fraction of the dense step)")
    predicted = {"fp32": predict_step(step, "fp32").step_s}
    for spec in candidates:
        predicted[spec] = predict_step(step, spec).step_s
    best = min(candidates, key=lambda s: predicted[s], default="fp32")
    if best == "fp32" or predicted[best] * (1.0 + margin) >= predicted["fp32"]:
        best = "fp32"
    return AutoChoice(spec=best, predicted_s=predicted)

"""The plan file: one option and fusion group per parameter name, with the predictions behind them.

Plans are versioned JSON (never pickle), keyed by parameter name, not by DDP bucket index (buckets are
rebuilt after the first iteration)::

    text = plan.to_json()
    same = Plan.from_json(text)
    same.option_for("fc.weight").code  # e.g. "comp-a2a-gpu-hier"
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math

from zensync.cost import measured_compressor_model, read_measured_costs
from zensync.planner._reader import MAX_NUMEL, MAX_TENSORS, NUMEL_WHY, TENSORS_WHY, Fields, parse_json, shorten
from zensync.planner.cluster import ClusterSpec
from zensync.planner.options import TensorOption, candidate_options
from zensync.planner.profile import ModelProfile

__all__ = ["PLAN_VERSION", "Plan", "PlanTensor", "Predictions"]

PLAN_VERSION = 1

_RUNTIME_SCHEME = {"ar": "allreduce", "ag": "allgather", "a2a": "alltoall_allgather", "gb": "gather_broadcast"}
"""Option scheme -> ``zensync.compress.collectives`` scheme name."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanTensor:
    """One parameter's entry."""

    name: str
    """Parameter name (as in ``model.named_parameters()``)."""
    numel: int
    option: TensorOption
    group: int
    """Fusion group id: consecutive tensors with the same id are compressed and sent as one."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Predictions:
    """Predicted iteration times (seconds) under the planner's simulator."""

    plan_s: float
    fp32_s: float
    """Every tensor float32 allreduce (flat or two-level, whichever is faster per tensor)."""
    fp16_s: float
    """Every tensor fp16 allreduce."""
    upper_bound_s: float
    """Zero-cost compression and no compute interference: no strategy of this option space does better."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Predictions.{field.name}={value!r} must be a finite number of seconds >= 0")

    @property
    def speedup_vs_fp32(self) -> float:
        return self.fp32_s / self.plan_s if self.plan_s > 0 else 1.0

    @property
    def speedup_vs_fp16(self) -> float:
        return self.fp16_s / self.plan_s if self.plan_s > 0 else 1.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A compression plan for one model on one cluster with one compressor."""

    model: str
    cluster: ClusterSpec
    compressor: str
    """Spec of the compressor that ``comp`` options use (e.g. ``"dgc:0.01"``)."""
    tensors: tuple[PlanTensor, ...]
    """In backward order."""
    predicted: Predictions
    selection_s: float
    """Wall time the planner took to choose."""
    chosen: str = "search"
    """``search``, or ``fp32`` / ``fp16`` when the searched plan was no faster than that baseline."""
    flags: dict[str, bool] = dataclasses.field(default_factory=dict)
    """Planner switches used: ``cpu_offload``, ``two_level``, ``fusion``."""
    profile: ModelProfile | None = None
    """The profile the plan was made for (``zensync plan`` embeds it, so ``zensync explain`` can
    re-simulate the plan from the file alone)."""
    costs: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Measured compressor costs that replaced the defaults: ``CompressorModel`` field name ->
    ``AffineCost`` fields (``fixed_s``, ``per_element_s``, ``knee_elements``)."""
    _by_name: dict[str, PlanTensor] = dataclasses.field(init=False, repr=False, compare=False)
    """Tensors by parameter name (lookups are per parameter per step in the hook)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})
        names = [t.name for t in self.tensors]
        if not names or len(set(names)) != len(names):
            counts = collections.Counter(names)
            bad = next((f"{n!r} appears {c} times" for n, c in counts.items() if c > 1 or not n), "there are none")
            raise ValueError(f"plan for {self.model!r}: tensor names must be non-empty and unique ({bad})")
        previous = -1
        for index, tensor in enumerate(self.tensors):
            if tensor.group not in (previous, previous + 1) or (index == 0 and tensor.group != 0):
                raise ValueError(
                    f"plan tensor {tensor.name!r}: group {tensor.group} after {previous}; groups must be runs "
                    f"of consecutive tensors numbered 0, 1, 2, ..."
                )
            previous = tensor.group

    def option_for(self, name: str) -> TensorOption:
        """The option of parameter ``name``; KeyError naming it if the plan has no such parameter."""
        return self._tensor(name).option

    def group_of(self, name: str) -> int:
        """The fusion group id of parameter ``name``; KeyError naming it if the plan has no such parameter."""
        return self._tensor(name).group

    def _tensor(self, name: str) -> PlanTensor:
        tensor = self._by_name.get(name)
        if tensor is None:
            raise KeyError(f"parameter {name!r} is not in the plan for {self.model!r}")
        return tensor

    def has(self, name: str) -> bool:
        """Whether parameter ``name`` is in the plan."""
        return name in self._by_name

    def compression_for(self, name: str) -> tuple[str, str] | None:
        """(compressor spec, ``zensync.compress.collectives`` scheme) of ``name``; None for float32 or unknown names."""
        if not self.has(name):
            return None
        option = self.option_for(name)
        if option.kind == "fp32":
            return None
        spec = "fp16" if option.kind == "fp16" else self.compressor
        return spec, _RUNTIME_SCHEME[option.scheme]

    def two_level_ranks_per_node(self, world_size: int) -> int:
        """GPUs per node when any option is two-level (0 when all are flat).

        Raises:
            ValueError: If ``world_size`` is not the planned cluster's.
        """
        if world_size != self.cluster.world_size:
            raise ValueError(
                f"plan is for {self.cluster.world_size} ranks ({self.cluster.nodes} x {self.cluster.gpus_per_node}); "
                f"this job has world_size={world_size}"
            )
        return self.cluster.gpus_per_node if any(t.option.level != "flat" for t in self.tensors) else 0

    def to_json(self) -> str:
        """Versioned JSON text (``PLAN_VERSION``)."""
        data = {
            "version": PLAN_VERSION,
            "model": self.model,
            "cluster": self.cluster.to_dict(),
            "compressor": self.compressor,
            "chosen": self.chosen,
            "flags": dict(self.flags),
            "predicted_s": {
                "plan": self.predicted.plan_s,
                "fp32": self.predicted.fp32_s,
                "fp16": self.predicted.fp16_s,
                "upper_bound": self.predicted.upper_bound_s,
            },
            "selection_s": self.selection_s,
            "tensors": [
                {"name": t.name, "numel": t.numel, "option": t.option.code, "group": t.group} for t in self.tensors
            ],
            "costs": self.costs,
            "profile": None if self.profile is None else json.loads(self.profile.to_json()),
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse ``to_json`` output; every rank does this at ``zensync.register``, so a bad file fails there.

        Steps: 1. parse within the caps of ``zensync.planner._reader`` (size, nesting, strict JSON);
        2. read every field (types, ranges, counts; unknown fields refused); 3. check the embedded
        profile lists the plan's tensors; 4. build the compressor and check every option is one the
        planner offers for it on the plan's cluster. Nothing is returned until all steps pass.

        Raises:
            ValueError: On any failed step; the message names the field (or tensor), the value, the
                bound and why.
        """
        # Step 1: text -> JSON value.
        data = parse_json(text, what="plan")
        # Step 2: fields.
        plan = _read_plan(data)
        # Step 3: the embedded profile.
        if plan.profile is not None:
            _check_profile(plan, plan.profile)
        # Step 4: the compressor and each option.
        _check_options(plan)
        return plan


_PLAN_FIELDS = ("version", "model", "cluster", "compressor", "predicted_s", "selection_s", "tensors")
_PLAN_OPTIONAL = ("chosen", "flags", "costs", "profile")
_PREDICTED_FIELDS = {"plan": "plan_s", "fp32": "fp32_s", "fp16": "fp16_s", "upper_bound": "upper_bound_s"}
_CHOSEN = ("search", "fp32", "fp16")
_FLAGS = ("cpu_offload", "two_level", "fusion")
_MAX_CODE_CHARS = 32
"""Longer than any option code (``comp-a2a-gpu-hier2`` has 18 characters); keeps messages short."""


def _read_plan(data: object) -> Plan:
    """Step 2 of ``Plan.from_json``: every field read and checked, then the ``Plan``."""
    fields = Fields("plan")
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(data, dict) and (type(version) is not int or version != PLAN_VERSION):
        raise ValueError(f"plan version {shorten(version)} is not supported (expected {PLAN_VERSION})")
    data = fields.mapping(data, "", required=_PLAN_FIELDS, optional=_PLAN_OPTIONAL)
    items = fields.array(data["tensors"], "tensors", max_items=MAX_TENSORS, why=TENSORS_WHY)
    predicted = fields.mapping(data["predicted_s"], "predicted_s", required=tuple(_PREDICTED_FIELDS), optional=())
    flags = fields.mapping(data.get("flags", {}), "flags", required=(), optional=_FLAGS)
    chosen = fields.string(data.get("chosen", "search"), "chosen")
    if chosen not in _CHOSEN:
        fields.fail("chosen", chosen, f"must be one of {_CHOSEN}")
    profile = data.get("profile")
    try:
        cluster = ClusterSpec.from_dict(data["cluster"])
    except ValueError as exc:
        raise ValueError(f"plan field 'cluster': {exc}") from None
    return Plan(
        model=fields.string(data["model"], "model"),
        cluster=cluster,
        compressor=fields.string(data["compressor"], "compressor", non_empty=True),
        tensors=tuple(_read_tensor(fields, item, f"tensors[{i}]") for i, item in enumerate(items)),
        predicted=Predictions(
            **{
                name: fields.number(predicted[key], f"predicted_s.{key}", why="seconds per iteration")
                for key, name in _PREDICTED_FIELDS.items()
            }
        ),
        selection_s=fields.number(data["selection_s"], "selection_s", why="seconds the planner took"),
        chosen=chosen,
        flags={name: fields.boolean(value, f"flags.{name}") for name, value in flags.items()},
        profile=None if profile is None else ModelProfile.from_dict(profile, what="plan", field="profile"),
        costs=read_measured_costs(data.get("costs", {}), fields, "costs"),
    )


def _read_tensor(fields: Fields, item: object, field: str) -> PlanTensor:
    data = fields.mapping(item, field, required=("name", "numel", "option", "group"), optional=())
    code = fields.string(data["option"], f"{field}.option")
    if len(code) > _MAX_CODE_CHARS:
        fields.fail(f"{field}.option", code, "must be an option code kind-scheme-device-level, e.g. 'comp-ag-gpu-hier'")
    try:
        option = TensorOption.from_code(code)
    except ValueError as exc:
        raise ValueError(f"plan field {field + '.option'!r}: {exc}") from None
    return PlanTensor(
        name=fields.string(data["name"], f"{field}.name", non_empty=True),
        numel=fields.integer(data["numel"], f"{field}.numel", low=0, high=MAX_NUMEL, why=NUMEL_WHY),
        option=option,
        group=fields.integer(data["group"], f"{field}.group", low=0, high=MAX_TENSORS, why="a fusion group id"),
    )


def _check_profile(plan: Plan, profile: ModelProfile) -> None:
    """Step 3 of ``Plan.from_json``: the profile lists the plan's tensors, in order, with their sizes."""
    if len(profile.tensors) != len(plan.tensors):
        raise ValueError(
            f"plan field 'profile' lists {len(profile.tensors)} tensors, the plan {len(plan.tensors)}; a plan "
            f"embeds the profile it was made for, with the same tensors in the same order"
        )
    for index, (planned, profiled) in enumerate(zip(plan.tensors, profile.tensors, strict=True)):
        if (planned.name, planned.numel) != (profiled.name, profiled.numel):
            raise ValueError(
                f"plan field 'tensors[{index}]' is {planned.name!r} ({planned.numel:,} elements) but "
                f"'profile.tensors[{index}]' is {profiled.name!r} ({profiled.numel:,} elements); a plan embeds "
                f"the profile it was made for, with the same tensors in the same order"
            )


def _check_options(plan: Plan) -> None:
    """Step 4 of ``Plan.from_json``: the compressor builds, and each option is one the planner offers for it
    on the plan's cluster (an allreduce needs summable payloads, alltoall and hier2 a divisible compressor,
    hier and hier2 several nodes of several GPUs), so a bad plan fails at register, not at a backward."""
    try:
        model = measured_compressor_model(plan.compressor, plan.costs)
    except ValueError as exc:
        users = [t.name for t in plan.tensors if t.option.kind == "comp"]
        used = f"tensor {users[0]!r} and {len(users) - 1} other(s) use it" if users else "no tensor uses it"
        raise ValueError(f"plan field 'compressor'={shorten(plan.compressor)} ({used}) is invalid: {exc}") from None
    valid = candidate_options(plan.cluster, model, devices=("gpu", "cpu"), two_level=True)
    for index, tensor in enumerate(plan.tensors):
        if tensor.option not in valid:
            c = plan.cluster
            raise ValueError(
                f"plan tensor {tensor.name!r} (tensors[{index}]): option {tensor.option.code!r} is not offered for "
                f"compressor {plan.compressor!r} (allreduce-compatible: {model.allreduce_compatible}, divisible: "
                f"{model.divisible}) on {c.nodes} node(s) x {c.gpus_per_node} GPU(s); valid: "
                f"{', '.join(o.code for o in valid)}"
            )

"""The plan file: one option and fusion group per parameter name, with the predictions behind them.

Plans are versioned JSON (never pickle), keyed by parameter name, not by DDP bucket index (buckets are
rebuilt after the first iteration)::

    text = plan.to_json()
    same = Plan.from_json(text)
    same.option_for("fc.weight").code  # e.g. "comp-a2a-gpu-hier"
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from zensync.planner.cluster import ClusterSpec
from zensync.planner.options import TensorOption
from zensync.planner.profile import ModelProfile

__all__ = ["PLAN_VERSION", "Plan", "PlanTensor", "Predictions"]

PLAN_VERSION = 1

_RUNTIME_SCHEME = {"ar": "allreduce", "ag": "allgather", "a2a": "alltoall_allgather", "gb": "gather_broadcast"}
"""Option scheme -> ``zensync.sync.compressed`` scheme name."""


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
            raise ValueError(f"plan for {self.model!r}: tensor names must be non-empty and unique")
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
        """(compressor spec, ``zensync.sync.compressed`` scheme) of ``name``; None for float32 or unknown names."""
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
        """Parse ``to_json`` output.

        Raises:
            ValueError: On malformed JSON, a wrong version, a missing or mistyped field, or an unknown
                option code; the message names the field.
        """
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"plan is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"plan must be a JSON object, got {type(data).__name__}")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version')!r} is not supported (expected {PLAN_VERSION})")
        try:
            return _from_dict(data)
        except KeyError as exc:
            raise ValueError(f"plan is missing field {exc.args[0]!r}") from exc
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"plan has a mistyped field: {exc}") from exc


def _from_dict(data: dict[str, Any]) -> Plan:
    predicted = data["predicted_s"]
    tensors = tuple(
        PlanTensor(
            name=_typed(t["name"], str, "tensors[].name"),
            numel=_typed(t["numel"], int, "tensors[].numel"),
            option=TensorOption.from_code(t["option"]),
            group=_typed(t["group"], int, "tensors[].group"),
        )
        for t in data["tensors"]
    )
    flags = data.get("flags", {})
    if not isinstance(flags, dict) or not all(isinstance(v, bool) for v in flags.values()):
        raise ValueError(f"plan field 'flags' must map names to booleans, got {flags!r}")
    costs = data.get("costs", {})
    if not isinstance(costs, dict) or not all(
        isinstance(c, dict) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in c.values())
        for c in costs.values()
    ):
        raise ValueError(f"plan field 'costs' must map cost names to {{field: number}}, got {costs!r}")
    profile = data.get("profile")
    if profile is not None:
        if not isinstance(profile, dict):
            raise ValueError(f"plan field 'profile' must be an object, got {type(profile).__name__}")
        profile = ModelProfile.from_json(json.dumps(profile))
        if [t.name for t in profile.tensors] != [t.name for t in tensors]:
            raise ValueError("plan field 'profile' does not list the plan's tensors in the same order")
    return Plan(
        model=_typed(data["model"], str, "model"),
        cluster=ClusterSpec.from_dict(data["cluster"]),
        compressor=_typed(data["compressor"], str, "compressor"),
        tensors=tensors,
        predicted=Predictions(
            plan_s=predicted["plan"],
            fp32_s=predicted["fp32"],
            fp16_s=predicted["fp16"],
            upper_bound_s=predicted["upper_bound"],
        ),
        selection_s=_typed(data["selection_s"], float, "selection_s"),
        chosen=_typed(data.get("chosen", "search"), str, "chosen"),
        flags=dict(flags),
        profile=profile,
        costs={str(k): {str(f): float(v) for f, v in c.items()} for k, c in costs.items()},
    )


def _typed(value: Any, kind: type, field: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"plan field {field!r} must be {kind.__name__}, got {value!r}")
    return value

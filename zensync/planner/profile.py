"""Model profiles: the planner's view of a model's backward pass (tensors, sizes, gradient-ready times).

A profile lists the gradient tensors in backward order (the order their gradients become ready),
each with its parameter name, shape and the time after the start of backward at which it is ready,
plus the forward and backward durations. Built-in profiles are computed from parameter shapes and a
roofline estimate (``zensync.planner.models``); ``zensync profile`` measures one on a real model.
Profiles are JSON (never pickle) with a version field::

    profile = ModelProfile.from_json(text)
    profile.tensors[0].name, profile.tensors[0].numel, profile.tensors[0].ready_s
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
from typing import Any

from zensync.cost import read_measured_costs
from zensync.planner._reader import MAX_NUMEL, MAX_TENSORS, NUMEL_WHY, TENSORS_WHY, Fields, parse_json, shorten

__all__ = ["PROFILE_VERSION", "MeasuredCosts", "ModelProfile", "TensorProfile", "read_profile_bundle"]

PROFILE_VERSION = 1
MAX_DIMS = 64
"""Most dimensions of one tensor's shape in a profile file (parameters have one to five)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorProfile:
    """One gradient tensor."""

    name: str
    """Parameter name (as in ``model.named_parameters()``, no ``module.`` prefix)."""
    shape: tuple[int, ...]
    ready_s: float
    """Seconds after the start of backward at which this gradient is ready."""
    ready_cv: float = 0.0
    """Coefficient of variation of ``ready_s`` over the profiled iterations (0 for built-ins)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TensorProfile.name must be a non-empty parameter name")
        if any(int(d) != d or d < 0 for d in self.shape):
            raise ValueError(f"TensorProfile {self.name!r}: shape {self.shape} must hold non-negative ints")
        if not (math.isfinite(self.ready_s) and self.ready_s >= 0):
            raise ValueError(f"TensorProfile {self.name!r}: ready_s={self.ready_s} must be a finite time >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """A model's gradient tensors in backward order, with timing."""

    model: str
    """Model name (e.g. "resnet101")."""
    tensors: tuple[TensorProfile, ...]
    """In backward order: ``ready_s`` is non-decreasing."""
    forward_s: float
    """Forward pass duration (communication of the previous step cannot overlap it in DDP)."""
    backward_s: float
    """Backward pass duration; every ``ready_s`` is at most this."""
    dtype_bytes: int = 4
    """Bytes per gradient element (4: float32)."""
    device: str = ""
    """Where the timings come from, e.g. "roofline:H100" or "measured:cuda:NVIDIA H200"."""
    batch: str = ""
    """Per-GPU batch the timings are for, e.g. "32 images"."""

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError(f"profile {self.model!r} has no tensors")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            repeated = next(n for n, count in collections.Counter(names).items() if count > 1)
            raise ValueError(f"profile {self.model!r}: duplicate tensor names ({repeated!r} appears twice or more)")
        for before, after in itertools.pairwise(self.tensors):
            if after.ready_s < before.ready_s:
                raise ValueError(
                    f"profile {self.model!r}: tensors must be in backward order (ready_s non-decreasing); tensor "
                    f"{after.name!r} is ready at {after.ready_s} s, before {before.name!r} at {before.ready_s} s"
                )
        last_ready = self.tensors[-1].ready_s
        if self.forward_s < 0 or self.backward_s < last_ready:
            raise ValueError(
                f"profile {self.model!r}: forward_s={self.forward_s} must be >= 0 and backward_s={self.backward_s} "
                f">= the last ready time {last_ready}"
            )
        if self.dtype_bytes not in (2, 4, 8):
            raise ValueError(f"profile {self.model!r}: dtype_bytes={self.dtype_bytes} must be 2, 4 or 8")

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def gradient_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    def to_json(self) -> str:
        data: dict[str, Any] = {"version": PROFILE_VERSION, **dataclasses.asdict(self)}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        """Parse ``to_json`` output (or a profile written by hand).

        Raises:
            ValueError: On text beyond the caps of ``zensync.planner._reader`` (size, nesting), malformed
                JSON, a wrong version, or a missing, unknown, mistyped or out-of-range field; the message
                names the field, the value, the bound and why.
        """
        return cls.from_dict(parse_json(text, what="profile"))

    @classmethod
    def from_dict(cls, data: object, *, what: str = "profile", field: str = "") -> ModelProfile:
        """Inverse of ``json.loads(profile.to_json())``; ValueError as in ``from_json``.

        Args:
            data: The parsed JSON value.
            what: The file kind, for messages (``"plan"`` when the profile is embedded in a plan).
            field: Where ``data`` sits in that file (``"profile"`` in a plan; ``""`` at the top).

        Returns:
            The profile.
        """
        fields, prefix = Fields(what), f"{field}." if field else ""
        version = data.get("version") if isinstance(data, dict) else None
        if type(version) is not int or version != PROFILE_VERSION:
            where = f"{what} field {field!r}" if field else what
            raise ValueError(f"{where}: profile version {shorten(version)} is not {PROFILE_VERSION}")
        data = fields.mapping(data, field, required=_PROFILE_FIELDS, optional=_PROFILE_OPTIONAL)
        items = fields.array(data["tensors"], f"{prefix}tensors", max_items=MAX_TENSORS, why=TENSORS_WHY)
        values: dict[str, Any] = {
            "tensors": tuple(_read_tensor(fields, item, f"{prefix}tensors[{i}]") for i, item in enumerate(items)),
            "model": fields.string(data["model"], f"{prefix}model"),
            "forward_s": fields.number(data["forward_s"], f"{prefix}forward_s", why="seconds of forward"),
            "backward_s": fields.number(data["backward_s"], f"{prefix}backward_s", why="seconds of backward"),
            "dtype_bytes": fields.integer(
                data.get("dtype_bytes", 4), f"{prefix}dtype_bytes", low=2, high=8, why="bytes per element: 2, 4 or 8"
            ),
            "device": fields.string(data.get("device", ""), f"{prefix}device"),
            "batch": fields.string(data.get("batch", ""), f"{prefix}batch"),
        }
        try:
            return cls(**values)
        except ValueError as exc:  # consistency across fields (order, names), named by __post_init__
            if not field:
                raise
            raise ValueError(f"{what} field {field!r}: {exc}") from None


_PROFILE_FIELDS = ("version", "model", "tensors", "forward_s", "backward_s")
_PROFILE_OPTIONAL = ("dtype_bytes", "device", "batch")
_DIMS_WHY = "parameters have 1 to 5 dimensions; MAX_DIMS"


def _read_tensor(fields: Fields, item: object, field: str) -> TensorProfile:
    data = fields.mapping(item, field, required=("name", "shape", "ready_s"), optional=("ready_cv",))
    dims = fields.array(data["shape"], f"{field}.shape", max_items=MAX_DIMS, why=_DIMS_WHY)
    shape = tuple(
        fields.integer(d, f"{field}.shape[{i}]", low=0, high=MAX_NUMEL, why=NUMEL_WHY) for i, d in enumerate(dims)
    )
    if math.prod(shape) > MAX_NUMEL:
        fields.fail(f"{field}.shape", list(shape), f"holds more than {MAX_NUMEL:,} elements ({NUMEL_WHY})")
    return TensorProfile(
        name=fields.string(data["name"], f"{field}.name", non_empty=True),
        shape=shape,
        ready_s=fields.number(data["ready_s"], f"{field}.ready_s", why="seconds after the start of backward"),
        ready_cv=fields.number(data.get("ready_cv", 0.0), f"{field}.ready_cv", why="a coefficient of variation"),
    )


MeasuredCosts = dict[str, dict[str, dict[str, float]]]
"""Measured compressor costs by compressor spec, then cost name, then fit field (``read_measured_costs``)."""


def read_profile_bundle(text: str, *, what: str = "profile") -> tuple[ModelProfile, MeasuredCosts]:
    """(profile, measured costs by compressor spec) from a ``zensync profile`` file or a bare profile's text.

    Raises:
        ValueError: As ``parse_json`` and ``ModelProfile.from_dict``, or a malformed ``compressor_costs``
            (keyed by compressor spec, each as ``read_measured_costs``).
    """
    data = parse_json(text, what=what)
    if not (isinstance(data, dict) and "profile" in data):
        return ModelProfile.from_dict(data, what=what), {}
    fields = Fields(what)
    # ``comm`` (the measured alpha-beta) and ``version`` are written by ``zensync profile``; not read here.
    data = fields.mapping(data, "", required=("profile",), optional=("version", "compressor_costs", "comm"))
    costs = data.get("compressor_costs", {})
    if not isinstance(costs, dict):  # parse_json gives str keys only
        fields.fail("compressor_costs", costs, "must be an object keyed by compressor spec")
    checked = {spec: read_measured_costs(fits, fields, f"compressor_costs.{spec}") for spec, fits in costs.items()}
    return ModelProfile.from_dict(data["profile"], what=what, field="profile"), checked

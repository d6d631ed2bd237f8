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

import dataclasses
import itertools
import json
import math
from typing import Any

__all__ = ["PROFILE_VERSION", "ModelProfile", "TensorProfile"]

PROFILE_VERSION = 1


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
            raise ValueError(f"profile {self.model!r}: duplicate tensor names")
        ready = [t.ready_s for t in self.tensors]
        if any(b < a for a, b in itertools.pairwise(ready)):
            raise ValueError(f"profile {self.model!r}: tensors must be in backward order (ready_s non-decreasing)")
        if self.forward_s < 0 or self.backward_s < ready[-1]:
            raise ValueError(
                f"profile {self.model!r}: forward_s={self.forward_s} must be >= 0 and backward_s={self.backward_s} "
                f">= the last ready time {ready[-1]}"
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
        """Parse a profile; ValueError on malformed JSON, a wrong version or invalid fields."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            found = data.get("version") if isinstance(data, dict) else None
            raise ValueError(f"profile version {found!r} is not {PROFILE_VERSION}")
        try:
            tensors = tuple(
                TensorProfile(
                    name=str(t["name"]),
                    shape=tuple(int(d) for d in t["shape"]),
                    ready_s=float(t["ready_s"]),
                    ready_cv=float(t.get("ready_cv", 0.0)),
                )
                for t in data["tensors"]
            )
            fields = {k: data[k] for k in ("model", "forward_s", "backward_s") if k in data}
            return cls(
                tensors=tensors,
                model=str(fields["model"]),
                forward_s=float(fields["forward_s"]),
                backward_s=float(fields["backward_s"]),
                dtype_bytes=int(data.get("dtype_bytes", 4)),
                device=str(data.get("device", "")),
                batch=str(data.get("batch", "")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile is missing or mistypes a field: {exc!r}") from exc

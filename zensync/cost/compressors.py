"""What a compressor costs: payload size and compress/decompress time, modelled or measured.

Compression costs follow Espresso's simulator (reference/espresso.md 1.6): on the GPU, a constant per
(compressor, operation) for tensors of at most 2**20 elements and linear scaling above; on the CPU,
bytes * 8 / 20 Gbit/s on one worker. Measured costs (``zensync profile``) replace them: ``CostFit`` is
one operation fitted by ``zensync.profiling``, and ``measured_compressor_model`` builds a model from
measured ``AffineCost`` fields::

    model = CompressorModel.family("dgc", bits_per_element=0.64, allreduce_compatible=False)
    model.payload_bytes(2**20)  # 83886 bytes: values + indices of 1 %

Every time function accepts a float or a float64 numpy array (the planner prices all tensors at once).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from zensync.cost.collectives import FloatArray, Num
from zensync.cost.fields import MAX_NUMEL, NUMEL_WHY, Fields

__all__ = [
    "FP16_MODEL",
    "FP32_MODEL",
    "GPU_KNEE_ELEMENTS",
    "MEASURABLE_COSTS",
    "AffineCost",
    "CompressorModel",
    "CostFit",
    "Device",
    "compressor_model",
    "measured_compressor_model",
    "read_measured_costs",
    "shape_priced",
]

Device = Literal["gpu", "cpu"]

GPU_KNEE_ELEMENTS = 2**20
"""Espresso's GPU compression cost is constant up to this many elements and linear above."""
_CPU_BYTES_PER_S = 20e9 / 8
"""Espresso's CPU compression speed: 20 Gbit/s of float32 input per worker."""
_CPU_FIXED_S = 15e-6
"""CPU latency floor per call: Espresso's microbenchmark measures 13-19 us at 2**10 elements."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AffineCost:
    """Seconds for ``numel`` elements: ``fixed_s + per_element_s * max(0, numel - knee_elements)``.

    With ``knee_elements = 0`` this is the affine ``a + b * numel``; Espresso's GPU model is
    ``fixed_s = c``, ``per_element_s = c / 2**20``, ``knee_elements = 2**20`` (constant below, linear above).
    """

    fixed_s: float = 0.0
    """Seconds charged for any call (kernel launch, Python overhead)."""
    per_element_s: float = 0.0
    """Seconds per element above the knee."""
    knee_elements: int = 0
    """Elements covered by ``fixed_s``."""

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_element_s", "knee_elements"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"AffineCost.{name}={value!r} must be finite and >= 0")

    @classmethod
    def espresso_gpu(cls, seconds_at_knee: float) -> AffineCost:
        """Espresso's GPU shape: ``seconds_at_knee`` up to 2**20 elements, proportional above."""
        return cls(fixed_s=seconds_at_knee, per_element_s=seconds_at_knee / GPU_KNEE_ELEMENTS, knee_elements=2**20)

    def __call__(self, numel: Num) -> Num:
        return self.fixed_s + self.per_element_s * np.maximum(numel - self.knee_elements, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CostFit:
    """seconds = fixed_s + per_element_s * numel, fitted to measured (numel, seconds) points."""

    fixed_s: float
    per_element_s: float
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    """The measured medians the fit came from."""

    def at(self, numel: int) -> float:
        return self.fixed_s + self.per_element_s * numel


_CPU_COST = AffineCost(fixed_s=_CPU_FIXED_S, per_element_s=4 / _CPU_BYTES_PER_S)
_ZERO_COST = AffineCost()

# Espresso 1.6, one-level column, at 2**20 elements: (encode us, decode us) = (total - decode, decode).
# Families Espresso did not measure borrow a measured one; "assumed" marks them.
_GPU_US: dict[str, tuple[float, float]] = {
    "none": (0.0, 0.0),
    "fp16": (4.0, 22.0),
    "bf16": (4.0, 22.0),  # assumed: as fp16
    "randomk": (54.0, 34.0),
    "dgc": (356.0, 34.0),
    "topk": (356.0, 34.0),  # assumed: as dgc
    "efsignsgd": (130.0, 140.0),
    "signsgd": (130.0, 140.0),  # assumed: as efsignsgd
    "qsgd": (130.0, 140.0),  # assumed: as efsignsgd
    "terngrad": (130.0, 140.0),  # assumed: as efsignsgd
    "onebit": (450.0, 170.0),
    "powersgd": (450.0, 170.0),  # assumed: as onebit
}
_SPARSIFIERS = frozenset({"randomk", "topk", "dgc"})
_SHAPE_PRICED = frozenset({"powersgd"})
"""Compressors whose payload is a function of the matrix shape, not of the size alone."""
_INDIVISIBLE = frozenset({"powersgd"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CompressorModel:
    """What the planner needs to know about one compressor: payload size, flags and costs."""

    spec: str
    """Spec string, as for ``zensync.compress.build`` (e.g. ``"dgc:0.01"``)."""
    bits_per_element: float
    """Payload bits per gradient element (32 x ratio; sparsifiers count values and indices)."""
    fixed_payload_bytes: int = 0
    """Payload bytes independent of size (a scale, a norm)."""
    payload_fn: Callable[[int], int] | None = None
    """Exact payload bytes of ``numel`` elements (a compressor's ``payload_bytes``); overrides the ratio."""
    allreduce_compatible: bool
    """Payloads of different ranks may be summed (fp16, shared-seed random-k): an allreduce scheme exists."""
    divisible: bool = True
    """Payloads split into chunks that can be decompressed, aggregated and re-compressed (alltoall schemes)."""
    sparse: bool = False
    """A sparsifier (random-k, top-k, DGC). Descriptive only: decoding is priced from the payload size
    for every compressor (``aggregate_elements``)."""
    gpu_compress: AffineCost
    gpu_decompress: AffineCost
    cpu_compress: AffineCost = _CPU_COST
    cpu_decompress: AffineCost = _CPU_COST

    def __post_init__(self) -> None:
        if not self.spec:
            raise ValueError("CompressorModel.spec must be a non-empty spec string such as 'dgc:0.01'")
        if not (math.isfinite(self.bits_per_element) and self.bits_per_element > 0):
            raise ValueError(f"CompressorModel.bits_per_element={self.bits_per_element!r} must be > 0")
        if self.fixed_payload_bytes < 0:
            raise ValueError(f"CompressorModel.fixed_payload_bytes={self.fixed_payload_bytes!r} must be >= 0")

    @classmethod
    def family(
        cls, name: str, *, bits_per_element: float, allreduce_compatible: bool, **fields: Any
    ) -> CompressorModel:
        """A model with Espresso's default costs for compressor family ``name`` (see ``_GPU_US``).

        Args:
            name: Family name, e.g. ``"dgc"``; also the spec unless ``spec=`` is given.
            bits_per_element: Payload bits per element.
            allreduce_compatible: Whether payloads can be summed.
            **fields: Overrides of any other field.

        Returns:
            The model.

        Raises:
            ValueError: If the family is unknown (the valid ones are listed).

        Example::

            CompressorModel.family("efsignsgd", bits_per_element=1.0, allreduce_compatible=False)
        """
        if name not in _GPU_US:
            raise ValueError(f"compressor family {name!r} has no default costs; valid: {', '.join(sorted(_GPU_US))}")
        encode_us, decode_us = _GPU_US[name]
        defaults: dict[str, Any] = {
            "spec": name,
            "divisible": name not in _INDIVISIBLE,
            "sparse": name in _SPARSIFIERS,
            "gpu_compress": AffineCost.espresso_gpu(encode_us * 1e-6),
            "gpu_decompress": AffineCost.espresso_gpu(decode_us * 1e-6),
        }
        if name == "none":
            defaults.update(cpu_compress=_ZERO_COST, cpu_decompress=_ZERO_COST)
        defaults.update(fields)
        return cls(bits_per_element=bits_per_element, allreduce_compatible=allreduce_compatible, **defaults)

    def payload_bytes(self, numel: int) -> int:
        """Bytes on the wire for ``numel`` float32 elements."""
        if self.payload_fn is not None:
            return int(self.payload_fn(int(numel)))
        return math.ceil(numel * self.bits_per_element / 8) + self.fixed_payload_bytes

    def payload_array(self, numel: FloatArray, cache: dict[int, int] | None = None) -> FloatArray:
        """``payload_bytes`` of every element count in ``numel`` (cached per distinct count)."""
        if self.payload_fn is None:
            return np.ceil(numel * self.bits_per_element / 8) + float(self.fixed_payload_bytes)
        memo = {} if cache is None else cache
        values = []
        for count in numel.astype(np.int64).ravel().tolist():  # a dict per count: cheaper than np.unique here
            if count not in memo:
                memo[count] = self.payload_bytes(count)
            values.append(memo[count])
        return np.array(values, dtype=np.float64).reshape(numel.shape)

    def compress_s(self, device: Device, numel: Num) -> Num:
        """Seconds to compress ``numel`` elements on ``device``."""
        return (self.gpu_compress if device == "gpu" else self.cpu_compress)(numel)

    def decompress_s(self, device: Device, numel: Num) -> Num:
        """Seconds to decompress into ``numel`` elements on ``device``."""
        return (self.gpu_decompress if device == "gpu" else self.cpu_decompress)(numel)

    def aggregate_elements(
        self, numel: FloatArray, count: int, cache: dict[int, int] | None = None, payload: FloatArray | None = None
    ) -> FloatArray:
        """Work, in elements, of decompressing ``count`` payloads of ``numel`` elements and summing them.

        One fused decode-and-accumulate pass: the output is written once (``numel``) and each further
        payload is read once, in proportion to its size (a scatter-add of a sparsifier's kept values,
        a 1-bit or 8-bit stream of a quantizer): ``numel * (1 + (count - 1) * payload / dense bytes)``.
        Decoding each quantized payload into its own dense tensor first would cost ``numel * count``;
        the fused pass is what a GPU kernel does, and what Espresso's per-tensor decode constants assume.
        """
        if count <= 1:
            return numel
        if payload is None:
            payload = self.payload_array(numel, cache)
        payload_fraction = payload / np.maximum(numel * 4.0, 1.0)
        return numel + (count - 1) * numel * np.minimum(payload_fraction, 1.0)


FP32_MODEL = CompressorModel.family("none", bits_per_element=32.0, allreduce_compatible=True)
"""Uncompressed float32: no compression cost."""
FP16_MODEL = CompressorModel.family("fp16", bits_per_element=16.0, allreduce_compatible=True)
"""The fp16 cast baseline (Espresso: 26 us per 2**20 elements on the GPU, 22 of them decode)."""


def compressor_model(spec: str, overrides: Mapping[str, Any] | None = None) -> CompressorModel:
    """The model of a registered compressor: payload size and flags from ``zensync.compress.build(spec)``.

    Costs default to Espresso's for the compressor's family (``CompressorModel.family``). Steps:

    1. build the compressor and check the override names;
    2. combine the family defaults, the compressor's payload formula and flags, and the overrides.

    Args:
        spec: Compressor spec string, e.g. ``"dgc:0.01"`` or ``"efsignsgd"``.
        overrides: Field values that replace the defaults, e.g. ``{"gpu_compress": AffineCost(...)}``.

    Returns:
        The model, with ``payload_fn`` bound to the compressor's ``payload_bytes``.

    Raises:
        ValueError: If the spec is invalid or an override names an unknown field.

    Example::

        compressor_model("dgc:0.01").payload_bytes(1_000_000)
    """
    # Step 1: the compressor (imported here: the registry is filled by zensync.compress's modules) and
    # the override names.
    from zensync import compress

    comp = compress.build(spec)
    if comp.name in _SHAPE_PRICED:
        raise ValueError(
            f"compressor {spec!r} cannot be planned: its payload depends on each tensor's matrix shape, and the "
            f"planner prices tensors by size; use it directly as a hook strategy (zensync.register(ddp, "
            f"strategy={spec!r})), which compresses every matrix whose low-rank form is smaller"
        )
    extra = dict(overrides or {})
    valid = {f.name for f in dataclasses.fields(CompressorModel)}
    unknown = sorted(set(extra) - valid)
    if unknown:
        raise ValueError(f"compressor_model overrides {unknown} are not fields; valid: {sorted(valid)}")
    if comp.name not in _GPU_US and not {"gpu_compress", "gpu_decompress"} <= set(extra):
        raise ValueError(
            f"compressor {comp.name!r} has no default costs (known: {', '.join(sorted(_GPU_US))}); "
            f"pass overrides={{'gpu_compress': AffineCost(...), 'gpu_decompress': AffineCost(...)}}"
        )
    # Step 2: family defaults, the compressor's own payload formula and flags, then the overrides.
    fields: dict[str, Any] = {
        "spec": comp.spec(),
        "payload_fn": comp.payload_bytes,
        "divisible": comp.name not in _INDIVISIBLE,
        "sparse": comp.name in _SPARSIFIERS,
        **extra,
    }
    bits = comp.payload_bytes(GPU_KNEE_ELEMENTS) * 8 / GPU_KNEE_ELEMENTS
    family = comp.name if comp.name in _GPU_US else "onebit"  # GPU costs overridden above
    return CompressorModel.family(
        family, bits_per_element=bits, allreduce_compatible=comp.allreduce_compatible, **fields
    )


def shape_priced(spec: str) -> str | None:
    """The spec of ``spec``'s compressor when its payload and work follow each tensor's matrix shape
    (PowerSGD: ``compressor_model`` refuses it, a step profile times it per bucket); None otherwise.

    Raises:
        ValueError: If the spec is invalid.
    """
    from zensync import compress

    comp = compress.build(spec)
    return comp.spec() if comp.name in _SHAPE_PRICED else None


MEASURABLE_COSTS = ("gpu_compress", "gpu_decompress", "cpu_compress", "cpu_decompress")
"""``CompressorModel`` fields that measured costs (``zensync profile``, a plan's ``costs``) may replace."""
_FIT_FIELDS = ("fixed_s", "per_element_s", "knee_elements")


def measured_compressor_model(spec: str, costs: Mapping[str, Any]) -> CompressorModel:
    """``compressor_model(spec)`` with measured costs: ``CompressorModel`` field -> ``AffineCost`` fields.

    Args:
        spec: Compressor spec string, e.g. ``"topk:0.01"``.
        costs: e.g. ``{"gpu_compress": {"fixed_s": 2e-5, "per_element_s": 1e-10, "knee_elements": 0}}``;
            names from ``MEASURABLE_COSTS``, missing ``AffineCost`` fields are 0.

    Returns:
        The model.

    Raises:
        ValueError: If the spec is invalid or ``costs`` is not of that form (finite, non-negative numbers).
    """
    fits = read_measured_costs(costs, Fields("measured costs"), "")
    overrides: dict[str, Any] = {name: AffineCost(**fit) for name, fit in fits.items()}  # type: ignore[arg-type]
    return compressor_model(spec, overrides or None)


def read_measured_costs(value: object, fields: Fields, field: str) -> dict[str, dict[str, float]]:
    """``value`` checked as ``{name in MEASURABLE_COSTS: {AffineCost field: number}}`` (a copy); ValueError
    from ``fields`` naming ``field`` otherwise. ``knee_elements`` stays an int."""
    data = fields.mapping(value, field, required=(), optional=MEASURABLE_COSTS)
    fits: dict[str, dict[str, float]] = {}
    for name, fit in data.items():
        where = f"{field}.{name}" if field else name
        fit = fields.mapping(fit, where, required=(), optional=_FIT_FIELDS)
        fits[name] = {
            key: fields.integer(v, f"{where}.{key}", low=0, high=MAX_NUMEL, why=NUMEL_WHY)
            if key == "knee_elements"
            else fields.number(v, f"{where}.{key}", why="seconds (per call, or per element)")
            for key, v in fit.items()
        }
    return fits

"""Per-tensor options: a reduced but faithful version of Espresso's decision tree, and what each costs.

An option fixes, for one tensor (or one fused group), whether and how it is compressed (``kind``), the
collective scheme (``scheme``), where compression runs (``device``) and whether communication is flat
or two-level (``level``). Its stable string code (``TensorOption.code``) is what plan files store.
Mapping to Espresso's runtime codes (reference/espresso.md 1.6):

============================  =========================================================  ========
code                          pipeline                                                   Espresso
============================  =========================================================  ========
fp32-ar-gpu-flat / -hier      float32 allreduce (ring; or intra RS, inter AR, intra AG)  0
fp16-ar-gpu-flat / -hier      fp16 cast + allreduce                                      1
comp-ar-*-flat / -hier        allreduce of the payloads (allreduce-compatible only)      --
comp-ag-gpu-flat              compress, allgather, decompress + sum                      10
comp-a2a-gpu-flat             compress, alltoall, chunk owners decompress + sum +        11
                              re-compress, allgather, decompress
comp-gb-gpu-flat              compress, gather to a root, root decompresses + sums +     --
                              re-compresses, broadcast, decompress
comp-ag-gpu-hier              intra reduce-scatter (fp32), inter compressed allgather    4
                              on the 1/g shard, intra allgather (fp32)
comp-a2a-gpu-hier             as above with inter alltoall + allgather                   3
comp-gb-gpu-hier              as above with inter gather + broadcast                     2
comp-{ag,a2a,gb}-gpu-hier2    intra compress + alltoall + decompress/sum replaces the    9, 7, 6
                              intra reduce-scatter (two-level compression)
comp-*-cpu-*                  the same pipelines with compression on the CPU workers     5 (*)
============================  =========================================================  ========

(*) Espresso's CPU option 5 runs BytePS push/pull; here a CPU option keeps the collectives of its
scheme and moves every compress/decompress to a CPU worker, plus the GPU<->CPU copies.

Cost of an option (``option_costs``), for the timeline simulator: ``compute_s`` is charged to the
compute stream at the tensor's ready time (the first GPU encode, as Espresso charges it), then the
tensor passes its ``stages`` in order, each on a resource: ``wait`` (a GPU kernel before the first
collective; no shared resource), ``comm`` (the one FIFO communication stream; GPU kernels between
collectives and the final GPU decode run on it) or ``cpu`` (one worker of the CPU pool).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import numpy as np

from zensync.cost import (
    FP16_MODEL,
    CompressorModel,
    Device,
    FloatArray,
    allgather_s,
    allreduce_s,
    alltoall_s,
    broadcast_s,
    gather_s,
    reduce_scatter_s,
)
from zensync.planner.cluster import ClusterSpec

__all__ = [
    "FP16_OPTION",
    "FP32_OPTION",
    "SCHEMES",
    "OptionCosts",
    "Resource",
    "Scheme",
    "TensorOption",
    "candidate_options",
    "option_costs",
]

Kind = Literal["fp32", "fp16", "comp"]
Scheme = Literal["ar", "ag", "a2a", "gb"]
Level = Literal["flat", "hier", "hier2"]
Resource = Literal["wait", "comm", "cpu"]
SCHEMES: tuple[Scheme, ...] = get_args(Scheme)
"""Every scheme: ``ar`` allreduce, ``ag`` allgather, ``a2a`` alltoall + allgather, ``gb`` gather + broadcast."""

_ESPRESSO_CODE = {("ag", "flat"): 10, ("a2a", "flat"): 11, ("ag", "hier"): 4, ("a2a", "hier"): 3, ("gb", "hier"): 2}
_ESPRESSO_CODE.update({("ag", "hier2"): 9, ("a2a", "hier2"): 7, ("gb", "hier2"): 6})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorOption:
    """How one tensor (or fused group) is synchronized; see the module docstring for the table."""

    kind: Kind
    """``fp32`` (uncompressed), ``fp16`` (cast) or ``comp`` (the plan's compressor)."""
    scheme: Scheme = "ar"
    """``ar`` allreduce, ``ag`` allgather, ``a2a`` alltoall + allgather, ``gb`` gather + broadcast."""
    device: Device = "gpu"
    """Where compress/decompress run."""
    level: Level = "flat"
    """``flat`` over all ranks; ``hier``: fp32 intra reduce-scatter, compressed inter phase, intra
    allgather; ``hier2``: the intra phase is compressed too."""

    def __post_init__(self) -> None:
        for name, literal in (("kind", Kind), ("scheme", Scheme), ("device", Device), ("level", Level)):
            if getattr(self, name) not in get_args(literal):
                raise ValueError(f"TensorOption.{name}={getattr(self, name)!r}; valid: {get_args(literal)}")
        if self.kind != "comp" and (self.scheme != "ar" or self.device != "gpu" or self.level == "hier2"):
            raise ValueError(f"TensorOption {self.code!r}: {self.kind} runs as a GPU allreduce, flat or hier only")
        if self.scheme == "ar" and self.level == "hier2":
            raise ValueError(f"TensorOption {self.code!r}: an allreduce scheme has no compressed intra phase")

    @property
    def code(self) -> str:
        """Stable string for plan files, e.g. ``"comp-a2a-gpu-hier"``."""
        return f"{self.kind}-{self.scheme}-{self.device}-{self.level}"

    @classmethod
    def from_code(cls, code: str) -> TensorOption:
        """Inverse of ``code``; ValueError naming the code and the expected form."""
        parts = code.split("-") if isinstance(code, str) else []
        if len(parts) != 4:
            raise ValueError(f"option code {code!r}: expected kind-scheme-device-level, e.g. 'comp-ag-gpu-hier'")
        try:
            return cls(kind=parts[0], scheme=parts[1], device=parts[2], level=parts[3])  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"option code {code!r} is invalid: {exc}") from exc

    @property
    def espresso_code(self) -> int | None:
        """The nearest option code of Espresso's runtime, or None where Espresso has no equivalent."""
        if self.kind != "comp":
            return 0 if self.kind == "fp32" else 1
        if self.device == "cpu":
            return 5
        return _ESPRESSO_CODE.get((self.scheme, self.level))

    def on(self, device: Device) -> TensorOption:
        """The same option with compression on ``device``."""
        return dataclasses.replace(self, device=device)


FP32_OPTION = TensorOption(kind="fp32")
FP16_OPTION = TensorOption(kind="fp16")


def candidate_options(
    cluster: ClusterSpec,
    model: CompressorModel,
    *,
    devices: tuple[Device, ...] = ("gpu",),
    two_level: bool = False,
    schemes: tuple[Scheme, ...] = SCHEMES,
    hierarchical: bool = True,
) -> tuple[TensorOption, ...]:
    """Every valid option for ``model`` on ``cluster``: fp32 and fp16 allreduce, then compressed ones.

    ``devices``, ``schemes`` and ``hierarchical`` restrict the space (user constraints, reference/espresso.md
    1.3; the restricted planners of Espresso's ablation, 1.7): e.g. ``schemes=("ar",)`` keeps only
    allreduce-compatible compression, ``devices=()`` only the fp32 and fp16 baselines.

    Args:
        cluster: The cluster; two-level options exist only with several nodes of several GPUs.
        model: The compressor; ``ar`` needs ``allreduce_compatible``, ``a2a`` and ``hier2`` need ``divisible``.
        devices: Devices for compressed options.
        two_level: Also offer ``hier2`` (compressed intra-node phase).
        schemes: Schemes allowed for compressed options (those the compressor cannot run are left out).
        hierarchical: Offer two-level communication (``hier``, ``hier2``) at all, for every kind.

    Returns:
        The options, baselines first.

    Raises:
        ValueError: If ``schemes`` names an unknown scheme.

    Example::

        candidate_options(cluster, model, devices=("gpu", "cpu"), two_level=True)
    """
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        raise ValueError(f"candidate_options schemes={schemes!r}: {unknown} unknown; valid: {SCHEMES}")
    levels: tuple[Level, ...] = ("flat", "hier") if cluster.hierarchical and hierarchical else ("flat",)
    options = [TensorOption(kind=kind, level=level) for kind in ("fp32", "fp16") for level in levels]
    supported: list[Scheme] = ["ar"] if model.allreduce_compatible else []
    supported += ["ag", "a2a", "gb"] if model.divisible else ["ag", "gb"]
    schemes = tuple(s for s in supported if s in schemes)
    for device in devices:
        for scheme in schemes:
            comp_levels = levels
            if two_level and len(levels) > 1 and model.divisible and scheme != "ar":
                comp_levels = (*levels, "hier2")
            options += [TensorOption(kind="comp", scheme=scheme, device=device, level=lv) for lv in comp_levels]
    return tuple(options)


@dataclasses.dataclass(frozen=True, slots=True)
class OptionCosts:
    """One option priced for an array of element counts (one entry per tensor or group)."""

    compute_s: FloatArray
    """Charged to the compute stream at the ready time (delays every later gradient)."""
    stages: tuple[tuple[Resource, FloatArray], ...]
    """In order, after the ready time: (resource, seconds)."""
    kernel_s: FloatArray
    """Total compress + decompress kernel time on the option's device (zero for fp32 and upper bound)."""


# A pipeline step before it is placed on a device: ("comm", seconds), ("enc", elements) or
# ("dec", work elements, output elements).
_Op = tuple[str, FloatArray] | tuple[str, FloatArray, FloatArray]


class _Pricer:
    """Collective and payload prices for one (cluster, model, dtype)."""

    def __init__(self, cluster: ClusterSpec, model: CompressorModel, dtype_bytes: int, cache: dict[int, int]) -> None:
        self.model, self.dtype_bytes, self.cache = model, dtype_bytes, cache
        g, n = cluster.gpus_per_node, cluster.nodes
        b_intra, b_inter = cluster.intra_bandwidth_bytes_per_s, cluster.inter_bandwidth_bytes_per_s
        self.intra = (g, b_intra, cluster.intra_latency_s)
        # g concurrent inter-node collectives (one per local rank) share the node's NIC.
        self.inter = (n, b_inter / g, cluster.inter_latency_s)
        if n == 1:
            self.flat_ring = self.flat_a2a = self.intra
        else:
            # A flat ring crosses each NIC once; alltoall traffic of the node's g ranks shares it.
            ring_bw, a2a_bw = b_inter, b_inter / g
            if g > 1:
                ring_bw, a2a_bw = min(b_intra, ring_bw), min(b_intra, a2a_bw)
            self.flat_ring = (n * g, ring_bw, cluster.inter_latency_s)
            self.flat_a2a = (n * g, a2a_bw, cluster.inter_latency_s)

    def payload(self, numel: FloatArray) -> FloatArray:
        return self.model.payload_array(numel, self.cache)

    def exchange(self, scheme: Scheme, numel: FloatArray, flat: bool) -> list[_Op]:
        """Ops after the encode of ``numel`` elements: the compressed exchange and its decodes."""
        ring, a2a = (self.flat_ring, self.flat_a2a) if flat else (self.inter, self.inter)
        ranks, payload, agg = ring[0], self.payload(numel), self.model.aggregate_elements
        if scheme == "ag":
            return [("comm", allgather_s(payload, *ring)), ("dec", agg(numel, ranks, payload=payload), numel)]
        if scheme == "gb":
            return [
                ("comm", gather_s(payload, *ring)),
                ("dec", agg(numel, ranks, payload=payload), numel),
                ("enc", numel),
                ("comm", broadcast_s(payload, *ring)),
                ("dec", numel, numel),
            ]
        chunk = np.ceil(numel / ranks)
        chunk_payload = self.payload(chunk)
        return [
            ("comm", alltoall_s(payload, *a2a)),
            ("dec", agg(chunk, ranks, payload=chunk_payload), chunk),
            ("enc", chunk),
            ("comm", allgather_s(chunk_payload, *ring)),
            ("dec", numel, numel),
        ]

    def ops(self, option: TensorOption, numel: FloatArray) -> list[_Op]:
        """The option's pipeline as device-independent ops."""
        g, dense = self.intra[0], numel * self.dtype_bytes
        shard = np.ceil(numel / g)
        if option.scheme == "ar":
            nbytes = dense if option.kind == "fp32" else self.payload(numel)
            if option.level == "flat":
                comm = allreduce_s(nbytes, *self.flat_ring)
            else:
                comm = reduce_scatter_s(nbytes, *self.intra) + allreduce_s(nbytes / g, *self.inter)
                comm = comm + allgather_s(nbytes / g, *self.intra)
            if option.kind == "fp32":
                return [("comm", comm)]
            return [("enc", numel), ("comm", comm), ("dec", numel, numel)]
        if option.level == "flat":
            return [("enc", numel), *self.exchange(option.scheme, numel, flat=True)]
        if option.level == "hier":
            head: list[_Op] = [("comm", reduce_scatter_s(dense, *self.intra)), ("enc", shard)]
        else:
            agg = self.model.aggregate_elements(shard, g, self.cache)
            head = [("enc", numel), ("comm", alltoall_s(self.payload(numel), *self.intra)), ("dec", agg, shard)]
            head.append(("enc", shard))
        tail: list[_Op] = [("comm", allgather_s(shard * self.dtype_bytes, *self.intra))]
        return [*head, *self.exchange(option.scheme, shard, flat=False), *tail]


def option_costs(
    option: TensorOption,
    numel: FloatArray,
    cluster: ClusterSpec,
    model: CompressorModel,
    *,
    dtype_bytes: int = 4,
    upper_bound: bool = False,
    fp16_model: CompressorModel = FP16_MODEL,
    cache: dict[int, int] | None = None,
) -> OptionCosts:
    """Price ``option`` for every element count in ``numel``.

    Steps:

    1. write the option's pipeline as device-independent ops (collectives, encodes, decodes);
    2. place them: on the GPU the first encode is charged to the compute stream, kernels before the
       first collective form the ``wait`` stage and everything after it runs on the comm stream; on
       the CPU each run of kernels is a ``cpu`` stage, with the GPU->CPU copy of the gradient before
       the first and the CPU->GPU copy of the result after the last.

    Args:
        option: The option.
        numel: Element counts (float64 array), one per tensor or fused group.
        cluster: The cluster.
        model: The plan's compressor (used by ``comp`` options).
        dtype_bytes: Bytes per gradient element.
        upper_bound: Zero-cost compression and no compute interference (Espresso's Upper Bound).
        fp16_model: The compressor used by ``fp16`` options.
        cache: Memo of ``model.payload_bytes`` per element count, shared across calls.

    Returns:
        ``OptionCosts`` with arrays shaped like ``numel``.

    Example::

        costs = option_costs(TensorOption(kind="comp", scheme="ag"), np.array([1e6]), cluster, model)
    """
    # Step 1: the pipeline.
    active = fp16_model if option.kind == "fp16" else model
    ops = _Pricer(cluster, active, dtype_bytes, cache if option.kind == "comp" and cache is not None else {}).ops(
        option, numel
    )
    # Step 2: placement.
    if option.device == "gpu":
        return _gpu_stages(ops, active, numel, upper_bound)
    copy_s_per_element = 0.0 if upper_bound else dtype_bytes / cluster.pcie_bandwidth_bytes_per_s
    return _cpu_stages(ops, active, numel, upper_bound, copy_s_per_element)


def _kernel_s(op: _Op, device: Device, model: CompressorModel) -> FloatArray:
    return model.compress_s(device, op[1]) if op[0] == "enc" else model.decompress_s(device, op[1])


def _gpu_stages(ops: list[_Op], model: CompressorModel, numel: FloatArray, upper_bound: bool) -> OptionCosts:
    zeros = np.zeros_like(numel, dtype=np.float64)
    compute, wait, comm, kernels = zeros, zeros, zeros, zeros
    seen_comm, seen_encode = False, False
    for op in ops:
        if op[0] == "comm":
            comm, seen_comm = comm + op[1], True
            continue
        cost = zeros if upper_bound else _kernel_s(op, "gpu", model)
        kernels = kernels + cost
        if op[0] == "enc" and not seen_encode:
            compute, seen_encode = cost, True
        if seen_comm:
            comm = comm + cost
        else:
            wait = wait + cost
    return OptionCosts(compute, (("wait", wait), ("comm", comm)), kernels)


def _cpu_stages(
    ops: list[_Op], model: CompressorModel, numel: FloatArray, upper_bound: bool, copy_s_per_element: float
) -> OptionCosts:
    stages: list[tuple[Resource, FloatArray]] = []
    kernels = np.zeros_like(numel)
    first_encode: tuple[int, FloatArray] | None = None
    last_decode: tuple[int, FloatArray] | None = None
    for op in ops:
        resource: Resource = "comm" if op[0] == "comm" else "cpu"
        if op[0] == "comm":
            cost = op[1]
        else:
            cost = np.zeros_like(numel) if upper_bound else _kernel_s(op, "cpu", model)
            kernels = kernels + cost
        if stages and stages[-1][0] == resource:
            stages[-1] = (resource, stages[-1][1] + cost)
        else:
            stages.append((resource, cost))
        if op[0] == "enc" and first_encode is None:
            first_encode = (len(stages) - 1, op[1])
        if op[0] == "dec":
            last_decode = (len(stages) - 1, op[2])  # type: ignore[misc]
    assert first_encode is not None and last_decode is not None, "a CPU option compresses and decompresses"
    for index, elements in (first_encode, last_decode):
        stages[index] = (stages[index][0], stages[index][1] + elements * copy_s_per_element)
    return OptionCosts(np.zeros_like(numel), tuple(stages), kernels)

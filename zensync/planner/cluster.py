"""The planner's view of a cluster: node and GPU counts, link bandwidths and latencies, CPU workers.

Bandwidths are bytes per second per link (per node for the inter-node network interface, shared by
the node's GPUs); latencies are charged once per collective, as Espresso's simulator does (its alpha
of 150 us per collective, reference/espresso.md 1.6). Strings such as ``"25Gbit"``, ``"12.5GB/s"`` or
the presets ``"nvlink"`` and ``"pcie"`` are parsed by ``parse_bandwidth``::

    cluster = ClusterSpec.from_strings(nodes=8, gpus_per_node=8, inter="25Gbit", intra="pcie")
    cluster.world_size  # 64
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from zensync.planner._reader import clip, finite, shorten

__all__ = [
    "BANDWIDTH_PRESETS",
    "DEFAULT_INTER_LATENCY_S",
    "DEFAULT_INTRA_LATENCY_S",
    "MAX_CPU_WORKERS",
    "MAX_WORLD_SIZE",
    "PCIE_BYTES_PER_S",
    "ClusterSpec",
    "parse_bandwidth",
]

NVLINK_BYTES_PER_S = 1e3 / 0.02e-6
"""Espresso's beta_intra for NVLink, 0.02 us per KB (reference/espresso.md 1.6): 50 GB/s."""
PCIE_BYTES_PER_S = 1e3 / 0.4e-6
"""Espresso's beta_intra for PCIe, 0.4 us per KB: 2.5 GB/s. Also the default GPU<->CPU copy speed."""
BANDWIDTH_PRESETS: dict[str, float] = {"nvlink": NVLINK_BYTES_PER_S, "pcie": PCIE_BYTES_PER_S}
"""Named link speeds accepted by ``parse_bandwidth``, bytes per second."""
DEFAULT_INTER_LATENCY_S = 150e-6
"""Espresso's alpha: 150 us per inter-node collective."""
DEFAULT_INTRA_LATENCY_S = 20e-6
"""Per intra-node collective: an assumption (NCCL's intra-node latency is tens of us), not from Espresso."""

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]i?)?\s*([A-Za-z/]+)\s*$")
_BYTE_UNITS = ("B", "B/s", "Bps", "byte", "bytes", "byte/s", "bytes/s")
_BIT_UNITS = ("b", "b/s", "bps", "bit", "bits", "bit/s", "bits/s")


def parse_bandwidth(text: str) -> float:
    """Bytes per second of a bandwidth string.

    Units: ``bit``/``bps``/``b/s`` (lower-case b: bits) or ``B``/``B/s``/``byte`` (upper-case B: bytes),
    with an optional decimal (k, M, G, T) or binary (Ki, Mi, Gi, Ti) prefix; the prefix letter is
    case-insensitive, so ``"100gbit"`` works. Presets: ``"nvlink"`` (50 GB/s) and ``"pcie"`` (2.5 GB/s),
    Espresso's intra-node constants.

    Args:
        text: e.g. ``"25Gbit"``, ``"100gbit"``, ``"12.5GB/s"``, ``"nvlink"``.

    Returns:
        Bytes per second (a positive float).

    Raises:
        ValueError: If the string has no number, no or an unknown unit, or a non-positive value.

    Example::

        parse_bandwidth("25Gbit")  # 3.125e9
        parse_bandwidth("12.5GB/s")  # 1.25e10
    """
    # Step 1: presets by name.
    if not isinstance(text, str):
        raise ValueError(f"bandwidth={text!r}: expected a string such as '25Gbit', '12.5GB/s' or 'nvlink'")
    preset = BANDWIDTH_PRESETS.get(text.strip().lower())
    if preset is not None:
        return preset
    # Step 2: number, prefix, unit.
    match = _BANDWIDTH.match(text)
    if match is None:
        raise ValueError(
            f"bandwidth={text!r}: expected <number><prefix><unit>, e.g. '25Gbit', '100gbit', '12.5GB/s', "
            f"or a preset ({', '.join(BANDWIDTH_PRESETS)})"
        )
    number, prefix, unit = float(match.group(1)), (match.group(2) or "").lower(), match.group(3)
    # Step 3: bits or bytes, from the unit's spelling (b = bit, B = byte).
    if unit in _BYTE_UNITS[:3] or unit.lower() in _BYTE_UNITS[3:]:
        bits_per_unit = 8.0
    elif unit in _BIT_UNITS[:3] or unit.lower() in _BIT_UNITS[3:]:
        bits_per_unit = 1.0
    else:
        raise ValueError(f"bandwidth={text!r}: unknown unit {unit!r}; use bit, bps, b/s (bits) or B, B/s, byte (bytes)")
    value = number * _PREFIX[prefix] * bits_per_unit / 8.0
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"bandwidth={text!r}: must be a positive, finite rate")
    return value


MAX_WORLD_SIZE = 2**20
"""Most ranks a cluster may have (1,048,576: several times the largest GPU clusters built); bounds the
counts a plan file can claim, so the planner's arithmetic on them stays small."""
MAX_CPU_WORKERS = 1024
"""Most CPU compression workers per GPU (more than the cores of any host)."""


def _check_positive(name: str, value: float) -> None:
    number = finite(value)
    if number is None or number <= 0:
        raise ValueError(f"ClusterSpec.{name}={shorten(value)} must be a positive, finite number")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """Nodes x GPUs per node, with the links between them (alpha-beta per collective)."""

    nodes: int
    """Number of machines."""
    gpus_per_node: int
    """GPUs per machine (one rank each)."""
    intra_bandwidth_bytes_per_s: float
    """GPU-to-GPU bandwidth inside a node (NVLink ~50 GB/s, PCIe ~2.5 GB/s in Espresso's model)."""
    intra_latency_s: float = DEFAULT_INTRA_LATENCY_S
    """Latency charged once per intra-node collective."""
    inter_bandwidth_bytes_per_s: float
    """Network bandwidth per node (its NIC, shared by the node's GPUs)."""
    inter_latency_s: float = DEFAULT_INTER_LATENCY_S
    """Latency charged once per collective that crosses nodes."""
    cpu_workers: int = 1
    """CPU compression workers per GPU (Espresso's CPU path: one pipeline per GPU)."""
    pcie_bandwidth_bytes_per_s: float = PCIE_BYTES_PER_S
    """GPU<->CPU copy bandwidth per GPU, for offloaded compression."""

    def __post_init__(self) -> None:
        bounds = {"nodes": MAX_WORLD_SIZE, "gpus_per_node": MAX_WORLD_SIZE, "cpu_workers": MAX_CPU_WORKERS}
        for name, high in bounds.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
                raise ValueError(
                    f"ClusterSpec.{name}={shorten(value)} must be an int >= 1 and <= {high:,} "
                    f"({'MAX_CPU_WORKERS' if name == 'cpu_workers' else 'MAX_WORLD_SIZE'})"
                )
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(
                f"ClusterSpec: nodes x gpus_per_node = {self.world_size:,} ranks, more than MAX_WORLD_SIZE="
                f"{MAX_WORLD_SIZE:,} (several times the largest GPU clusters built)"
            )
        for name in ("intra_bandwidth_bytes_per_s", "inter_bandwidth_bytes_per_s", "pcie_bandwidth_bytes_per_s"):
            _check_positive(name, getattr(self, name))
        for name in ("intra_latency_s", "inter_latency_s"):
            value = getattr(self, name)
            number = finite(value)
            if number is None or number < 0:
                raise ValueError(f"ClusterSpec.{name}={shorten(value)} must be a finite number of seconds >= 0")

    @property
    def world_size(self) -> int:
        """Ranks in total: nodes x GPUs per node."""
        return self.nodes * self.gpus_per_node

    @property
    def hierarchical(self) -> bool:
        """Whether two-level (intra, then inter-node) schemes exist: more than one node and GPU per node."""
        return self.nodes > 1 and self.gpus_per_node > 1

    @classmethod
    def from_strings(
        cls,
        *,
        nodes: int,
        gpus_per_node: int,
        inter: str,
        intra: str = "nvlink",
        inter_latency_s: float = DEFAULT_INTER_LATENCY_S,
        intra_latency_s: float = DEFAULT_INTRA_LATENCY_S,
        cpu_workers: int = 1,
        pcie: str = "pcie",
    ) -> ClusterSpec:
        """A cluster from bandwidth strings (see ``parse_bandwidth``).

        Args:
            nodes: Machines.
            gpus_per_node: GPUs per machine.
            inter: Network bandwidth per node, e.g. ``"25Gbit"``.
            intra: Intra-node link, e.g. ``"nvlink"`` or ``"pcie"``.
            inter_latency_s: Latency per inter-node collective.
            intra_latency_s: Latency per intra-node collective.
            cpu_workers: CPU compression workers per GPU.
            pcie: GPU<->CPU copy bandwidth.

        Returns:
            The ``ClusterSpec``.

        Example::

            ClusterSpec.from_strings(nodes=8, gpus_per_node=8, inter="100Gbit", intra="nvlink")
        """
        return cls(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            intra_bandwidth_bytes_per_s=parse_bandwidth(intra),
            intra_latency_s=intra_latency_s,
            inter_bandwidth_bytes_per_s=parse_bandwidth(inter),
            inter_latency_s=inter_latency_s,
            cpu_workers=cpu_workers,
            pcie_bandwidth_bytes_per_s=parse_bandwidth(pcie),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ClusterSpec:
        """Inverse of ``to_dict``; ValueError naming the missing or unknown field."""
        if not isinstance(data, dict):
            raise ValueError(f"cluster must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(clip(str(k)) for k in data if k not in names)
        if unknown:
            raise ValueError(f"cluster has unknown field(s) {unknown[:5]} (a typo?); valid: {sorted(names)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"cluster is missing field(s) {missing}")
        return cls(**data)

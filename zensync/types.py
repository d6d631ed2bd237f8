"""Plain data records shared by every layer: per-phase traffic counters and per-call sync statistics.

Nothing here talks to a process group or runs a kernel; every other layer may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

__all__ = [
    "Granularity",
    "PhaseTraffic",
    "SyncStats",
    "accumulation_dtype",
    "index_dtype",
]

Granularity = Literal["element", "row"]
"""How a tensor is cut into items: one element per item, or one row (dim 0 slice) per item."""


@dataclasses.dataclass(slots=True)
class PhaseTraffic:
    """Traffic one rank sent and received, and time it spent in collectives, during one phase.

    Payload bytes are the data an algorithm moves (indices, values, bitmaps, headers).
    Control bytes are the size exchanges a variable-size collective needs before its payload.
    Both are counted with the same logical model on every transport (see ``zensync.transport``),
    so the simulated world and torch.distributed report identical numbers for identical inputs.
    """

    bytes_sent: int = 0
    """Payload bytes this rank sent to other ranks."""
    bytes_recv: int = 0
    """Payload bytes this rank received from other ranks."""
    control_bytes_sent: int = 0
    """Size-exchange bytes sent (8 bytes per count)."""
    control_bytes_recv: int = 0
    """Size-exchange bytes received."""
    messages_sent: int = 0
    """Non-empty point-to-point payload messages sent."""
    num_calls: int = 0
    """Collective calls made in this phase."""
    collectives: int = 0
    """Backend collectives those calls took: one each, plus one for the size exchange a variable-size
    collective makes before its payload (none where the sizes were known). Each is at least one
    network latency on the critical path."""
    comm_time_s: float = 0.0
    """Wall time spent inside collective calls, from call to completion: their union (calls in
    flight together, such as the casts' pieces, count once)."""

    def add(self, other: PhaseTraffic) -> None:
        """Accumulate ``other`` into this record."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


@dataclasses.dataclass(slots=True)
class SyncStats:
    """What one ``sparse_allreduce`` call did on this rank.

    Pass an instance as ``stats=`` and the call fills it in. Densities are fractions of items
    (elements or rows, see ``granularity``). Fields that a scheme cannot observe stay ``None``.
    """

    scheme: str = ""
    """Scheme that ran (for ``auto``: the one it chose)."""
    requested_scheme: str = ""
    """Scheme the caller asked for."""
    world_size: int = 0
    rank: int = 0
    numel: int = 0
    granularity: Granularity = "element"
    num_items: int = 0
    """Items in the tensor: numel (element mode) or rows (row mode)."""
    item_numel: int = 1
    """Elements per item: 1 or the row length."""
    local_nnz: int = 0
    """Non-zero items on this rank."""
    density: float = 0.0
    """Local density d: local_nnz / num_items."""
    mean_density: float = 0.0
    """Density averaged over ranks (the d of Zen's Eq. 1)."""
    global_nnz: int | None = None
    """Non-zero items of the union over ranks (before cancellation), where the scheme sees it."""
    densification: float | None = None
    """gamma_n = global density / mean density (Zen C2)."""
    overlap: float | None = None
    """Pooled pairwise overlap: mean |I_a & I_b| over mean min(|I_a|, |I_b|) (Zen C1)."""
    skew: float = 0.0
    """Local skew: max density over n even ranges of the item space / overall density (Zen C3)."""
    push_imbalance: float | None = None
    """Max / mean push bytes received per rank (partitioned schemes)."""
    pull_imbalance: float | None = None
    """Max / mean pull bytes received per rank (partitioned schemes)."""
    pull_encodings: dict[str, int] = dataclasses.field(default_factory=dict)
    """How many owner partitions were pulled as 'coo', 'bitmap' or 'dense'."""
    pull_bitmap_words: int = 0
    """32-bit bitmap words in all owners' pull payloads together (what each rank decodes)."""
    predicted_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """For ``auto``: predicted time per candidate scheme."""
    phases: dict[str, PhaseTraffic] = dataclasses.field(default_factory=dict)
    """Traffic per phase (validate, push, pull, exchange, ...)."""
    phase_time_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Wall time per phase, local compute included."""

    @property
    def bytes_sent(self) -> int:
        """Payload bytes sent over all phases."""
        return sum(p.bytes_sent for p in self.phases.values())

    @property
    def bytes_recv(self) -> int:
        """Payload bytes received over all phases."""
        return sum(p.bytes_recv for p in self.phases.values())

    @property
    def collectives(self) -> int:
        """Backend collectives over all phases (``PhaseTraffic.collectives``): the call's rounds."""
        return sum(p.collectives for p in self.phases.values())

    @property
    def total_time_s(self) -> float:
        """Wall time of the whole call."""
        return sum(self.phase_time_s.values())

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict (phases flattened to plain dicts)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "phases"}
        out["phases"] = {name: dataclasses.asdict(p) for name, p in self.phases.items()}
        out["bytes_sent"] = self.bytes_sent
        out["bytes_recv"] = self.bytes_recv
        out["collectives"] = self.collectives
        return out


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of every index payload (sparse schemes, top-k, DGC): int32 positions when they fit
    (numel < 2**31), else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types are summed in float32 and rounded once; float32/64 in their own precision."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

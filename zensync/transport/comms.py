"""A comms logger: one record per collective of the transports it is attached to, with its bandwidths.

Each record holds the operation, the backend, the group size, the message size, the latency (call
to completion) and the two bandwidths nccl-tests reports (its PERFORMANCE.md): the algorithm
bandwidth ``size / latency`` and the bus bandwidth, that times the factor that makes it comparable
with the links' peak whatever the operation and group size:

    all_reduce          2 (n - 1) / n     size: the tensor
    all_gather(_v)      (n - 1) / n       size: the gathered output (every rank's part)
    all_to_all_v        (n - 1) / n       size: this rank's input (every destination's chunk)
    broadcast           1                 size: the tensor
    send_recv           1                 size: the bytes sent

Example::

    log = CommsLogger()
    transport.comms_logger = log  # every collective of this transport from now on
    transport.all_reduce(torch.ones(1 << 20))
    print(log.table())  # op, size, calls, median latency, algbw, busbw
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
from collections.abc import Iterable

__all__ = ["BUS_FACTORS", "CommRecord", "CommsLogger", "bus_factor"]


def _ring(n: int) -> float:
    return (n - 1) / n


BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": _ring,
    "all_gather_v": _ring,
    "all_to_all_v": _ring,
    "reduce_scatter": _ring,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}
"""nccl-tests' bus-bandwidth factor of each operation, as a function of the group size n."""


def bus_factor(op: str, world_size: int) -> float:
    """The bus-bandwidth factor of ``op`` in a group of ``world_size`` (1 for one rank and unknown ops)."""
    factor = BUS_FACTORS.get(op)
    return 1.0 if factor is None or world_size < 2 else factor(world_size)


@dataclasses.dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective as the logger saw it complete."""

    op: str
    backend: str
    """The transport's class ("TorchTransport", "MPITransport", "SimulatedTransport")."""
    world_size: int
    rank: int
    size_bytes: int
    """The message size as nccl-tests counts it (module docstring)."""
    seconds: float
    """From the call to completion (waiting for the other ranks included)."""
    phase: str

    @property
    def algbw_bytes_per_s(self) -> float:
        return self.size_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def busbw_bytes_per_s(self) -> float:
        return self.algbw_bytes_per_s * bus_factor(self.op, self.world_size)

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out.update(algbw_bytes_per_s=self.algbw_bytes_per_s, busbw_bytes_per_s=self.busbw_bytes_per_s)
        return out


class CommsLogger:
    """Collects a ``CommRecord`` per completed collective (thread-safe; attach with ``Transport.comms_logger``).

    Args:
        jsonl_path: Also append each record to this file as a JSON line.
        keep: Keep the records in ``records`` (False: the file only).
    """

    def __init__(self, jsonl_path: str | None = None, *, keep: bool = True) -> None:
        self.jsonl_path = jsonl_path
        self.keep = keep
        self.records: list[CommRecord] = []
        self._lock = threading.Lock()

    def record(self, entry: CommRecord) -> None:
        with self._lock:
            if self.keep:
                self.records.append(entry)
            if self.jsonl_path is not None:
                with open(self.jsonl_path, "a") as f:
                    f.write(json.dumps(entry.as_dict()) + "\n")

    def summary(self) -> list[dict[str, object]]:
        """Per (op, backend, size): calls, median latency and median bandwidths, in order of first call."""
        with self._lock:
            records = list(self.records)
        groups: dict[tuple[str, str, int], list[CommRecord]] = {}
        for entry in records:
            groups.setdefault((entry.op, entry.backend, entry.size_bytes), []).append(entry)
        return [_summarise(op, backend, size, entries) for (op, backend, size), entries in groups.items()]

    def table(self) -> str:
        """``summary`` as a Markdown table."""
        lines = [
            "| op | backend | size (bytes) | calls | median latency (us) | algbw (GB/s) | busbw (GB/s) |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in self.summary():
            lines.append(
                f"| {row['op']} | {row['backend']} | {row['size_bytes']:,} | {row['calls']} | "
                f"{float(row['median_s']) * 1e6:.1f} | {float(row['algbw_bytes_per_s']) / 1e9:.3f} | "  # type: ignore[arg-type]
                f"{float(row['busbw_bytes_per_s']) / 1e9:.3f} |"  # type: ignore[arg-type]
            )
        return "\n".join(lines)


def _summarise(op: str, backend: str, size: int, entries: Iterable[CommRecord]) -> dict[str, object]:
    entries = list(entries)
    median_s = statistics.median(e.seconds for e in entries)
    algbw = size / median_s if median_s > 0 else 0.0
    return {
        "op": op,
        "backend": backend,
        "size_bytes": size,
        "calls": len(entries),
        "median_s": median_s,
        "algbw_bytes_per_s": algbw,
        "busbw_bytes_per_s": algbw * bus_factor(op, entries[0].world_size),
    }

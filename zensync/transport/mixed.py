"""Per-operation backend mixing (MCR-DL): each collective goes to the backend a tuning table names.

``MixedTransport({"gloo": TorchTransport(), "mpi": MPITransport()}, table)`` is one ``Transport``
whose collectives each run on one of its backends, chosen by ``TuningTable.backend_for`` from the
operation, the dtype, the group size and the message size. All backends span the same ranks in the
same order.

No deadlock across backends: the routing of a call depends only on what every rank passes alike
(operation, dtype, world size and, for the operations whose size is the same on every rank, the
byte size; the variable-size ones route by operation and dtype alone), so every rank sends its
i-th call to the same backend, and each backend receives its calls in the order they were made
(``Transport._issue`` keeps that order, and each backend keeps it in turn). Backends progress on
their own threads, so a collective pending on one never waits for the other.

``tune`` measures the table on the current group: every operation at each size on every backend,
the slowest rank's median per (operation, size), and per size the fastest backend, decided on rank
0 and broadcast so that every rank holds the same table (a table that differed between ranks would
route a call to two backends and hang).

Example::

    table = tune({"gloo": gloo, "mpi": mpi}, sizes=[8, 1 << 10, 1 << 20])
    mixed = MixedTransport({"gloo": gloo, "mpi": mpi}, table)
    mixed.all_reduce(torch.ones(2))  # MPI where it measured faster at 8 bytes
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zensync.transport.base import Transport
from zensync.transport.handle import Handle
from zensync.transport.reduce_scatter import Traffic

__all__ = [
    "DEFAULT_SIZES",
    "TUNED_OPS",
    "MixedTransport",
    "TuningEntry",
    "TuningTable",
    "burst_calls",
    "collective_call",
    "interleaved_samples",
    "tune",
]

TUNED_OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_v",
    "all_to_all_v",
    "reduce_scatter",
    "broadcast",
    "send_recv",
    "barrier",
)
"""The operations a table routes (``split`` stays on the first backend)."""

_SIZED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
"""Operations whose byte size is the same on every rank: routed by size too."""


@dataclasses.dataclass(frozen=True, slots=True)
class TuningEntry:
    """One row of a table: ``op`` on ``dtype`` ("*": any) up to ``max_bytes`` goes to ``backend``."""

    op: str
    backend: str
    dtype: str = "*"
    max_bytes: float = math.inf


@dataclasses.dataclass(frozen=True, slots=True)
class TuningTable:
    """Which backend each collective takes; the first matching entry wins, else ``default``."""

    default: str
    entries: tuple[TuningEntry, ...] = ()
    world_size: int | None = None
    """The group size it was measured on (None: any); a table is refused on another size."""

    def backend_for(self, op: str, dtype: torch.dtype | None, nbytes: int | None) -> str:
        """The backend of one call: ``nbytes`` None for operations routed without a size."""
        name = "*" if dtype is None else str(dtype).removeprefix("torch.")
        for entry in self.entries:
            if entry.op != op or entry.dtype not in ("*", name):
                continue
            if nbytes is None or nbytes <= entry.max_bytes:
                return entry.backend
        return self.default

    def backends(self) -> set[str]:
        return {self.default, *(e.backend for e in self.entries)}

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": 1,
                "default": self.default,
                "world_size": self.world_size,
                "entries": [
                    {**dataclasses.asdict(e), "max_bytes": None if math.isinf(e.max_bytes) else e.max_bytes}
                    for e in self.entries
                ],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> TuningTable:
        """Raises ValueError on anything but a version-1 table."""
        try:
            data = json.loads(text)
            if data.get("version") != 1:
                raise ValueError(f"version {data.get('version')!r}, expected 1")
            entries = tuple(
                TuningEntry(
                    op=str(e["op"]),
                    backend=str(e["backend"]),
                    dtype=str(e.get("dtype", "*")),
                    max_bytes=math.inf if e.get("max_bytes") is None else float(e["max_bytes"]),
                )
                for e in data["entries"]
            )
            table = cls(default=str(data["default"]), entries=entries, world_size=data.get("world_size"))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(f"not a tuning table: {exc}") from None
        unknown = sorted({e.op for e in entries} - set(TUNED_OPS))
        if unknown:
            raise ValueError(f"tuning table: unknown operations {unknown}; known: {', '.join(TUNED_OPS)}")
        return table


class MixedTransport(Transport):
    """A ``Transport`` that runs each collective on the backend ``table`` names (module docstring).

    Args:
        backends: Name -> transport; every one spans the same ranks (checked: same rank and size).
        table: The routing; every backend it names must be given.

    Raises:
        ValueError: If the backends differ in rank or size, the table names a missing backend,
            or the table was measured on another group size.
    """

    def __init__(self, backends: Mapping[str, Transport], table: TuningTable) -> None:
        if not backends:
            raise ValueError("MixedTransport needs at least one backend")
        first = next(iter(backends.values()))
        for name, backend in backends.items():
            if (backend.rank, backend.world_size) != (first.rank, first.world_size):
                raise ValueError(
                    f"MixedTransport: backend {name!r} is rank {backend.rank} of {backend.world_size}, "
                    f"the others rank {first.rank} of {first.world_size}: they must span the same ranks"
                )
        missing = sorted(table.backends() - set(backends))
        if missing:
            raise ValueError(f"tuning table names backends {missing} that are not given ({', '.join(backends)})")
        if table.world_size is not None and table.world_size != first.world_size:
            raise ValueError(
                f"tuning table measured on {table.world_size} ranks, this group has {first.world_size}: "
                f"measure it here (zensync.transport.mixed.tune)"
            )
        super().__init__(first.rank, first.world_size)
        self.backends = dict(backends)
        self.table = table
        self.routed: dict[str, int] = {}
        """Calls per backend so far (what the table did)."""
        self._routes: dict[tuple[str, torch.dtype | None, int | None], tuple[str, Transport]] = {}
        """``backend_for``'s answers, by (op, dtype, size): a call pays one dict lookup."""
        self._told = [b for b in self.backends.values() if type(b)._caller_blocks is not Transport._caller_blocks]
        """The backends that run a blocking call inline (``_caller_blocks``): told before each issue."""

    @property
    def control_device(self) -> torch.device:
        return next(iter(self.backends.values())).control_device

    def _issue(self, start_op: Any, traffic: Any, start: Any, *, blocking: bool, **kwargs: Any) -> Any:
        # A backend that runs a blocking call on the caller's thread (MPI: no hand-off to its own
        # thread) learns it here: its hook is called below ``_issue``, not through its own.
        flag = blocking or self._driven_here()
        for backend in self._told:
            backend._caller_blocks(flag)
        try:
            return super()._issue(start_op, traffic, start, blocking=blocking, **kwargs)
        finally:
            for backend in self._told:
                backend._caller_blocks(False)

    def _to(self, op: str, dtype: torch.dtype | None, nbytes: int | None) -> Transport:
        key = (op, dtype, nbytes if op in _SIZED_OPS else None)
        route = self._routes.get(key)
        if route is None:
            name = self.table.backend_for(*key)
            route = self._routes[key] = (name, self.backends[name])
        self.routed[route[0]] = self.routed.get(route[0], 0) + 1
        return route[1]

    # Backend hooks: the chosen backend's own (its issue order is this transport's, see _issue).
    def _all_reduce(self, tensor: torch.Tensor) -> Handle[torch.Tensor]:
        nbytes = tensor.numel() * tensor.element_size()
        return self._to("all_reduce", tensor.dtype, nbytes)._all_reduce(tensor)

    def _all_gather(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        nbytes = tensor.numel() * tensor.element_size()
        return self._to("all_gather", tensor.dtype, nbytes)._all_gather(tensor)

    def _all_gather_v(self, tensor: torch.Tensor) -> Handle[tuple[list[torch.Tensor], int | None]]:
        return self._to("all_gather_v", tensor.dtype, None)._all_gather_v(tensor)

    def _all_to_all_v(
        self, tensor: torch.Tensor, counts: list[int], recv_counts: list[int] | None
    ) -> Handle[tuple[torch.Tensor, list[int]]]:
        return self._to("all_to_all_v", tensor.dtype, None)._all_to_all_v(tensor, counts, recv_counts)

    def _reduce_scatter(self, tensor: torch.Tensor, algorithm: str) -> Handle[Traffic]:
        nbytes = tensor.numel() * tensor.element_size()
        return self._to("reduce_scatter", tensor.dtype, nbytes)._reduce_scatter(tensor, algorithm)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        nbytes = tensor.numel() * tensor.element_size()
        return self._to("broadcast", tensor.dtype, nbytes)._broadcast(tensor, src)

    def _send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> Handle[torch.Tensor | None]:
        return self._to("send_recv", None, None)._send_recv(tensor, dst, src, device)

    def _barrier(self) -> Handle[None]:
        return self._to("barrier", None, None)._barrier()

    def _split(self, color: int) -> MixedTransport:
        parts = {name: backend.split(color) for name, backend in self.backends.items()}
        return MixedTransport(parts, dataclasses.replace(self.table, world_size=None))


DEFAULT_SIZES = tuple(8 << (3 * k) for k in range(8))
"""Bytes per rank ``tune`` measures by default: 8 B to 16 MiB, every factor of 8."""


def tune(
    backends: Mapping[str, Transport],
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    ops: Sequence[str] = ("all_reduce", "all_gather", "broadcast"),
    dtype: torch.dtype = torch.float32,
    reps: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[TuningTable, dict[str, Any]]:
    """Measure every op at every size (bytes per rank) on every backend; the table of the fastest.

    A collective call of every rank. Each measurement is the median of ``reps`` samples, each a
    barrier on that backend then ``burst_calls(size)`` calls back to back (a barrier's exit skew
    between ranks, about 0.1 ms on gloo, would otherwise be timed with each small call), taken by
    ``interleaved_samples`` (the backends alternate, so a slow spell of the machine hits each alike;
    measured one backend after the other, 4 ranks on 2 cores once sent 16 MiB broadcasts to gloo at
    25 ms where MPI took 20), the slowest rank's (an all-gather on the first backend); rank 0
    decides and broadcasts the table, so every rank holds the same one. Sizes between measured ones
    take the backend of the next larger measured size; above the largest, the largest's.

    Returns:
        The table, and the measurements: {op: {size: {backend: seconds}}}.
    """
    names = list(backends)
    first = backends[names[0]]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    seconds: dict[str, dict[int, dict[str, float]]] = {}
    for op in ops:
        for size in sizes:
            x = torch.ones(max(1, size // itemsize), dtype=dtype)
            calls = {name: collective_call(backends[name], op, x) for name in names}
            for call in calls.values():
                call()  # warm-up: first-use setup
            samples = interleaved_samples(calls, backends, reps, burst_calls(size), clock)
            seconds.setdefault(op, {})[size] = {name: statistics.median(samples[name]) for name in names}
    flat = torch.tensor(
        [seconds[op][size][name] for op in ops for size in sizes for name in names], dtype=torch.float64
    )
    slowest = first.all_gather(flat)
    agreed = torch.stack(slowest).max(0).values.tolist()
    it = iter(agreed)
    for op in ops:
        for size in sizes:
            for name in names:
                seconds[op][size][name] = next(it)
    entries: list[TuningEntry] = []
    for op in ops:
        ordered = sorted(sizes)
        for i, size in enumerate(ordered):
            measured = seconds[op][size]
            best = min(names, key=measured.__getitem__)
            upper = math.inf if i == len(ordered) - 1 else float(size)
            entries.append(TuningEntry(op=op, backend=best, dtype=str(dtype).removeprefix("torch."), max_bytes=upper))
    table = TuningTable(default=names[0], entries=_merged(entries), world_size=first.world_size)
    # Rank 0's table for every rank: measured alike, but a tie broken differently would route apart.
    return TuningTable.from_json(first.broadcast_text(table.to_json())), seconds


def interleaved_samples(
    calls: Mapping[str, Callable[[], object]],
    fences: Mapping[str, Transport],
    reps: int,
    burst: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Per-call seconds of ``reps`` timed bursts of each call, the calls interleaved.

    Repetition r runs every call's burst once, in the order of ``calls`` rotated by r (no call
    always runs right after the same one; every rank rotates alike), each burst right after a
    barrier of its ``fences`` transport (the one the call runs on). Noise that lasts a repetition,
    such as a busy core, then hits every call alike, and the samples of one repetition pair up.
    """
    names = list(calls)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            call = calls[name]
            fences[name].barrier()
            start = clock()
            for _ in range(burst):
                call()
            seconds[name].append((clock() - start) / burst)
    return seconds


def burst_calls(nbytes: int) -> int:
    """Calls timed back to back per sample at ``nbytes`` per rank: 64 at 16 KiB and below, fewer
    above (about 1 MiB of messages per sample), 1 from 1 MiB."""
    return max(1, min(64, (1 << 20) // max(1, nbytes)))


def _merged(entries: list[TuningEntry]) -> tuple[TuningEntry, ...]:
    """Consecutive size ranges of one op and backend as one entry (the larger bound)."""
    out: list[TuningEntry] = []
    for entry in entries:
        if out and out[-1].op == entry.op and out[-1].backend == entry.backend and out[-1].dtype == entry.dtype:
            out[-1] = entry
        else:
            out.append(entry)
    return tuple(out)


def collective_call(backend: Transport, op: str, x: torch.Tensor) -> Callable[[], object]:
    """A call of ``op`` on ``x`` (all_reduce, all_gather, reduce_scatter with the backend's own
    algorithm, or broadcast from rank 0), as ``tune`` times it."""
    calls: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: backend.all_reduce(x),
        "all_gather": lambda: backend.all_gather(x),
        "reduce_scatter": lambda: backend.reduce_scatter(x),
        "broadcast": lambda: backend.broadcast(x, src=0),
    }
    if op not in calls:
        raise ValueError(f"tune: op {op!r} is not measured (measured: {', '.join(calls)})")
    return calls[op]

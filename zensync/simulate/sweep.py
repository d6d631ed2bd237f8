"""One synchronization step of a sparse gradient, per scheme and world size: what ``zensync simulate`` runs.

``ZipfWorkload`` describes the gradient (``zensync.workloads.zipf``: items, row width, density,
skew, overlap, seed; rank r's non-zero ids are ``zipf_items(r, ...)`` in both modes, so a full and a
counted run of the same point see the same index sets), or ``LMWorkload`` (``lm_workload``: the rows
the embedded LM's batches touch). ``simulate_step`` runs one point:

- ``full``: every rank builds its dense tensor and the scheme's real code runs on the simulated
  world (``run_agreed``, one steady-state step: the agreement is made once, at registration, as the
  DDP hook makes it), with every collective and the local work between them recorded
  (``zensync.simulate``), after one unrecorded warm-up step (kernel compilation is not local work);
- ``counted``: the records come from the index sets alone (``zensync.simulate.counted``; every
  scheme), equal to a full run's, and the local work is fitted to full runs of
  the same workload cut to fewer rows (``zensync.simulate.local_work``);
- ``auto``: full while the ranks' dense tensors fit in ``memory_bytes``, else counted.

The step is priced on the topology with each rank's local work times ``compute_scale`` (its row's
``compute_seconds``): measured at a full point (``zensync.simulate``: one core of this machine),
fitted at a counted one (the row's ``local_work`` holds the fit; the fit is made once per scheme
and workload). With ``compute_scale`` 0 the time is the network's alone and no fit is made. With
``cores`` the ranks' local work shares that many cores, and ``transport_cpu`` gives the collectives
CPU work per byte too (``zensync.simulate.timeline``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zensync.cost.topology import Topology
from zensync.simulate import record
from zensync.simulate.analysis import counted_points
from zensync.simulate.counted import counted_calls
from zensync.simulate.lm_workload import LMWorkload, RowWorkload
from zensync.simulate.local_work import LocalWorkFit, calibrate, charge
from zensync.simulate.record import Call, sent_bytes
from zensync.simulate.timeline import price
from zensync.sync import SCHEMES
from zensync.sync.base import SyncOptions, item_view
from zensync.sync.run import run_agreed
from zensync.transport import Transport
from zensync.types import SyncStats
from zensync.workloads.zipf import zipf_items

__all__ = [
    "MODES", "Workload", "ZipfWorkload", "combine", "full_calls", "load_stats", "payload_sent", "simulate_step",
    "simulate_sweep",
]  # fmt: skip

MODES = ("auto", "full", "counted")


@dataclasses.dataclass(frozen=True, slots=True)
class ZipfWorkload(RowWorkload):
    """A Zipf-family sparse gradient: ``num_items`` rows of ``dim`` float32 (module docstring)."""

    num_items: int
    dim: int = 1
    density: float = 0.01
    skew: float = 1.1
    overlap: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_items < 1 or self.dim < 1:
            raise ValueError(f"rows={self.num_items} and dim={self.dim} must be >= 1")
        if not 0 < self.density <= 1 or not 0 <= self.overlap <= 1 or not 0 <= self.skew <= 8:
            raise ValueError("density must be in (0, 1], overlap in [0, 1], skew in [0, 8]")

    def items(self, rank: int) -> torch.Tensor:
        return zipf_items(
            rank, self.num_items, density=self.density, zipf_s=self.skew, overlap=self.overlap, seed=self.seed
        )


Workload = ZipfWorkload | LMWorkload
"""What a point synchronizes: one sparse gradient, each rank's rows from ``items(rank)``."""


def payload_sent(calls: Sequence[Call], rank: int) -> int:
    """Payload bytes ``rank`` sends in ``calls`` (``record.sent_bytes`` summed)."""
    return sum(sent_bytes(call, rank) for call in calls)


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES or scheme == "auto":
        raise ValueError(f"scheme={scheme!r}: expected one of {', '.join(s for s in SCHEMES if s != 'auto')}")


def _mode(ranks: int, workload: Workload, mode: str, memory_bytes: float) -> str:
    """The mode a point runs in (every scheme is countable: ``counted.COUNTED_SCHEMES``)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "auto":
        return "full" if workload.full_bytes(ranks) <= memory_bytes else "counted"
    return mode


def simulate_step(
    scheme: str,
    ranks: int,
    workload: Workload,
    topology: Topology,
    *,
    mode: str = "auto",
    memory_bytes: float = 4e9,
    h0_seed: int = 12345,
    compute_scale: float = 1.0,
    cores: float | None = None,
    transport_cpu: Mapping[str, float] | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """One point: the priced step of ``scheme`` on ``ranks`` ranks (module docstring), as a report row;
    ``repeats``: full runs record the step that many times (local work: the median, ``record``)."""
    _check_scheme(scheme)
    chosen = _mode(ranks, workload, mode, memory_bytes)
    cpu = _Cpu(compute_scale, cores, transport_cpu, repeats)
    return _point(scheme, ranks, workload, topology, chosen, h0_seed, cpu, {})


@dataclasses.dataclass(frozen=True, slots=True)
class _Cpu:
    """How CPU work is charged (``price``'s ``compute_scale``, ``cores`` and ``transport_cpu``) and
    measured (``record``'s ``repeats``)."""

    scale: float
    cores: float | None
    transport: Mapping[str, float] | None
    repeats: int = 1


def _point(
    scheme: str,
    ranks: int,
    workload: Workload,
    topology: Topology,
    chosen: str,
    h0_seed: int,
    cpu: _Cpu,
    fits: dict[str, LocalWorkFit],
) -> dict[str, Any]:
    """The row of one point whose mode is decided (``_mode``); ``fits`` caches local-work fits."""
    row: dict[str, Any] = {"scheme": scheme, "ranks": ranks, "mode": chosen}
    start = time.perf_counter()
    if chosen == "counted":
        calls = counted_calls(
            scheme, workload.items, world_size=ranks, num_items=workload.num_items,
            item_bytes=workload.item_bytes, seed=h0_seed,
        )  # fmt: skip
        return _counted_row(row, calls, workload, topology, start, cpu, fits, h0_seed)
    calls = full_calls(scheme, ranks, workload, h0_seed, repeats=cpu.repeats)
    return _row(row, calls, topology, start, cpu)


def _counted_row(
    row: dict[str, Any],
    calls: list[list[Call]],
    workload: Workload,
    topology: Topology,
    start: float,
    cpu: _Cpu,
    fits: dict[str, LocalWorkFit],
    h0_seed: int,
) -> dict[str, Any]:
    """A counted point's row: its records with the scheme's fitted local work (none at scale 0)."""
    if cpu.scale == 0:
        return {**_row(row, calls, topology, start, cpu), "compute_seconds": None, "local_work": None}
    scheme = row["scheme"]
    if scheme not in fits:
        fits[scheme] = calibrate(
            scheme,
            lambda n, rows: full_calls(scheme, n, dataclasses.replace(workload, num_items=rows), h0_seed, cpu.repeats),
            num_items=workload.num_items, item_bytes=workload.item_bytes,
        )  # fmt: skip
    dense = workload.num_items * workload.item_bytes
    charged = charge(calls, fits[scheme], lambda rank: dense)
    return {**_row(row, charged, topology, start, cpu), "local_work": dataclasses.asdict(fits[scheme])}


def _row(row: dict[str, Any], calls: list[list[Call]], topology: Topology, start: float, cpu: _Cpu) -> dict[str, Any]:
    priced = price(calls, topology, compute_scale=cpu.scale, cores=cpu.cores, transport_cpu=cpu.transport)
    sent = [payload_sent(c, r) for r, c in enumerate(calls)]
    return {
        **row,
        "seconds": priced.seconds,
        "phase_seconds": priced.phase_seconds,
        "compute_seconds": priced.compute_seconds,
        "max_sent_bytes": max(sent),
        "mean_sent_bytes": sum(sent) / len(calls),
        "wall_s": time.perf_counter() - start,
    }


def simulate_sweep(
    schemes: Sequence[str],
    ranks: Sequence[int],
    workload: Workload,
    topology: Topology,
    *,
    mode: str = "auto",
    memory_bytes: float = 4e9,
    h0_seed: int = 12345,
    compute_scale: float = 1.0,
    cores: float | None = None,
    transport_cpu: Mapping[str, float] | None = None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """``simulate_step`` for every (world size, scheme), rows in that order, each rank's ids drawn once.

    The counted points share one pass over the ranks: rank r's ids (the same at every world size)
    are drawn once and fed to every counted point with more than r ranks, and each point is priced
    as soon as its last rank is in. A counted point's ``wall_s`` is its own counting and pricing;
    the shared draws are not in it. ``on_point`` sees each row as it is done.
    """
    for scheme in schemes:
        _check_scheme(scheme)
    done: dict[tuple[int, str], dict[str, Any]] = {}
    counted: list[int] = []
    fits: dict[str, LocalWorkFit] = {}
    cpu = _Cpu(compute_scale, cores, transport_cpu)
    for n in ranks:
        chosen = _mode(n, workload, mode, memory_bytes)
        if chosen == "counted":
            counted.append(n)
            continue
        for scheme in schemes:
            done[(n, scheme)] = _point(scheme, n, workload, topology, chosen, h0_seed, cpu, fits)
            if on_point is not None:
                on_point(done[(n, scheme)])
    spent: dict[tuple[int, str], float] = {}
    points = counted_points(
        schemes, counted, workload.items, num_items=workload.num_items, item_bytes=workload.item_bytes,
        seed=h0_seed, spent=spent,
    )  # fmt: skip
    for n, scheme, calls in points:
        start = time.perf_counter()
        head = {"scheme": scheme, "ranks": n, "mode": "counted"}
        row = _counted_row(head, calls, workload, topology, start, cpu, fits, h0_seed)
        row["wall_s"] += spent[(n, scheme)]
        done[(n, scheme)] = row
        if on_point is not None:
            on_point(row)
    return [done[(n, scheme)] for n in ranks for scheme in schemes]


def full_calls(scheme: str, ranks: int, workload: Workload, h0_seed: int, repeats: int = 1) -> list[list[Call]]:
    """Every rank's records of one full step of ``scheme`` on ``workload`` (module docstring); building
    a rank's tensor is not part of its local work; ``repeats``: as ``record``'s."""

    def body(t: Transport, x: torch.Tensor) -> None:
        view = item_view(x, "row")
        options = SyncOptions(h0_seed=h0_seed)
        run_agreed(view, t, scheme=scheme, options=options, h0_seed=h0_seed, stats=SyncStats())

    return record(body, ranks, inputs=workload.tensor, warmup=True, repeats=repeats)[1]


def load_stats(text: str) -> dict[str, ZipfWorkload]:
    """Gradient statistics as JSON: one Zipf-family tensor per entry, synced one after another.

    Format (version 1)::

        {
            "version": 1,
            "seed": 0,
            "tensors": [
                {"name": "embedding", "rows": 10000000, "dim": 64, "density": 0.0113, "skew": 1.1, "overlap": 0.3}
            ],
        }

    ``dim`` (default 1), ``skew`` (1.1), ``overlap`` (0) and the top-level ``seed`` (0) are optional;
    names must be unique. Raises ValueError on anything else.
    """
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError('expected an object with "version": 1')
        seed = int(data.get("seed", 0))
        tensors = data["tensors"]
        if not isinstance(tensors, list) or not tensors:
            raise ValueError('"tensors" must be a non-empty list')
        out: dict[str, ZipfWorkload] = {}
        for i, entry in enumerate(tensors):
            name = str(entry.get("name", f"tensor{i}"))
            if name in out:
                raise ValueError(f"tensor name {name!r} appears twice")
            try:
                out[name] = ZipfWorkload(
                    num_items=int(entry["rows"]), dim=int(entry.get("dim", 1)), density=float(entry["density"]),
                    skew=float(entry.get("skew", 1.1)), overlap=float(entry.get("overlap", 0.0)), seed=seed + i,
                )  # fmt: skip
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"not a gradient-statistics file: {exc}") from None
    return out


def combine(per_tensor: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per point from each tensor's rows (the same points, in the same order): the tensors
    synced one after another, so times and bytes add."""
    tables = list(per_tensor.values())
    rows = []
    for parts in zip(*tables, strict=True):
        first = parts[0]
        modes = {p["mode"] for p in parts}
        row: dict[str, Any] = {"scheme": first["scheme"], "ranks": first["ranks"]}
        summary = {
            name: {"seconds": p["seconds"], "mode": p["mode"], "max_sent_bytes": p["max_sent_bytes"]}
            for name, p in zip(per_tensor, parts, strict=True)
        }
        wall_s = sum(p["wall_s"] for p in parts)
        phases: dict[str, float] = {}
        for part in parts:
            for phase, seconds in part["phase_seconds"].items():
                phases[phase] = phases.get(phase, 0.0) + seconds
        rows.append({
            **row,
            "mode": modes.pop() if len(modes) == 1 else "mixed",
            "seconds": sum(p["seconds"] for p in parts),
            "phase_seconds": phases,
            "compute_seconds": (
                None if any(p["compute_seconds"] is None for p in parts) else sum(p["compute_seconds"] for p in parts)
            ),
            "max_sent_bytes": sum(p["max_sent_bytes"] for p in parts),
            "wall_s": wall_s,
            "tensors": summary,
        })  # fmt: skip
    return rows

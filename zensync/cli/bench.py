"""``zensync bench --scan``: a collective micro-benchmark over message sizes and backends (under mpiexec).

    mpiexec -n 2 python -m mpi4py -m zensync bench --scan [--sizes 8,4096,1048576] \\
        [--ops all_reduce,all_gather,reduce_scatter,broadcast] [--backends gloo,mpi,mixed] [--reps 11] \\
        [--tuning tuning.json] [--timeout 300] [-o collective_scan_p2] [--png]

Every rank joins torch.distributed from MPI (``zensync.transport.init_torch_distributed``) and builds
the gloo transport, the MPI transport and, for ``mixed``, a ``MixedTransport`` whose table is read
from ``--tuning`` or else measured here (``zensync.transport.tune`` on the scanned sizes and ops).
Then, per (op, size): one warm-up call on each backend, and per repetition, on each backend in turn,
a barrier on that backend and ``burst_calls(size)`` calls timed back to back (backends interleaved
within a repetition, so noise hits them alike). A cell's latency is the median over repetitions of
the slowest rank's per-call time; its bandwidths are ``zensync.transport.comms``'s (the message size
as nccl-tests counts it, taken from the ``CommsLogger`` record of the call, and ``bus_factor``).
Rank 0 prints a Markdown table and writes PREFIX.json (and PREFIX.png with ``--png``).

Expected on 2 local ranks (2 shared cores, loopback; about 10 s): MPI about 30 us per call at 8
bytes, gloo several hundred, MPI ahead at every size, and the mixed dispatch near the backend its
table routes to. From 1 MiB a sample is one call (``burst_calls``): give more ``--reps`` there.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import statistics
from typing import TYPE_CHECKING, Any

import torch

from zensync.cli._errors import CommandFailed, UsageError, check_output_file, read_input
from zensync.cli._scan_report import report

if TYPE_CHECKING:  # the transport package (torch.distributed) is imported when the command runs
    from zensync.transport import CommsLogger, Transport, TuningTable

__all__ = ["BENCH_FLAGS", "SCAN_BACKENDS", "SCAN_OPS", "ScanConfig", "add_bench"]

_log = logging.getLogger(__name__)

BENCH_FLAGS = (
    "--scan",
    "--sizes",
    "--ops",
    "--backends",
    "--reps",
    "--tuning",
    "--timeout",
    "--output",
    "--png",
)
"""The pinned flag set of ``zensync bench`` (tests/unit/cli/test_cli.py); each sets one ``ScanConfig`` field."""

SCAN_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
"""The operations ``zensync.transport.mixed.collective_call`` times (reduce_scatter: the backend's own
algorithm; broadcast from rank 0)."""

SCAN_BACKENDS = ("gloo", "mpi", "mixed")
"""gloo (``TorchTransport``), MPI (``MPITransport``), and the mixed dispatch of the two."""

_ITEMSIZE = 4
"""Bytes per element: every message is float32, so a size must be a multiple of 4."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScanConfig:
    """What ``zensync bench --scan`` measures and writes (one field per flag)."""

    sizes: tuple[int, ...]
    """Bytes per rank, ascending, each a positive multiple of 4 (float32)."""
    ops: tuple[str, ...]
    """Operations, from ``SCAN_OPS``."""
    backends: tuple[str, ...]
    """Backends, from ``SCAN_BACKENDS``, in the order each repetition runs them."""
    reps: int
    """Timed repetitions per (op, size, backend), each a burst of ``burst_calls(size)`` calls."""
    tuning: str | None = None
    """Tuning table of the mixed backend (``zensync tune -o``); None: measured before the scan."""
    timeout_s: float = 300.0
    """Collective timeout of both transports, seconds."""
    output: str | None = None
    """Prefix of the files rank 0 writes; None: ``collective_scan_p<N>`` in the working directory."""
    png: bool = False
    """Also draw latency against size, per op (matplotlib)."""

    def __post_init__(self) -> None:
        for name, given, valid in (("ops", self.ops, SCAN_OPS), ("backends", self.backends, SCAN_BACKENDS)):
            unknown = [x for x in given if x not in valid]
            if not given:
                raise ValueError(f"--{name}: empty; give one or more of: {', '.join(valid)}")
            if unknown:
                raise ValueError(f"--{name} {','.join(given)}: unknown {unknown}; valid: {', '.join(valid)}")
            if len(set(given)) != len(given):
                raise ValueError(f"--{name} {','.join(given)}: a name given twice")
        bad = [s for s in self.sizes if s < _ITEMSIZE or s % _ITEMSIZE]
        if not self.sizes or bad or len(set(self.sizes)) != len(self.sizes):
            raise ValueError(
                f"--sizes {self.sizes}: need distinct byte counts, each a positive multiple of {_ITEMSIZE} "
                f"(float32 messages); bad: {bad}"
            )
        if self.reps < 1:
            raise ValueError(f"--reps {self.reps}: must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout {self.timeout_s}: must be > 0 seconds")
        if self.tuning is not None and "mixed" not in self.backends:
            raise ValueError(f"--tuning {self.tuning} routes the mixed backend: add mixed to --backends")

    def prefix(self, world_size: int) -> str:
        return self.output if self.output is not None else f"collective_scan_p{world_size}"


def add_bench(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    parser = sub.add_parser(
        "bench",
        help="collective micro-benchmark over sizes and backends (--scan; run under mpiexec)",
        description="\n\n".join(__doc__.split("\n\n")[1:3]) if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scan", action="store_true", help="scan sizes x ops x backends (required: the only mode)")
    parser.add_argument("--sizes", default="8,4096,1048576", help="bytes per rank, comma-separated")
    parser.add_argument("--ops", default=",".join(SCAN_OPS), help=f"comma-separated, of: {', '.join(SCAN_OPS)}")
    parser.add_argument(
        "--backends", default=",".join(SCAN_BACKENDS), help=f"comma-separated, of: {', '.join(SCAN_BACKENDS)}"
    )
    parser.add_argument("--reps", type=int, default=11, help="timed repetitions per cell (default 11)")
    parser.add_argument("--tuning", metavar="FILE", default=None, help="mixed backend's table (default: measure)")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds (default 300)")
    parser.add_argument("-o", "--output", metavar="PREFIX", default=None, help="write PREFIX.json (and .png)")
    parser.add_argument("--png", action="store_true", help="also write PREFIX.png, latency vs size (matplotlib)")
    parser.set_defaults(run=_run_bench, subparser=parser)


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _scan_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ScanConfig:
    """The ``ScanConfig`` of parsed flags; a bad value (or no ``--scan``) is a usage error (exit 2)."""
    if not args.scan:
        parser.error("--scan is required: a scan over sizes, ops and backends is the only mode of bench for now")
    try:
        sizes = tuple(sorted(int(s) for s in _names(args.sizes)))
        return ScanConfig(
            sizes=sizes,
            ops=_names(args.ops),
            backends=_names(args.backends),
            reps=args.reps,
            tuning=args.tuning,
            timeout_s=args.timeout,
            output=args.output,
            png=args.png,
        )
    except ValueError as err:
        parser.error(str(err))


def _check_before_work(config: ScanConfig) -> TuningTable | None:
    """Paths (exit 2) and matplotlib (exit 1) before any collective; returns the --tuning table or None."""
    if config.output is not None:
        for suffix in (".json", ".png") if config.png else (".json",):
            check_output_file(config.output + suffix, "-o")
    table = None
    if config.tuning is not None:
        from zensync.transport import TuningTable

        try:
            table = TuningTable.from_json(read_input(config.tuning, "tuning table"))
        except ValueError as err:
            raise UsageError(f"--tuning {config.tuning}: {err}") from err
        unknown = sorted(table.backends() - {"gloo", "mpi"})
        if unknown:
            raise UsageError(f"--tuning {config.tuning}: names backends {unknown}; bench has gloo and mpi")
    if config.png and importlib.util.find_spec("matplotlib") is None:
        raise CommandFailed("--png needs matplotlib (pip install 'zensync[bench]')")
    return table


def _run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = _scan_config(args, parser)
    table = _check_before_work(config)
    from zensync.transport import MPITransport, TorchTransport, init_torch_distributed, launch

    # Step 1: join both worlds; the default output's name needs the world size.
    rank, world = init_torch_distributed("gloo", timeout=config.timeout_s)
    mpi = MPITransport(timeout=config.timeout_s)
    if rank == 0:
        _log.info("bench --scan on %d ranks: %s", world, config)
    try:
        gloo = TorchTransport()
        _agree_on_output(gloo, config, world)
        # Step 2: the mixed table (read, or measured on the scanned sizes and ops), then the scan.
        runs, table = _transports(gloo, mpi, config, table)
        cells = _scan(runs, config)
        # Step 3: the slowest rank's times, over gloo, once.
        rows = _rows(cells, _slowest(gloo, cells), runs, world)
    finally:
        mpi.close()
        launch.destroy()
    if rank == 0:
        report(config, world, rows, table)
    return 0


def _agree_on_output(gloo: Transport, config: ScanConfig, world: int) -> None:
    """The output paths with the world size in the name, checked on rank 0 and agreed on every rank."""
    problem = ""
    if gloo.rank == 0:
        prefix = config.prefix(world)
        try:
            for suffix in (".json", ".png") if config.png else (".json",):
                check_output_file(prefix + suffix, "-o")
        except UsageError as err:
            problem = str(err)
    problem = gloo.broadcast_text(problem)
    if problem:
        raise UsageError(problem)


def _transports(
    gloo: Transport, mpi: Transport, config: ScanConfig, table: TuningTable | None
) -> tuple[dict[str, Transport], TuningTable | None]:
    """Name -> transport in ``config.backends`` order, and the mixed table (None without mixed)."""
    from zensync.transport import MixedTransport, tune

    singles: dict[str, Transport] = {"gloo": gloo, "mpi": mpi}
    if "mixed" not in config.backends:
        return {name: singles[name] for name in config.backends}, None
    if table is None:
        table, _ = tune(singles, sizes=config.sizes, ops=config.ops, reps=config.reps)
    try:
        mixed = MixedTransport(singles, table)
    except ValueError as err:  # measured on another group size: every rank alike
        raise UsageError(f"--tuning {config.tuning}: {err}") from err
    runs: dict[str, Transport] = {**singles, "mixed": mixed}
    return {name: runs[name] for name in config.backends}, table


@dataclasses.dataclass(slots=True)
class _Cell:
    """One (op, size): this rank's per-call seconds per backend and repetition, and what the logger saw."""

    op: str
    size: int
    seconds: dict[str, list[float]]
    """Backend -> per-call seconds of each repetition's burst (this rank)."""
    logged: dict[str, tuple[int, int]]
    """Backend -> (calls the CommsLogger recorded, their size as nccl-tests counts it)."""
    routed_to: str | None = None
    """The backend the mixed dispatch sent this (op, size) to (None without mixed)."""


def _scan(runs: dict[str, Transport], config: ScanConfig) -> list[_Cell]:
    """Every (op, size) cell with a ``CommsLogger`` on every transport (detached afterwards)."""
    from zensync.transport import CommsLogger

    log = CommsLogger()
    for transport in runs.values():
        transport.comms_logger = log
    try:
        return [_measure(runs, op, size, config.reps, log) for op in config.ops for size in config.sizes]
    finally:
        for transport in runs.values():
            transport.comms_logger = None


def _measure(runs: dict[str, Transport], op: str, size: int, reps: int, log: CommsLogger) -> _Cell:
    """One cell: a warm-up call per backend, then per repetition a barrier and a timed burst on each."""
    from zensync.transport import MixedTransport
    from zensync.transport.mixed import burst_calls, collective_call, interleaved_samples

    x = torch.ones(size // _ITEMSIZE, dtype=torch.float32)
    calls = {name: collective_call(transport, op, x) for name, transport in runs.items()}
    first = len(log.records)
    routed_to = None
    for name, call in calls.items():  # warm-up: first-use setup; the mixed dispatch shows its route
        mixed = runs[name] if name == "mixed" else None
        before = dict(mixed.routed) if isinstance(mixed, MixedTransport) else {}
        call()
        if isinstance(mixed, MixedTransport):
            (routed_to,) = [b for b, n in mixed.routed.items() if n != before.get(b, 0)]
    # Each burst starts after a barrier of the backend that runs it: for the mixed dispatch, the one
    # it routes this cell to (its own barrier takes the table's default, whose exit skew, about 0.1 ms
    # on gloo, would be timed with a one-call burst).
    fences = dict(runs)
    mixed_run = runs.get("mixed")
    if routed_to is not None and isinstance(mixed_run, MixedTransport):
        fences["mixed"] = mixed_run.backends[routed_to]
    seconds = interleaved_samples(calls, fences, reps, burst_calls(size))
    records = log.records[first:]
    logged = {}
    for name, transport in runs.items():
        mine = [r for r in records if r.backend == type(transport).__name__]
        logged[name] = (len(mine), mine[0].size_bytes)
    return _Cell(op=op, size=size, seconds=seconds, logged=logged, routed_to=routed_to)


def _slowest(gloo: Transport, cells: list[_Cell]) -> list[dict[str, list[float]]]:
    """Per cell, backend -> the slowest rank's per-call seconds in each repetition (one all-gather)."""
    from zensync.profiling import slowest_over_ranks

    local = [t for cell in cells for name in cell.seconds for t in cell.seconds[name]]
    agreed = iter(slowest_over_ranks(gloo, local))
    return [{name: [next(agreed) for _ in times] for name, times in cell.seconds.items()} for cell in cells]


def _best_single(medians: dict[str, float]) -> str:
    """The single backend (not "mixed") of lowest median time."""
    return min((name for name in medians if name != "mixed"), key=medians.__getitem__)


def _paired(times: dict[str, list[float]], medians: dict[str, float]) -> float:
    """Median over repetitions of mixed's time over the best single backend's in the same repetition
    (best: lowest median): the pairing cancels noise that a repetition shares, such as a busy core."""
    best = _best_single(medians)
    return statistics.median(m / b for m, b in zip(times["mixed"], times[best], strict=True))


def _rows(
    cells: list[_Cell], slowest: list[dict[str, list[float]]], runs: dict[str, Transport], world: int
) -> list[dict[str, Any]]:
    """One row per (op, size, backend): latency and bandwidths by ``CommRecord``'s own definitions."""
    from zensync.transport import CommRecord

    rows = []
    for cell, times in zip(cells, slowest, strict=True):
        medians = {name: statistics.median(t) for name, t in times.items()}
        singles = [medians[name] for name in medians if name != "mixed"]
        for name, median_s in medians.items():
            calls, size_bytes = cell.logged[name]
            record = CommRecord(
                op=cell.op,
                backend=type(runs[name]).__name__,
                world_size=world,
                rank=0,
                size_bytes=size_bytes,
                seconds=median_s,
                phase="scan",
            )
            mixed = name == "mixed"
            rows.append(
                {
                    "op": cell.op,
                    "bytes_per_rank": cell.size,
                    "backend": name,
                    "size_bytes": size_bytes,
                    "latency_s": median_s,
                    "algbw_bytes_per_s": record.algbw_bytes_per_s,
                    "busbw_bytes_per_s": record.busbw_bytes_per_s,
                    "calls_logged": calls,
                    "slowest_rank_s": times[name],
                    "routed_to": cell.routed_to if mixed else None,
                    "best_single": _best_single(medians) if mixed and singles else None,
                    "mixed_over_best_single": median_s / min(singles) if mixed and singles else None,
                    "mixed_over_best_single_paired": _paired(times, medians) if mixed and singles else None,
                }
            )
    return rows

"""``zensync tune``: measure the mixed dispatch's tuning table on this machine and group (under mpiexec).

    mpiexec -n 2 python -m mpi4py -m zensync tune [--sizes 8,4096,1048576] [--reps 7] [-o tuning.json]

Every rank joins torch.distributed from MPI (``zensync.transport.init_torch_distributed``), builds
the gloo transport and the MPI transport, and ``zensync.transport.tune`` times all_reduce,
all_gather and broadcast at each size on both: the slowest rank's median per (op, size), the
fastest backend per size, rank 0's table on every rank. Rank 0 writes the JSON, which
``MixedTransport(backends, TuningTable.from_json(...))`` loads, and prints the table.
"""

from __future__ import annotations

import argparse
import pathlib

from zensync.cli._errors import check_output_file, write_failed

__all__ = ["TUNE_FLAGS", "add_tune"]

TUNE_FLAGS = ("--sizes", "--reps", "--timeout", "--output")
"""The pinned flag set of ``zensync tune`` (tests/unit/cli/test_cli.py)."""


def add_tune(sub: argparse._SubParsersAction) -> None:
    """Add the ``tune`` subcommand."""
    parser = sub.add_parser(
        "tune",
        help="measure the gloo/MPI tuning table of the mixed dispatch (run under mpiexec)",
        description=__doc__.split("\n\n")[2] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--sizes", default="8,64,512,4096,16384,65536,1048576,16777216", help="bytes per rank")
    parser.add_argument("--reps", type=int, default=7, help="timed calls per op, size and backend")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    parser.add_argument("-o", "--output", metavar="FILE", default="tuning.json", help="where rank 0 writes the table")
    parser.set_defaults(run=_run_tune, subparser=parser)


def _run_tune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check_output_file(args.output, "-o")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        if not sizes or min(sizes) < 1 or args.reps < 1 or not args.timeout > 0:
            raise ValueError("--sizes must be positive byte counts, --reps >= 1 and --timeout > 0")
    except ValueError as err:
        parser.error(str(err))
    from zensync.transport import MPITransport, TorchTransport, init_torch_distributed, launch, tune

    rank, world = init_torch_distributed("gloo", timeout=args.timeout)
    mpi = MPITransport(timeout=args.timeout)
    table, seconds = tune({"gloo": TorchTransport(), "mpi": mpi}, sizes=sorted(sizes), reps=args.reps)
    mpi.close()
    launch.destroy()
    if rank != 0:
        return 0
    try:
        pathlib.Path(args.output).write_text(table.to_json())
    except OSError as err:
        raise write_failed(args.output, err) from err
    print(f"zensync tune: {world} ranks, slowest rank's median of {args.reps} calls, microseconds")
    print("| op | bytes per rank | gloo | mpi | table |")
    print("|---|---|---|---|---|")
    for op, by_size in seconds.items():
        for size, times in sorted(by_size.items()):
            chosen = table.backend_for(op, None, size)
            print(f"| {op} | {size:,} | {times['gloo'] * 1e6:.1f} | {times['mpi'] * 1e6:.1f} | {chosen} |")
    print(f"wrote {args.output}")
    return 0

"""``zensync`` command line: a thin argparse front end whose flags map 1:1 onto config fields.

Subcommands (one module each, ``add_<name>`` registers it)::

    zensync demo [--workers 4] [--steps 30] [--net 1gbit] ...        # DDP vs fp16 vs zensync, side by side
    zensync plan --model resnet101 --nodes 8 --gpus-per-node 8 --inter-bw 25Gbit --intra nvlink \\
                 --compressor dgc:0.01 [--cpu-offload] [--two-level] [-o plan.json]
    zensync explain plan.json [--png timeline.png]                   # summary and timeline of a plan
    zensync profile --model lm [--iterations 100] [-o profile.json]  # measure a real model's inputs
    mpiexec -n 2 python -m mpi4py -m zensync tune [-o tuning.json]   # gloo/MPI table of the mixed dispatch
    mpiexec -n 2 python -m mpi4py -m zensync bench --scan [--sizes 8,4096] [--backends gloo,mpi,mixed] \\
                 [--png] [-o collective_scan_p2]                     # collective latency/busbw per size
    zensync simulate [--schemes zen,agsparse,dense] [--ranks 2,...,1024] [--items 10000000] \\
                 [--ranks-per-node 8] [--inter 25Gbit] [-o PREFIX] [--png]  # one sync step, priced
    zensync launch [--ckpt-root DIR] -- --nproc-per-node 2 --max-restarts 3 train.py  # torchrun + checkpoint agent
    zensync agent --ckpt-root /dev/shm/job42                          # hold a host's checkpoint store

Exit status (``zensync --help`` prints it; ``zensync.cli._errors`` holds the rule): 0 on success; 1
when the command fails while running (a worker crashed or hung, matplotlib missing for ``--png``, a
result that cannot be written after the work); 2 on a usage error: a bad flag or value, or a file
named on the command line that cannot be read, parsed or written, checked before any work starts.
Errors are one line ``zensync <command>: error: ...`` on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from zensync.cli._errors import EXIT_FAILURE, EXIT_STATUS_HELP, EXIT_USAGE, CommandFailed, UsageError
from zensync.cli.bench import add_bench
from zensync.cli.demo import DEMO_FLAGS, add_demo
from zensync.cli.launch import add_agent, add_launch
from zensync.cli.plan import add_explain, add_plan
from zensync.cli.profile import add_profile
from zensync.cli.simulate import add_simulate
from zensync.cli.tune import add_tune

__all__ = ["DEMO_FLAGS", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``zensync`` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="zensync",
        description="zensync: gradient synchronization for PyTorch",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log at INFO level (DEBUG with -vv)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_demo(sub)
    add_plan(sub)
    add_explain(sub)
    add_profile(sub)
    add_tune(sub)
    add_bench(sub)
    add_simulate(sub)
    add_launch(sub)
    add_agent(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``zensync``; returns the exit status (module docstring; argparse exits 2 itself)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args, args.subparser))
    except (UsageError, CommandFailed) as err:
        print(f"zensync {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE if isinstance(err, UsageError) else EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())

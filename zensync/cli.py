"""``zensync`` command line: a thin argparse front end whose flags map 1:1 onto config fields.

Subcommands (one ``_add_<name>`` and one ``_run_<name>`` each; ``plan``, ``explain`` and ``profile``
will be added the same way):

    zensync demo [--workers 4] [--steps 30] [--net 1gbit] ...   # DDP vs fp16 vs zensync, side by side

Bad values exit with status 2 and argparse's usage message; a failed or hung worker exits with 1.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import logging
import sys
import time
from collections.abc import Callable, Sequence

from zensync.demo import DemoConfig, run_demo
from zensync.demo import config as demo_config_module
from zensync.demo.config import STRATEGIES
from zensync.demo.report import format_table, summarize, write_outputs
from zensync.testbed import WorkerError

__all__ = ["DEMO_FLAGS", "build_parser", "main"]

DEMO_FLAGS = {
    "--workers": "workers",
    "--steps": "steps",
    "--warmup-steps": "warmup_steps",
    "--vocab-size": "vocab_size",
    "--output-vocab-size": "output_vocab_size",
    "--embed-dim": "embed_dim",
    "--hidden-size": "hidden_size",
    "--batch-size": "batch_size",
    "--seq-len": "seq_len",
    "--corpus-bytes": "corpus_bytes",
    "--lr": "lr",
    "--strategies": "strategies",
    "--net": "net",
    "--latency-s": "latency_s",
    "--bandwidth-bytes-per-s": "bandwidth_bytes_per_s",
    "--seed": "seed",
    "--out-dir": "out_dir",
    "--timeout": "timeout_s",
}
"""Flag -> DemoConfig field of ``zensync demo`` (tests/unit/test_cli.py pins both sides)."""


def _demo_help() -> dict[str, str]:
    """Each DemoConfig field's attribute docstring is its flag's help (one source of truth)."""
    tree = ast.parse(inspect.getsource(demo_config_module.DemoConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    helps = {}
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            helps[node.target.id] = str(nxt.value.value)  # type: ignore[union-attr]
    return helps


def _add_demo(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="train an embedding-heavy LSTM LM with DDP under several sync strategies and compare them",
        description=(
            "Run each strategy as a fresh group of --workers processes (or emulated hosts with --net), "
            "then print step time, communication time, bytes per worker and final-parameter difference "
            "against plain DDP, and save demo_<hardware>_<date>.{json,md,png} to --out-dir."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = DemoConfig()
    helps = _demo_help()
    types: dict[str, Callable[[str], object]] = {"lr": float, "timeout_s": float, "net": str, "out_dir": str}
    types |= {"latency_s": float, "bandwidth_bytes_per_s": float}
    for flag, field in DEMO_FLAGS.items():
        default = getattr(defaults, field)
        if field == "strategies":
            parser.add_argument(
                flag,
                dest=field,
                nargs="+",
                default=list(default),
                metavar="NAME",
                help=f"{helps[field]} Valid: {', '.join(STRATEGIES)}.",
            )
            continue
        metavar = {"net": "RATE", "out_dir": "DIR", "timeout_s": "SECONDS"}.get(field)
        parser.add_argument(
            flag, dest=field, type=types.get(field, int), default=default, metavar=metavar, help=helps[field]
        )
    parser.set_defaults(run=_run_demo, subparser=parser)


def _demo_config(args: argparse.Namespace) -> DemoConfig:
    values = {field: getattr(args, field) for field in DEMO_FLAGS.values()}
    values["strategies"] = tuple(values["strategies"])
    return DemoConfig(**values)


def _run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = _demo_config(args)
    except ValueError as err:
        parser.error(str(err))  # exits with status 2 and the usage line
    started = time.monotonic()
    try:
        result = run_demo(config)
    except WorkerError as err:
        print(f"zensync demo: a worker failed:\n{err}", file=sys.stderr)
        return 1
    rows = summarize(result)
    table = format_table(rows, result.emulated)
    paths = write_outputs(result, rows, table)
    print(table)
    print(f"total {time.monotonic() - started:.0f} s; wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``zensync`` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="zensync", description="zensync: gradient synchronization for PyTorch")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log at INFO level (DEBUG with -vv)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``zensync``; returns the exit status (2 on a bad value, via argparse)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(args.run(args, args.subparser))


if __name__ == "__main__":
    sys.exit(main())

"""``zensync demo``: flags map 1:1 onto ``DemoConfig`` fields (``DEMO_FLAGS``, pinned by a test)."""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import logging
import time
from collections.abc import Callable

from zensync.cli._errors import CommandFailed, check_output_dir, check_output_file
from zensync.cli._progress import DemoProgress
from zensync.demo import DemoConfig, run_demo
from zensync.demo import config as demo_config_module
from zensync.demo.config import DEMO_FLAGS, STRATEGIES
from zensync.demo.report import format_table, summarize, write_outputs
from zensync.testbed import WorkerError

__all__ = ["DEMO_FLAGS", "add_demo"]

logger = logging.getLogger(__name__)


def _demo_help() -> dict[str, str]:
    """Each DemoConfig field's attribute docstring is its flag's help (one source of truth)."""
    tree = ast.parse(inspect.getsource(demo_config_module.DemoConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    helps = {}
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            helps[node.target.id] = str(nxt.value.value)  # type: ignore[union-attr]
    return helps


def add_demo(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    parser = sub.add_parser(
        "demo",
        help="train an embedding-heavy LSTM LM with DDP under several sync strategies and compare them",
        description=(
            "Run each strategy as a fresh group of --workers processes (or emulated hosts with --net), "
            "then print step time, communication time, bytes per worker, final-parameter difference "
            "against plain DDP and the share of each sync scheme, and save demo_<hardware>_<date>.{json,md,png} "
            "to --out-dir (with a _2, _3, ... suffix instead of overwriting), or to --out. A progress bar per "
            "strategy is drawn when stderr is a terminal."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = DemoConfig()
    helps = _demo_help()
    types: dict[str, Callable[[str], object]] = {
        "lr": float,
        "timeout_s": float,
        "net": str,
        "out_dir": str,
        "out": str,
    }
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
        metavar = {"net": "RATE", "out_dir": "DIR", "out": "PATH", "timeout_s": "SECONDS"}.get(field)
        parser.add_argument(
            flag, dest=field, type=types.get(field, int), default=default, metavar=metavar, help=helps[field]
        )
    parser.set_defaults(run=_run_demo, subparser=parser)


def _demo_config(args: argparse.Namespace) -> DemoConfig:
    values = {field: getattr(args, field) for field in DEMO_FLAGS.values()}
    return DemoConfig(**values)


def _run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = _demo_config(args)
    except ValueError as err:
        parser.error(str(err))  # exits with status 2 and the usage line
    # Output paths first: a bad one fails now, not after the whole run.
    if config.out is not None:
        check_output_file(config.out, "--out")
    if config.out_dir is not None:
        check_output_dir(config.out_dir, "--out-dir")
    started = time.monotonic()
    try:
        with DemoProgress() as progress:
            result = run_demo(config, say=progress.say, on_progress=progress)
    except WorkerError as err:
        raise CommandFailed(f"a worker failed:\n{err}") from err
    except RuntimeError as err:  # the testbed could not build or tear down the emulated cluster
        # One line for the user; the traceback stays reachable (-vv) in case it is a bug of ours.
        logger.debug("zensync demo failed", exc_info=True)
        raise CommandFailed(f"{err} (run with -vv for the traceback)") from err
    rows = summarize(result)
    table = format_table(rows, result.emulated)
    print(table)
    try:
        paths = write_outputs(result, rows, table)
    except OSError as err:
        raise CommandFailed(f"cannot write the results: {err}") from err
    print(f"total {time.monotonic() - started:.0f} s; wrote {', '.join(str(p) for p in paths.values())}")
    return 0

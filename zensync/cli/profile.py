"""``zensync profile``: measure the planner's inputs on this machine.

    zensync profile --model lm [--iterations 50] [--compressors dgc:0.01,efsignsgd] \\
                    [--calibrate-workers 2] [-o profile.json]

Records, for a model that really runs here: each parameter's gradient-ready time over
``--iterations`` backward passes (mean and coefficient of variation), tensor shapes, forward and
backward durations; each compressor's compress/decompress seconds by tensor size on this device
(fitted ``a + b * numel``); and, with ``--calibrate-workers N``, the alpha-beta parameters of a gloo
group of N local processes. The output is what ``zensync plan --profile`` reads.

Models: ``lm`` (the embedded-corpus LSTM language model of ``zensync.workloads.lm``), ``mlp`` (a
4-layer MLP on random data), or ``--factory package.module:function`` returning
``(model, make_batch, loss_fn)``.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import pathlib
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zensync.cli._errors import check_output_file, write_failed
from zensync.cli._progress import bar
from zensync.planner import ModelProfile
from zensync.profiling import CompressorCost, measure_compressor_costs, measure_ready_times
from zensync.workloads import lm

__all__ = ["PROFILE_BUNDLE_VERSION", "PROFILE_FLAGS", "add_profile"]

PROFILE_BUNDLE_VERSION = 1
PROFILE_FLAGS = (
    "--model",
    "--factory",
    "--iterations",
    "--warmup",
    "--batch",
    "--compressors",
    "--sizes",
    "--repeats",
    "--calibrate-workers",
    "--seed",
    "--output",
)
"""The pinned flag set of ``zensync profile`` (tests/unit/cli/test_cli.py)."""

_Workload = tuple[nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]], Callable[..., torch.Tensor]]


def add_profile(sub: argparse._SubParsersAction) -> None:
    """Add the ``profile`` subcommand."""
    parser = sub.add_parser(
        "profile",
        help="measure gradient-ready times, compressor costs and link alpha/beta on this machine",
        description=__doc__.split("\n\n")[2] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", choices=("lm", "mlp"), default="lm", help="built-in runnable model")
    source.add_argument("--factory", metavar="MODULE:FUNCTION", help="returns (model, make_batch, loss_fn)")
    parser.add_argument("--iterations", type=int, default=30, help="timed backward passes")
    parser.add_argument("--warmup", type=int, default=3, help="untimed passes first")
    parser.add_argument("--batch", type=int, default=20, help="batch of the built-in models")
    parser.add_argument(
        "--compressors", default="fp16,randomk:0.01,dgc:0.01,efsignsgd", help="comma-separated specs to time"
    )
    parser.add_argument("--sizes", default="4096,65536,1048576", help="comma-separated tensor sizes to time")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per compressor and size")
    parser.add_argument("--calibrate-workers", type=int, default=0, help="N > 1: fit alpha/beta of N local gloo ranks")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    parser.add_argument("-o", "--output", metavar="FILE", default="profile.json", help="where to write the profile")
    parser.set_defaults(run=_run_profile, subparser=parser)


def _run_profile(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check_output_file(args.output, "-o")  # before minutes of measuring
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        specs = [s.strip() for s in args.compressors.split(",") if s.strip()]
        if args.iterations < 1 or args.batch < 1 or args.repeats < 1 or args.calibrate_workers == 1:
            raise ValueError("--iterations, --batch and --repeats must be >= 1; --calibrate-workers 0 or >= 2")
        model, make_batch, loss_fn = _factory(args.factory) if args.factory else _builtin(args.model, args)
        costs = _compressor_costs(specs, sizes, args.repeats)
    except ValueError as err:
        parser.error(str(err))
    name = args.factory or args.model
    profile = _ready_times(args, name, model, make_batch, loss_fn)
    comm = None
    if args.calibrate_workers:
        with bar(1, f"alpha/beta of {args.calibrate_workers} gloo ranks", unit="fit") as fits:
            comm = _calibrate(args.calibrate_workers)
            fits.update()
    # The planner's "gpu" options compress on the training device's own stream: measured there, on a
    # GPU or on the CPU a CPU model trains on (which is also where offloaded compression runs).
    devices = ("gpu",) if profile.device.startswith("measured:cuda") else ("gpu", "cpu")
    bundle: dict[str, Any] = {
        "version": PROFILE_BUNDLE_VERSION,
        "profile": json.loads(profile.to_json()),
        "compressor_costs": {
            c.spec: {
                f"{d}_{op}": _fit(fit)
                for d in devices
                for op, fit in (("compress", c.compress), ("decompress", c.decompress))
            }
            for c in costs
        },
        "comm": comm,
    }
    try:
        pathlib.Path(args.output).write_text(json.dumps(bundle, indent=1))
    except OSError as err:
        raise write_failed(args.output, err) from err
    _print_summary(args, name, profile, costs, comm)
    return 0


def _ready_times(
    args: argparse.Namespace, name: str, model: nn.Module, make_batch: Callable[[], Any], loss_fn: Callable[..., Any]
) -> ModelProfile:
    """``measure_ready_times`` under a progress bar of its passes."""
    with bar(args.warmup + args.iterations, "ready times", unit="pass") as passes:
        profile = measure_ready_times(
            model,
            _counted(make_batch, passes.update),
            loss_fn,
            iterations=args.iterations,
            warmup=args.warmup,
            name=name,
            batch=str(args.batch),
        )
        passes.update(passes.total - passes.n)  # the last pass
    return profile


def _print_summary(
    args: argparse.Namespace,
    name: str,
    profile: ModelProfile,
    costs: list[CompressorCost],
    comm: dict[str, float] | None,
) -> None:
    worst = max(profile.tensors, key=lambda t: t.ready_cv)
    print(
        f"profiled {name}: {len(profile.tensors)} tensors, {profile.num_params:,} parameters, forward "
        f"{profile.forward_s * 1e3:.2f} ms, backward {profile.backward_s * 1e3:.2f} ms over {args.iterations} "
        f"iterations; largest ready-time CV {worst.ready_cv:.1%} ({worst.name})"
    )
    for c in costs:
        print(
            f"  {c.spec}: compress {c.compress.at(2**20) * 1e3:.3f} ms, decompress {c.decompress.at(2**20) * 1e3:.3f} "
            f"ms per 2**20 elements on {c.device}"
        )
    if comm:
        alpha_us, beta_gb = comm["latency_s"] * 1e6, comm["bandwidth_bytes_per_s"] / 1e9
        print(f"  gloo x{comm['world_size']}: alpha {alpha_us:.1f} us, beta {beta_gb:.2f} GB/s")
    print(f"wrote {args.output} (use: zensync plan --profile {args.output} ...)")


def _compressor_costs(specs: list[str], sizes: list[int], repeats: int) -> list[CompressorCost]:
    """``measure_compressor_costs`` one spec at a time, under a progress bar."""
    costs = []
    with bar(len(specs), "compressor costs", unit="spec") as done:
        for spec in specs:
            done.set_postfix_str(spec)
            costs += measure_compressor_costs([spec], sizes, repeats=repeats)
            done.update()
    return costs


def _counted(
    make_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], tick: Callable[[], object]
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """``make_batch`` that calls ``tick()`` from its second call on: a pass ended when the next one starts."""
    calls = itertools.count()

    def counted() -> tuple[torch.Tensor, torch.Tensor]:
        if next(calls):
            tick()
        return make_batch()

    return counted


def _fit(fit: Any) -> dict[str, float]:
    return {"fixed_s": fit.fixed_s, "per_element_s": fit.per_element_s, "knee_elements": 0}


def _builtin(name: str, args: argparse.Namespace) -> _Workload:
    gen = torch.Generator().manual_seed(args.seed)
    if name == "mlp":
        model: nn.Module = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)])
        x, y = torch.randn(args.batch, 512, generator=gen), torch.randn(args.batch, 512, generator=gen)
        return model, lambda: (x, y), nn.functional.mse_loss
    config = lm.Config(batch_size=args.batch, max_bytes=2_000_000)
    corpus = lm.load_corpus(config)
    model = lm.LanguageModel(config, generator=gen)
    steps = iter(range(10**9))

    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return lm.batch_for_rank(corpus, config, rank=0, step=next(steps))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))

    return model, make_batch, loss_fn


def _factory(spec: str) -> _Workload:
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise ValueError(f"--factory={spec!r}: expected 'package.module:function'")
    try:
        made = getattr(importlib.import_module(module_name), function)()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--factory={spec!r}: {exc}") from exc
    if not (isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], nn.Module)):
        raise ValueError(f"--factory={spec!r} must return (model, make_batch, loss_fn)")
    return made


def _calibrate(workers: int) -> dict[str, float]:
    """alpha/beta of a gloo group of ``workers`` local processes (rank 0's fit, agreed by all)."""
    from zensync.testbed import LoopbackCluster, free_port

    with tempfile.TemporaryDirectory() as tmp, LoopbackCluster(workers) as cluster:
        out = str(pathlib.Path(tmp, "comm.json"))
        code = f"from zensync.cli.profile import calibrate_worker; calibrate_worker({out!r})"
        port = free_port()
        cluster.run_workers(
            lambda r: [sys.executable, "-c", code],
            lambda r: {**cluster.env_for_torch(r, port), "OMP_NUM_THREADS": "1"},
            timeout_s=300,
        )
        return json.loads(pathlib.Path(out).read_text())


def calibrate_worker(out: str) -> None:
    """One rank of ``--calibrate-workers``: join the group, fit alpha/beta, rank 0 writes ``out``."""
    from zensync.cost.calibrate import calibrate
    from zensync.transport import TorchTransport, launch

    rank, world = launch.init_from_env(timeout_s=120)
    model = calibrate(TorchTransport(), torch.device("cpu"))
    if rank == 0:
        pathlib.Path(out).write_text(
            json.dumps(
                {
                    "world_size": world,
                    "latency_s": model.latency_s,
                    "bandwidth_bytes_per_s": model.bandwidth_bytes_per_s,
                }
            )
        )
    launch.destroy()

"""``zensync plan`` and ``zensync explain``: choose a compression plan, and show what a plan does.

    zensync plan --model resnet101 --nodes 8 --gpus-per-node 8 --inter-bw 25Gbit --intra nvlink \\
                 --compressor dgc:0.01 [--cpu-offload] [--two-level] [--no-fusion] [-o plan.json]
    zensync plan --profile profile.json ...     # a profile measured by ``zensync profile``
    zensync explain plan.json [--width 100] [--png timeline.png]

``PLAN_FLAGS`` maps each ``plan`` flag to what it sets (pinned by tests/unit/cli/test_cli.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
from typing import Any

from zensync.cli._errors import CommandFailed, UsageError, check_input, check_output_file, read_input, write_failed
from zensync.cost import compressor_model, measured_compressor_model
from zensync.planner import (
    MAX_JSON_CHARS,
    ClusterSpec,
    ModelProfile,
    Plan,
    builtin_gpus,
    builtin_models,
    builtin_profile,
    plan,
    read_profile_bundle,
    render_timeline,
    simulate_plan,
    summarize,
)

__all__ = ["PLAN_FLAGS", "add_explain", "add_plan", "load_profile_bundle"]

PLAN_FLAGS = {
    "--model": "built-in profile name",
    "--profile": "profile file from `zensync profile`",
    "--gpu": "GPU of the built-in profile's roofline",
    "--batch": "per-GPU batch of the built-in profile",
    "--precision": "precision of the built-in profile",
    "--nodes": "ClusterSpec.nodes",
    "--gpus-per-node": "ClusterSpec.gpus_per_node",
    "--inter-bw": "ClusterSpec.inter_bandwidth_bytes_per_s",
    "--intra": "ClusterSpec.intra_bandwidth_bytes_per_s",
    "--inter-latency-s": "ClusterSpec.inter_latency_s",
    "--intra-latency-s": "ClusterSpec.intra_latency_s",
    "--cpu-workers": "ClusterSpec.cpu_workers",
    "--compressor": "compressor spec",
    "--cpu-offload": "plan(cpu_offload=True)",
    "--two-level": "plan(two_level=True)",
    "--no-fusion": "plan(fusion=False)",
    "--output": "plan file to write",
}


def add_plan(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    parser = sub.add_parser(
        "plan",
        help="choose a per-tensor compression plan for a model on a cluster (Espresso-style)",
        description=(
            "Simulate the iteration timeline of a model on a cluster and pick, per gradient tensor, whether and "
            "how to compress it (compressor, collective, GPU or CPU, flat or two-level), then fuse neighbours. "
            "Prints the predicted iteration time against FP32 and FP16 allreduce and the zero-cost upper bound, "
            "and writes the plan as JSON for `zensync.register(ddp, strategy='plan.json')`."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help=f"built-in profile: {', '.join(builtin_models())}")
    source.add_argument("--profile", metavar="FILE", help="profile JSON written by `zensync profile`")
    parser.add_argument("--gpu", default="V100", help=f"built-in profile's GPU: {', '.join(builtin_gpus())}")
    parser.add_argument("--batch", type=int, default=None, help="built-in profile's per-GPU batch (default: its own)")
    parser.add_argument("--precision", choices=("amp", "fp32"), default="amp", help="built-in profile's precision")
    parser.add_argument("--nodes", type=int, required=True, help="machines")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="GPUs (ranks) per machine")
    parser.add_argument(
        "--inter-bw", required=True, help="inter-node bandwidth per node, e.g. 25Gbit, 100Gbit, 12.5GB/s"
    )
    parser.add_argument("--intra", default="nvlink", help="intra-node link: nvlink, pcie, or a bandwidth")
    parser.add_argument("--inter-latency-s", type=float, default=None, help="inter-node latency per collective (s)")
    parser.add_argument("--intra-latency-s", type=float, default=None, help="intra-node latency per collective (s)")
    parser.add_argument("--cpu-workers", type=int, default=1, help="CPU compression workers per GPU")
    parser.add_argument("--compressor", required=True, help="compressor spec, e.g. dgc:0.01, randomk:0.01, efsignsgd")
    parser.add_argument("--cpu-offload", action="store_true", help="allow compression on the CPU (Espresso Alg. 2)")
    parser.add_argument("--two-level", action="store_true", help="allow compressing the intra-node phase too")
    parser.add_argument("--no-fusion", action="store_true", help="do not fuse neighbouring tensors")
    parser.add_argument("-o", "--output", metavar="FILE", default=None, help="write the plan JSON here")
    parser.set_defaults(run=_run_plan, subparser=parser)


def load_profile_bundle(path: str) -> tuple[ModelProfile, dict[str, dict[str, dict[str, float]]]]:
    """(profile, measured costs by compressor spec) from a ``zensync profile`` file or a bare profile JSON.

    Raises:
        ValueError: If the file cannot be read or is not a valid profile.
    """
    try:
        size = pathlib.Path(path).stat().st_size
        if size > MAX_JSON_CHARS:  # refused before reading it into memory
            raise ValueError(f"profile {path!r} is {size:,} bytes, more than MAX_JSON_CHARS={MAX_JSON_CHARS:,}")
        text = pathlib.Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read profile {path!r}: {exc}") from exc
    return read_profile_bundle(text, what=f"profile {path!r}")


def _profile_file(path: str) -> tuple[ModelProfile, dict[str, dict[str, dict[str, float]]]]:
    """``load_profile_bundle`` of a file named on the command line: a bad one is a usage error (one line)."""
    check_input(path, "profile")  # a missing or unreadable file: the reason alone (opened, not read twice)
    try:
        return load_profile_bundle(path)
    except ValueError as err:
        raise UsageError(f"--profile {path}: {err}") from err


def _run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.output:
        check_output_file(args.output, "-o")
    bundle = _profile_file(args.profile) if args.profile else None
    try:
        if bundle is None:
            bundle = builtin_profile(args.model, gpu=args.gpu, batch=args.batch, precision=args.precision), {}
        profile, measured = bundle
        cluster = _cluster(args)
        costs = measured.get(compressor_model(args.compressor).spec, {})
        model = measured_compressor_model(args.compressor, costs)
    except ValueError as err:
        parser.error(str(err))
    chosen = plan(
        profile, cluster, model, cpu_offload=args.cpu_offload, two_level=args.two_level, fusion=not args.no_fusion
    )
    chosen = dataclasses.replace(chosen, profile=profile, costs=costs)
    print(summarize(chosen))
    if args.output:
        try:
            pathlib.Path(args.output).write_text(chosen.to_json())
        except OSError as err:
            raise write_failed(args.output, err) from err
        print(f"wrote {args.output} (use: zensync.register(ddp, strategy={args.output!r}))")
    return 0


def _cluster(args: argparse.Namespace) -> ClusterSpec:
    latencies: dict[str, Any] = {}
    if args.inter_latency_s is not None:
        latencies["inter_latency_s"] = args.inter_latency_s
    if args.intra_latency_s is not None:
        latencies["intra_latency_s"] = args.intra_latency_s
    return ClusterSpec.from_strings(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        inter=args.inter_bw,
        intra=args.intra,
        cpu_workers=args.cpu_workers,
        **latencies,
    )


def add_explain(sub: argparse._SubParsersAction) -> None:
    """Add the ``explain`` subcommand."""
    parser = sub.add_parser(
        "explain",
        help="summarize a plan file and render its predicted timeline",
        description="Re-simulate a plan written by `zensync plan` and print its summary and an ASCII timeline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("plan", metavar="PLAN.json", help="plan file from `zensync plan -o`")
    parser.add_argument("--width", type=int, default=100, help="timeline width in characters (>= 10)")
    parser.add_argument("--png", metavar="FILE", default=None, help="also draw the timeline as a PNG (matplotlib)")
    parser.set_defaults(run=_run_explain, subparser=parser)


def _run_explain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.width < 10:
        parser.error(f"--width={args.width} must be >= 10")
    if args.png:
        check_output_file(args.png, "--png")
    text = read_input(args.plan, "plan")
    try:
        loaded = Plan.from_json(text)
        result = simulate_plan(loaded)
    except ValueError as err:
        raise UsageError(f"{args.plan}: {err}") from err
    if args.png and importlib.util.find_spec("matplotlib") is None:
        raise CommandFailed("--png needs matplotlib (pip install 'zensync[bench]')")
    print(summarize(loaded))
    print()
    print(render_timeline(result, width=args.width))
    if args.png:
        from zensync.cli._timeline_png import draw_timeline

        try:
            draw_timeline(result, args.png, title=f"{loaded.model}: {loaded.compressor}")
        except OSError as err:
            raise write_failed(args.png, err) from err
        print(f"wrote {args.png}")
    return 0

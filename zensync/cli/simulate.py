"""``zensync simulate``: one synchronization step per scheme and world size, priced on a two-level network.

    zensync simulate [--schemes zen,sparse_ps,agsparse,dense] [--ranks 2,4,8,...,1024]
                     [--items 10000000] [--dim 1] [--density 0.01] [--skew 1.1] [--overlap 0.0] [--seed 0]
                     [--ranks-per-node 8] [--intra nvlink] [--inter 25Gbit] [--intra-latency-us 5]
                     [--inter-latency-us 10] [--inter-burst-kib 0] [--mode auto] [--memory-gb 4]
                     [--compute-scale 1] [--cores K]
                     [--transport-cpu all_reduce=0.5,all_to_all_v=0.8,...]
                     [--stats FILE | --lm-batch B | --model NAME [--compressor dgc:0.01]] [-o PREFIX] [--png]

For each scheme and each world size, zensync's real algorithms run on the in-process simulated world
(full mode) or their exact records are counted from the ranks' index sets (counted mode, every
scheme; ``auto`` takes it once the dense tensors would not fit in --memory-gb),
and the step's collectives are priced on a cluster of --ranks-per-node ranks per node joined by
--intra, with one --inter link per node (``zensync.simulate``). The workload is a Zipf-family
sparse gradient (``zensync.workloads.zipf``): --items rows of --dim float32, --density of the rows
non-zero on each rank, Zipf exponent --skew, --overlap of each rank's rows from a shared pool; or
several such tensors from --stats FILE (``zensync.simulate.sweep.load_stats``: per tensor rows, dim,
density, skew, overlap), synced one after another, their times and bytes added; or, with
--lm-batch B, the embedded LM's embedding gradient (``zensync.simulate.lm_workload``: --items
vocabulary rows of --dim, each rank's non-zero rows those its B sequences of 35 stdlib-corpus
tokens touch).
Each rank's local work is charged too, times --compute-scale (0: the network alone; a faster
device: a smaller factor): at a full point as measured (the CPU seconds of one core of this machine
between its calls); at a counted point, which runs no kernels, as fitted to full runs of the same
workload cut to at most 64 MiB per rank (``zensync.simulate.local_work``; the fits are in the
JSON). By default each rank has a core of its own; with --cores K the ranks' local work shares K
cores (processor sharing: hosts emulated on one machine, or ranks whose CPU-side compression shares
a node's cores), and --transport-cpu OP=NS,... charges each collective OP NS nanoseconds of CPU per
byte a rank sends or receives (the backend's copies and the kernel's network stack, on the same
cores; ops: all_reduce, reduce_scatter, all_gather, all_gather_v, all_to_all_v, broadcast,
send_recv). Prints a Markdown table (step time per scheme and world size, the mode that ran, the largest
rank's payload and local work) and writes PREFIX.json, PREFIX.md and, with --png and matplotlib,
PREFIX.png (time against ranks).

With --model (a built-in model: ``zensync plan --help`` lists them) the gradient step is a dense
model's instead: at each world size (a multiple of --ranks-per-node) the planner chooses a
compression plan with --compressor for the cluster the flags describe, and the step of DDP's
float32 buckets, the same in fp16 and the plan run as the hook runs them, on one rank whose records
stand for every rank (``zensync.simulate.planned``; mode M, mirrored).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any

from zensync.cli._errors import CommandFailed, UsageError, check_output_file, read_input, write_failed
from zensync.cli._progress import bar

__all__ = ["SIMULATE_FLAGS", "add_simulate", "format_report"]

SIMULATE_FLAGS = (
    "--schemes", "--ranks", "--items", "--dim", "--density", "--skew", "--overlap", "--seed",
    "--ranks-per-node", "--intra", "--inter", "--intra-latency-us", "--inter-latency-us", "--inter-burst-kib", "--mode",
    "--memory-gb", "--compute-scale", "--cores", "--transport-cpu", "--stats", "--lm-batch", "--model", "--compressor",
    "--output", "--png",
)  # fmt: skip
"""The pinned flag set of ``zensync simulate``."""


def add_simulate(sub: argparse._SubParsersAction) -> None:
    """Add the ``simulate`` subcommand."""
    parser = sub.add_parser(
        "simulate",
        help="price one sync step per scheme and world size on a modelled two-level network",
        description=__doc__.split("\n\n")[2] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--schemes", default="zen,sparse_ps,agsparse,dense", help="comma-separated schemes")
    parser.add_argument("--ranks", default="2,4,8,16,32,64,128,256,512,1024", help="comma-separated world sizes")
    parser.add_argument("--items", type=int, default=10_000_000, help="rows of the gradient")
    parser.add_argument("--dim", type=int, default=1, help="float32 elements per row")
    parser.add_argument("--density", type=float, default=0.01, help="non-zero fraction of rows per rank")
    parser.add_argument("--skew", type=float, default=1.1, help="Zipf exponent over row ids (0: uniform)")
    parser.add_argument("--overlap", type=float, default=0.0, help="fraction of each rank's rows from a shared pool")
    parser.add_argument("--seed", type=int, default=0, help="seed of the index sets")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks (GPUs) per node")
    parser.add_argument("--intra", default="nvlink", help="intra-node bandwidth: nvlink, pcie or e.g. 50GB/s")
    parser.add_argument("--inter", default="25Gbit", help="inter-node bandwidth per node, e.g. 25Gbit, 100Gbit")
    parser.add_argument("--intra-latency-us", type=float, default=5.0, help="intra-node latency per message")
    parser.add_argument("--inter-latency-us", type=float, default=10.0, help="inter-node latency per message")
    parser.add_argument(
        "--inter-burst-kib",
        type=float,
        default=0.0,
        help="token bucket of each inter-node link in KiB (a tbf-shaped link, as zensync.testbed's; 0: a NIC's)",
    )
    parser.add_argument("--mode", choices=("auto", "full", "counted"), default="auto", help="how each point runs")
    parser.add_argument("--memory-gb", type=float, default=4.0, help="auto: the largest full run, in dense tensors")
    parser.add_argument(
        "--compute-scale", type=float, default=1.0, help="factor on a full point's measured local work (0: network)"
    )
    parser.add_argument(
        "--cores", type=float, default=None, help="the ranks' local work shares this many cores (default: one each)"
    )
    parser.add_argument(
        "--transport-cpu", default="", metavar="OP=NS,...", help="CPU nanoseconds per byte moved, per collective op"
    )
    parser.add_argument(
        "--stats", metavar="FILE", help="gradient statistics JSON (several tensors; replaces --items ... --seed)"
    )
    parser.add_argument(
        "--lm-batch", type=int, default=0, help="> 0: the LM workload, this many sequences per rank (--items rows)"
    )
    parser.add_argument("--model", help="a built-in model's dense step with a planned compression (replaces --stats)")
    parser.add_argument("--compressor", default="dgc:0.01", help="with --model: the plan's compressor")
    parser.add_argument("-o", "--output", metavar="PREFIX", default="simulate", help="writes PREFIX.json and .md")
    parser.add_argument("--png", action="store_true", help="also PREFIX.png (needs matplotlib)")
    parser.set_defaults(run=_run_simulate, subparser=parser)


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[str], list[int], Any, Any]:
    """Schemes, world sizes, workload and topology from the flags (a bad value: exit 2)."""
    from zensync.planner.cluster import parse_bandwidth
    from zensync.simulate import Link, Topology
    from zensync.simulate.lm_workload import LMWorkload
    from zensync.simulate.sweep import ZipfWorkload
    from zensync.sync import SCHEMES

    try:
        schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
        unknown = [s for s in schemes if s not in SCHEMES or s == "auto"]
        if not schemes or unknown:
            raise ValueError(f"--schemes: unknown {unknown}; valid: {', '.join(s for s in SCHEMES if s != 'auto')}")
        ranks = sorted({int(r) for r in args.ranks.split(",") if r.strip()})
        if not ranks or ranks[0] < 1 or ranks[-1] > 4096:
            raise ValueError("--ranks: world sizes in 1..4096")
        try:
            workload: Any = ZipfWorkload(
                num_items=args.items, dim=args.dim, density=args.density, skew=args.skew, overlap=args.overlap,
                seed=args.seed,
            )  # fmt: skip
            if args.lm_batch:
                if args.lm_batch < 0 or args.stats is not None or args.model is not None:
                    raise ValueError("--lm-batch must be >= 1, without --stats or --model")
                workload = LMWorkload(num_items=args.items, dim=args.dim, batch_size=args.lm_batch, seed=args.seed)
        except ValueError as err:
            raise ValueError(f"--items, --dim, --density, --skew, --overlap, --lm-batch: {err}") from None
        if not args.memory_gb > 0:
            raise ValueError("--memory-gb must be > 0")
        if not args.compute_scale >= 0:
            raise ValueError("--compute-scale must be >= 0 (0: the network alone)")
        if args.cores is not None and not (0 < args.cores < float("inf")):
            raise ValueError("--cores must be finite and > 0 (omit it: a core per rank)")
        args.transport_cpu = _transport_cpu(args.transport_cpu)
        topology = Topology(
            args.ranks_per_node,
            Link(args.intra_latency_us * 1e-6, parse_bandwidth(args.intra)),
            Link(args.inter_latency_us * 1e-6, parse_bandwidth(args.inter), args.inter_burst_kib * 1024),
        )
    except ValueError as err:
        parser.error(str(err))
    if args.model is not None:
        _check_model(args, parser, ranks)
    return schemes, ranks, workload, topology


def _check_model(args: argparse.Namespace, parser: argparse.ArgumentParser, ranks: list[int]) -> None:
    from zensync.compress import build
    from zensync.planner import builtin_models

    if args.stats is not None:
        parser.error("--model and --stats are two workloads: give one")
    if args.model.lower() not in builtin_models():
        parser.error(f"--model {args.model!r}: valid: {', '.join(builtin_models())}")
    try:
        build(args.compressor)
    except ValueError as err:
        parser.error(f"--compressor: {err}")
    if args.compressor.startswith("powersgd"):
        parser.error("--compressor powersgd: a plan does not hold the matrix shapes PowerSGD factors")
    bad = [n for n in ranks if n % args.ranks_per_node]
    if bad:
        parser.error(f"--model: world sizes {bad} are not multiples of --ranks-per-node {args.ranks_per_node}")


def _run_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    for suffix in (".json", ".md", *((".png",) if args.png else ())):
        check_output_file(args.output + suffix, "-o")
    schemes, ranks, workload, topology = _config(args, parser)
    if args.png and importlib.util.find_spec("matplotlib") is None:  # before the work, as bench and explain
        raise CommandFailed("--png needs matplotlib (pip install 'zensync[bench]')")
    from zensync.simulate.sweep import combine, load_stats, simulate_sweep

    if args.model is not None:
        return _run_model(args, ranks, topology)
    tensors = {"gradient": workload}
    if args.stats is not None:
        try:
            tensors = load_stats(read_input(args.stats, "--stats"))
        except ValueError as err:
            raise UsageError(f"--stats {args.stats}: {err}") from err
    started = time.perf_counter()
    per_tensor = {}
    with bar(len(schemes) * len(ranks) * len(tensors), "simulate", unit="point") as progress:
        for name, tensor in tensors.items():
            per_tensor[name] = simulate_sweep(
                schemes, ranks, tensor, topology, mode=args.mode, memory_bytes=args.memory_gb * 1e9,
                compute_scale=args.compute_scale, cores=args.cores, transport_cpu=args.transport_cpu,
                on_point=lambda row: progress.update(1),
            )  # fmt: skip
    rows = per_tensor["gradient"] if args.stats is None else combine(per_tensor)
    workload_doc = {
        "family": "lm" if args.lm_batch else "zipf",
        "stats": args.stats,
        "tensors": {n: dataclasses.asdict(w) for n, w in tensors.items()},
    }
    return _report(args, topology, workload_doc, rows, started)


def _run_model(args: argparse.Namespace, ranks: list[int], topology: Any) -> int:
    from zensync.planner import builtin_profile
    from zensync.simulate.planned import plan_sweep

    started = time.perf_counter()
    profile = builtin_profile(args.model)
    with bar(3 * len(ranks), "simulate", unit="point") as progress:
        rows = plan_sweep(
            profile, args.compressor, ranks, topology, compute_scale=args.compute_scale, cores=args.cores,
            transport_cpu=args.transport_cpu, seed=args.seed, on_point=lambda row: progress.update(1),
        )  # fmt: skip
    workload_doc = {
        "family": "model",
        "model": args.model,
        "parameters": profile.num_params,
        "tensors": len(profile.tensors),
        "compressor": args.compressor,
        "profile": f"{profile.device}, {profile.batch}",
    }
    return _report(args, topology, workload_doc, rows, started)


def _report(
    args: argparse.Namespace, topology: Any, workload: dict[str, Any], rows: list[dict[str, Any]], started: float
) -> int:
    document = {
        "version": 1,
        "command": "zensync " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cores": os.cpu_count()},
        "seed": args.seed,
        "versions": _versions(),
        "workload": workload,
        "topology": {
            "ranks_per_node": topology.ranks_per_node,
            "intra": dataclasses.asdict(topology.intra),
            "inter": dataclasses.asdict(topology.inter),
        },
        "priced": _priced(args.compute_scale, args.cores, args.transport_cpu),
        "compute_scale": args.compute_scale,
        "cores": args.cores,
        "transport_cpu_s_per_byte": args.transport_cpu,
        "local_work_fits": {r["scheme"]: r["local_work"] for r in rows if r.get("local_work")},
        "wall_s": time.perf_counter() - started,
        "rows": rows,
    }
    text = format_report(document)
    print(text)
    _write(args.output + ".json", json.dumps(document, indent=1) + "\n")
    _write(args.output + ".md", text + "\n")
    if args.png:
        from zensync.cli._simulate_png import draw_simulation

        try:
            draw_simulation(rows, args.output + ".png", title=_title(document))
        except OSError as err:
            raise write_failed(args.output + ".png", err) from err
    print(f"wrote {args.output}.json, {args.output}.md" + (f", {args.output}.png" if args.png else ""))
    return 0


def _transport_cpu(text: str) -> dict[str, float]:
    """``OP=NS,...`` (nanoseconds per byte) as ``price``'s ``transport_cpu`` (seconds per byte)."""
    from zensync.simulate.timeline import TRANSPORT_CPU_OPS

    costs = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        op, _, value = item.partition("=")
        try:
            ns = float(value)
        except ValueError:
            ns = float("nan")
        if op not in TRANSPORT_CPU_OPS or not 0 <= ns < float("inf"):
            raise ValueError(
                f"--transport-cpu: {item!r} must be OP=NS with NS >= 0 and OP one of {', '.join(TRANSPORT_CPU_OPS)}"
            )
        costs[op] = ns * 1e-9
    return costs


def _priced(compute_scale: float, cores: float | None, transport_cpu: dict[str, float]) -> str:
    if compute_scale == 0 and not transport_cpu:
        return "the network alone: collectives on the two-level model, local work not charged"
    shared = "each rank on a core of its own" if cores is None else f"the ranks sharing {cores:g} cores"
    transport = ", ".join(f"{op} {cost * 1e9:g} ns/byte" for op, cost in transport_cpu.items())
    return (
        f"collectives on the two-level model plus {compute_scale:g} x each rank's local work on one core of this "
        "machine: measured at full and mirrored points, fitted to full runs of the workload cut to fewer rows at "
        f"counted points; {shared}" + (f"; transport CPU per byte moved: {transport}" if transport else "")
    )


def _versions() -> dict[str, str]:
    import torch

    import zensync

    versions = {"zensync": getattr(zensync, "__version__", "unknown"), "torch": torch.__version__}
    try:  # a source checkout names its commit
        here = pathlib.Path(zensync.__file__).parent
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if done.returncode == 0:
            versions["git"] = done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return versions


def _write(path: str, text: str) -> None:
    try:
        pathlib.Path(path).write_text(text)
    except OSError as err:
        raise write_failed(path, err) from err


def _title(document: dict[str, Any]) -> str:
    workload, t = document["workload"], document["topology"]
    tensors = workload["tensors"]
    if workload["family"] == "model":
        what = (
            f"{workload['model']} ({workload['parameters']:,} parameters in {tensors} tensors), "
            f"DDP fp32 / fp16 buckets vs the plan with {workload['compressor']}"
        )
    elif workload["family"] == "lm":
        (w,) = tensors.values()
        what = f"LM embedding {w['num_items']:,} x {w['dim']} rows, {w['batch_size']} x {w['seq_len']} tokens per rank"
    elif len(tensors) == 1:
        (w,) = tensors.values()
        what = (
            f"Zipf {w['num_items']:,} x {w['dim']} rows, density {w['density']}, skew {w['skew']}, "
            f"overlap {w['overlap']}"
        )
    else:
        what = f"{len(tensors)} Zipf tensors ({', '.join(tensors)}) synced in turn"
    burst = t["inter"].get("burst_bytes", 0.0)
    bucket = f", a {burst / 1024:g} KiB bucket" if burst else ""
    return f"{what}; {t['ranks_per_node']}/node, inter {t['inter']['bandwidth_bytes_per_s'] * 8 / 1e9:g} Gbit/s{bucket}"


def format_report(document: dict[str, Any]) -> str:
    """The run as Markdown: the setting, then one row per world size, a time column per scheme."""
    rows = document["rows"]
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    ranks = sorted({r["ranks"] for r in rows})
    by = {(r["scheme"], r["ranks"]): r for r in rows}
    versions = ", ".join(f"{k} {v}" for k, v in document["versions"].items())
    machine = document["machine"]
    lines = [
        f"zensync simulate: {_title(document)}.",
        f"Command: `{document['command']}` ({document['date']}; {versions}; Python {machine['python']} on "
        f"{machine['platform']}, {machine.get('cores', '?')} cores; seeds: workload {document.get('seed', 0)}, "
        f"h0 12345).",
        f"Step time in ms ({document['priced']}); mode: F full run, C counted from the index sets, "
        "M one rank mirrored, F+C some tensors full and some counted; in brackets the largest rank's payload sent, MB, "
        "and the local work of the rank with the most, ms.",
        "",
        "| ranks | " + " | ".join(schemes) + " |",
        "|---|" + "---|" * len(schemes),
    ]
    for n in ranks:
        cells = []
        for scheme in schemes:
            row = by[(scheme, n)]
            mode = {"full": "F", "counted": "C", "mirror": "M", "mixed": "F+C"}[row["mode"]]
            local = "" if not row.get("compute_seconds") else f"; local {row['compute_seconds'] * 1e3:.3g}"
            cells.append(f"{row['seconds'] * 1e3:.3g} {mode} ({row['max_sent_bytes'] / 1e6:.3g}{local})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    for scheme, fit in document.get("local_work_fits", {}).items():
        lines.append(
            f"Counted {scheme}'s local work per rank: {fit['fixed_s'] * 1e3:.3g} ms + "
            f"{fit['per_dense_byte_s'] * 1e9:.3g} ns per dense byte + {fit['per_moved_byte_s'] * 1e9:.3g} ns per byte "
            f"moved (fit of {fit['samples']} full-run ranks, at most {fit['max_relative_error']:.0%} off any of them)."
        )
    lines.append(f"Simulator wall time: {document['wall_s']:.1f} s.")
    return "\n".join(lines)

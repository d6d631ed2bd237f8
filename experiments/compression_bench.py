"""Compression in training against torch's own hooks: DDP on a dense MLP over shaped links.

Launch (from the repository root, as root; without root it falls back to loopback and says so)::

    python experiments/compression_bench.py                          # 4 hosts, 1gbit, ~6 min on 2 cores
    python experiments/compression_bench.py --rate 100mbit --strategies ddp torch:fp16 fp16
    python experiments/compression_bench.py --buckets default        # DDP's default 25 MB buckets
    python experiments/compression_bench.py --loopback --strategies ddp auto   # unshaped links

Workload (issue 14): DDP on an MLP 1024-2048-2048-1024-10 (8.4M parameters, 34 MB fp32), batch
64 of fixed synthetic data per rank (a fixed random teacher's labels), SGD lr 0.01 momentum 0.9,
one DDP bucket (``bucket_cap_mb=64``) unless ``--buckets default``; ``--warmup`` untimed steps,
then ``--steps`` timed ones, one fresh process group per strategy, one process per emulated host.

Strategies: ``ddp`` (no hook), ``torch:fp16`` / ``torch:bf16`` (torch's fp16/bf16_compress_hook),
``torch:powersgd:R`` (torch's powerSGD_hook, rank R, start_powerSGD_iter=2 so the warm-up covers
its dense start; with several buckets on gloo it can fail, which the report says), ``nosync``
(DDP's ``no_sync``: backward and the optimizer with no communication at all, the compute floor),
and any zensync strategy (``zensync.register(ddp, strategy=...)``: "fp16", "powersgd:4",
"topk:0.01", "dgc:0.01", "onebit", "efsignsgd", "qsgd", "auto", ...). A zensync strategy with the
suffix ``@serial`` registers with ``overlap_buckets=False`` (each bucket's job runs to its end
before the next starts), to measure what overlapping the buckets buys, side by side; ``@thread``
with ``comm_thread=True`` (the jobs start on a thread of the hook's own, beside backward);
``auto@warmup`` is "auto" measuring its own profile in its first 8 steps (``profile="warmup"``;
give ``--warmup 9`` or more, so that the step that measures is not timed).

Per strategy: the median over timed steps of the slowest rank's step time (forward, backward with
the hook, optimizer), CPU time per step (user + system of the rank's process, all threads), bytes on
the wire per step (eth0 tx of each host over the timed steps), the wire time of those bytes at the
link rate, the final loss (mean over ranks of the last step's loss), and, for zensync, its per-step
comm time and bytes from the hook's step log. Results:
``experiments/results/compression_<cluster>_<buckets>_<date>.{json,md}``.

Predictions (unless ``--no-predict``): before the strategies, a calibration run on the same cluster
(``zensync.profiling.profile_group``: compute with every rank at once, the links' alpha-beta per
collective, the hook's agreement round, each compressor at the bucket's size) writes a step profile;
each strategy the planner can price gets ``zensync.planner.predict_step``'s step time beside its
measured one, and "auto" registers with that profile (``profile=``) and reports its own choice and
prediction. The calibration never sees the runs it predicts. ``--rounds R`` runs the strategy list R
times, interleaved, and pools the steps (run-to-run noise on 2 shared cores is +-10-20 %).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zensync.testbed import EmulatedCluster, LoopbackCluster, make_cluster, parse_rate

# Sibling modules of this driver (experiments/ is not a package).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _counters import cpu_seconds, tx_bytes

_PORT = 29641
_WIDTHS = (1024, 2048, 2048, 1024, 10)
DEFAULT_STRATEGIES = (
    "nosync",
    "ddp",
    "torch:fp16",
    "fp16",
    "torch:bf16",
    "bf16",
    "torch:powersgd:4",
    "powersgd:4",
    "topk:0.01",
    "dgc:0.01",
    "onebit",
    "efsignsgd",
    "qsgd",
    "auto",
)


def mlp() -> nn.Module:
    """The issue's MLP, seeded: every rank and every strategy starts from the same weights."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(_WIDTHS)):
        layers.append(nn.Linear(a, b))
        if i < len(_WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's batch at ``step``: Gaussian inputs labelled by a fixed random linear teacher."""
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randn(size, _WIDTHS[0], generator=g)
    teacher = torch.randn(_WIDTHS[0], _WIDTHS[-1], generator=torch.Generator().manual_seed(7))
    return x, (x @ teacher).argmax(1)


def _register(ddp: nn.parallel.DistributedDataParallel, strategy: str, profile: str | None) -> Any:
    """Install the strategy's hook; the zensync state (or None). "auto" plans compression from the
    calibration run's step profile (``profile``, a JSON path) when there is one."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if strategy in ("ddp", "nosync"):
        return None
    if strategy == "torch:fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if strategy == "torch:bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return None
    if strategy.startswith("torch:powersgd:"):
        rank = int(strategy.rsplit(":", 1)[1])
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2, use_error_feedback=True
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return None
    import zensync

    strategy, _, variant = strategy.partition("@")
    variants: dict[str, dict[str, Any]] = {
        "": {},
        "serial": {"overlap_buckets": False},
        "thread": {"comm_thread": True},
        "warmup": {"profile": "warmup"},
    }
    if variant not in variants:
        raise ValueError(f"unknown strategy variant @{variant} (known: @serial, @thread, @warmup)")
    options = variants[variant]
    if strategy == "auto" and profile is not None:
        options = {"profile": profile, **options}  # a variant's own profile ("warmup") wins
    return zensync.register(ddp, strategy=strategy, **options)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _priced_specs(strategies: list[str]) -> list[str]:
    """The compressor specs the calibration run times: those of the strategies it can predict."""
    from zensync.planner import AUTO_COMPRESSORS

    specs = {priced[0] for priced in map(_prediction_of, strategies) if priced is not None}
    if "auto" in strategies:
        specs |= set(AUTO_COMPRESSORS)
    return sorted(specs - {"fp32", "auto"})


def _prediction_of(strategy: str) -> tuple[str, bool] | None:
    """(spec predict_step prices, whether the zensync hook runs) for a strategy; None: not priced
    (no_sync is the compute floor, not a sync; torch's PowerSGD hook computes otherwise than the
    zensync PowerSGD the profile times on the buckets). "auto": its own prediction, made by the
    hook from the same profile. "@serial" variants: the same prediction as the strategy (the
    planner does not model the buckets' overlap)."""
    strategy = strategy.partition("@")[0]
    if strategy == "ddp":
        return "fp32", False
    if strategy == "nosync":
        return None
    if strategy.startswith("torch:"):
        spec = strategy.removeprefix("torch:")
        return (spec, False) if spec in ("fp16", "bf16") else None
    if strategy == "auto":
        return "auto", True
    return strategy, True


def profile_worker(args: argparse.Namespace) -> None:
    """The calibration run (rank 0 writes profile.json): ``zensync.profiling.profile_group`` on the
    benchmark's model, buckets, batch and optimizer, apart from the runs it predicts."""
    from zensync.profiling import profile_group

    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    ddp = nn.parallel.DistributedDataParallel(mlp(), bucket_cap_mb=64 if args.buckets == "one" else 25)
    steps = itertools.count()
    measured = profile_group(
        ddp,
        lambda: batch(rank, next(steps), args.batch),
        nn.CrossEntropyLoss(),
        optimizer=_sgd,
        specs=_priced_specs(args.strategies),
        iterations=args.steps,
        warmup=args.warmup,
        name="mlp",
    )
    if rank == 0:
        pathlib.Path(args.out, "profile.json").write_text(measured.to_json())
    dist.destroy_process_group()


def worker(args: argparse.Namespace) -> None:
    """One rank of one strategy: writes <strategy>_rank<r>.json."""
    if args.strategy == "profile":
        profile_worker(args)
        return
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    report: dict[str, Any] = {"rank": rank}
    try:
        model = mlp()
        cap = 64 if args.buckets == "one" else 25
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        calibrated = pathlib.Path(args.out, "profile.json")
        state = _register(ddp, args.strategy, str(calibrated) if calibrated.exists() else None)
        opt = _sgd(ddp.parameters())
        loss_fn = nn.CrossEntropyLoss()
        times, cpu, losses, split = [], [], [], []
        tx0 = 0
        for step in range(args.warmup + args.steps):
            x, y = batch(rank, step, args.batch)
            if step == args.warmup:
                dist.barrier()
                tx0 = tx_bytes(args.iface)
            dist.barrier()
            start, start_cpu = time.perf_counter(), cpu_seconds()
            opt.zero_grad(set_to_none=False)
            with ddp.no_sync() if args.strategy == "nosync" else contextlib.nullcontext():
                loss = loss_fn(ddp(x), y)
                forward_end = time.perf_counter()
                loss.backward()
            backward_end = time.perf_counter()
            opt.step()
            if step >= args.warmup:
                end = time.perf_counter()
                times.append(end - start)
                cpu.append(cpu_seconds() - start_cpu)
                split.append([forward_end - start, backward_end - forward_end, end - backward_end])
            losses.append(float(loss))
        dist.barrier()
        barrier_tx = tx_bytes(args.iface)
        dist.barrier()
        barrier_tx = tx_bytes(args.iface) - barrier_tx  # one barrier's bytes, to subtract
        tx = tx_bytes(args.iface) - tx0 - barrier_tx * (2 * args.steps + 3)
        report.update(times=times, cpu=cpu, losses=losses, split=split, tx_per_step=max(0.0, tx / args.steps))
        if state is not None:
            history = state.history[-args.steps :]
            report["zensync"] = {
                "comm_time_s": [h["comm_time_s"] for h in history],
                "bytes_sent": [h["bytes_sent"] for h in history],
                "schemes": sorted({p["scheme"] for h in history for p in h["params"].values()}),
                "phases_s": [h["phases_s"] for h in history],
            }
            if state.auto_profile is not None and rank == 0 and args.strategy.endswith("@warmup"):
                pathlib.Path(args.out, "warmup_profile.json").write_text(state.auto_profile.to_json())
            if state.auto_choice is not None:
                report["zensync"]["auto_choice"] = {
                    "spec": state.auto_choice.spec,
                    "predicted_s": dict(state.auto_choice.predicted_s),
                }
            if state.auto_verdict is not None:
                report["zensync"]["auto_verdict"] = dataclasses.asdict(state.auto_verdict)
    except Exception as exc:  # noqa: BLE001 - reported per strategy (torch's PowerSGD hook can fail on gloo)
        report["error"] = f"{type(exc).__name__}: {exc}"
    pathlib.Path(args.out, f"{args.strategy.replace(':', '_')}_rank{rank}.json").write_text(json.dumps(report))
    with contextlib.suppress(Exception):  # a failed strategy may leave the group broken
        dist.destroy_process_group()


def _merge_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each rank's report over every round: the timed steps of all rounds, in order (the median is then
    over all of them), the wire bytes averaged; the last round's losses. A failed round fails the strategy."""
    merged = []
    for per_rank in zip(*rounds, strict=True):
        if any("error" in r or "times" not in r for r in per_rank):
            merged.append(next(r for r in per_rank if "error" in r or "times" not in r))
            continue
        out = dict(per_rank[-1])
        for key in ("times", "cpu", "split"):
            out[key] = [x for r in per_rank for x in r[key]]
        out["tx_per_step"] = statistics.mean(r["tx_per_step"] for r in per_rank)
        if "zensync" in out:
            out["zensync"] = dict(out["zensync"])
            for key in ("comm_time_s", "bytes_sent", "phases_s"):
                out["zensync"][key] = [x for r in per_rank for x in r["zensync"][key]]
        merged.append(out)
    return merged


def _summary(strategy: str, ranks: list[dict[str, Any]], rate_bits: int | None) -> dict[str, Any]:
    errors = sorted({r["error"] for r in ranks if "error" in r})
    if errors or any("times" not in r for r in ranks):
        return {"strategy": strategy, "error": "; ".join(errors) or "a rank wrote no result"}
    steps = len(ranks[0]["times"])
    step_s = statistics.median(max(r["times"][i] for r in ranks) for i in range(steps))
    tx = statistics.mean(r["tx_per_step"] for r in ranks)
    out: dict[str, Any] = {
        "strategy": strategy,
        "step_s": step_s,
        "cpu_s_per_rank": statistics.mean(statistics.median(r["cpu"]) for r in ranks),
        "wire_bytes_per_step": tx,
        "wire_s_at_rate": tx * 8 / rate_bits if rate_bits else None,
        "final_loss": statistics.mean(r["losses"][-1] for r in ranks),
        # Forward, backward (with the hook: DDP waits for its buckets there) and optimizer, each
        # the median over steps of the mean over ranks.
        "split_s": [
            statistics.median(statistics.mean(r["split"][i][k] for r in ranks) for i in range(steps)) for k in range(3)
        ],
    }
    z = ranks[0].get("zensync")
    if z:
        out["zensync_comm_s"] = statistics.median(z["comm_time_s"]) if z["comm_time_s"] else None
        out["zensync_bytes_sent"] = statistics.median(z["bytes_sent"]) if z["bytes_sent"] else None
        out["zensync_schemes"] = z["schemes"]
        if "auto_choice" in z:
            out["auto_choice"] = z["auto_choice"]
            verdict = z.get("auto_verdict")
            if verdict is not None:
                out["auto_verdict"] = verdict
            # The timed steps sync with the choice, or densely after a verdict against it.
            spec = "fp32" if verdict is not None and not verdict["kept"] else z["auto_choice"]["spec"]
            out["predicted_step_s"] = z["auto_choice"]["predicted_s"][spec]
        per_rank = [r["zensync"]["phases_s"] for r in ranks]
        names = sorted({k for steps_of in per_rank for h in steps_of for k in h})
        out["zensync_phases_s"] = {
            k: statistics.median(statistics.mean(p[i].get(k, 0.0) for p in per_rank) for i in range(steps))
            for k in names
        }
    return out


def _markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    base = next((r["step_s"] for r in rows if r["strategy"] == "ddp" and "step_s" in r), None)
    lines = [
        f"# Compression in training vs torch's hooks ({meta['label']}, {meta['buckets']} bucket(s), {meta['date']})",
        "",
        f"Command: `{meta['command']}`; torch {meta['torch']}, {meta['cpus']} CPUs; MLP "
        f"{'-'.join(map(str, _WIDTHS))}, batch {meta['batch']}, SGD momentum 0.9; median over "
        f"{meta['steps']} steps (after {meta['warmup']}) x {meta.get('rounds', 1)} interleaved round(s) of the "
        "slowest rank's step.",
        "",
        "| strategy | ms/step | vs ddp | CPU ms/step/rank | wire MB/step/host | wire ms at link rate "
        "| zensync comm ms | final loss | schemes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['strategy']} | failed: {r['error'][:160]} | | | | | | | |")
            continue
        wire_ms = f"{r['wire_s_at_rate'] * 1e3:.1f}" if r["wire_s_at_rate"] is not None else "n/a"
        comm = r.get("zensync_comm_s")
        lines.append(
            f"| {r['strategy']} | {r['step_s'] * 1e3:.1f} | "
            f"{'' if base is None else format(base / r['step_s'], '.2f') + 'x'} | {r['cpu_s_per_rank'] * 1e3:.1f} | "
            f"{r['wire_bytes_per_step'] / 1e6:.2f} | {wire_ms} | {'' if comm is None else format(comm * 1e3, '.1f')} | "
            f"{r['final_loss']:.4f} | {', '.join(r.get('zensync_schemes', []))} |"
        )
    lines += [
        "",
        "nosync: DDP's no_sync (no communication): the compute floor of the step. CPU ms: user + system "
        f"time of one rank's process per step (all threads); {meta['hosts']} ranks share {meta['cpus']} cores.",
        "",
        *_phase_table(rows),
        *_prediction_table(meta, rows),
    ]
    return "\n".join(lines) + "\n"


def _prediction_table(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Predicted beside measured, for every strategy the planner prices."""
    priced = [r for r in rows if "predicted_step_s" in r and "step_s" in r]
    if not priced:
        return []
    lines = [
        "",
        "## Predicted beside measured",
        "",
        "Predicted: `zensync.planner.predict_step` on the calibration run's `StepProfile` "
        "(`zensync.profiling.profile_group`, run before and apart from the strategies: compute with every rank "
        "at once, the links' alpha-beta per collective, each compressor at the bucket's size); "
        f"calibration: {meta.get('calibration_summary', '')}.",
        "",
        "| strategy | predicted ms/step | measured ms/step | measured / predicted | predicted comm busy ms |",
        "|---|---|---|---|---|",
    ]
    for r in priced:
        busy = r.get("predicted_comm_busy_s")
        lines.append(
            f"| {r['strategy']} | {r['predicted_step_s'] * 1e3:.1f} | {r['step_s'] * 1e3:.1f} | "
            f"{r['step_s'] / r['predicted_step_s']:.2f} | {'' if busy is None else format(busy * 1e3, '.1f')} |"
        )
    for r in priced:
        choice = r.get("auto_choice")
        if choice:
            options = ", ".join(f"{spec} {t * 1e3:.1f}" for spec, t in choice["predicted_s"].items())
            how = "profile='warmup'" if r["strategy"].endswith("@warmup") else "profile=<the calibration run's>"
            lines += [
                "",
                f"{r['strategy']} (`zensync.register(ddp, strategy='auto', {how})`) chose {choice['spec']}; "
                f"its predicted ms/step per candidate: {options}.",
            ]
            verdict = r.get("auto_verdict")
            if verdict:
                outcome = "kept it" if verdict["kept"] else "went back to dense (the timed steps are dense)"
                dense = "the warm-up's dense" if verdict.get("dense_measured", True) else "the predicted dense"
                lines[-1] += (
                    f" Measured after {choice['spec']}'s first steps (`verify_steps`): "
                    f"{verdict['compressed_step_s'] * 1e3:.1f} ms/step against {dense} "
                    f"{verdict['dense_step_s'] * 1e3:.1f}; it {outcome}."
                )
    for strategy, summaries in meta.get("warmup_profiles", {}).items():
        lines += ["", f"{strategy}'s own profile, measured in its warm-up steps, per round: " + "; ".join(summaries)]
    return lines


_PHASE_ORDER = ("queued", "detect", "divide", "error_feedback", "compress", "codec", "decompress", "finite_check")


def _phase_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where each strategy's step went: forward / backward (with the hook) / optimizer for every
    strategy, and, for zensync's, the hook's sections and its waits in each collective phase."""
    ok = [r for r in rows if "error" not in r]
    waits = sorted({k for r in ok for k in r.get("zensync_phases_s", {}) if k.startswith("wait:")})
    columns = [*_PHASE_ORDER, *waits]
    lines = [
        "## Where the step goes (ms, median over steps of the mean over ranks)",
        "",
        "forward, backward (DDP waits for the hook's buckets at its end) and optimizer for every strategy; "
        "for zensync's, the hook's own sections (the local passes over the bucket) and `wait:<phase>`, the "
        "time inside the collectives of each phase from call to completion (the wire, the rounds and the "
        "slower ranks: on 2 shared cores, also the other ranks' CPU). Blank: the section did not run.",
        "",
        "| strategy | forward | backward | optimizer | " + " | ".join(columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for r in ok:
        phases = r.get("zensync_phases_s", {})
        cells = [f"{phases[c] * 1e3:.1f}" if c in phases else "" for c in columns]
        fwd, bwd, opt = (f"{v * 1e3:.1f}" for v in r["split_s"])
        lines.append(f"| {r['strategy']} | {fwd} | {bwd} | {opt} | " + " | ".join(cells) + " |")
    return lines


def _read_profile(path: pathlib.Path) -> Any:
    from zensync.planner import StepProfile

    if not path.exists():
        print("profile: the calibration run wrote no profile; no predictions", file=sys.stderr)
        return None
    return StepProfile.from_json(path.read_text())


def _calibration_summary(step_profile: Any) -> str:
    profile, ar, ag = step_profile.profile, step_profile.allreduce, step_profile.allgather
    return (
        f"forward {profile.forward_s * 1e3:.1f} ms, backward {profile.backward_s * 1e3:.1f} ms, rest of the step "
        f"{step_profile.other_s * 1e3:.1f} ms; allreduce alpha {ar.latency_s * 1e3:.2f} ms beta "
        f"{ar.bandwidth_bytes_per_s / 1e6:.1f} MB/s; allgather alpha {ag.latency_s * 1e3:.2f} ms beta "
        f"{ag.bandwidth_bytes_per_s / 1e6:.1f} MB/s; agreement round {step_profile.round_s * 1e3:.2f} ms; "
        f"{len(step_profile.buckets)} bucket(s)"
    )


def _predicted(step_profile: Any, strategy: str) -> dict[str, Any]:
    """The planner's step time for ``strategy`` from the calibration run (``predict_step``)."""
    from zensync.planner import predict_step

    priced = _prediction_of(strategy)
    if priced is None:
        return {}
    spec, hooked = priced
    if spec == "auto":
        return {}  # the hook's own prediction: _summary reads it from the ranks' reports
    prediction = predict_step(step_profile, spec, hooked=hooked)
    return {"predicted_step_s": prediction.step_s, "predicted_comm_busy_s": prediction.result.comm_busy_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--buckets", choices=["one", "default"], default="one")
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES))
    p.add_argument(
        "--rounds", type=int, default=1, help="run the strategy list this many times, interleaved; pool the steps"
    )
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--loopback", action="store_true", help="unshaped loopback instead of emulated hosts")
    p.add_argument(
        "--no-predict",
        dest="predict",
        action="store_false",
        help="skip the calibration run (zensync.profiling.profile_group) and the predicted step times",
    )
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--iface", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    rows = []
    step_profile = None
    warmup_profiles: dict[str, list[str]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        LoopbackCluster(args.hosts) if args.loopback else make_cluster(args.hosts, rate=args.rate) as cluster,
    ):
        emulated = isinstance(cluster, EmulatedCluster)
        iface = "eth0" if emulated else ""
        runs = (["profile"] if args.predict else []) + [s for _ in range(args.rounds) for s in args.strategies]
        reports: dict[str, list[list[dict[str, Any]]]] = {}
        for index, strategy in enumerate(runs):
            cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", "--strategy", strategy]
            cmd += ["--out", tmp, "--iface", iface]
            port = _PORT + index

            def env_for(rank: int, port: int = port) -> dict[str, str]:
                return {**cluster.env_for_torch(rank, port), "OMP_NUM_THREADS": "1"}

            try:
                cluster.run_workers(lambda r, cmd=cmd: cmd, env_for, timeout_s=args.timeout_s + 60)
            except Exception as exc:  # noqa: BLE001 - a crashed strategy is reported, the others still run
                print(f"{strategy}: workers failed: {exc}", file=sys.stderr)
            if strategy == "profile":
                step_profile = _read_profile(pathlib.Path(tmp, "profile.json"))
                continue
            own = pathlib.Path(tmp, "warmup_profile.json")
            if own.exists():  # auto@warmup's own profile (rank 0's copy; every rank's is the same)
                warmup_profiles.setdefault(strategy, []).append(_calibration_summary(_read_profile(own)))
                own.unlink()
            ranks = []
            for r in range(args.hosts):
                path = pathlib.Path(tmp, f"{strategy.replace(':', '_')}_rank{r}.json")
                ranks.append(json.loads(path.read_text()) if path.exists() else {"error": "no result (worker died)"})
                path.unlink(missing_ok=True)
            reports.setdefault(strategy, []).append(ranks)
            print(json.dumps(_summary(strategy, ranks, parse_rate(args.rate) if emulated else None)), flush=True)
        for strategy in args.strategies:
            merged = _merge_rounds(reports[strategy])
            rows.append(_summary(strategy, merged, parse_rate(args.rate) if emulated else None))
            if step_profile is not None:
                rows[-1].update(_predicted(step_profile, strategy))
        label = f"netns{args.hosts}x{args.rate}" if emulated else f"loopback{args.hosts}"
    date = datetime.date.today().isoformat()
    meta = {
        "label": label,
        "date": date,
        "buckets": args.buckets,
        "command": " ".join(["python", "experiments/compression_bench.py", *forwarded]),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "hosts": args.hosts,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": args.batch,
        "rounds": args.rounds,
    }
    if step_profile is not None:
        meta["calibration_summary"] = _calibration_summary(step_profile)
    if warmup_profiles:
        meta["warmup_profiles"] = warmup_profiles
    out_dir = pathlib.Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"compression_{label}_{args.buckets}_{date}"
    calibration = json.loads(step_profile.to_json()) if step_profile is not None else None
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "calibration": calibration}, indent=2))
    stem.with_suffix(".md").write_text(_markdown(meta, rows))
    print(_markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

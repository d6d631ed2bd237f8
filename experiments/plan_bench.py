"""Plan-selection time and predicted speedups of the Espresso-style planner on Espresso's workloads.

Launch (from the repository root; CPU only, about 10 s on 2 cores)::

    python experiments/plan_bench.py                 # 5 models x 2 clusters x 4 compressors, 5 repeats
    python experiments/plan_bench.py --repeats 1 --models resnet101 lstm

For each built-in profile (``zensync.planner.builtin_profile(name, gpu=--gpu)``: ResNet-101 314
tensors, BERT-base 199, GPT-2 148, VGG-16 32, LSTM 10), each cluster (8 x 8 GPUs on 25 Gbit/s with
PCIe inside the node, 8 x 8 on 100 Gbit/s with NVLink) and each compressor (dgc:0.01, randomk:0.01,
efsignsgd, fp16; models from ``compressor_model(spec)``, Espresso's cost constants), it runs ``plan``
three ways (GPU only with fusion, the default; GPU only without fusion; with CPU offload) and reports
the selection time (min over ``--repeats`` runs of wall time) and the predicted iteration time against
float32 allreduce, fp16 allreduce and the zero-cost upper bound. All numbers are the planner's own
simulator: predictions, not measurements.

Expected: the default plan selects in well under 50 ms for the 314-tensor ResNet-101 on 2 cores;
the plan is never predicted slower than the faster of fp32 and fp16 (speedup vs fp16 >= 1) and is
at or above the upper bound. Results: experiments/results/plan_bench_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

import numpy
import torch

import zensync
from zensync.cost import compressor_model
from zensync.planner import ClusterSpec, Plan, builtin_profile, plan

_MODELS = ("resnet101", "bert-base", "gpt2", "vgg16", "lstm")
_COMPRESSORS = ("dgc:0.01", "randomk:0.01", "efsignsgd", "fp16")
_CLUSTERS = {
    "8x8-pcie-25gbit": dict(nodes=8, gpus_per_node=8, inter="25Gbit", intra="pcie"),
    "8x8-nvlink-100gbit": dict(nodes=8, gpus_per_node=8, inter="100Gbit", intra="nvlink"),
}
_VARIANTS = {"default": {}, "no-fusion": {"fusion": False}, "cpu-offload": {"cpu_offload": True}}


def best_of(fn, repeats: int):  # type: ignore[no-untyped-def]
    """``fn()``'s last result and its fastest wall time over ``repeats`` calls (seconds)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    assert result is not None
    return result, best


def _timed(profile, cluster, model, repeats: int, flags: dict) -> tuple[Plan, float]:
    return best_of(lambda: plan(profile, cluster, model, **flags), repeats)


def _row(model_name: str, cluster_name: str, spec: str, variant: str, result: Plan, selection_s: float) -> dict:
    p = result.predicted
    options = [t.option for t in result.tensors]
    return {
        "model": model_name,
        "tensors": len(result.tensors),
        "cluster": cluster_name,
        "compressor": spec,
        "variant": variant,
        "selection_ms": selection_s * 1e3,
        "plan_ms": p.plan_s * 1e3,
        "fp32_ms": p.fp32_s * 1e3,
        "fp16_ms": p.fp16_s * 1e3,
        "upper_bound_ms": p.upper_bound_s * 1e3,
        "speedup_vs_fp32": p.speedup_vs_fp32,
        "speedup_vs_fp16": p.speedup_vs_fp16,
        "gap_to_upper_bound": p.plan_s / p.upper_bound_s - 1.0,
        "chosen": result.chosen,
        "compressed": sum(o.kind == "comp" for o in options),
        "fp16": sum(o.kind == "fp16" for o in options),
        "on_cpu": sum(o.device == "cpu" for o in options),
        "two_level": sum(o.level != "flat" for o in options),
        "groups": result.tensors[-1].group + 1,
    }


def _markdown(rows: list[dict], config: dict) -> str:
    lines = [
        f"# Plan selection benchmark ({config['date']})",
        "",
        "Predictions of zensync's planner simulator (not measurements). Selection time: min over "
        f"{config['repeats']} runs of `plan(...)` wall time on {config['hardware']}.",
        "",
        "```",
        json.dumps(config, indent=1),
        "```",
        "",
        "| model | tensors | cluster | compressor | variant | select ms | plan ms | fp32 ms | fp16 ms | UB ms "
        "| x fp32 | x fp16 | gap to UB | chosen | comp / fp16 / cpu / 2-level | groups |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['tensors']} | {r['cluster']} | {r['compressor']} | {r['variant']} "
            f"| {r['selection_ms']:.1f} | {r['plan_ms']:.1f} | {r['fp32_ms']:.1f} | {r['fp16_ms']:.1f} "
            f"| {r['upper_bound_ms']:.1f} | {r['speedup_vs_fp32']:.2f} | {r['speedup_vs_fp16']:.2f} "
            f"| {r['gap_to_upper_bound']:.1%} | {r['chosen']} "
            f"| {r['compressed']} / {r['fp16']} / {r['on_cpu']} / {r['two_level']} | {r['groups']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(_MODELS))
    parser.add_argument("--compressors", nargs="+", default=list(_COMPRESSORS))
    parser.add_argument("--gpu", default="V100", help="GPU of the built-in profiles (Espresso's testbed: V100)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()
    date = datetime.date.today().isoformat()
    config = {
        "date": date,
        "gpu_profile": args.gpu,
        "repeats": args.repeats,
        "clusters": _CLUSTERS,
        "variants": _VARIANTS,
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {
            "python": sys.version.split()[0],
            "numpy": numpy.__version__,
            "torch": torch.__version__,
            "zensync": zensync.__version__,
        },
        "seed": "none (deterministic)",
    }
    rows = []
    for model_name in args.models:
        profile = builtin_profile(model_name, gpu=args.gpu)
        for cluster_name, cluster_args in _CLUSTERS.items():
            cluster = ClusterSpec.from_strings(**cluster_args)
            for spec in args.compressors:
                model = compressor_model(spec)
                for variant, flags in _VARIANTS.items():
                    result, selection_s = _timed(profile, cluster, model, args.repeats, flags)
                    rows.append(_row(model_name, cluster_name, spec, variant, result, selection_s))
                    print(
                        f"{model_name:>9} {cluster_name:>18} {spec:>12} {variant:>11}: select "
                        f"{selection_s * 1e3:6.1f} ms, x{rows[-1]['speedup_vs_fp32']:.2f} vs fp32, "
                        f"x{rows[-1]['speedup_vs_fp16']:.2f} vs fp16, gap to UB {rows[-1]['gap_to_upper_bound']:.1%}",
                        flush=True,
                    )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"plan_bench_{date}"
    stem.with_suffix(".json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(_markdown(rows, config))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()

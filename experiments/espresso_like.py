"""Planner near-optimality on Espresso-like inputs: gap to the zero-cost upper bound, speedups, selection time.

Launch (from the repository root; CPU only, about half a minute)::

    python experiments/espresso_like.py

Espresso (EuroSys'23, reference/espresso.md 1.7) evaluates on 8 machines x 8 V100, either NVLink +
100 Gbit/s or PCIe + 25 Gbit/s, with FP32 training. Its Table 1 gives the FP32 scaling factor of
three workloads (GPT2 0.58 and BERT-base 0.51 on NVLink/100G, LSTM 0.46 on PCIe/25G; ResNet101 0.70
on PCIe/25G in section 5). Our built-in profiles are roofline estimates, so for those workloads the
per-GPU batch is chosen (bisection over integers) so that the simulated FP32 scaling factor,
compute / FP32-allreduce iteration, matches the paper's; the other workloads keep their default
batch. Each workload is then planned with the paper's compressor and the full option space
(GPU and CPU compression, two-level, fusion), and compared with the zero-cost upper bound.

Target (issue 4): every plan within 10 % of the upper bound; never slower than FP32 or FP16
allreduce (by construction). Espresso reports 3 % (GPT2 + EFSignSGD), 5 % (UGATIT + DGC) and 7 %
(BERT-base + Randomk). Results: experiments/results/espresso_like_<date>.{md,json}.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import sys
import time

import torch

from zensync.cost import compressor_model
from zensync.planner import ClusterSpec, ModelProfile, builtin_profile, plan

RESULTS = pathlib.Path(__file__).parent / "results"
CLUSTERS = {
    "nvlink-100gbit": ClusterSpec.from_strings(nodes=8, gpus_per_node=8, inter="100Gbit", intra="nvlink"),
    "pcie-25gbit": ClusterSpec.from_strings(nodes=8, gpus_per_node=8, inter="25Gbit", intra="pcie"),
}
# (model, cluster, compressor, FP32 scaling factor from the paper or None to keep the default batch)
WORKLOADS = (
    ("gpt2", "nvlink-100gbit", "efsignsgd", 0.58),
    ("bert-base", "nvlink-100gbit", "randomk:0.01", 0.51),
    ("lstm", "pcie-25gbit", "efsignsgd", 0.46),
    ("resnet101", "pcie-25gbit", "dgc:0.01", 0.70),
    ("vgg16", "pcie-25gbit", "randomk:0.01", None),
    ("resnet101", "nvlink-100gbit", "dgc:0.01", None),
)
GAP_TARGET = 0.10


def _scaling(profile: ModelProfile, cluster: ClusterSpec) -> float:
    fp32 = plan(profile, cluster, compressor_model("fp16"), fusion=False).predicted.fp32_s
    return (profile.forward_s + profile.backward_s) / fp32


def _calibrated(model: str, cluster: ClusterSpec, target: float | None) -> ModelProfile:
    """The fp32 V100 profile whose simulated FP32 scaling factor is closest to ``target``."""
    if target is None:
        return builtin_profile(model, gpu="V100", precision="fp32")
    low, high = 1, 4096
    while high - low > 1:  # scaling grows with the batch (more compute per byte synchronized)
        mid = (low + high) // 2
        if _scaling(builtin_profile(model, gpu="V100", precision="fp32", batch=mid), cluster) < target:
            low = mid
        else:
            high = mid
    candidates = [builtin_profile(model, gpu="V100", precision="fp32", batch=b) for b in (low, high)]
    return min(candidates, key=lambda p: abs(_scaling(p, cluster) - target))


def main() -> int:
    rows = []
    for model, cluster_name, spec, target in WORKLOADS:
        cluster = CLUSTERS[cluster_name]
        profile = _calibrated(model, cluster, target)
        compressor = compressor_model(spec)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            chosen = plan(profile, cluster, compressor, cpu_offload=True, two_level=True)
            times.append(time.perf_counter() - start)
        p = chosen.predicted
        rows.append(
            {
                "model": model,
                "cluster": cluster_name,
                "compressor": spec,
                "batch": profile.batch,
                "target_scaling": target,
                "scaling_fp32": (profile.forward_s + profile.backward_s) / p.fp32_s,
                "plan_ms": p.plan_s * 1e3,
                "fp32_ms": p.fp32_s * 1e3,
                "fp16_ms": p.fp16_s * 1e3,
                "upper_bound_ms": p.upper_bound_s * 1e3,
                "gap": p.plan_s / p.upper_bound_s - 1,
                "speedup_fp32": p.speedup_vs_fp32,
                "speedup_fp16": p.speedup_vs_fp16,
                "select_ms": min(times) * 1e3,
                "chosen": chosen.chosen,
            }
        )
    date = datetime.date.today().isoformat()
    lines = [
        f"# Planner on Espresso-like inputs ({date})",
        "",
        "Command: `python experiments/espresso_like.py`. Predictions of zensync's simulator (not measurements); "
        f"fp32 V100 roofline profiles, 8 x 8 GPUs; torch {torch.__version__}, Python {platform.python_version()}.",
        "",
        "| model | cluster | compressor | batch | FP32 scaling (paper) | plan ms | FP32 ms | FP16 ms | upper bound ms "
        "| gap | x FP32 | x FP16 | select ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        paper = f" ({r['target_scaling']:.2f})" if r["target_scaling"] is not None else ""
        lines.append(
            f"| {r['model']} | {r['cluster']} | {r['compressor']} | {r['batch']} | {r['scaling_fp32']:.2f}{paper} | "
            f"{r['plan_ms']:.1f} | {r['fp32_ms']:.1f} | {r['fp16_ms']:.1f} | {r['upper_bound_ms']:.1f} | "
            f"{r['gap']:.1%} | {r['speedup_fp32']:.2f} | {r['speedup_fp16']:.2f} | {r['select_ms']:.1f} |"
        )
    within = sum(r["gap"] <= GAP_TARGET for r in rows)
    lines += ["", f"Within {GAP_TARGET:.0%} of the upper bound: {within} of {len(rows)}."]
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"espresso_like_{date}"
    stem.with_suffix(".json").write_text(json.dumps({"rows": rows, "gap_target": GAP_TARGET}, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Markdown and figure of experiments/espresso_repro.py (sibling module; experiments/ is not a package)."""

from __future__ import annotations

import json
import pathlib

from espresso_repro import (
    ABLATIONS,
    CLUSTERS,
    EXTRA_ABLATIONS,
    PAPER_64,
    PAPER_SELECTION_MS,
    PAPER_SETUP,
    PAPER_SPEEDUP_64,
    PAPER_UB_GAP,
    SELECTION_SCAN,
    TABLE_1,
)

SHAPE_FACTOR = 2.0
"""A ratio of ours to the paper's (speedup, or gain = speedup - 1) beyond this is flagged and explained."""
COMPUTE_BOUND = 1.01
"""FP32 iteration within this factor of compute: nearly compute-bound, so Property 1 leaves little to try."""


def _iteration_table(points: dict, models: list[str], gpus: list[int], cluster: str) -> list[str]:
    lines = [
        f"### {cluster}",
        "",
        "| model + compressor | GPUs | FP32 ms | FP16 ms | compress-all ms (option) | plan ms | UB ms | compute ms "
        "| FP32 scaling | plan scaling | x plan / FP32 | x comp-all / FP32 | gap to UB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in models:
        for g in gpus:
            r = points[f"iter|{m}|{cluster}|{g}"]
            lines.append(
                f"| {m} + {PAPER_SETUP[m][0]} | {g} | {r['fp32_ms']:.1f} | {r['fp16_ms']:.1f} "
                f"| {r['compress_all_ms']:.1f} ({r['compress_all_option']}) | {r['plan_ms']:.1f} "
                f"| {r['upper_bound_ms']:.1f} | {r['compute_ms']:.1f} | {r['scaling_fp32']:.2f} "
                f"| {r['scaling_plan']:.2f} | {r['speedup_plan_vs_fp32']:.2f} "
                f"| {r['speedup_compress_all_vs_fp32']:.2f} | {r['gap_to_upper_bound']:.1%} |"
            )
    return [*lines, ""]


def _shape_flag(ours: float, paper: float) -> bool:
    speedup = max(ours, paper) / min(ours, paper) > SHAPE_FACTOR
    gains = (ours - 1.0, paper - 1.0)
    gain = max(abs(x) for x in gains) > 0.05 and (
        min(gains) <= 0 < max(gains) or max(gains) / max(min(gains), 1e-9) > SHAPE_FACTOR
    )
    return speedup or gain


def _table1(points: dict, models: list[str]) -> list[str]:
    lines = [
        "| model (cluster) | GC used | FP32: ours / paper | GC on GPU: ours / paper | GC on CPU: ours / paper "
        "| our GPU / CPU option |",
        "|---|---|---|---|---|---|",
    ]
    for m, (c, spec, (fp32, gpu, cpu)) in TABLE_1.items():
        r = points.get(f"table1|{m}")
        if m not in models or r is None:
            continue
        lines.append(
            f"| {m} ({c}) | {spec} | {r['scaling_fp32']:.2f} / {fp32:.2f} | {r['scaling_gpu']:.2f} / {gpu:.2f} "
            f"| {r['scaling_cpu']:.2f} / {cpu:.2f} | {r['gpu_option']} / {r['cpu_option']} |"
        )
    return [*lines, ""]


def _side_by_side(points: dict, models: list[str]) -> list[str]:
    lines = [
        "| model (cluster), 64 GPUs | Espresso (paper) | ours: FP32 scaling | ours: x comp-all / FP32 "
        "| ours: x plan / FP32 | paper x plan / FP32 | > 2x in shape? |",
        "|---|---|---|---|---|---|---|",
    ]
    flagged = []
    for (m, c), text in PAPER_64.items():
        key = f"iter|{m}|{c}|64"
        if m not in models or key not in points:
            continue
        r, paper = points[key], PAPER_SPEEDUP_64.get((m, c))
        flag = paper is not None and _shape_flag(r["speedup_plan_vs_fp32"], paper)
        if flag:
            flagged.append((m, c))
        lines.append(
            f"| {m} ({c}) | {text} | {r['scaling_fp32']:.2f} | {r['speedup_compress_all_vs_fp32']:.2f} "
            f"| {r['speedup_plan_vs_fp32']:.2f} | {'-' if paper is None else f'{paper:.2f}'} "
            f"| {'YES' if flag else 'no'} |"
        )
    lines.append("")
    for m, c in flagged:
        lines.append(f"- **{m} ({c})**: explained in section 6.")
    return [*lines, ""]


def _selection_table(points: dict, models: list[str], gpus: list[int], repeats: int) -> list[str]:
    lines = [
        "| model | tensors (ours / paper) | GPUs | ours: GPU-only plan() ms | ours: full-space plan() ms "
        "| paper Table 5 (Alg. 1) ms | paper Table 6 (Alg. 2) ms, tensors to offload |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in models:
        tensors, alg1, offload, alg2 = PAPER_SELECTION_MS[m]
        for g in gpus:
            r = points[f"select|{m}|{g}|{repeats}"]
            paper = f"{alg1} | {alg2}, {offload}" if g == 64 else "- | -"
            lines.append(
                f"| {m} | {r['tensors']} / {tensors} | {g} | {r['gpu_only_ms']:.1f} | {r['full_ms']:.1f} | {paper} |"
            )
    return [*lines, ""]


def _ratio(paper_ms: float, ours_ms: float) -> str:
    """Paper / ours, marked when more than ``SHAPE_FACTOR`` apart either way."""
    ratio = paper_ms / ours_ms
    flag = " (> 2x)" if max(ratio, 1 / ratio) > SHAPE_FACTOR else ""
    return f"{ratio:.1f}x{flag}"


def _workloads(doc: dict) -> dict[str, tuple[dict, dict, dict, dict, dict]]:
    """Per model at 64 GPUs: (rule point, Alg. 1 and plan() points on the selection workload, the same on
    section 1's workload); models without all five are left out."""
    points, repeats, rows = doc["points"], doc["repeats"], {}
    for m, text in doc.get("selection_batches", {}).items():
        anchor, batch = doc["batches"][m].split()[0], text.split()[0]
        keys = (f"selbatch|{m}|{anchor}", f"alg1-w|{m}|{batch}|{repeats}", f"select-w|{m}|{batch}|{repeats}")
        found = [points.get(k) for k in (*keys, f"alg1|{m}|64|{repeats}", f"select|{m}|64|{repeats}")]
        if None not in found:
            rows[m] = tuple(found)
    return rows


def _arrow(before: float, after: float, digits: int = 1) -> str:
    return f"{before:.{digits}f} -> {after:.{digits}f}"


def _workload_table(doc: dict) -> list[str]:
    """The selection workload per model (the rule and its result), then Tables 5 and 6 timed on section 1's
    workload and on it."""
    rows = _workloads(doc)
    if not rows:
        return []
    lines = [
        "Table 6 counts the tensors whose offloading Espresso's Algorithm 2 decides: the tensors Algorithm 1 "
        "compressed on the GPU (its brute-force column fits 2^n offload subsets: 1.9 h for 32 tensors and 7.6 h "
        "for 34 are both 2^n x 1.6 us, derived). Algorithm 2 only moves those between GPU and CPU, so they are "
        "the tensors the paper's plan compresses. **Rule** for the workload of the selection times (the same for "
        "all five models, no time in it): on the NVLink cluster at 64 GPUs, the per-GPU batch in 1 .. "
        f"{SELECTION_SCAN} x section 1's at which our full-space plan compresses (GPU or CPU) the number of "
        "tensors closest to Table 6's; ties: the batch nearest section 1's, then the larger. Sections 1-2 and "
        "4-5 keep section 1's batches.",
        "",
        "Our plan's compressed tensors need not come from Algorithm 1 as in the paper: the fourth column gives how "
        "many Algorithm 1 alone compresses (one pass, GPU); the rest come from the refinement sweeps, Algorithm "
        "2's extra candidates (large uncompressed tensors, compressed on the CPU) and the joint search.",
        "",
        "| model | batch: section 1 -> selection | compressed tensors: section 1 -> selection / Table 6 "
        "| Algorithm 1 alone compresses: section 1 -> selection | counts at batch - 1, batch, + 1 "
        "| FP32 scaling on NVLink: section 1 -> selection |",
        "|---|---|---|---|---|---|",
    ]
    for m, (rule, alg1, select, alg1_before, before) in rows.items():
        counts, batch = rule["counts"], rule["batch"]
        near = ", ".join(str(counts.get(str(b), "-")) for b in (batch - 1, batch, batch + 1))
        scaling = (before["compute_ms"] / before["fp32_ms"], select["compute_ms"] / select["fp32_ms"])
        lines.append(
            f"| {m} | {doc['batches'][m]} -> {doc['selection_batches'][m]} | {before['compressed_full']} -> "
            f"{select['compressed_full']} / {rule['target']} | {alg1_before['compressed']} -> {alg1['compressed']} "
            f"| {near} | {_arrow(*scaling, 2)} |"
        )
    lines += [
        "",
        "Timed at 64 GPUs, each cell section 1's workload -> the selection workload. Algorithm 1 alone (one pass "
        "from FP32, GPU options, no fusion, pricing of the options included): *as stated* simulates the whole "
        "iteration F(S) for every single-tensor variant (the planner's Python event loop, `espresso_algorithm1`), "
        "*O(1)* prices each variant from max-plus prefix/suffix maxima (what `plan()` runs). `plan()` GPU-only "
        "adds up to two refinement sweeps, the exact fusion and the upper bound; full space adds Algorithm 2, the "
        "joint local search and the CPU-only candidate. paper / ours > 1: ours faster.",
        "",
        "| model | tensors (ours / paper) | GPU options | tensors tried (F(S) runs) | Alg. 1 as stated ms "
        "| Alg. 1 O(1) ms | paper Table 5 ms | paper / as stated | plan() GPU-only ms | paper / GPU-only "
        "| plan() full space ms | paper Table 5 + 6 ms | paper / full space |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, (_, a, s, a0, s0) in rows.items():
        tensors, alg1, _, alg2 = PAPER_SELECTION_MS[m]
        tried = f"{a0['tensors_tried']} ({a0['simulations']}) -> {a['tensors_tried']} ({a['simulations']})"
        lines.append(
            f"| {m} | {a['tensors']} / {tensors} | {a['gpu_options']} | {tried} "
            f"| {_arrow(a0['as_stated_ms'], a['as_stated_ms'])} | {_arrow(a0['max_plus_ms'], a['max_plus_ms'])} "
            f"| {alg1} | {_ratio(alg1, a0['as_stated_ms'])} -> {_ratio(alg1, a['as_stated_ms'])} "
            f"| {_arrow(s0['gpu_only_ms'], s['gpu_only_ms'])} "
            f"| {_ratio(alg1, s0['gpu_only_ms'])} -> {_ratio(alg1, s['gpu_only_ms'])} "
            f"| {_arrow(s0['full_ms'], s['full_ms'])} | {alg1 + alg2} "
            f"| {_ratio(alg1 + alg2, s0['full_ms'])} -> {_ratio(alg1 + alg2, s['full_ms'])} |"
        )
    same = sum(a["same_choice"] and a0["same_choice"] for _, a, _, a0, _ in rows.values())
    lines += [
        "",
        f"As stated and O(1) chose the same option for every tensor on both workloads in {same} of {len(rows)} models.",
    ]
    return [*lines, ""]


def _gap_table(points: dict, models: list[str], gpus: list[int]) -> list[str]:
    lines = ["| model | cluster | " + " | ".join(f"{g} GPUs" for g in gpus) + " | paper (64, NVLink) |"]
    lines.append("|---|---|" + "---|" * (len(gpus) + 1))
    for m in models:
        for c in CLUSTERS:
            gaps = " | ".join(f"{points[f'iter|{m}|{c}|{g}']['gap_to_upper_bound']:.1%}" for g in gpus)
            paper = f"{PAPER_UB_GAP[m]:.0%}" if m in PAPER_UB_GAP and c.startswith("nvlink") else "-"
            lines.append(f"| {m} | {c} | {gaps} | {paper} |")
    return [*lines, ""]


def _ablation_table(points: dict, models: list[str]) -> tuple[list[str], list[str]]:
    variants = [*ABLATIONS, *EXTRA_ABLATIONS]
    lines = [
        "Iteration time of each restricted planner / the full planner's (1.00 = as fast; > 1 slower).",
        "",
        "| model | cluster | full ms | " + " | ".join(variants[1:]) + " |",
        "|---|---|---|" + "---|" * (len(variants) - 1),
    ]
    faster = []
    for m in models:
        for c in CLUSTERS:
            full = points[f"ablate|{m}|{c}|full"]["plan_ms"]
            cells = []
            for v in variants[1:]:
                ms = points[f"ablate|{m}|{c}|{v}"]["plan_ms"]
                cells.append(f"{ms / full:.3f}" + (" (!)" if ms < full - 1e-9 else ""))
                if ms < full - 1e-9:
                    faster.append(f"{m} / {c} / {v}: {ms:.2f} ms < full {full:.2f} ms")
            lines.append(f"| {m} | {c} | {full:.1f} | " + " | ".join(cells) + " |")
    return [*lines, ""], faster


def _mix(tensors: dict) -> str:
    return ", ".join(f"{count} {kind.replace('_', ' on ')}" for kind, count in tensors.items() if count)


def _outside(paper_ms: float, ours_ms: float) -> bool:
    return max(paper_ms / ours_ms, ours_ms / paper_ms) > SHAPE_FACTOR


def _selection_differences(doc: dict) -> list[str]:
    """Section 6 on selection time at 64 GPUs (the workload of Table 6's size): the ratios, and why each
    one beyond 2x differs; the ratios on section 1's workload beside them."""
    rows = _workloads(doc)
    if not rows:
        return []
    columns = {
        "Algorithm 1 as stated vs Table 5": lambda m, a, s: (PAPER_SELECTION_MS[m][1], a["as_stated_ms"]),
        "plan() GPU-only (O(1) price) vs Table 5": lambda m, a, s: (PAPER_SELECTION_MS[m][1], s["gpu_only_ms"]),
        "plan() full space vs Table 5 + 6": lambda m, a, s: (
            PAPER_SELECTION_MS[m][1] + PAPER_SELECTION_MS[m][3],
            s["full_ms"],
        ),
    }
    lines = []
    for title, pick in columns.items():
        pairs = {m: pick(m, a, s) for m, (_, a, s, _, _) in rows.items()}
        before = {m: pick(m, a, s) for m, (_, _, _, a, s) in rows.items()}
        within = sum(not _outside(*pair) for pair in pairs.values())
        within_before = sum(not _outside(*pair) for pair in before.values())
        text = "; ".join(f"{m} {paper / ours:.1f}x" for m, (paper, ours) in pairs.items())
        lines.append(
            f"- **Selection time at 64 GPUs, {title}, on the workload of Table 6's size (section 3), paper / ours: "
            f"{text}** ({within} of {len(pairs)} within 2x; {within_before} of {len(pairs)} on section 1's workload)."
        )
        for m, (paper, ours) in pairs.items():
            if _outside(paper, ours):
                lines.append(f"  - {m}: {_selection_reason(title, m, *rows[m][:3], paper, ours)}")
    return lines


def _selection_reason(title: str, m: str, rule: dict, a: dict, s: dict, paper: float, ours: float) -> str:
    """Why one selection time is more than 2x from the paper's (from this run's numbers)."""
    compressed, target, counts = s["compressed_full"], rule["target"], rule["counts"]
    above = min((c for c in counts.values() if c > target), default=None)
    below = max((c for c in counts.values() if c < target), default=None)
    nearest = [
        f"{count} (batch {max(int(b) for b, c in counts.items() if c == count)})"
        for count in (above, below)
        if count is not None
    ]
    size = (
        f"the rule's batch ({rule['batch']}) gives {compressed} compressed tensors vs Table 6's {target}: the scan's "
        f"counts nearest it are {' and '.join(nearest)} (largest batch with each), so the decision is still "
        f"{'smaller' if compressed < target else 'larger'} than the paper's. "
        if max(compressed, 1) / max(target, 1) > SHAPE_FACTOR or max(target, 1) / max(compressed, 1) > SHAPE_FACTOR
        else ""
    )
    if s["fp32_ms"] <= COMPUTE_BOUND * s["compute_ms"] and ours < paper:
        return (
            f"ours {ours:.1f} ms vs the paper's {paper:g} ms: {size}Property 1 left {a['tensors_tried']} of "
            f"{a['tensors']} tensors to try: FP32 {s['fp32_ms']:.1f} ms vs compute {s['compute_ms']:.1f} ms, "
            "nearly compute-bound."
        )
    us_each = a["as_stated_ms"] * 1e3 / a["simulations"]
    paper_us = paper * 1e3 / a["simulations"]
    per_simulation = (
        f"Property 1 left {a['tensors_tried']} of {a['tensors']} tensors to try, {a['gpu_options']} GPU options "
        f"each: {a['simulations']} full simulations F(S), {us_each:.0f} us each by the planner's Python event "
        f"loop on 2 cores shared with other jobs (the paper: a Xeon 8260); the paper's {paper:g} ms over as many "
        f"simulations would be {paper_us:.0f} us each (derived). Our notes give neither the paper's GPU option "
        "subset (4341 options per tensor in all, reference/espresso.md 1.3), nor how many tensors Property 1 left "
        "it, nor its simulator's cost per variant"
    )
    speedup = a["as_stated_ms"] / a["max_plus_ms"]
    o1 = (
        f"the O(1) max-plus price makes Algorithm 1 {speedup:.0f}x faster than as stated here "
        f"({a['max_plus_ms']:.1f} vs {a['as_stated_ms']:.1f} ms, same choices: {a['same_choice']}): the "
        "algorithm, not the machine"
    )
    full = title.endswith("Table 5 + 6")
    fixed = (
        "ours slower: a fixed per-call cost independent of the decisions: every option priced for every "
        "tensor (one vectorised `option_costs` call per option), up to two refinement sweeps, the exact fusion, the "
        "upper bound (every GPU option priced again at zero cost)"
        + (", Algorithm 2, the joint local search and the CPU-only candidate's search" if full else "")
        + f"; Algorithm 1 itself is the smaller part (as stated {a['as_stated_ms']:.1f} ms, O(1) "
        f"{a['max_plus_ms']:.1f} ms, pricing included). The paper's 1 ms entries are whole milliseconds"
    )
    if title.startswith("Algorithm 1"):
        reason = per_simulation
    else:
        reason = o1 if ours < paper else fixed
    return (
        f"ours {ours:.1f} ms vs the paper's {paper:g} ms: {size}{reason[0].upper() if size else reason[0]}{reason[1:]}."
    )


def _differences(doc: dict) -> list[str]:
    """Section 6: every difference of more than 2x in shape, and why (numbers from this run)."""
    points, models = doc["points"], doc["models"]
    lines = ["## 6. Differences of more than 2x in shape, and why", ""]

    def at(m: str, c: str, field: str) -> float:
        return points[f"iter|{m}|{c}|64"][field]

    if "resnet101" in models:
        scaling, plan_scaling = (
            at("resnet101", "pcie-25gbit", "scaling_fp32"),
            at("resnet101", "pcie-25gbit", "scaling_plan"),
        )
        lines.append(
            f"- **ResNet-101 + DGC, PCIe, 64 GPUs: x{at('resnet101', 'pcie-25gbit', 'speedup_plan_vs_fp32'):.2f} "
            f"vs the paper's x1.20 (gain twice the paper's).** Both start from FP32 scaling 0.70 (ours calibrated to "
            f"{scaling:.2f}), so no strategy can beat x{1 / scaling:.2f}. Our simulator predicts the plan hides almost "
            f"all exposed communication (plan scaling {plan_scaling:.2f}); the paper measured Espresso at 0.84 "
            "(0.70 x 1.20, derived). The simulator overlaps communication with backward perfectly and charges "
            "compute no slowdown for concurrent NCCL or CPU-side traffic (only GPU compression kernels are "
            "charged to the compute stream), and prices CPU compression with Espresso's 20 Gbit/s constant; "
            "our notes do not give Espresso's ResNet-101 strategy, so we cannot tell how much of the gap is "
            "that optimism and how much a different strategy."
        )
    if "vgg16" in models:
        scaling = at("vgg16", "pcie-25gbit", "scaling_fp32")
        lines.append(
            f"- **VGG-16 + Randomk, PCIe, 64 GPUs: x{at('vgg16', 'pcie-25gbit', 'speedup_plan_vs_fp32'):.2f} vs the "
            f"paper's x3.69.** VGG-16 is not calibrated (our notes give no FP32 scaling for it) and keeps Table 4's "
            f"32 images per GPU; our fp32 V100 roofline profile then computes for "
            f"{at('vgg16', 'pcie-25gbit', 'compute_ms'):.0f} ms per iteration, so FP32 scaling is {scaling:.2f} "
            f"and no strategy can beat x{1 / scaling:.2f} (the plan is at x"
            f"{at('vgg16', 'pcie-25gbit', 'speedup_plan_vs_fp32'):.2f}, FP16 alone reaches it). The paper's x3.69 "
            "implies an FP32 scaling of at most 1 / 3.69 = 0.27 (derived), i.e. a real iteration far shorter "
            "than our roofline's relative to its 528 MB of gradients. In this session our VGG-16 profile gave "
            "FP32 scaling 0.18 at 8 images and 0.34 at 16 (espresso_like._scaling, PCIe 8 x 8): the difference "
            "is the workload's compute-to-communication ratio, not the planner."
        )
    if {"gpt2", "bert-base"} & set(models):
        lines.append(
            "- **Table 1, GC on GPU, GPT-2 + DGC and BERT-base + EFSignSGD (NVLink): our compress-everything "
            "loses to FP32 where the paper's gained (+15 %, +8 %).** Every tensor pays Espresso's fixed GPU "
            "cost per tensor (up to 2^20 elements per shard: 390 us DGC, 270 us EFSignSGD, reference/espresso.md "
            "1.6) with the encode on the compute stream: 148 x 390 us = 58 ms (GPT-2) and 199 x 270 us = 54 ms "
            "(BERT-base) of kernels against 89 and 60 ms of compute (derived). The paper's measured runs gained, "
            "so its per-tensor cost on small tensors was lower than these constants imply, or its runtime "
            "batched them; our notes do not say which. The LSTM row (10 large tensors) agrees with the paper."
        )
    if "gpt2" in models:
        lines.append(
            f"- **Upper-bound gap, GPT-2 + EFSignSGD, NVLink, 64 GPUs: "
            f"{at('gpt2', 'nvlink-100gbit', 'gap_to_upper_bound'):.1%} vs the paper's 3 %** (BERT-base "
            f"{at('bert-base', 'nvlink-100gbit', 'gap_to_upper_bound') if 'bert-base' in models else float('nan'):.1%}"
            f" vs 7 % agrees). The plan (tensors: {_mix(at('gpt2', 'nvlink-100gbit', 'tensors'))}) is a local "
            "optimum of a greedy search plus a local search (search.py), and every compressed tensor pays its "
            "compression time (the fixed GPU cost above, or a turn on the one CPU worker), which the zero-cost "
            "upper bound does not; we read the gap as that cost "
            "(not verified against the paper's GPT-2 inputs, which our notes do not give). Within the 10 % target. "
            f"On PCIe GPT-2's gap is {at('gpt2', 'pcie-25gbit', 'gap_to_upper_bound'):.1%} (no paper number; "
            f"tensors: {_mix(at('gpt2', 'pcie-25gbit', 'tensors'))}), above the 10 % target: nearly every tensor "
            "is compressed there, and their encode time, which the bound omits, is the gap."
        )
    lines += _selection_differences(doc)
    lines.append(
        "- **Ablation**: Fig. 15's values are not in our notes, only its direction (every restricted planner "
        "worse). Ours agrees except where listed in section 5: the full space is searched greedily (Algorithm 1 "
        "commits to GPU compression tensor by tensor, then offloads), and a restricted start (fp32/fp16 only "
        "before the CPU pass, for cpu-only) can end in a better local optimum. GPU-only and no-fusion are steps "
        "of the full search and are never faster (tested). Many cells are 1.000 because the plan is within a "
        "few percent of compute (nothing left to gain). all-compression and myopic are strategies, not "
        "searches, and are slower than the full plan in every cell here."
    )
    return [*lines, ""]


def markdown(doc: dict) -> str:
    points, models, gpus = doc["points"], doc["models"], doc["gpus"]
    lines = [
        f"# Espresso (EuroSys'23) reproduced on zensync's planner simulator ({doc['date']})",
        "",
        f"Command: `{doc['command']}`",
        "",
        "All times are predictions of zensync's planner simulator (`zensync.planner`), not measurements; "
        "selection times are wall times of `plan()` measured on a contended machine.",
        "",
        "```",
        json.dumps(
            {k: doc[k] for k in ("versions", "machine", "seed", "batches", "selection_batches", "repeats") if k in doc},
            indent=1,
        ),
        "```",
        "",
        "Reproduced (reference/espresso.md): Table 1 and the section 5 speedups at 64 GPUs (1.2, 1.7); "
        "Tables 5 and 6, selection time (1.5); the Upper Bound gap of section 5 (1.7); the ablation of "
        "Fig. 15 (1.7). Setup: 8 GPUs per node, fp32 V100 roofline profiles with the per-GPU batch "
        "calibrated to the paper's FP32 scaling at 64 GPUs (`batches` above), the paper's compressor per "
        "model (section 5): " + ", ".join(f"{m} {PAPER_SETUP[m][0]}" for m in models) + ".",
        "",
        "## 1. Iteration time (ms per iteration)",
        "",
        "compress-all = the model's compressor on every tensor on the GPU, one option for all (the fastest "
        "uniform one, named); plan = `plan(cpu_offload=True, two_level=True, fusion=True)`; UB = the paper's "
        "Upper Bound (zero-cost compression, no compute interference, same option space); scaling = "
        "compute / iteration time.",
        "",
    ]
    for c in CLUSTERS:
        lines += _iteration_table(points, models, gpus, c)
    if 64 in gpus:
        lines += ["## 2. Side by side with the paper at 64 GPUs", "", *_side_by_side(points, models)]
        lines += [
            "### Table 1: scaling factors, every tensor compressed in the inter-node phase (best uniform hier option)",
            "",
            *_table1(points, models),
        ]
    lines += ["## 3. Selection time (NVLink cluster)", "", *_selection_table(points, models, gpus, doc["repeats"])]
    if 64 in gpus:
        lines += ["### Tables 5 and 6 at 64 GPUs, on section 1's workload and on one of Table 6's size", ""]
        lines += _workload_table(doc)
    lines += [
        "## 4. Gap of the plan to the Upper Bound (the paper's definition)",
        "",
        *_gap_table(points, models, gpus),
    ]
    if 64 in gpus:
        table, faster = _ablation_table(points, models)
        lines += ["## 5. Ablation at 64 GPUs (Fig. 15)", "", *table]
        lines += ["Restricted planners faster than the full one (greedy search; see notes):", ""]
        lines += [f"- {f}" for f in faster] or ["- none"]
        lines += ["", *_differences(doc)]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: pathlib.Path) -> None:
    """Iteration time vs GPUs per model (columns) and cluster (rows)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure")
        return
    points, models, gpus = doc["points"], doc["models"], doc["gpus"]
    fig, axes = plt.subplots(len(CLUSTERS), len(models), figsize=(3.2 * len(models), 6), squeeze=False)
    series = {"FP32": "fp32_ms", "FP16": "fp16_ms", "compress-all": "compress_all_ms", "plan": "plan_ms"}
    series["upper bound"] = "upper_bound_ms"
    for row, c in enumerate(CLUSTERS):
        for col, m in enumerate(models):
            ax = axes[row][col]
            for label, field in series.items():
                ax.plot(gpus, [points[f"iter|{m}|{c}|{g}"][field] for g in gpus], marker="o", label=label)
            ax.set_title(f"{m} + {PAPER_SETUP[m][0]}\n{c}", fontsize=9)
            ax.set_xlabel("GPUs (8 per node)")
            ax.set_ylabel("iteration time (ms)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(gpus, [str(g) for g in gpus])
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Predicted iteration time (zensync planner simulator, fp32 V100 profiles)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

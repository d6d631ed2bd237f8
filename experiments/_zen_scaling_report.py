"""The Markdown report and figure of experiments/zen_scaling.py, from its JSON data."""

from __future__ import annotations

import math
import pathlib
from typing import Any

SCHEMES = ("dense", "agsparse", "sparcml", "omnireduce", "sparse_ps", "zen")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _times(rows: list[dict[str, Any]], topology: str = "flat25") -> dict[tuple[int, str], float]:
    return {(r["ranks"], r["scheme"]): r["seconds"][topology] for r in rows if topology in r["seconds"]}


def _workloads(data: dict[str, Any]) -> list[str]:
    out = ["## Workloads (experiments/configs/zen_*.json; Zen Table 1, C1-C3 in reference/zen.md 1.1)", "",
           "| model | simulated rows x dim (rows / scale) | density | Zipf skew | overlap param | measured: "
           "overlap(I0, I1) | gamma_8 | gamma_n (n) | share of ids in first 1/8 |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, d in data["models"].items():
        w, s = d["workload"], d["statistics"]
        gamma_n = s["gamma_n"]
        out.append(f"| {model} | {w['num_items']:,} x {w['dim']} (/{d['scale']}) | {w['density']:.4f} | {w['skew']} | "
                   f"{w['overlap']} | {s['overlap_01']:.2f} | {s['gamma_8']:.2f} | {gamma_n:.1f} ({s['n']}) | "
                   f"{s['share_in_first_eighth']:.2f} |")  # fmt: skip
    return out


def _part1(data: dict[str, Any]) -> list[str]:
    out = ["## 1. Communication time vs n, one GPU per node, 25 Gbit/s (Fig. 8 setting)", "",
           "Network time of one step in ms (alpha 10 us per message); every point counted (C). In brackets: "
           "time / dense.", ""]  # fmt: skip
    for model, d in data["models"].items():
        times = _times(d["rows"])
        ranks = sorted({n for n, _ in times})
        out += [f"### {model}", "", "| n | " + " | ".join(SCHEMES) + " |", "|---" * (len(SCHEMES) + 1) + "|"]
        for n in ranks:
            dense = times[(n, "dense")]
            cells = [f"{_ms(times[(n, s)])} C" + ("" if s == "dense" else f" ({times[(n, s)] / dense:.2f})")
                     for s in SCHEMES]  # fmt: skip
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def _part2(data: dict[str, Any]) -> list[str]:
    paper = data["paper"]["fig8_nmt_agsparse_crossover_gpus"]
    out = ["## 2. Where AGsparse loses to dense all-reduce (Fig. 8)", "",
           "| workload | index per | our crossover n (log2-interpolated) | paper |", "|---|---|---|---|"]  # fmt: skip
    for model, d in data["models"].items():
        x = d["crossover_agsparse_dense"]
        cell = "none" if x is None else f"{x:.1f}"
        out.append(f"| {model} | row of {d['workload']['dim']} | {cell} | {paper if model == 'nmt' else '-'} |")
    el = data["nmt_element"]
    x = el["crossover_agsparse_dense"]
    out.append(f"| nmt-element ({el['workload']['num_items']:,} items) | element | "
               f"{'none' if x is None else f'{x:.1f}'} | {paper} |")  # fmt: skip
    return [*out, ""]


def _part3(data: dict[str, Any]) -> list[str]:
    paper = data["paper"]["fig15_zen_speedup_over_dense_25g"]
    out = ["## 3. Zen's speedup at 16 nodes x 8 GPUs (NVLink 50 GB/s inside; Fig. 15)", "",
           "Speedup = scheme's time / zen's time. flat: all 128 GPUs in one sparse sync on the two-level "
           "topology; hier: Zen's setup (dense reduce-scatter + all-gather over NVLink, the sparse scheme "
           "between the 16 node aggregates).", "",
           "| model | rate | variant | zen ms | over dense | over agsparse | over sparcml | over omnireduce | "
           "over sparse_ps | paper (Fig. 15, comm, over dense) |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, d in data["models"].items():
        for rate in (25, 100):
            flat = {s: t for (n, s), t in _times(d["rows"], f"nodes{rate}").items() if n == 128}
            hier = d["hier_seconds"][str(rate)]
            for variant, t in (("flat", flat), ("hier", hier)):
                if not t:
                    continue
                zen = t["zen"]
                ups = " | ".join(f"{t[s] / zen:.2f}" for s in SCHEMES if s != "zen")
                ref = paper.get(model, "-") if rate == 25 else "- (comm not given)"
                out.append(f"| {model} | {rate} Gbit/s | {variant} | {_ms(zen)} | {ups} | {ref} |")
    return [*out, ""]


def _part4(data: dict[str, Any]) -> list[str]:
    out = ["## 4. Push/pull imbalance vs n (Theorem 2; max over ranks / mean, from the recorded calls)", "",
           "Push: bytes each rank receives in the push all-to-all. Pull: each owner's pull block. "
           "Theorem 2 term: sqrt(n ln n / nnz per rank).", "",
           "| model | n | zen push | zen pull | sparse_ps push | sparse_ps pull | omnireduce push | "
           "sqrt(n ln n / nnz) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, d in data["models"].items():
        rows = {(r["ranks"], r["scheme"]): r for r in d["rows"]}
        nnz = d["workload"]["num_items"] * d["workload"]["density"]
        for n in sorted({n for n, _ in rows}):
            z, p, o = rows[(n, "zen")], rows[(n, "sparse_ps")], rows[(n, "omnireduce")]
            term = math.sqrt(n * math.log(n) / nnz)
            out.append(f"| {model} | {n} | {z['push_imbalance']:.2f} | {z['pull_imbalance']:.2f} | "
                       f"{p['push_imbalance']:.2f} | {p['pull_imbalance']:.2f} | {o['push_imbalance']:.2f} | "
                       f"{term:.3f} |")  # fmt: skip
    return [*out, ""]


def _scale_check(data: dict[str, Any]) -> list[str]:
    out = ["## Scale check: time / dense at the simulated scale and at 4x fewer rows", "",
           "| model | n | " + " | ".join(f"{s} (x/x4)" for s in SCHEMES if s != "dense") + " | largest change |",
           "|---" * (len(SCHEMES) + 2) + "|"]  # fmt: skip
    for model, d in data["models"].items():
        big, small = _times(d["rows"]), _times(d["check_rows"])
        for n in sorted({n for n, _ in small}):
            cells, worst = [], 0.0
            for s in SCHEMES[1:]:
                a, b = big[(n, s)] / big[(n, "dense")], small[(n, s)] / small[(n, "dense")]
                worst = max(worst, abs(b / a - 1))
                cells.append(f"{a:.3f}/{b:.3f}")
            out.append(f"| {model} | {n} | " + " | ".join(cells) + f" | {worst:.1%} |")
    return [*out, ""]


def _figure(data: dict[str, Any], path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, (model, d) in zip(axes.flat, data["models"].items(), strict=False):
        times = _times(d["rows"])
        ranks = sorted({n for n, _ in times})
        for s in SCHEMES:
            ax.plot(ranks, [times[(n, s)] * 1e3 for n in ranks], marker="o", label=s)
        ax.set(xscale="log", yscale="log", xlabel="GPUs n (one per node)", ylabel="communication time per step (ms)",
               title=f"{model}: 25 Gbit/s, rows/{d['scale']}")  # fmt: skip
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for model, d in data["models"].items():
        rows = {(r["ranks"], r["scheme"]): r for r in d["rows"]}
        ranks = sorted({n for n, _ in rows})
        for scheme, style in (("zen", "-"), ("sparse_ps", "--")):
            ax.plot(ranks, [rows[(n, scheme)]["push_imbalance"] for n in ranks], style, marker=".",
                    label=f"{model} {scheme} push")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="GPUs n", ylabel="push imbalance (max / mean bytes received)",
           title="Theorem 2: push imbalance")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(data: dict[str, Any], prefix: str) -> None:
    """Write ``prefix``.md and, with matplotlib, ``prefix``.png."""
    v = data["versions"]
    png = pathlib.Path(prefix + ".png")
    has_png = _figure(data, png)
    versions = f"zensync {v['zensync']} at git {v['git_sha']}; torch {v['torch']}; python {v['python']}"
    figure = f" Figure: {png.name}." if has_png else ""
    head = [
        "# Zen scaling results, simulated (zensync counted mode)",
        "",
        f"Command: `{data['command']}`  ",
        f"{versions}; {v['machine']}.  ",
        f"Seeds: {data['seeds']}.  ",
        "Mode: every point counted from the index sets (records equal to a full run's); network time only "
        f"(no local work). Wall time {data['wall_s']:.0f} s.{figure}",
        "",
    ]
    body = [*_workloads(data), "", *_part1(data), *_part2(data), *_part3(data), *_part4(data), *_scale_check(data)]
    pathlib.Path(prefix + ".md").write_text("\n".join(head + body) + "\n")

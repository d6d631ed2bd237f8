"""Tables, target checks and files for ``sparse_sync_bench.py`` (kept apart so the driver reads top-down)."""

from __future__ import annotations

import datetime
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

__all__ = ["markdown", "progress_line", "target_checks", "write_outputs"]

ZEN_RATIO_TOLERANCE = 0.10
"""Zen's received bytes must be within 10 % of the hash-bitmap prediction (reference/zen.md 6)."""
IMBALANCE_TARGET = 1.1
"""Push/pull imbalance bound (Zen 3.2) ..."""
IMBALANCE_MIN_NNZ = 100_000
"""... asserted only when a rank holds at least this many non-zero items (Theorem 2's root term is small)."""
SKEW_TARGET = 3.0
"""sparse_ps must see range skew above this on the LM at n = 16 (the imbalance Zen removes)."""
ZEN_LARGE_TIME_S = 60.0
"""Wall-time budget of the n = 128 zen run on 10M elements."""
LARGE_ITEMS = 10_000_000


def _fmt_bytes(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}"


def _verdict(passed: bool | None) -> str:
    return "not run" if passed is None else ("PASS" if passed else "FAIL")


def progress_line(row: dict[str, Any]) -> str:
    ratio = f" meas/pred {row['ratio']:.3f}" if row["ratio"] else ""
    ran = f" (ran {row['ran']})" if row["ran"] != row["scheme"] else ""
    return (
        f"  {row['workload']} n={row['n']} {row['scheme']}{ran}: recv {_fmt_bytes(row['recv_mean'])}/rank "
        f"({row['recv_mean_over_M']:.3f} M){ratio} lossless={row['lossless']} {row['wall_s']:.2f} s"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Target checks
# ---------------------------------------------------------------------------------------------------------------------


def _check(name: str, value: Any, target: str, passed: bool | None, detail: str = "") -> dict[str, Any]:
    return {
        "check": name,
        "value": value,
        "target": target,
        "passed": None if passed is None else bool(passed),
        "detail": detail,
    }


def _zen_checks(name: str, zen: Sequence[dict[str, Any]], k_of: dict[tuple[str, int], float]) -> list[dict[str, Any]]:
    """Volume, balance, bitmap size and large-run time targets of one workload's zen rows."""
    checks: list[dict[str, Any]] = []
    if zen:
        worst = max(zen, key=lambda r: abs(r["ratio"] - 1))
        checks.append(
            _check(
                f"{name}: zen bytes / bitmap prediction",
                round(worst["ratio"], 4),
                f"within 1 +- {ZEN_RATIO_TOLERANCE}",
                abs(worst["ratio"] - 1) <= ZEN_RATIO_TOLERANCE,
                f"worst at n={worst['n']}",
            )
        )
    big = [r for r in zen if k_of[(name, r["n"])] >= IMBALANCE_MIN_NNZ]
    if big:
        worst_imb = max(max(r["push_imbalance"] or 1, r["pull_imbalance"] or 1) for r in big)
        checks.append(
            _check(
                f"{name}: zen push/pull imbalance (K >= 100k)",
                round(worst_imb, 4),
                f"< {IMBALANCE_TARGET}",
                worst_imb < IMBALANCE_TARGET,
            )
        )
    words = [r for r in zen if r["pull_encodings"].get("bitmap", 0) == r["n"]]
    if words:
        checks.append(
            _check(
                f"{name}: pull bitmap words when every owner pulls a bitmap",
                words[0]["pull_bitmap_words"],
                "== ceil(N/32)",
                all(r["pull_bitmap_words"] == r["bitmap_words_expected"] for r in words),
                "n = " + ", ".join(str(r["n"]) for r in words),
            )
        )
    large = [r for r in zen if r["n"] == 128 and r["num_items"] >= LARGE_ITEMS]
    for r in large:
        checks.append(
            _check(
                f"{name}: zen wall time, n=128, 10M items",
                round(r["wall_s"], 2),
                f"< {ZEN_LARGE_TIME_S} s",
                r["wall_s"] < ZEN_LARGE_TIME_S,
            )
        )
    return checks


def target_checks(
    rows: Sequence[dict[str, Any]], pred_records: Sequence[dict[str, Any]], skipped: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The measurable targets, one record per workload where they apply (passed None: not run)."""
    checks = []
    for s in skipped:
        if s["scheme"] == "zen" and s["n"] == 128:
            checks.append(
                _check(
                    f"{s['workload']}: zen wall time, n=128", "not run", f"< {ZEN_LARGE_TIME_S} s", None, s["reason"]
                )
            )
    k_of = {(p["workload"], p["n"]): p["K"] for p in pred_records}
    for name in sorted({r["workload"] for r in rows}):
        zen = [r for r in rows if r["workload"] == name and r["scheme"] == "zen"]
        checks += _zen_checks(name, zen, k_of)
    skew = [r for r in rows if r["workload"] == "lm" and r["scheme"] == "sparse_ps" and r["n"] == 16]
    for r in skew:
        checks.append(
            _check(
                "lm: sparse_ps skew at n=16", round(r["skew_mean"], 2), f"> {SKEW_TARGET}", r["skew_mean"] > SKEW_TARGET
            )
        )
    lossy = [f"{r['workload']} n={r['n']} {r['scheme']}" for r in rows if not r["lossless"]]
    checks.append(_check("all runs lossless (float32 summation bound)", not lossy, "True", not lossy, ", ".join(lossy)))
    return checks


# ---------------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------------


def _workload_header(meta: dict[str, Any], name: str) -> list[str]:
    info = next(w for w in meta["workloads"] if w["name"] == name)
    dense = info["num_items"] * info["item_numel"] * 4
    params = ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("name",))
    return [f"## Workload `{name}` (M = dense tensor = {_fmt_bytes(dense)})", "", params, ""]


def _stats_table(name: str, rows: Sequence[dict[str, Any]], preds: Sequence[dict[str, Any]]) -> list[str]:
    out = [
        "| n | K (d) | U (gamma) | overlap | sparse_ps skew | zen push/pull imb | zen pull enc "
        "| bitmap words (ceil(N/32)) | dense ring | zen bitmap pred | zen COO (Eq.1) | SparCML (Eq.2) | AGsparse |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in (p for p in preds if p["workload"] == name):
        by = {r["scheme"]: r for r in rows if r["workload"] == name and r["n"] == p["n"]}
        zen, ps = by.get("zen", {}), by.get("sparse_ps", {})
        d = zen.get("density") or ps.get("density")
        enc = ", ".join(f"{k}:{v}" for k, v in zen.get("pull_encodings", {}).items() if v)
        gamma = p["U"] / p["K"] if p["K"] else None
        out.append(
            f"| {p['n']} | {p['K']:.0f} ({_fmt(100 * d if d else None)} %) | {p['U']} ({_fmt(gamma)})"
            f" | {_fmt(zen.get('overlap'))} | {_fmt(ps.get('skew_mean'))}"
            f" | {_fmt(zen.get('push_imbalance'), 4)} / {_fmt(zen.get('pull_imbalance'), 4)} | {enc or '-'}"
            f" | {zen.get('pull_bitmap_words', '-')} ({zen.get('bitmap_words_expected', '-')})"
            f" | {_fmt_bytes(p['dense'])} | {_fmt_bytes(p['zen'])} | {_fmt_bytes(p['zen_coo'])}"
            f" | {_fmt_bytes(p['sparcml'])} | {_fmt_bytes(p['agsparse'])} |"
        )
    return out


def _bytes_table(name: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    out = [
        "| n | scheme | recv mean | recv max | mean / M | predicted | meas / pred | push imb | pull imb "
        "| validate recv | wall s | peak RSS | lossless (max err) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["workload"] == name):
        scheme = r["scheme"] if r["ran"] == r["scheme"] else f"{r['scheme']} -> {r['ran']}"
        out.append(
            f"| {r['n']} | {scheme} | {_fmt_bytes(r['recv_mean'])} | {_fmt_bytes(r['recv_max'])}"
            f" | {r['recv_mean_over_M']:.4f} | {_fmt_bytes(r['predicted'])} | {_fmt(r['ratio'], 4)}"
            f" | {_fmt(r['push_imbalance'], 4)} | {_fmt(r['pull_imbalance'], 4)}"
            f" | {_fmt_bytes(r['validate_recv_mean'])}"
            f" | {r['wall_s']:.2f} | {_fmt_bytes(r.get('peak_rss_bytes'))}"
            f" | {'yes' if r['lossless'] else 'NO'} ({r['max_abs_err']:.2g}) |"
        )
    return out


def markdown(
    meta: dict[str, Any], rows: Sequence, preds: Sequence, checks: Sequence[dict[str, Any]], skipped: Sequence[dict]
) -> str:
    v = meta["versions"]
    lines = [
        f"# Sparse sync bench ({meta['hardware']}, {meta['date'][:10]})",
        "",
        f"`{meta['command']}`; seed {meta['seed']}; python {v['python']}, torch {v['torch']}, numba {v['numba']}, "
        f"zensync {v['zensync']}; {meta['cpu_count']} CPUs; total {meta['total_s']:.0f} s.",
        "",
        "Bytes are payload bytes received per rank over all phases except `validate` (shown apart); "
        "M is the dense tensor's size; predictions as in the driver's docstring (zen: hash-bitmap pull).",
        "",
        "## Targets",
        "",
        "| check | value | target | pass | detail |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {c['check']} | {c['value']} | {c['target']} | {_verdict(c['passed'])} | {c['detail']} |" for c in checks
    ]
    lines.append("")
    for name in dict.fromkeys(r["workload"] for r in rows):
        lines += _workload_header(meta, name)
        lines += ["### Data and predictions per n", "", *_stats_table(name, rows, preds), ""]
        lines += ["### Bytes received per rank", "", *_bytes_table(name, rows), ""]
    if skipped:
        lines += ["## Skipped runs", "", "| workload | n | scheme | reason |", "|---|---|---|---|"]
        lines += [f"| {s['workload']} | {s['n']} | {s['scheme']} | {s['reason']} |" for s in skipped] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------------


def write_outputs(
    out_dir: pathlib.Path,
    hardware: str,
    meta: dict,
    rows: Sequence,
    preds: Sequence,
    checks: Sequence,
    skipped: Sequence,
    text: str,
) -> list[pathlib.Path]:
    """Write ``sparse_sync_<hardware>_<date>.{json,md}`` and, if matplotlib imports, a ``.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"sparse_sync_{hardware}_{datetime.date.today().isoformat()}"
    payload = {
        "meta": meta,
        "checks": list(checks),
        "predictions": list(preds),
        "rows": list(rows),
        "skipped": list(skipped),
    }
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    paths[0].write_text(json.dumps(payload, indent=1, default=str) + "\n")
    paths[1].write_text(text + "\n")
    png = _plot(stem.with_suffix(".png"), rows, preds)
    return paths + ([png] if png else [])


def _plot(path: pathlib.Path, rows: Sequence[dict[str, Any]], preds: Sequence[dict[str, Any]]) -> pathlib.Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            pts = sorted((r["n"], r["recv_mean"]) for r in rows if r["workload"] == name and r["scheme"] == scheme)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=scheme)
        zen_pred = sorted((p["n"], p["zen"]) for p in preds if p["workload"] == name)
        ax.plot(*zip(*zen_pred, strict=True), linestyle="--", color="black", label="zen prediction")
        ax.set(xscale="log", yscale="log", xlabel="ranks n", ylabel="bytes received per rank", title=name)
        ax.set_xticks([p[0] for p in zen_pred], [str(p[0]) for p in zen_pred])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize="small")
    fig.tight_layout(rect=(0.0, 0.0, 0.9, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

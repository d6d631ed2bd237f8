"""Summarise a demo run: one row per strategy against DDP, printed and saved as JSON, Markdown and PNG.

Numbers per strategy (warm-up steps excluded):

- step time: median over timed steps of the slowest rank's barrier-to-barrier step time;
- comm time: median over steps of the ranks' mean summed bucket communication time;
- MB sent per worker per step: mean over ranks and steps; *counted* by zensync's hook, *modelled*
  (ring allreduce, 2(n-1)/n of each bucket) for torch's hooks;
- wire MB per worker per step (emulated hosts only): each host's interface tx delta over the timed
  steps / steps, counted by the kernel (includes barriers and TCP/IP headers);
- wire ms per step (emulated hosts only): those bytes at the link rate, the physical floor of the
  step's communication (Eq. 1's wire time for the sparse part, the ring's for the dense part);
- speedup: DDP's step time / this step time; max |dparam|: rank 0's final parameters against DDP's;
- schemes: which sync schemes actually ran, as the share of parameter-steps (one parameter synced in
  one timed step) each scheme took, e.g. "zen 14% / dense 86%" (schemes are agreed by all ranks).

Results go to demo_<hardware>_<date>.{json,md,png}, with a _2, _3, ... suffix when a result of that
name exists (nothing is overwritten), or to exactly the files named by ``DemoConfig.out``.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import pathlib
import platform
import statistics
from typing import Any

import torch

import zensync
from zensync.demo.config import DEMO_FLAGS, TORCH_STRATEGIES, DemoConfig, split_strategy
from zensync.demo.model import parameter_counts
from zensync.demo.runner import DemoResult, StrategyRun, default_out_dir
from zensync.hooks.decision import COMPRESSED_PREFIX
from zensync.testbed import parse_rate

__all__ = [
    "format_schemes",
    "format_table",
    "hardware_tag",
    "output_paths",
    "scheme_shares",
    "summarize",
    "write_outputs",
]

_MB = 1e6
_BASELINE = "ddp"
_SUFFIXES = (".json", ".md", ".png")


def _max_param_diff(run: StrategyRun, baseline: StrategyRun | None) -> float | None:
    if baseline is None:
        return None
    return max(float((run.params[k] - baseline.params[k]).abs().max()) for k in baseline.params)


def _summarize_run(run: StrategyRun, steps: int) -> dict[str, Any]:
    per_step = list(zip(*[rank["steps"] for rank in run.ranks], strict=True))
    step_s = statistics.median(max(r["step_time_s"] for r in ranks) for ranks in per_step)
    comm_s = statistics.median(statistics.fmean(r["comm_time_s"] for r in ranks) for ranks in per_step)
    sent = statistics.fmean(r["bytes_sent"] for ranks in per_step for r in ranks)
    wires = [rank["wire_tx_bytes"] for rank in run.ranks]
    wire = None if any(w is None for w in wires) else statistics.fmean(wires) / steps
    schemes = run.ranks[0]["steps"][-1].get("schemes")
    return {
        "strategy": run.strategy,
        "step_ms": step_s * 1e3,
        "comm_ms": comm_s * 1e3,
        "mb_sent_per_step": sent / _MB,
        "bytes_kind": "modelled (ring)" if split_strategy(run.strategy)[0] in TORCH_STRATEGIES else "counted (hook)",
        "wire_mb_per_step": None if wire is None else wire / _MB,
        "final_loss": statistics.fmean(rank["steps"][-1]["loss"] for rank in run.ranks),
        "schemes": schemes,
        "scheme_shares": scheme_shares(run.ranks[0]["steps"]),
        "launch_wall_s": run.wall_s,
    }


def scheme_shares(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Share of parameter-steps per scheme over ``steps`` (their ``scheme_counts``), largest first.

    Example::

        scheme_shares([{"scheme_counts": {"zen": 1, "dense": 6}}, {"scheme_counts": {"dense": 7}}])
        # {"dense": 0.928..., "zen": 0.0714...}
    """
    totals: dict[str, int] = {}
    for step in steps:
        for scheme, count in step.get("scheme_counts", {}).items():
            totals[scheme] = totals.get(scheme, 0) + int(count)
    whole = sum(totals.values())
    if not whole:
        return {}
    return {scheme: count / whole for scheme, count in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))}


def format_schemes(shares: dict[str, float]) -> str:
    """e.g. 'zen 14% / dense 86%'; compressed schemes read 'topk:0.01 (allgather, flat)'; 'n/a' if none."""
    if not shares:
        return "n/a"
    parts = []
    for scheme, share in shares.items():
        label = scheme
        if scheme.startswith(COMPRESSED_PREFIX):  # compress:<spec>|<collective>|<level>
            spec, _, rest = scheme[len(COMPRESSED_PREFIX) :].partition("|")
            label = f"{spec} ({rest.replace('|', ', ')})" if rest else spec
        percent = "<1%" if 0 < share < 0.005 else f"{share:.0%}"
        parts.append(f"{label.replace('|', '/')} {percent}")
    return " / ".join(parts)


def summarize(result: DemoResult) -> list[dict[str, Any]]:
    """One dict per strategy with the table's numbers (see the module docstring)."""
    baseline = next((r for r in result.runs if r.strategy == _BASELINE), None)
    rows = [_summarize_run(run, result.config.steps) for run in result.runs]
    base_row = next((row for row in rows if row["strategy"] == _BASELINE), None)
    rate = parse_rate(result.config.net) if result.config.net else None
    for row, run in zip(rows, result.runs, strict=True):
        wire = row["wire_mb_per_step"]
        row["wire_ms_at_rate"] = None if rate is None or wire is None else wire * _MB * 8 / rate * 1e3
        row["max_param_diff"] = _max_param_diff(run, baseline)
        row["speedup"] = None if base_row is None else base_row["step_ms"] / row["step_ms"]
        row["comm_vs_ddp"] = (
            None if base_row is None or not base_row["comm_ms"] else row["comm_ms"] / base_row["comm_ms"]
        )
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]], emulated: bool) -> str:
    """The comparison as a Markdown table (readable as plain text)."""
    head = ["strategy", "step ms (median)", "comm ms/step", "comm / ddp", "MB sent/worker/step"]
    head += ["wire MB/worker/step", "wire ms/step at link rate"] if emulated else []
    head += ["speedup vs ddp", "max abs(param - ddp)", "final loss", "schemes (share of param-steps)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        kind = "m" if row["bytes_kind"].startswith("modelled") else "c"
        cells = [row["strategy"], _fmt(row["step_ms"], ".1f"), _fmt(row["comm_ms"], ".1f")]
        cells += [_fmt(row["comm_vs_ddp"], ".2f"), f"{row['mb_sent_per_step']:.3f} ({kind})"]
        cells += [_fmt(row["wire_mb_per_step"], ".3f"), _fmt(row.get("wire_ms_at_rate"), ".1f")] if emulated else []
        cells += [_fmt(row["speedup"], ".2f") + "x", _fmt(row["max_param_diff"], ".2e"), f"{row['final_loss']:.3f}"]
        cells += [format_schemes(row.get("scheme_shares", {}))]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "(m) = modelled by the ring formula 2(n-1)/n x bucket bytes (sparse buckets: an all-gather of their "
        "entries); (c) = counted by zensync's hook."
    )
    return "\n".join(lines)


def hardware_tag(result: DemoResult) -> str:
    """e.g. 'cpu2core-loopback' or 'cpu2core-netns4x1gbit'."""
    cpu = f"cpu{os.cpu_count()}core"
    if result.emulated:
        return f"{cpu}-netns{result.config.workers}x{result.config.net}"
    return f"{cpu}-loopback"


def _versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "zensync": zensync.__version__,
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
    }


def _plot(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [row["strategy"] for row in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows)), 3.6))
    ax.bar([x - 0.2 for x in xs], [row["step_ms"] for row in rows], width=0.4, label="step time (median)")
    ax.bar([x + 0.2 for x in xs], [row["comm_ms"] for row in rows], width=0.4, label="comm time per step")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ms")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _per_step(result: DemoResult) -> dict[str, Any]:
    return {
        run.strategy: {"launch_wall_s": run.wall_s, "interface_tx_bytes": run.interface_tx_bytes, "ranks": run.ranks}
        for run in result.runs
    }


def output_paths(result: DemoResult) -> dict[str, pathlib.Path]:
    """Where the results go: ``config.out`` + .json/.md/.png, or a new name in the output directory.

    Without ``out`` the name is demo_<hardware>_<date>, or the first of demo_<hardware>_<date>_2, _3, ...
    of which no .json, .md or .png exists; its .json is created (empty) here, so that two demos
    finishing at once cannot pick the same name.
    """
    if result.config.out is not None:
        base = pathlib.Path(result.config.out)
        base = base.with_suffix("") if base.suffix in _SUFFIXES else base
        return {suffix[1:]: base.with_name(base.name + suffix) for suffix in _SUFFIXES}
    out_dir = pathlib.Path(result.config.out_dir) if result.config.out_dir else default_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"demo_{hardware_tag(result)}_{datetime.date.today().isoformat()}"
    for n in itertools.count(1):
        name = stem if n == 1 else f"{stem}_{n}"
        paths = {suffix[1:]: out_dir / (name + suffix) for suffix in _SUFFIXES}
        if any(path.exists() for path in paths.values()):
            continue
        try:
            paths["json"].open("x").close()
        except FileExistsError:  # another demo took the name meanwhile
            continue
        return paths
    raise AssertionError("unreachable")


def write_outputs(result: DemoResult, rows: list[dict[str, Any]], table: str) -> dict[str, pathlib.Path]:
    """Write the JSON, Markdown and (with matplotlib) PNG results to ``output_paths``; returns the paths written.

    Raises:
        OSError: If a file cannot be written.
    """
    paths = output_paths(result)
    setting = (
        f"{result.config.workers} emulated hosts at {result.config.net}"
        if result.emulated
        else f"{result.config.workers} local processes on loopback"
    )
    payload = {
        "config": json.loads(result.config.to_json()),
        "versions": _versions(),
        "setting": setting,
        "parameters": parameter_counts(result.config),
        "corpus": {"tokens": result.corpus_tokens, "distinct_words": result.corpus_words},
        "wall_s": result.wall_s,
        "summary": rows,
        "per_step": _per_step(result),
    }
    paths["json"].write_text(json.dumps(payload, indent=1))
    md = [
        f"# zensync demo: {setting}",
        "",
        f"Command: `zensync demo {_flags(result)}`",
        "",
        f"Versions: {_versions()}",
        f"Parameters: {parameter_counts(result.config)}",
        f"Corpus: {result.corpus_tokens:,} tokens, {result.corpus_words:,} distinct words; "
        f"total wall {result.wall_s:.0f} s",
        f"Warm-up steps excluded: {result.config.warmup_steps}; timed steps: {result.config.steps}; "
        f"seed {result.config.seed}",
        "",
        table,
        "",
    ]
    paths["md"].write_text("\n".join(md))
    if not _plot(rows, paths["png"], f"zensync demo: {setting}"):
        if result.config.out is not None:  # an OUT.png of an earlier run would not match the new OUT.json
            paths["png"].unlink(missing_ok=True)
        del paths["png"]
    return paths


_FLAG_OF = {field: flag for flag, field in DEMO_FLAGS.items()}


def _flags(result: DemoResult) -> str:
    """The ``zensync demo`` flags that reproduce this run (fields that differ from the defaults)."""
    defaults = DemoConfig()
    parts = []
    for field in dataclasses.fields(DemoConfig):
        value = getattr(result.config, field.name)
        if field.name in ("out_dir", "out") or value == getattr(defaults, field.name):
            continue
        flag = _FLAG_OF[field.name]
        parts.append(f"{flag} {' '.join(value) if isinstance(value, tuple) else value}")
    return " ".join(parts)

"""The report of experiments/simulate_validation.py: markdown, JSON and a predicted-vs-measured PNG.

Sibling module of the driver (experiments/ is not a package); it reads the driver's cache only.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from typing import Any

MOVED_OPS = ("all_reduce", "all_to_all_v", "send_recv", "all_gather_v", "all_gather")
"""The collectives whose transport CPU the calibration measures, in the table's order."""
TOLERANCE = 0.15
"""Issue 16 item 3's target: |predicted / measured - 1| <= 15 % for every scheme at n <= 16."""
_MB = 1e6


def _points(
    cache: dict[str, Any], rates: list[str], hosts: list[int], schemes: list[str], starts: int
) -> list[dict[str, Any]]:
    rows = (combined(cache, f"{r}/{n}", s, starts) for r in rates for n in hosts for s in schemes)
    return [row for row in rows if row is not None]


def combined(cache: dict[str, Any], cluster: str, scheme: str, starts: int) -> dict[str, Any] | None:
    """One point over its cluster starts (``cluster``: "rate/n"; the starts' rows are cached under
    "rate/n@start/scheme"): measured, simulate_step and step-alone times are the medians over the
    starts, the errors their ratios; the other columns (phases, CPU, wire, ablation, per-rank times)
    are those of the start whose measured time is the median (the lower middle one for an even
    count). ``starts``: per start, its measured and predicted times. None: no start is cached."""
    rows = [cache["points"].get(f"{cluster}@{k}/{scheme}") for k in range(1, starts + 1)]
    done = [row for row in rows if row is not None]
    if not done:
        return None
    by_measured = sorted(done, key=lambda row: row["measured_s"])
    point = dict(by_measured[(len(done) - 1) // 2])
    for key in ("measured_s", "predicted_s", "step_predicted_s"):
        point[key] = statistics.median(row[key] for row in done)
    point["error"] = point["predicted_s"] / point["measured_s"] - 1
    point["step_error"] = point["step_predicted_s"] / point["measured_s"] - 1
    point["starts"] = [
        {key: row[key] for key in ("start", "measured_s", "predicted_s", "step_predicted_s", "step_error")}
        for row in done
    ]
    return point


def _starts(p: dict[str, Any]) -> str:
    return ", ".join(f"{s['measured_s']:.3f} / {s['step_predicted_s']:.3f}" for s in p["starts"])


def _calibration_table(cache: dict[str, Any], rates: list[str], hosts: list[int], starts: int) -> list[str]:
    from simulate_validation import all_to_all_latency_scale, cores_of

    lines = [
        "| rate | n @ start | alpha (us) | beta (MB/s) | beta / rate | all-to-all efficiency e (raw fit) "
        "| all-to-all latency scale | exchange efficiency (one-way MB/s) | all-gather efficiency g "
        "| contention c | cores n / c "
        "| transport CPU (ns per byte moved, the processes'): all_reduce, all_to_all_v, send_recv, all_gather_v, "
        "all_gather | load (1 min) "
        "| cores busy before |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in rates:
        for n, start in ((n, start) for n in hosts for start in range(1, starts + 1)):
            c = cache["calibration"].get(f"{rate}/{n}@{start}")
            if c is None:
                continue
            transport = c.get("transport_cpu_s_per_byte")
            cpu = "not measured" if transport is None else ", ".join(_ns(transport.get(op)) for op in MOVED_OPS)
            machine = c.get("transport_machine_cpu_s_per_byte")
            if machine is not None:
                cpu += " (machine: " + ", ".join(_ns(machine.get(op)) for op in MOVED_OPS) + ")"
            lines.append(
                f"| {rate} | {n} @ {start} | {c['alpha_s'] * 1e6:.0f} | {c['beta_bytes_per_s'] / _MB:.2f} | "
                f"{c['beta_over_rate']:.3f} | {c['all_to_all_efficiency']:.3f} "
                f"({c['all_to_all_efficiency_raw']:.3f}) | {all_to_all_latency_scale(c, n):.3f} | "
                f"{c['exchange_efficiency']:.3f} ({c['one_way_bytes_per_s'] / _MB:.2f}) | "
                f"{c.get('all_gather_efficiency', 1.0):.3f} | {c['contention']:.2f} "
                f"({c['job_concurrent_wall_s']:.3f} / {c['job_solo_thread_cpu_s']:.3f} s) | {cores_of(c, n):.2f} | "
                f"{cpu} | {c['load_avg_1m']:.2f} | {c.get('machine_busy_before', float('nan')):.0%} |"
            )
    return lines


def _ns(seconds_per_byte: float | None) -> str:
    return "-" if seconds_per_byte is None else f"{seconds_per_byte * 1e9:.2f}"


def _phases(p: dict[str, Any]) -> str:
    measured = p["measured_phase_comm_s"]
    return ", ".join(f"{k} {v:.3f} / {measured.get(k, 0.0):.3f}" for k, v in p["step_phase_s"].items())


def _ok(error: float) -> str:
    return f"{error:+.1%}" if abs(error) <= TOLERANCE else f"**{error:+.1%}**"


def _point_table(points: list[dict[str, Any]], rate: str) -> list[str]:
    lines = [
        "| n | scheme | measured (s) | simulate_step (s) | error | step alone (s) | error | per start: measured / "
        "step alone (s) | network alone: "
        "simulated / measured calls (s) | local work, step alone (s) | machine CPU busy | process CPU/step: max, "
        "sum over ranks (s) | phases: step alone / measured in collectives (s) | collectives | wire tx/host, "
        "max (MB) | engine bytes/host, max (MB) | wire / engine | calls match | sum ok | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in (p for p in points if p["rate"] == rate):
        ratios = [x for x in p["wire_over_engine"] if x is not None]
        ratio = f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "n/a"
        lines.append(
            f"| {p['n']} | {p['scheme']} | {p['measured_s']:.3f} | {p['predicted_s']:.3f} | {_ok(p['error'])} | "
            f"{p['step_predicted_s']:.3f} | {_ok(p['step_error'])} | {_starts(p)} | {p['step_network_s']:.3f} / "
            f"{p['network_only_s']:.3f} | {p['step_compute_s']:.3f} | {p['machine_busy_fraction']:.0%} | "
            f"{p['step_process_cpu_s_max']:.3f}, {p['step_process_cpu_s_sum']:.3f} | {_phases(p)} | "
            f"{p['collectives_per_rank']} | {max(p['wire_tx_per_host']) / _MB:.2f} | "
            f"{max(p['engine_bytes_per_host']) / _MB:.2f} | {ratio} | {p['calls_match']} | {p['sum_ok']} | "
            f"{p['load_avg_1m'][0]:.2f}-{p['load_avg_1m'][1]:.2f} |"
        )
    return lines


def _ablation_table(points: list[dict[str, Any]]) -> list[str]:
    """Per point, the step alone's records priced with the model's terms added one at a time."""
    rows = [p for p in points if p.get("ablation_s")]
    if not rows:
        return []
    terms = list(rows[0]["ablation_s"])
    within = {t: sum(abs(p["ablation_s"][t] / p["measured_s"] - 1) <= TOLERANCE for p in rows) for t in terms}
    lines = [
        "",
        "## Which model term does what",
        "",
        "The step alone's records (one recording per point) priced with the model's terms added one at a time: "
        "the network alone (the whole network model: the bucket, the ring out of lockstep, the all-gather's "
        "efficiency; the findings give what those changed); + local work, each rank on a core of its own times "
        "the contention c (the model "
        "before 2026-12-04); the n / c cores shared instead (processor sharing); + the all-to-all latency "
        "scale; + the transport CPU (the full model). Error against the measured step; within 15 %: "
        + "; ".join(f"{t} {within[t]} of {len(rows)}" for t in terms)
        + ".",
        "",
        "| rate | n | scheme | measured (s) | " + " | ".join(terms) + " |",
        "|---|---|---|---|" + "---|" * len(terms),
    ]
    for p in rows:
        cells = " | ".join(_ok(p["ablation_s"][t] / p["measured_s"] - 1) for t in terms)
        lines.append(f"| {p['rate']} | {p['n']} | {p['scheme']} | {p['measured_s']:.3f} | {cells} |")
    return lines


def _rank_table(points: list[dict[str, Any]]) -> list[str]:
    """For the points outside the tolerance: per rank and phase, the seconds inside the phase's
    collectives (waits for peers included), simulated (the step alone) / measured (median over steps)."""
    rows = [p for p in points if abs(p["error"]) > TOLERANCE and p.get("measured_rank_phase_comm_s")]
    if not rows:
        return []
    lines = [
        "",
        "## Inside the collectives, per rank (points outside 15 %)",
        "",
        "Per rank and phase, seconds from the call's start to its end (waits for the other members included), "
        "simulated (the step alone) / measured (each host's median over its steps).",
        "",
        "| rate | n | scheme | phase | per rank: simulated / measured (s) |",
        "|---|---|---|---|---|",
    ]
    for p in rows:
        simulated, measured = p["step_rank_call_s"], p["measured_rank_phase_comm_s"]
        for phase in sorted(measured[0]):
            cells = ", ".join(
                f"{r}: {sim.get(phase, 0.0):.3f} / {meas.get(phase, 0.0):.3f}"
                for r, (sim, meas) in enumerate(zip(simulated, measured, strict=True))
            )
            lines.append(f"| {p['rate']} | {p['n']} | {p['scheme']} | {phase} | {cells} |")
    return lines


def markdown(
    meta: dict[str, Any], cache: dict[str, Any], rates: list[str], hosts: list[int], schemes: list[str], starts: int
) -> str:
    points = _points(cache, rates, hosts, schemes, starts)
    start_within = sum(abs(s["step_error"]) <= TOLERANCE for p in points for s in p["starts"])
    start_count = sum(len(p["starts"]) for p in points)
    within = sum(abs(p["error"]) <= TOLERANCE for p in points)
    step_within = sum(abs(p["step_error"]) <= TOLERANCE for p in points)
    lines = [
        f"# zensync.simulate vs the emulated cluster: predicted vs measured step time ({meta['date']})",
        "",
        'Validates the priced step of `zensync.simulate` (`simulate_step(..., mode="full")`: the schemes\' real '
        "collectives on `Topology.flat`, plus measured local work and transport CPU on the shared cores), the "
        "model behind `zensync simulate` and experiments/results/simulate_zipf10M_25gbit_2026-12-05 (issue 16 item 3).",
        "",
        f"{'Report written by' if meta.get('report_only') else 'Command'}: `{meta['command']}`; git "
        f"{meta['git_sha']} (tracked files changed in the shared checkout "
        f"when the report was written: {', '.join(meta['git_tracked_changes']) or 'none'}); torch "
        f"{meta['torch']}, Python {meta['python']}; machine: "
        f"{meta['cpus']} CPU cores shared by all n hosts, kernel {meta['kernel']}"
        + ("." if meta.get("report_only") else f"; wall {meta['wall_s']:.0f} s."),
        f"Workload: `ZipfWorkload` with {meta['workload']['rows_per_mbit']} rows per Mbit/s of rate, "
        f"dim {meta['workload']['dim']} float32, density {meta['workload']['density']}, skew "
        f"{meta['workload']['skew']}; seeds {meta['seeds']}. Measured: median over {meta['steps']} steps (after "
        f"one warm-up) of the max over ranks, each step after a barrier, on each of {starts} cluster starts "
        "(calibrated, measured and predicted per start; starts interleaved over the points, start 1 of every "
        "point first). A point's measured, simulate_step and step-alone times are the medians over its starts "
        f"(`combined`). Calibration: median of {meta['reps']} reps.",
        "",
        f"**Target: |predicted / measured - 1| <= {TOLERANCE:.0%}: simulate_step {within} of {len(points)} "
        f"points; the step alone {step_within} of {len(points)}.** Single starts, the step alone against that "
        f"start's own measurement: {start_within} of {start_count}.",
        "",
        "## Calibration (separate processes, separate data)",
        "",
        "alpha, beta: ring all-reduce fit on links with the tbf's token bucket (`Link.burst_bytes`: 64 KiB at "
        "100 Mbit/s, 125 kB at 1 Gbit/s; each ring step's latency refills it, so bandwidth-bound all-reduces pay "
        "about 2 (n - 1) max(0, alpha - burst / beta) of latency, not 2 (n - 1) alpha); e: equal-block "
        "`all_to_all_single` fit, T = a + S / (e beta) "
        "(S bytes sent per rank; e capped at 1); all-to-all latency scale: the 4 KiB all-to-all's time, its "
        "bytes' share taken off, over (n - 1) alpha; c: wall of a fixed job on all n ranks at once / its "
        "thread-CPU seconds alone, so the n hosts share n / c cores; x: the exchange efficiency (one pair, both "
        "ways at once, over one way: the median over the sizes, as an exchange runs at about half the rate "
        "each way or near all of it); transport CPU: the hosts' processes' CPU seconds (all threads, user and "
        "system) per byte sent plus received, the slope over each collective's three larger calibration sizes "
        "(in brackets: the whole machine's busy CPU, `/proc/stat`, with the kernel's network work no process "
        "is charged for; not charged, see the findings); all_gather is zensync's all_gather_v with equal "
        "blocks, which runs as gloo's own all-gather (AGsparse's blocks), all_gather_v its uneven ring of "
        "point-to-point steps; g: that all-gather's rate over beta (its time's slope, as e). "
        "The prediction uses `Topology.flat(Link(alpha, beta, burst), all_to_all_efficiency=e, "
        "exchange_efficiency=x, all_to_all_latency_scale=..., all_gather_efficiency=g)`, `cores=n / c` and "
        "`transport_cpu=...` (`zensync.simulate.timeline`: "
        "local work and transport CPU share the cores; a collective ends when its wire time and its members' "
        "CPU work are done).",
        "",
        *_calibration_table(cache, rates, hosts, starts),
    ]
    for rate in rates:
        lines += ["", f"## {rate}", "", *_point_table(points, rate)]
    lines += [
        "",
        'Columns: simulate_step = `simulate_step(..., mode="full")` as `zensync simulate` runs it (before '
        "b6a0b31 its recorded step included building each rank's input tensor, charged as local work); step "
        "alone = the same `run_agreed` step on inputs built beforehand (`zensync.simulate.simulate`), what the "
        "hosts time (since b6a0b31 an independent second simulation of the same step); "
        "network alone = the step's collectives priced with no local work, from the simulated ranks' records / "
        "from the emulated ranks' own records; local work = the largest rank's seconds of local work on the shared "
        "cores; "
        "machine CPU busy = both cores' busy share over the timed steps (`/proc/stat`, kernel network work "
        "included; near 100 %: CPU-bound); process CPU/step = CPU seconds of the hosts' processes in one step "
        "(all threads: local work, gloo, the transport; not the kernel's); phases = per phase, the simulated "
        "seconds (calls, waits, local work) / the measured seconds inside that phase's collectives (max over "
        "ranks, median over steps; waits for other ranks fall in either); wire tx = eth0 tx bytes per step "
        "(barriers subtracted), engine = the transport's count (payload + control); calls match = the "
        "simulated ranks sent the same payload bytes (max and mean over ranks) as the emulated ones.",
    ]
    lines += _ablation_table(points)
    lines += _rank_table(points)
    if meta.get("notes"):
        lines += ["", "## Findings", "", meta["notes"].rstrip()]
    return "\n".join(lines) + "\n"


def _png(path: pathlib.Path, points: list[dict[str, Any]], rates: list[str], schemes: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 5.5), squeeze=False)
    markers = {4: "o", 8: "s", 16: "^"}
    colors = {s: f"C{i}" for i, s in enumerate(schemes)}
    for ax, rate in zip(axes[0], rates, strict=True):
        mine = [p for p in points if p["rate"] == rate]
        if not mine:
            continue
        lo = 0.5 * min(min(p["measured_s"], p["predicted_s"], p["step_predicted_s"]) for p in mine)
        hi = 2.0 * max(max(p["measured_s"], p["predicted_s"], p["step_predicted_s"]) for p in mine)
        ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="predicted = measured")
        for f in (1 - TOLERANCE, 1 + TOLERANCE):
            ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=1)
        for p in mine:
            marker = markers.get(p["n"], "x")
            ax.scatter(p["measured_s"], p["step_predicted_s"], color=colors[p["scheme"]], marker=marker)
            ax.scatter(
                p["measured_s"], p["predicted_s"], facecolors="none", edgecolors=colors[p["scheme"]], marker=marker
            )
        for s in schemes:
            ax.scatter([], [], color=colors[s], label=s)
        for n, m in markers.items():
            ax.scatter([], [], color="gray", marker=m, label=f"n = {n}")
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), title=f"{rate} per link, 2 CPU cores",
               xlabel="measured step time (s)", ylabel="predicted step time (s)")  # fmt: skip
        ax.legend(fontsize=7, loc="upper left")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
    fig.suptitle(
        f"zensync.simulate vs emulated cluster: filled = step alone, hollow = simulate_step (dotted: +-{TOLERANCE:.0%})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(
    stem: pathlib.Path, meta: dict[str, Any], cache: dict[str, Any], rates: list[str], hosts: list[int],
    schemes: list[str], starts: int,
) -> None:  # fmt: skip
    """``<stem>.md``, ``<stem>.json`` and, with matplotlib, ``<stem>.png``."""
    points = _points(cache, rates, hosts, schemes, starts)
    calibration = {k: v for k, v in cache["calibration"].items() if k.split("/")[0] in rates}
    payload = {"meta": meta, "calibration": calibration, "points": points, "tolerance": TOLERANCE}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    stem.with_suffix(".md").write_text(markdown(meta, cache, rates, hosts, schemes, starts))
    try:
        _png(stem.with_suffix(".png"), points, rates, schemes)
    except ImportError:
        print("matplotlib not installed: no PNG")

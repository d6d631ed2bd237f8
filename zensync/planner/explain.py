"""Re-simulating a saved plan and describing it: what ``zensync explain`` prints.

A plan written by ``zensync plan`` embeds its profile and any measured compressor costs, so the
timeline can be rebuilt from the file alone::

    plan = Plan.from_json(text)
    print(summarize(plan))
    print(render_timeline(simulate_plan(plan)))
"""

from __future__ import annotations

import collections
from typing import Any

from zensync.cost import CompressorModel, measured_compressor_model
from zensync.planner.plan import Plan
from zensync.planner.simulator import SimResult, Strategy, simulate

__all__ = ["plan_compressor_model", "simulate_plan", "summarize"]


def plan_compressor_model(plan: Plan) -> CompressorModel:
    """The compressor model the plan was made with (defaults, or the embedded measured costs)."""
    return measured_compressor_model(plan.compressor, plan.costs)


def simulate_plan(plan: Plan, *, upper_bound: bool = False) -> SimResult:
    """The plan's predicted timeline (events recorded).

    Raises:
        ValueError: If the plan carries no profile (plans made by ``zensync plan`` always do).
    """
    if plan.profile is None:
        raise ValueError(
            f"plan for {plan.model!r} has no embedded profile; re-create it with `zensync plan` to explain it"
        )
    strategy = Strategy(options=tuple(t.option for t in plan.tensors), groups=tuple(t.group for t in plan.tensors))
    return simulate(plan.profile, plan.cluster, plan_compressor_model(plan), strategy, upper_bound=upper_bound)


def summarize(plan: Plan) -> str:
    """A readable summary: cluster, compressor, predictions, and which tensors take which option."""
    p, c = plan.predicted, plan.cluster
    gap = (p.plan_s / p.upper_bound_s - 1) * 100 if p.upper_bound_s else 0.0
    inter_gbit, intra_gbyte = c.inter_bandwidth_bytes_per_s * 8 / 1e9, c.intra_bandwidth_bytes_per_s / 1e9
    lines = [
        f"plan for {plan.model} on {c.nodes} node(s) x {c.gpus_per_node} GPU(s) (inter {inter_gbit:g} Gbit/s, "
        f"intra {intra_gbyte:g} GB/s), compressor {plan.compressor}, chosen by {plan.chosen} in "
        f"{plan.selection_s * 1e3:.1f} ms",
        f"predicted iteration: plan {p.plan_s * 1e3:.2f} ms | fp32 allreduce {p.fp32_s * 1e3:.2f} ms "
        f"(x{p.speedup_vs_fp32:.2f}) | fp16 allreduce {p.fp16_s * 1e3:.2f} ms (x{p.speedup_vs_fp16:.2f}) | "
        f"upper bound {p.upper_bound_s * 1e3:.2f} ms (gap {gap:.1f} %)",
        "",
        "| option | tensors | elements | MB (fp32) | example |",
        "|---|---|---|---|---|",
    ]
    by_option: dict[str, list[Any]] = collections.defaultdict(list)
    for t in plan.tensors:
        by_option[t.option.code].append(t)
    for code, tensors in sorted(by_option.items(), key=lambda kv: -sum(t.numel for t in kv[1])):
        numel = sum(t.numel for t in tensors)
        lines.append(f"| {code} | {len(tensors)} | {numel:,} | {numel * 4 / 1e6:.1f} | {tensors[0].name} |")
    groups = len({t.group for t in plan.tensors})
    lines.append(f"\n{len(plan.tensors)} tensors in {groups} fusion group(s); flags: {plan.flags or 'none'}")
    return "\n".join(lines)

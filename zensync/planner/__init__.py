"""Espresso-style compression planning: model profiles, a timeline simulator and the plan search.

Never imports the transport layer: planning works offline, with no process group and no GPU. The cost
formulas it prices with (compressor models, collective times) live in ``zensync.cost``.
"""

from __future__ import annotations

from zensync.planner._reader import MAX_JSON_CHARS, MAX_JSON_DEPTH, MAX_TENSORS, parse_json
from zensync.planner.cluster import ClusterSpec, parse_bandwidth
from zensync.planner.explain import plan_compressor_model, simulate_plan, summarize
from zensync.planner.gpus import GpuSpec, builtin_gpus, gpu_spec
from zensync.planner.models import builtin_models, builtin_profile
from zensync.planner.options import FP16_OPTION, FP32_OPTION, TensorOption, candidate_options, option_costs
from zensync.planner.plan import PLAN_VERSION, Plan, PlanTensor, Predictions
from zensync.planner.profile import PROFILE_VERSION, ModelProfile, TensorProfile, read_profile_bundle
from zensync.planner.search import plan
from zensync.planner.simulator import (
    SimResult,
    Strategy,
    TimelineEvent,
    Unit,
    iteration_time,
    price_units,
    render_timeline,
    simulate,
    simulate_units,
)
from zensync.planner.step import (
    AUTO_COMPRESSORS,
    STEP_PROFILE_VERSION,
    AutoChoice,
    BucketCost,
    LinkFit,
    StepPrediction,
    StepProfile,
    choose_compression,
    predict_step,
)

__all__ = [
    "AUTO_COMPRESSORS",
    "FP16_OPTION",
    "FP32_OPTION",
    "MAX_JSON_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_TENSORS",
    "PLAN_VERSION",
    "PROFILE_VERSION",
    "STEP_PROFILE_VERSION",
    "AutoChoice",
    "BucketCost",
    "ClusterSpec",
    "GpuSpec",
    "LinkFit",
    "ModelProfile",
    "Plan",
    "PlanTensor",
    "Predictions",
    "SimResult",
    "StepPrediction",
    "StepProfile",
    "Strategy",
    "TensorOption",
    "TensorProfile",
    "TimelineEvent",
    "Unit",
    "builtin_gpus",
    "builtin_models",
    "builtin_profile",
    "candidate_options",
    "choose_compression",
    "gpu_spec",
    "iteration_time",
    "option_costs",
    "parse_bandwidth",
    "parse_json",
    "plan",
    "plan_compressor_model",
    "predict_step",
    "price_units",
    "read_profile_bundle",
    "render_timeline",
    "simulate",
    "simulate_plan",
    "simulate_units",
    "summarize",
]

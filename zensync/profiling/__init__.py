"""Measuring the planner's inputs on real hardware: gradient-ready times, compressor costs.

The group's alpha-beta parameters are measured by ``zensync.cost.calibrate``.
"""

from __future__ import annotations

from zensync.profiling.costs import CompressorCost, measure_compressor_costs
from zensync.profiling.group import agreed_compute, profile_group, profile_links, slowest_over_ranks
from zensync.profiling.ready import measure_ready_times

__all__ = [
    "CompressorCost",
    "agreed_compute",
    "measure_compressor_costs",
    "measure_ready_times",
    "profile_group",
    "profile_links",
    "slowest_over_ranks",
]

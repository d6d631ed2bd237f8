"""Cost models: the one home of every time and volume formula, shared by the sync engine, the hooks
and the planner.

- ``network``: the alpha-beta ``CostModel`` and ``fit_affine``;
- ``sparse``: Zen's Eq. 1/Eq. 2 volumes and each sync scheme's alpha-beta time;
- ``collectives``: the planner's collective times (alpha once per collective, as Espresso);
- ``compressors``: payload sizes and compress/decompress costs, modelled or measured;
- ``fields``: typed reads of untrusted file fields (measured costs, and the planner's files);
- ``calibrate``: measures alpha and beta on a live group. Not imported here (import
  ``zensync.cost.calibrate``): this package imports neither torch nor the transport layer.
"""

from __future__ import annotations

from zensync.cost.collectives import (
    FloatArray,
    Num,
    allgather_s,
    allreduce_s,
    alltoall_s,
    broadcast_s,
    gather_s,
    reduce_scatter_s,
)
from zensync.cost.compressors import (
    FP16_MODEL,
    FP32_MODEL,
    GPU_KNEE_ELEMENTS,
    MEASURABLE_COSTS,
    AffineCost,
    CompressorModel,
    CostFit,
    Device,
    compressor_model,
    measured_compressor_model,
    read_measured_costs,
    shape_priced,
)
from zensync.cost.network import CostModel, fit_affine
from zensync.cost.sparse import TensorShape, independent_union, measured_union, predict_bytes, predict_time

__all__ = [
    "FP16_MODEL",
    "FP32_MODEL",
    "GPU_KNEE_ELEMENTS",
    "MEASURABLE_COSTS",
    "AffineCost",
    "CompressorModel",
    "CostFit",
    "CostModel",
    "Device",
    "FloatArray",
    "Num",
    "TensorShape",
    "allgather_s",
    "allreduce_s",
    "alltoall_s",
    "broadcast_s",
    "compressor_model",
    "fit_affine",
    "gather_s",
    "independent_union",
    "measured_compressor_model",
    "measured_union",
    "predict_bytes",
    "predict_time",
    "read_measured_costs",
    "reduce_scatter_s",
    "shape_priced",
]

"""Named GPUs with the peak numbers a roofline estimate needs.

Each entry gives dense FP32 (CUDA-core, non-tensor) and FP16/BF16 tensor-core throughput and HBM
bandwidth. The numbers are the vendor datasheet peaks, dense (no 2:4 sparsity), for the SXM parts:
NVIDIA V100 (SXM2 32GB), A100 (SXM 80GB), H100 (SXM5) and H200 (SXM) product datasheets. Peaks are
upper bounds; :meth:`GpuSpec.roofline_s` scales them by the named efficiency constants below.

Example::

    spec = gpu_spec("h100-sxm")
    spec.name, spec.tensor_tflops, spec.hbm_gbps  # ("H100", 989.0, 3350.0)
    spec.roofline_s(2e12, 1e9, tensor_cores=True)  # max(2e12 / (989e12 * 0.6), 1e9 / (3350e9 * 0.7))
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["COMPUTE_EFFICIENCY", "MEMORY_EFFICIENCY", "GpuSpec", "builtin_gpus", "gpu_spec"]

COMPUTE_EFFICIENCY = 0.6
"""Fraction of peak FLOP/s a training GEMM or convolution reaches (cuBLAS/cuDNN on large shapes: ~60-80 %)."""
MEMORY_EFFICIENCY = 0.7
"""Fraction of HBM bandwidth a streaming kernel reaches (STREAM-like copies: ~80-90 % of the datasheet)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GpuSpec:
    """Peak throughput of one GPU, as a roofline needs it."""

    name: str
    """Canonical short name, e.g. "V100"."""
    part: str
    """The exact part the numbers are for, e.g. "V100 SXM2 32GB"."""
    fp32_tflops: float
    """Dense FP32 throughput on CUDA cores (no tensor cores), TFLOP/s."""
    tensor_tflops: float
    """Dense FP16/BF16 tensor-core throughput (no sparsity), TFLOP/s."""
    hbm_gbps: float
    """HBM bandwidth, GB/s (10^9 bytes per second)."""

    def __post_init__(self) -> None:
        for field in ("fp32_tflops", "tensor_tflops", "hbm_gbps"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"GpuSpec {self.name!r}: {field}={value} must be a finite number > 0")

    def roofline_s(self, flops: float, bytes_moved: float, *, tensor_cores: bool) -> float:
        """Seconds for a kernel by the roofline: the slower of its compute and its HBM traffic.

        Args:
            flops: Floating-point operations.
            bytes_moved: Bytes read from and written to HBM.
            tensor_cores: True for FP16/BF16 matmul-class work; False for FP32 or non-matmul work.

        Returns:
            ``max(flops / (peak * COMPUTE_EFFICIENCY), bytes_moved / (hbm * MEMORY_EFFICIENCY))``.

        Example::

            gpu_spec("V100").roofline_s(75e12, 0.0, tensor_cores=True)  # 1.0 (125 TFLOP/s at 60 %)
        """
        tflops = self.tensor_tflops if tensor_cores else self.fp32_tflops
        compute_s = flops / (tflops * 1e12 * COMPUTE_EFFICIENCY)
        return max(compute_s, bytes_moved / (self.hbm_gbps * 1e9 * MEMORY_EFFICIENCY))


# Vendor datasheet peaks, dense: (FP32 TFLOP/s, FP16/BF16 tensor TFLOP/s, HBM GB/s).
# V100: 15.7 / 125 / 900 (V100 SXM2 datasheet). A100: 19.5 / 312 / 2039 (A100 80GB SXM datasheet).
# H100: 67 / 989 / 3350 (H100 SXM datasheet lists 1979 FP16 "with sparsity", i.e. 989 dense).
# H200: 67 / 989 / 4800 (H200 SXM datasheet; same compute as H100 SXM, faster and larger HBM3e).
_GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(name="V100", part="V100 SXM2 32GB", fp32_tflops=15.7, tensor_tflops=125.0, hbm_gbps=900.0),
        GpuSpec(name="A100", part="A100 SXM 80GB", fp32_tflops=19.5, tensor_tflops=312.0, hbm_gbps=2039.0),
        GpuSpec(name="H100", part="H100 SXM", fp32_tflops=67.0, tensor_tflops=989.0, hbm_gbps=3350.0),
        GpuSpec(name="H200", part="H200 SXM", fp32_tflops=67.0, tensor_tflops=989.0, hbm_gbps=4800.0),
    )
}

# Accepted spellings, after lower-casing and mapping spaces/underscores to "-" and dropping a
# leading "nvidia-" or "tesla-". Only the SXM part is tabulated, so PCIe names are not aliases.
_ALIASES: dict[str, str] = {
    "v100": "V100",
    "v100-sxm2": "V100",
    "v100-sxm2-32gb": "V100",
    "v100-32gb": "V100",
    "a100": "A100",
    "a100-sxm": "A100",
    "a100-sxm4": "A100",
    "a100-80gb": "A100",
    "a100-sxm-80gb": "A100",
    "a100-sxm4-80gb": "A100",
    "h100": "H100",
    "h100-sxm": "H100",
    "h100-sxm5": "H100",
    "h100-sxm5-80gb": "H100",
    "h100-80gb-hbm3": "H100",
    "h200": "H200",
    "h200-sxm": "H200",
    "h200-141gb": "H200",
}


def builtin_gpus() -> tuple[str, ...]:
    """Canonical names of the tabulated GPUs.

    Returns:
        The names, e.g. ``("V100", "A100", "H100", "H200")``.

    Example::

        assert "H100" in builtin_gpus()
    """
    return tuple(_GPUS)


def _normalise(name: str) -> str:
    key = "-".join(name.strip().lower().replace("_", " ").replace("-", " ").split())
    for prefix in ("nvidia-", "tesla-"):
        key = key.removeprefix(prefix)
    return key


def gpu_spec(name: str) -> GpuSpec:
    """Look up a GPU by name, case-insensitively, accepting aliases such as "h100" or "H100-SXM".

    Args:
        name: A canonical name (``builtin_gpus()``) or an alias, e.g. "NVIDIA H100-SXM5".

    Returns:
        The GPU's peak numbers.

    Raises:
        ValueError: If the name is not a known GPU; the message lists the valid names.

    Example::

        assert gpu_spec("a100-sxm4-80gb").hbm_gbps == 2039.0
    """
    canonical = _ALIASES.get(_normalise(name))
    if canonical is None:
        raise ValueError(
            f"gpu={name!r} is not a known GPU: valid names are {list(_GPUS)} "
            f"(case-insensitive; aliases such as 'h100-sxm' or 'a100-80gb' also work)"
        )
    return _GPUS[canonical]

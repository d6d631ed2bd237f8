"""CPU emulation of the CUDA kernels in ``cuda_ext/csrc``, for CPU-only CI; ``build.py`` says what it covers."""

from cuda_ext.emulation.build import (
    VARIANTS,
    build_directory,
    build_ops,
    namespace,
    rewrite_launches,
    run_selftest,
    unavailable_reason,
)

__all__ = [
    "VARIANTS",
    "build_directory",
    "build_ops",
    "namespace",
    "rewrite_launches",
    "run_selftest",
    "unavailable_reason",
]

"""CPU emulation of the CUDA kernels in ``cuda_ext/csrc``, for CPU-only CI; ``build.py`` says what it covers."""

from cuda_ext.emulation.build import (
    SANITIZERS,
    VARIANTS,
    Sanitizer,
    Variant,
    build_directory,
    build_ops,
    compile_program,
    namespace,
    rewrite_launches,
    rewrite_shared,
    run_selftest,
    sanitizer_environment,
    sanitizer_runtime,
    unavailable_reason,
)

__all__ = [
    "SANITIZERS",
    "VARIANTS",
    "Sanitizer",
    "Variant",
    "build_directory",
    "build_ops",
    "compile_program",
    "namespace",
    "rewrite_launches",
    "rewrite_shared",
    "run_selftest",
    "sanitizer_environment",
    "sanitizer_runtime",
    "unavailable_reason",
]

"""CPU emulation of the CUDA kernels in ``cuda_ext/csrc``, for CPU-only CI; ``build.py`` says what it covers."""

from cuda_ext.emulation import build as _build
from cuda_ext.emulation.build import *  # noqa: F403 - the public names are build.__all__

__all__ = _build.__all__

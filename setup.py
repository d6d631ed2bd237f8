"""Packaging for zensync: metadata lives here; tool configs live in pyproject.toml.

Install (CPU machine; pin torch first so pip takes the local CPU wheel, not a multi-GB CUDA build):

    pip install "torch==2.13.0" -e ".[test]"

Optional CUDA extension (cuda_ext/, the module ``zensync_cuda_ext``), controlled by USE_CUDA:

- ``auto`` (default): built when nvcc is found (CUDA_HOME or PATH) and the torch visible to the build is a
  CUDA build; otherwise skipped with a note, and the install is the plain Python package. pip builds in
  an isolated environment without torch, so a plain ``pip install -e .`` never builds it: use
  ``USE_CUDA=1 pip install --no-build-isolation -e .`` on a GPU machine with a CUDA torch;
- ``1``: build it, and fail when nvcc or a CUDA torch is missing;
- ``0``: never build it.

Without the prebuilt module, zensync.kernels.cuda JIT-compiles cuda_ext/csrc on first use where it can,
else warns once and CUDA tensors use the torch reference kernels. A CPU-only install never needs nvcc.
"""

import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup

_HERE = Path(__file__).resolve().parent
_USE_CUDA_CHOICES = ("auto", "0", "1")


def _cuda_build_blocker() -> str:
    """Why the CUDA extension cannot be built here ('' when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not importable by the build (pip's build isolation: pass --no-build-isolation)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    return ""


def _cuda_extension() -> dict:
    """setup() keywords that build cuda_ext as the module zensync_cuda_ext, or {} (see the docstring)."""
    choice = os.environ.get("USE_CUDA", "auto")
    if choice not in _USE_CUDA_CHOICES:
        raise ValueError(f"USE_CUDA={choice!r} must be one of {_USE_CUDA_CHOICES}")
    if choice == "0":
        return {}
    blocker = _cuda_build_blocker()
    if blocker:
        if choice == "1":
            raise RuntimeError(f"USE_CUDA=1 but the CUDA extension cannot be built: {blocker}")
        print(f"zensync: not building the CUDA extension (USE_CUDA=auto): {blocker}")
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    csrc = Path("cuda_ext") / "csrc"  # setuptools wants paths relative to setup.py
    sources = [str(csrc / "ops.cpp"), *sorted(str(path) for path in (csrc / "cuda").glob("*.cu"))]
    extension = CUDAExtension(
        name="zensync_cuda_ext",
        sources=sources,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


_MPI_REQUIRES = ["mpi4py>=4", "mpich"]  # mpich: the MPI library and mpiexec, as a wheel
_TEST_REQUIRES = ["pytest", "hypothesis", "pytest-timeout", "ninja", *_MPI_REQUIRES]  # ninja: the emulated CUDA build

setup(
    name="zensync",
    version="0.1.0",
    description=(
        "Gradient synchronization engine for PyTorch distributed training: lossless sparse allreduce "
        "(Zen balanced parallelism), DDP comm hooks and compression planning"
    ),
    long_description=(_HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    packages=find_packages(include=["zensync", "zensync.*"]),
    install_requires=[
        "torch>=2.1",
        "numba>=0.59",
        "numpy>=1.24",
        "tqdm>=4.62",  # progress bars of `zensync demo` and `zensync profile`
    ],
    extras_require={
        "test": _TEST_REQUIRES,
        "bench": ["matplotlib"],
        "mpi": _MPI_REQUIRES,
        "dev": [*_TEST_REQUIRES, "ruff", "mypy", "import-linter", "pre-commit"],
    },
    entry_points={
        "console_scripts": [
            "zensync = zensync.cli:main",
        ],
    },
    **_cuda_extension(),
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)

"""Packaging for zensync: metadata lives here; tool configs live in pyproject.toml.

Install (CPU machine; pin torch first so pip takes the local CPU wheel, not a multi-GB CUDA build):

    pip install "torch==2.13.0" -e ".[test]"

The optional CUDA extension under cuda_ext/ is not built yet. When it lands it is built here only when
USE_CUDA=auto finds nvcc and a CUDA torch; a CPU-only install never needs nvcc.
"""

from pathlib import Path

from setuptools import find_packages, setup

_HERE = Path(__file__).resolve().parent

_TEST_REQUIRES = ["pytest", "hypothesis", "pytest-timeout"]

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
    ],
    extras_require={
        "test": _TEST_REQUIRES,
        "bench": ["matplotlib"],
        "mpi": ["mpi4py"],
        "dev": [*_TEST_REQUIRES, "ruff", "mypy", "import-linter", "pre-commit"],
    },
    entry_points={
        "console_scripts": [
            "zensync = zensync.cli:main",
        ],
    },
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

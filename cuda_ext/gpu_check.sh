#!/usr/bin/env bash
# One script for a lent GPU machine: build the CUDA extension, run the GPU tests, run the GPU benchmark.
#
#   bash cuda_ext/gpu_check.sh          # from anywhere; works in the repository root; about 5 min on an H200
#
# Needs a CUDA build of torch, nvcc and the [test] extras already installed (no network is used).
# Step 1 builds zensync_cuda_ext in place with setup.py (USE_CUDA=1, --no-build-isolation so the build
# sees the installed torch). If that fails, its error is shown and Step 2 goes on: zensync.kernels.cuda
# then JIT-builds the same sources on first use (torch.utils.cpp_extension.load, which needs ninja).
# Exits non-zero when the extension cannot be loaded at all, a test fails or the benchmark fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SECONDS=0
step() { echo "== [${SECONDS} s] $*"; }

step "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "(nvidia-smi not found)"
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.is_available())"
command -v nvcc >/dev/null && nvcc --version | tail -n 1 || echo "(nvcc not on PATH)"

step "1/3 build the extension (setup.py, USE_CUDA=1)"
if USE_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" python -m pip install --no-build-isolation --no-deps -e .; then
    step "setup.py build done"
else
    step "setup.py build FAILED (output above); the first use will try a JIT build"
fi
python -c "
import zensync.kernels.cuda as c
assert c.available(), c.unavailable_reason()
print('zensync_cuda_ext loaded from', c._LOADER.module.__file__)
"

step "2/3 GPU tests (tests/gpu, slow ones included) and the loader tests"
python -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_cuda_loader.py

step "3/3 benchmark (benchmarks/kernels_gpu.py)"
python benchmarks/kernels_gpu.py

step "done"

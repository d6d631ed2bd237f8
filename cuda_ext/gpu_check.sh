#!/usr/bin/env bash
# One script for a lent GPU machine: build the CUDA extension, run the GPU tests, run the GPU benchmark.
#
#   bash cuda_ext/gpu_check.sh          # from anywhere; works in the repository root; about 5 min on an H200
#   SKIP_SANITIZER=1 bash cuda_ext/gpu_check.sh   # without Step 4
#   SANITIZER_TIMEOUT_S=120 bash cuda_ext/gpu_check.sh   # each sanitizer run's limit (default 300 s)
#
# Needs a CUDA build of torch, nvcc and the [test] extras already installed (no network is used); the
# MPI test of tests/gpu (MPITransport on CUDA tensors) also needs mpiexec, and skips without it.
# Step 1 builds zensync_cuda_ext in place with setup.py (USE_CUDA=1, --no-build-isolation so the build
# sees the installed torch). If that fails, its error is shown and Step 2 goes on: zensync.kernels.cuda
# then JIT-builds the same sources on first use (torch.utils.cpp_extension.load, which needs ninja).
# Step 4 reruns the GPU tests (5 Hypothesis examples each) under compute-sanitizer's memcheck (global
# memory out of bounds) and racecheck (shared-memory hazards), when compute-sanitizer is on PATH.
# Step 3 also times the DDP hook on the GPU (benchmarks/hook_fixed_cost.py --device cuda, one NCCL rank:
# the hook's own work against DDP's and torch's hooks), written to experiments/results/hook_fixed_cost_cuda.json.
# Every step runs even when one before it failed (a lease is short: one call should show every failure);
# the script exits non-zero when the extension cannot be loaded at all, a test fails, a benchmark fails
# or a sanitizer reports an error, and its last line names the failed steps.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SECONDS=0
step() { echo "== [${SECONDS} s] $*"; }
FAILED=()
check() { "$@" || { echo "== FAILED (exit $?): $*"; FAILED+=("$*"); }; }

step "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "(nvidia-smi not found)"
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.is_available())"
command -v nvcc >/dev/null && nvcc --version | tail -n 1 || echo "(nvcc not on PATH)"

step "1/4 build the extension (setup.py, USE_CUDA=1)"
if USE_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" python -m pip install --no-build-isolation --no-deps -e .; then
    step "setup.py build done"
else
    step "setup.py build FAILED (output above); the first use will try a JIT build"
fi
python -c "
import zensync.kernels.cuda as c
assert c.available(), c.unavailable_reason()
print('zensync_cuda_ext loaded from', c._LOADER.module.__file__)
" || { echo "== the extension cannot be loaded: stopping"; exit 1; }

step "2/4 GPU tests (tests/gpu, slow ones included) and the loader tests"
# -m names `slow`, so tests/conftest.py keeps the slow tier's GPU test (test_sizes_beyond_int32) in.
check python -m pytest -q -p no:cacheprovider -rs -m "slow or not slow" tests/gpu tests/unit/kernels/test_cuda_loader.py

step "3/4 benchmarks (benchmarks/kernels_gpu.py; the hook's cost per step on one GPU)"
check python benchmarks/kernels_gpu.py
check python benchmarks/hook_fixed_cost.py --device cuda --ranks 1 --rounds "${HOOK_ROUNDS:-60}" \
    --out experiments/results/hook_fixed_cost_cuda.json ddp torch:fp16 fp16 torch:powersgd powersgd:4 dense

step "4/4 compute-sanitizer over the GPU tests"
if [[ -n "${SKIP_SANITIZER:-}" ]]; then
    echo "(skipped: SKIP_SANITIZER is set)"
elif ! command -v compute-sanitizer >/dev/null; then
    echo "(skipped: compute-sanitizer is not on PATH)"
else
    for tool in memcheck racecheck; do
        step "compute-sanitizer --tool $tool"
        # No caching allocator: memcheck then sees each tensor's own bounds.
        check env PYTORCH_NO_CUDA_MEMORY_CACHING=1 ZENSYNC_GPU_TEST_EXAMPLES=5 timeout "${SANITIZER_TIMEOUT_S:-300}" \
            compute-sanitizer --tool "$tool" --error-exitcode 66 --target-processes all \
            python -m pytest -q -p no:cacheprovider tests/gpu -k "not beyond_int32 and not mpi and not hook"
    done
fi

if (( ${#FAILED[@]} )); then
    step "done: ${#FAILED[@]} step(s) failed: ${FAILED[*]}"
    exit 1
fi
step "done: every step passed"

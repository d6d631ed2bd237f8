"""The GPU tests of ``tests/gpu/test_cuda_kernels.py``, rerun on CPU threads by the CUDA emulation.

CPU-only CI has no GPU, so ``tests/gpu`` skips there. This module imports those tests unchanged and
gives them another ``device`` fixture: CPU tensors, served by the CUDA sources of ``cuda_ext/csrc``
compiled as C++ by ``cuda_ext.emulation.build_ops`` (one OS thread per CUDA thread, several blocks at
once, real block barriers, warp shuffles and atomics, per-block poisoned shared memory) and reached
through the production wrappers of ``zensync.kernels.cuda``, argument checks and fall-backs included.
Each test runs once per variant of ``EMULATED_VARIANTS``:

- ``small``: 64-thread blocks, 128-element tiles and at most 3 grid-stride blocks (all at once), so the
  Hypothesis inputs span many tiles, multi-row tiles and several grid-stride iterations per thread;
- ``prod``: the production constants (256 threads, so 8 warp totals in the block-wide scan, and
  2048-element tiles), 2 blocks at once.

Adversarial collisions (``parallel_slots=1``, tiny ``serial_slots`` forcing the overflow re-run), empty
and all-non-zero inputs, NaN/Inf/-0.0, every dtype and the k edge cases are therefore covered as on the
GPU, with the same Hypothesis settings. ``test_cuda_sanitizers.py`` reruns them under ThreadSanitizer
(the ``tsan`` variant: data races, whatever their timing) and AddressSanitizer + UBSan (``asan``: accesses
outside a tensor, undefined integer arithmetic). What the emulation cannot show (the GPU's reorderings,
timing) is listed in ``cuda_ext/emulation/build.py``;
``test_sizes_beyond_int32`` is not rerun (see ``_NOT_EMULATED``).

Every test here is skipped, with the reason, on a machine without a C++ compiler, ninja or the Python
headers; a compile error fails them. The first build takes about 25 s per variant on 2 cores, later
sessions reuse it (``cuda_ext.emulation.build_directory``). A slow tier: plain ``python -m pytest``
deselects it (``tests/conftest.py``); run it with ``python -m pytest -m emulated tests/emulated``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cuda_ext import emulation
from tests.gpu import test_cuda_kernels as gpu_tests
from zensync.kernels import cuda

EMULATED_VARIANTS = tuple(os.environ.get("ZENSYNC_EMULATED_VARIANTS", "small,prod").split(","))
"""The variants the tests run on: "small" and "prod" (each about 25 s of build, then 25-45 s of tests on 2
cores), or those ZENSYNC_EMULATED_VARIANTS names ("tsan" and "asan" only in the subprocesses of
tests/emulated/test_cuda_sanitizers.py, which preload the sanitizer's runtime)."""

_BUILD_TIMEOUT_S = 1200
"""Per-test timeout here (pyproject's 300 s elsewhere): the first test of a variant builds it, and a cold
build of the ``asan`` variant took 320 s on 2 idle cores (``tsan`` and the plain ones less); a hung test
still fails, later."""
pytestmark = pytest.mark.timeout(_BUILD_TIMEOUT_S)

_NOT_EMULATED = {
    "test_sizes_beyond_int32": "2^31 + 100 elements: 12 GB of memory, and far too slow on CPU threads",
}
"""GPU tests that are not rerun here, with the reason."""

# Step 1: rerun the GPU module's tests here. pytest collects the test functions of this module's
# namespace, imported ones included, and resolves their `device` fixture here (below), not there.
globals().update(
    {name: test for name, test in vars(gpu_tests).items() if name.startswith("test_") and name not in _NOT_EMULATED}
)


# Step 2: the emulated device, built once per variant and session.
@pytest.fixture(scope="module", params=EMULATED_VARIANTS)
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """CPU tensors, whose zensync.kernels.cuda calls run the emulated CUDA kernels of variant ``request.param``."""
    reason = emulation.unavailable_reason()
    if reason:
        pytest.skip(f"the CUDA emulation cannot be built here: {reason}")
    ops = emulation.build_ops(request.param)
    # zensync.kernels.cuda sends only CUDA tensors to torch.ops.zensync_cuda; for these tests, its
    # one routing function sends every tensor to the emulated ops instead.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda, "_ops", lambda *tensors: ops)
        yield torch.device("cpu")


# ---------------------------------------------------------------- the harness itself


def test_every_gpu_test_is_rerun_or_excused() -> None:
    gpu_names = {name for name in vars(gpu_tests) if name.startswith("test_")}
    assert set(_NOT_EMULATED) <= gpu_names, "an excused test no longer exists: update _NOT_EMULATED"
    assert gpu_names - set(_NOT_EMULATED) <= set(globals())


def test_launch_rewrite() -> None:
    """Template arguments, nested parentheses, an empty argument list; launches in comments stay."""
    source = "k<T, int><<<grid(n), 64, 0, s>>>(f(a, b), c);\n// e.g. k<<<1, 32>>>()\nz<<<1, 32, 0, s>>>();"
    expected = (
        "::emu::launch(grid(n), 64, 0, s, [](auto... a) { k<T, int>(a...); }, f(a, b), c);\n"
        "// e.g. k<<<1, 32>>>()\n"
        "::emu::launch(1, 32, 0, s, [](auto... a) { z(a...); });"
    )
    assert emulation.rewrite_launches(source) == expected


def test_shared_rewrite() -> None:
    """Each __shared__ array gets its own id, counting on from first_id; other text is left alone."""
    source = "__shared__ long long totals[kWarps];\n  __shared__ unsigned int local[1 << 8];\nint shared_x[4];"
    text, next_id = emulation.rewrite_shared(source, first_id=3)
    assert text == (
        "auto& totals = ::emu::shared<long long[kWarps], 3>();\n"
        "  auto& local = ::emu::shared<unsigned int[1 << 8], 4>();\n"
        "int shared_x[4];"
    )
    assert next_id == 5


@pytest.mark.parametrize("variant", sorted(emulation.VARIANTS))
def test_sources_fit_the_rewrites(variant: str) -> None:
    """Every launch is rewritten and every variant constant is found (no compiler needed)."""
    assert emulation.build_directory(variant).name.startswith(f"{variant}-")


def test_runtime_selftest(tmp_path: Path) -> None:
    """The runtime's claims: shuffles, barriers and atomics work; divergence and bad launches are reported."""
    reason = emulation.unavailable_reason()
    if reason:
        pytest.skip(f"the CUDA emulation cannot be built here: {reason}")
    result = emulation.run_selftest(tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr

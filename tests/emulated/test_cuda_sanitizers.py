"""The CUDA kernels of ``cuda_ext/csrc`` under compiler sanitizers, on the CPU emulation: no race, no bad access.

The emulation (``cuda_ext/emulation``) runs every CUDA thread as an OS thread, blocks of a launch
concurrently, with CUDA's ordering rules: only ``__syncthreads`` orders the threads of a block, only the
end of a launch orders blocks, and atomics are relaxed (they order nothing but themselves). Its device
pointers are the tensors' own host allocations. Built with a sanitizer, the GPU test-suite therefore
checks what a GPU run with ``compute-sanitizer`` would:

- ``thread`` (variant ``tsan``, ThreadSanitizer): every pair of accesses, one a plain write, that those
  rules leave unordered is a report, whatever the timing (it checks happens-before; it does not wait
  for a race to go wrong), so nanosecond races such as a write-then-re-read slot claim are found;
- ``address`` (variant ``asan``, AddressSanitizer + UndefinedBehaviorSanitizer): any access outside a
  tensor's allocation (a tile bound off by one, a read past the end), and undefined integer
  arithmetic such as a signed index computation that overflows.

Each sanitizer is first checked on ``selftest.cu``: its deliberate faults must each be reported, in the
faulty kernel, and the runtime's own checks must not be. Then the GPU test-suite (``tests/gpu`` via
``test_cuda_emulated.py``) runs on the sanitized variant in a subprocess that preloads the sanitizer's
runtime, and must pass with no report.

Measured on this tree (by hand, with the source edited and restored): replacing hashing.cu's
``atomicCAS`` claim with the paper's write-then-re-read, or deleting ``block_exclusive_sum``'s last
``__syncthreads``, makes the ``thread`` run report races in ``hash_insert_kernel`` /
``block_exclusive_sum``; the plain emulation passed the first of them.

Skipped, with the reason, without a C++ compiler, ninja, Python headers or the sanitizer's runtime.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_ext import emulation

_REPO = Path(__file__).resolve().parents[2]
_VARIANT = {"thread": "tsan", "address": "asan"}
"""Sanitizer -> the emulation variant built with it."""
_EXAMPLES = 20
"""Hypothesis examples per property in the sanitized runs (50 elsewhere): each is several times slower."""
_TIMEOUT_S = 1800
"""The whole sanitized run, a cold build of its variant included (asan: 320 s on 2 idle cores)."""
_REPORT = re.compile(r"^SUMMARY: \w+Sanitizer|runtime error:", re.MULTILINE)
"""A report line: the summary of ThreadSanitizer / AddressSanitizer, or UndefinedBehaviorSanitizer's error."""

SANITIZERS = sorted(_VARIANT)


def _require(sanitizer: str) -> None:
    reason = emulation.unavailable_reason()
    if reason:
        pytest.skip(f"the CUDA emulation cannot be built here: {reason}")
    if emulation.sanitizer_runtime(sanitizer) is None:
        pytest.skip(f"the C++ compiler has no {emulation.SANITIZERS[sanitizer].runtime}")


def _reports(text: str) -> list[str]:
    return [line for line in text.splitlines() if _REPORT.search(line)]


def test_every_sanitizer_has_a_variant() -> None:
    assert set(_VARIANT) == set(emulation.SANITIZERS)
    assert all(emulation.VARIANTS[variant].sanitizer == name for name, variant in _VARIANT.items())


@pytest.fixture(scope="module")
def selftest_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sanitized_selftest")


@pytest.mark.parametrize("sanitizer", SANITIZERS)
def test_selftest_is_clean_under_the_sanitizer(selftest_dir: Path, sanitizer: str) -> None:
    _require(sanitizer)
    result = emulation.run_selftest(selftest_dir, sanitizer=sanitizer)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
    assert not _reports(result.stderr) and "Sanitizer" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("sanitizer", "fault"), [(name, fault) for name in SANITIZERS for fault in emulation.SANITIZERS[name].faults]
)
def test_selftest_faults_are_reported(selftest_dir: Path, sanitizer: str, fault: str) -> None:
    _require(sanitizer)
    result = emulation.run_selftest(selftest_dir, sanitizer=sanitizer, fault=fault)
    reports = _reports(result.stderr)
    assert result.returncode == 66 and reports, f"the {sanitizer} sanitizer did not report {fault}:\n{result.stderr}"
    # In the faulty kernel: its name is in the report's stack (or, for races, in every summary line).
    assert f"fault_{fault}_kernel" in result.stderr, result.stderr
    if sanitizer == "thread":
        assert all(f"fault_{fault}_kernel" in line for line in reports), "\n".join(reports)


@pytest.mark.timeout(_TIMEOUT_S + 60)
@pytest.mark.parametrize("sanitizer", SANITIZERS)
def test_gpu_tests_are_clean_under_the_sanitizer(tmp_path: Path, sanitizer: str) -> None:
    _require(sanitizer)
    env = {
        **os.environ,
        **emulation.sanitizer_environment(sanitizer, log_prefix=tmp_path / "report"),
        "ZENSYNC_EMULATED_VARIANTS": _VARIANT[sanitizer],
        "ZENSYNC_GPU_TEST_EXAMPLES": str(_EXAMPLES),
        # torch's and numba's worker pools are not instrumented: their hand-offs look like races.
        "OMP_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }
    # -m emulated: without it tests/conftest.py deselects the slow tier.
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "emulated",
        "tests/emulated/test_cuda_emulated.py", "-k", "not test_runtime_selftest",
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=_REPO, env=env, check=False, capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    logs = [log.read_text(errors="replace") for log in sorted(tmp_path.glob("report*"))]
    reports = [line for log in logs for line in _reports(log)]
    # The pytest output's end, and the start of each sanitizer log (a runtime failure, not a report,
    # also lands there: e.g. AddressSanitizer's CHECK failures).
    tail = "\n".join([*(result.stdout + result.stderr).splitlines()[-30:], *(log[:3000] for log in logs)])
    assert not reports, f"{sanitizer} sanitizer reports in the CUDA kernels:\n" + "\n".join(sorted(set(reports)))
    assert result.returncode == 0, f"the sanitized run failed (exit {result.returncode}):\n{tail}"
    summary = result.stdout.splitlines()[-1] if result.stdout else ""
    assert " passed" in summary and "skipped" not in summary and "deselected" in summary, tail

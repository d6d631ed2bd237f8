"""ThreadSanitizer over the CUDA emulation: the kernels of ``cuda_ext/csrc`` have no data race under CUDA's rules.

The emulation (``cuda_ext/emulation``) runs every CUDA thread as an OS thread, blocks of a launch
concurrently, with CUDA's ordering rules: only ``__syncthreads`` orders the threads of a block, only the
end of a launch orders blocks, and atomics are relaxed (they order nothing but themselves). Built with
``-fsanitize=thread`` (variant ``tsan``), every plain access that these rules leave unordered against a
write is a report, whatever the timing: ThreadSanitizer checks happens-before, it does not wait for a
race to go wrong. That is what the emulation alone cannot show (a write-then-re-read slot claim, a
missing barrier whose window is nanoseconds).

- ``selftest.cu``'s deliberate races (a missing barrier, two blocks writing one word, data passed
  through a relaxed atomic, Zen's write-then-re-read claim) must each be reported, and its plain
  checks must not be: the sanitizer sees these races through the runtime, and the runtime itself is
  race-free.
- The GPU test-suite (``tests/gpu``, via ``test_cuda_emulated.py``) runs on the ``tsan`` variant in a
  subprocess that preloads the sanitizer's runtime; it must pass with no report.

Measured on this tree: replacing hashing.cu's ``atomicCAS`` claim with the paper's write-then-re-read,
or deleting ``block_exclusive_sum``'s last ``__syncthreads``, makes the subprocess report races in
``hash_insert_kernel`` / ``block_exclusive_sum`` (the plain emulation passed the first of them).

Skipped, with the reason, without a C++ compiler, ninja, Python headers or the compiler's TSan runtime.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_ext import emulation

pytestmark = pytest.mark.emulated

_REPO = Path(__file__).resolve().parents[2]
_EXAMPLES = 20
"""Hypothesis examples per property in the sanitized run (50 elsewhere): each is about 10x slower here."""
_TIMEOUT_S = 1200


def _tsan_runtime() -> Path:
    reason = emulation.unavailable_reason()
    if reason:
        pytest.skip(f"the CUDA emulation cannot be built here: {reason}")
    runtime = emulation.tsan_runtime()
    if runtime is None:
        pytest.skip("the C++ compiler has no ThreadSanitizer runtime (libtsan.so)")
    return runtime


def _reports(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("SUMMARY: ThreadSanitizer")]


@pytest.fixture(scope="module")
def selftest_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _tsan_runtime()
    return tmp_path_factory.mktemp("tsan_selftest")


def test_selftest_is_race_free_under_thread_sanitizer(selftest_dir: Path) -> None:
    result = emulation.run_selftest(selftest_dir, sanitize_threads=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
    assert "ThreadSanitizer" not in result.stderr, result.stderr


@pytest.mark.parametrize("race", emulation.SELFTEST_RACES)
def test_selftest_races_are_reported(selftest_dir: Path, race: str) -> None:
    result = emulation.run_selftest(selftest_dir, sanitize_threads=True, race=race)
    assert result.stdout.strip() == f"ran {race}", result.stdout + result.stderr
    reports = _reports(result.stderr)
    assert result.returncode == 66 and reports, f"ThreadSanitizer did not report the {race} race:\n{result.stderr}"
    assert all(f"race_{race}_kernel" in line for line in reports), "\n".join(reports)


def test_gpu_tests_are_race_free_under_thread_sanitizer(tmp_path: Path) -> None:
    runtime = _tsan_runtime()
    env = {
        **os.environ,
        "LD_PRELOAD": str(runtime),
        # halt_on_error=0: all reports of the run; log_path: one file per process, read below.
        "TSAN_OPTIONS": f"halt_on_error=0 exitcode=66 log_path={tmp_path / 'tsan'}",
        "ZENSYNC_EMULATED_VARIANTS": "tsan",
        "ZENSYNC_GPU_TEST_EXAMPLES": str(_EXAMPLES),
        # torch's and numba's worker pools are not instrumented: their hand-offs look like races.
        "OMP_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
        "tests/emulated/test_cuda_emulated.py", "-k", "not test_runtime_selftest",
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=_REPO, env=env, check=False, capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    logs = sorted(tmp_path.glob("tsan*"))
    reports = [line for log in logs for line in _reports(log.read_text(errors="replace"))]
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
    assert not reports, "data races in the CUDA kernels:\n" + "\n".join(sorted(set(reports))) + f"\n{tail}"
    assert result.returncode == 0, f"the sanitized run failed (exit {result.returncode}):\n{tail}"
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], tail

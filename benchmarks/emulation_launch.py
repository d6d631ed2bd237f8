"""Micro-benchmark: the cost of one kernel launch in the CUDA emulation (cuda_ext/emulation), per runtime.

Launch (from the repository root)::

    python benchmarks/emulation_launch.py                         # the current runtime, plain and sanitized
    python benchmarks/emulation_launch.py --against de08bbf       # and the runtime of that commit, side by side

A launch of an almost empty kernel on 3 blocks x 64 threads (the ``small`` and sanitized variants'
shape, 3 blocks at once) is timed in a loop, for each build: plain ``-O1``, ThreadSanitizer and
AddressSanitizer + UBSan. With ``--against REV`` the same program is also built with the
``shim/`` directory of that git revision (e.g. the one before the thread pool), and the builds run
round-robin (one batch of each per round, medians over rounds) so machine noise hits them alike.
Writes ``experiments/results/emulation_launch_<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

from cuda_ext import emulation  # noqa: E402

_PROGRAM = r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>
__global__ void almost_empty_kernel(int* counter) {
  if (threadIdx.x == 0 && blockIdx.x == 0) ++counter[0];
}
int main(int argc, char** argv) {
  const int launches = std::atoi(argv[1]);
  int counter = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < launches; ++i) almost_empty_kernel<<<3, 64, 0, nullptr>>>(&counter);
  const auto stop = std::chrono::steady_clock::now();
  if (counter != launches) return 1;
  std::printf("%.6f\n", std::chrono::duration<double, std::milli>(stop - start).count() / launches);
  return 0;
}
"""

_SANITIZERS = {"plain": "", "ThreadSanitizer": "thread", "AddressSanitizer + UBSan": "address"}


def _shim_of(revision: str, into: pathlib.Path) -> pathlib.Path:
    """The ``cuda_ext/emulation/shim`` directory of a git revision, extracted under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(_ROOT), "archive", revision, "cuda_ext/emulation/shim"], check=True, capture_output=True
    ).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "cuda_ext" / "emulation" / "shim"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="", help="also time the shim/ of this git revision")
    parser.add_argument("--launches", type=int, default=50, help="launches per batch")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=pathlib.Path, default=_ROOT / "experiments" / "results")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        runtimes: dict[str, pathlib.Path | None] = {"current": None}
        if args.against:
            runtimes[args.against] = _shim_of(args.against, work / "old")
        binaries = {
            (runtime, name): emulation.compile_program(
                _PROGRAM, work / f"{runtime}-{sanitizer or 'plain'}", sanitizer=sanitizer, shim=shim
            )
            for runtime, shim in runtimes.items()
            for name, sanitizer in _SANITIZERS.items()
        }
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in binaries}
        for _ in range(args.rounds):
            for key, binary in binaries.items():
                done = subprocess.run([str(binary), str(args.launches)], check=True, capture_output=True, text=True)
                samples[key].append(float(done.stdout))

    lines = [
        f"# CUDA emulation: cost of one launch ({datetime.date.today()})",
        "",
        f"`python benchmarks/emulation_launch.py{' --against ' + args.against if args.against else ''}`: "
        f"<<<3, 64>>> launches of an almost empty kernel, {args.launches} per batch, median of "
        f"{args.rounds} round-robin rounds; {platform.processor() or platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} cores.",
        "",
        "| runtime | " + " | ".join(f"{name} ms/launch" for name in _SANITIZERS) + " |",
        "|---|" + "---|" * len(_SANITIZERS),
    ]
    for runtime in runtimes:
        cells = [f"{statistics.median(samples[(runtime, name)]):.2f}" for name in _SANITIZERS]
        lines.append(f"| {runtime} | " + " | ".join(cells) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"emulation_launch_{datetime.date.today()}.md").write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

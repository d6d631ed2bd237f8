"""Timing: numba CPU top-k selection (``cpu_select``) vs ``torch.topk(x, k, sorted=False)``, side by side.

Launch (from the repository root)::

    python benchmarks/select_cpu_timing.py                    # the issue's cases, 9 rounds
    python benchmarks/select_cpu_timing.py --rounds 15 --draws 6

Input: ``torch.randn(numel).abs()`` in the case's dtype, k = 1 % of numel. For ``sampled_topk`` the
threshold is what DGC computes, the top-1 % value of a 1 % random sample (the sampling is not
timed); ``--draws`` samples give that many thresholds (about half of them pass fewer than k entries
and need one relaxation), each timed as its own variant. Variants run round-robin (one call of each
per round after a warm-up round, medians over rounds) in one process, so machine noise hits them
alike; "serial" is the numba op called from a worker thread (its single-threaded build). Every
result is first checked equal to ``reference``.

Targets (issue, 2 cores, 25M float32): exact topk >= 1.5x and sampled_topk >= 5x torch.topk.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import numba
import torch
from kernels_cpu import _in_thread, _round_robin  # the sibling script (run from benchmarks/ on sys.path)

from zensync.kernels import cpu_select, reference

_SEED = 0
_CASES = (
    (25_000_000, torch.float32),
    (25_000_000, torch.float16),
    (25_000_000, torch.bfloat16),
    (25_000_000, torch.float64),
    (10_000_000, torch.float32),
)


def _dgc_thresholds(x: torch.Tensor, k: int, draws: int, generator: torch.Generator) -> list[tuple[float, int]]:
    """(threshold, tries needed) per draw: the top-1 % value of a 1 % sample, as DGC computes it."""
    out = []
    for _ in range(draws):
        sample = x[torch.randint(0, x.numel(), (x.numel() // 100,), generator=generator)]
        threshold = float(torch.topk(sample, max(1, sample.numel() // 100)).values.min())
        tries, t = 1, threshold
        while int(((x >= t) | x.isnan()).sum()) < k and tries < 10:
            tries, t = tries + 1, t * 0.8
        out.append((threshold, tries))
    return out


def _run_case(numel: int, dtype: torch.dtype, rounds: int, draws: int) -> None:
    generator = torch.Generator().manual_seed(_SEED)
    x = torch.randn(numel, generator=generator).abs().to(dtype)
    k = numel // 100
    thresholds = _dgc_thresholds(x, k, draws, generator)
    expected = reference.topk(x, k)
    assert torch.equal(cpu_select.topk(x, k), expected)
    for threshold, _ in thresholds:
        assert torch.equal(cpu_select.sampled_topk(x, k, threshold), expected)
    variants: dict[str, Callable[[], object]] = {
        "torch.topk": lambda: torch.topk(x, k, sorted=False),
        "topk": lambda: cpu_select.topk(x, k),
        "topk serial": _in_thread(lambda: cpu_select.topk(x, k)),
    }
    for i, (threshold, _) in enumerate(thresholds):
        variants[f"sampled {i}"] = lambda t=threshold: cpu_select.sampled_topk(x, k, t)
    t = _round_robin(variants, rounds)
    base = t["torch.topk"]
    sampled = [t[f"sampled {i}"] for i in range(draws)]
    print(f"{numel:,} {str(dtype).removeprefix('torch.')}, k = {k:,}")
    print(f"  torch.topk(sorted=False) {base * 1e3:8.2f} ms")
    print(f"  cpu_select.topk          {t['topk'] * 1e3:8.2f} ms  {base / t['topk']:6.1f}x")
    print(f"  cpu_select.topk serial   {t['topk serial'] * 1e3:8.2f} ms  {base / t['topk serial']:6.1f}x")
    for i, (threshold, tries) in enumerate(thresholds):
        print(
            f"  sampled_topk draw {i} ({tries} {'try' if tries == 1 else 'tries'}, threshold {threshold:.5g}) "
            f"{sampled[i] * 1e3:8.2f} ms  {base / sampled[i]:6.1f}x"
        )
    print(f"  sampled_topk median over draws {statistics.median(sampled) * 1e3:8.2f} ms  "
          f"{base / statistics.median(sampled):6.1f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--draws", type=int, default=4, help="DGC threshold samples timed for sampled_topk")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), numba {numba.__version__} "
        f"({numba.get_num_threads()} threads, layer {numba.config.THREADING_LAYER}), {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; medians of {args.rounds} round-robin rounds"
    )
    for numel, dtype in _CASES:
        _run_case(numel, dtype, args.rounds, args.draws)


if __name__ == "__main__":
    main()

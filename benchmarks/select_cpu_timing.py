"""Timing: numba CPU top-k selection (``cpu_select``) vs ``torch.topk(x, k, sorted=False)``, side by side.

Launch (from the repository root)::

    python benchmarks/select_cpu_timing.py                    # the issue's cases, 9 rounds
    python benchmarks/select_cpu_timing.py --rounds 15 --draws 6
    python benchmarks/select_cpu_timing.py --small --rounds 25   # small inputs: where dispatch picks torch

Input: ``torch.randn(numel).abs()`` in the case's dtype, k = 1 % of numel. For ``sampled_topk`` the
threshold is what DGC computes, the top-1 % value of a 1 % random sample (the sampling is not
timed); ``--draws`` samples give that many thresholds (about half of them pass fewer than k entries
and need one relaxation), each timed as its own variant. Variants run round-robin (one call of each
per round after a warm-up round, medians over rounds) in one process, so machine noise hits them
alike; "serial" is the numba op called from a worker thread (its single-threaded build). Every
result is first checked equal to ``reference``.

``--small`` times float32 inputs of 64 to 131072 elements instead: the torch reference
(``reference.topk`` / ``reference.sampled_topk``), the numba op and ``zensync.kernels.topk`` /
``sampled_topk`` (the dispatcher, which runs the reference for exact top-k below
``dispatch._CPU_MIN_NUMEL``).

Targets (issue, 2 cores, 25M float32): exact topk >= 1.5x and sampled_topk >= 5x torch.topk.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from collections.abc import Callable

import torch
from kernels_cpu import (  # the sibling script (run from benchmarks/ on sys.path)
    RESULTS,
    _in_thread,
    _round_robin,
    environment,
)

from zensync.kernels import cpu_select, dispatch, reference

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


_SMALL_SIZES = (64, 1024, 4096, 16384, 32768, 65536, 131072)


def _time_small(x: torch.Tensor, rounds: int) -> dict[str, float]:
    """Microseconds of reference, numba and dispatcher, exact and sampled (threshold: the top-1 % value)."""
    k = max(1, x.numel() // 100)
    threshold = float(torch.topk(x, k).values.min())
    variants: dict[str, Callable[[], object]] = {
        "topk ref": lambda: reference.topk(x, k),
        "topk numba": lambda: cpu_select.topk(x, k),
        "topk dispatch": lambda: dispatch.topk(x, k),
        "sampled ref": lambda: reference.sampled_topk(x, k, threshold),
        "sampled numba": lambda: cpu_select.sampled_topk(x, k, threshold),
        "sampled dispatch": lambda: dispatch.sampled_topk(x, k, threshold),
    }
    return {name: seconds * 1e6 for name, seconds in _round_robin(variants, rounds).items()}


def _run_small(rounds: int, header: str) -> None:
    generator = torch.Generator().manual_seed(_SEED)
    lines = [
        f"# Small top-k selections on CPU: torch reference vs numba vs dispatcher ({datetime.date.today()})",
        "",
        f"Command: `python benchmarks/select_cpu_timing.py --small --rounds {rounds}`. {header}. float32 "
        "`randn().abs()`, k = 1 % (at least 1); sampled_topk at the exact top-1 % value (one try).",
        "",
        "| numel | topk reference us | topk numba us | topk dispatch us | sampled reference us | "
        "sampled numba us | sampled dispatch us |",
        "|---|---|---|---|---|---|---|",
    ]
    for numel in _SMALL_SIZES:
        t = _time_small(torch.randn(numel, generator=generator).abs(), rounds)
        lines.append(
            f"| {numel:,} | {t['topk ref']:.1f} | {t['topk numba']:.1f} | {t['topk dispatch']:.1f} | "
            f"{t['sampled ref']:.1f} | {t['sampled numba']:.1f} | {t['sampled dispatch']:.1f} |"
        )
        print(lines[-1])
    path = RESULTS / f"select_cpu_small_{datetime.date.today()}.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--draws", type=int, default=4, help="DGC threshold samples timed for sampled_topk")
    parser.add_argument("--small", action="store_true", help="small inputs (64 to 131072 elements) instead")
    args = parser.parse_args()
    header = environment(args.rounds)
    print(header)
    if args.small:
        _run_small(args.rounds, header)
        return
    for numel, dtype in _CASES:
        _run_case(numel, dtype, args.rounds, args.draws)


if __name__ == "__main__":
    main()

"""Micro-benchmark: numba CPU kernels vs the torch reference on a Zen-sized push.

Launch: ``python benchmarks/kernels_cpu.py [--numel 10000000] [--density 0.01] [--owners 16] [--stat min]``.
Prints the median (or min) wall time of each op, after a warm-up call that also JIT-compiles, for
the reference, the numba kernels from the main thread (parallel version) and from a worker thread
(serial version), and the speedups. Expected: every numba op at least as fast as the reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable

import numba
import torch

from zensync.kernels import cpu, reference
from zensync.sync.partition import make_partition

_NUM_RUNS = 9
_SEED = 0


_STATS = {"median": statistics.median, "min": min}
"""min is the robust choice on a shared machine: other processes only ever add time."""


def _time_s(fn: Callable[[], object], stat: str) -> float:
    fn()  # warm-up (and JIT compilation or cache load)
    times = []
    for _ in range(_NUM_RUNS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return _STATS[stat](times)


def _time_in_thread_s(fn: Callable[[], object], stat: str) -> float:
    """Time of ``fn`` called from a non-main thread, where cpu kernels take their serial path."""
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(_time_s(fn, stat)))
    worker.start()
    worker.join()
    return result[0]


def _sparse(numel: int, density: float, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(numel, 1, generator=generator)
    x[torch.rand(numel, 1, generator=generator) >= density] = 0
    return x


def _cases(numel: int, density: float, num_owners: int) -> dict[str, tuple[Callable, tuple]]:
    generator = torch.Generator().manual_seed(_SEED)
    part = make_partition(numel, num_owners, seed=_SEED)
    x2d = _sparse(numel, density, generator)
    items = reference.nonzero_items(x2d)
    perm = reference.permute(items, part)
    # Owner 0's push from every rank (num_owners ranks): duplicates where the ranks' supports overlap.
    pushes = [reference.bucket_nonzero(_sparse(numel, density, generator), part) for _ in range(num_owners)]
    owner_positions = torch.cat([positions[: counts[0]] for _, positions, counts in pushes])
    owner_values = torch.randn(owner_positions.numel(), 1, generator=generator)
    words = reference.bitmap_encode(items, numel)
    return {
        "nonzero_items": ("nonzero_items", (x2d,)),
        "bucket_nonzero": ("bucket_nonzero", (x2d, part)),
        "permute": ("permute", (items, part)),
        "unpermute": ("unpermute", (perm, part)),
        f"aggregate (k={owner_positions.numel()})": ("aggregate", (owner_positions, owner_values)),
        "bitmap_encode": ("bitmap_encode", (items, numel)),
        "bitmap_decode": ("bitmap_decode", (words, numel)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--owners", type=int, default=16)
    parser.add_argument("--stat", choices=sorted(_STATS), default="median", help="statistic over the timed runs")
    args = parser.parse_args()
    print(
        f"numel={args.numel} density={args.density} owners={args.owners} float32; torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), numba {numba.__version__} ({numba.get_num_threads()} threads); "
        f"{args.stat} of {_NUM_RUNS} runs; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{'op':<26}{'reference ms':>14}{'numba ms':>10}{'serial ms':>11}{'ref/numba':>11}{'ref/serial':>12}")
    for label, (name, call_args) in _cases(args.numel, args.density, args.owners).items():
        ref_s = _time_s(lambda: getattr(reference, name)(*call_args), args.stat)  # noqa: B023 - called at once
        cpu_s = _time_s(lambda: getattr(cpu, name)(*call_args), args.stat)  # noqa: B023
        serial_s = _time_in_thread_s(lambda: getattr(cpu, name)(*call_args), args.stat)  # noqa: B023
        print(
            f"{label:<26}{ref_s * 1e3:>14.2f}{cpu_s * 1e3:>10.2f}{serial_s * 1e3:>11.2f}"
            f"{ref_s / cpu_s:>10.1f}x{ref_s / serial_s:>11.1f}x"
        )


if __name__ == "__main__":
    main()

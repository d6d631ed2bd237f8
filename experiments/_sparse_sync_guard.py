"""Keeps ``sparse_sync_bench.py`` inside the machine: peak-RSS measurement and run-size extrapolation.

A simulated world holds every rank's tensors in one process, so its memory is n times a real rank's.
Before each run the driver releases freed heap memory (glibc ``malloc_trim``) and resets the kernel's
peak-RSS counter, so peak minus baseline is the run's own footprint; the next, larger n of the same
scheme is extrapolated from it and skipped if it would not fit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools

__all__ = ["Estimate", "Guard", "peak_rss_bytes", "start_measuring"]

PER_RANK_GROWS_WITH_N = frozenset({"agsparse", "sparcml", "omnireduce", "auto"})
"""Schemes whose per-rank working set grows about linearly in n: they receive and merge (n - 1) K
items (agsparse), sums of stage unions (sparcml), or union blocks (omnireduce); auto may pick any."""
PER_RANK_GROWS_WITH_UNION = frozenset({"zen", "sparse_ps"})
"""Schemes whose per-rank working set grows with the union U_n (every rank decodes all of it)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def _read_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int | None:
    """This process's peak resident set since ``start_measuring`` (Linux VmHWM), or None elsewhere."""
    kib = _read_status_kib("VmHWM")
    return None if kib is None else kib * 1024


def start_measuring() -> int:
    """Return freed heap memory to the OS, reset the peak-RSS counter, and return the current RSS."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    kib = _read_status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
    """Extrapolated peak RSS and wall time of a run, and the run it was extrapolated from."""

    peak_bytes: float
    wall_s: float
    from_n: int


@dataclasses.dataclass(slots=True)
class Guard:
    """Extrapolates a scheme's wall time and peak RSS from its previous (smaller) n.

    Per rank: 2 dense tensors (input and output) plus a working set measured at the previous n and
    scaled by the scheme's growth (constant for dense, U_n / U_prev for zen and sparse_ps,
    (n - 1) / (prev - 1) for the others). Time scales as the total working set over all ranks.
    """

    dense_bytes: int
    max_run_s: float
    memory_budget_bytes: float
    last: dict[str, tuple[int, float, int, int]] = dataclasses.field(default_factory=dict)
    """scheme -> (n, wall s, peak bytes over the pre-run RSS, U_n) of its last run."""

    def record(self, scheme: str, n: int, wall_s: float, extra_bytes: int, union: int) -> None:
        self.last[scheme] = (n, wall_s, max(0, extra_bytes), union)

    def estimate(self, scheme: str, n: int, union: int, baseline_bytes: int) -> Estimate | None:
        if scheme not in self.last:
            return None
        prev_n, wall_s, extra_bytes, prev_union = self.last[scheme]
        if scheme in PER_RANK_GROWS_WITH_N:
            growth = (n - 1) / max(prev_n - 1, 1)
        elif scheme in PER_RANK_GROWS_WITH_UNION:
            growth = union / max(prev_union, 1)
        else:
            growth = 1.0
        growth = max(1.0, growth)
        working_set = max(0.0, extra_bytes / prev_n - 2 * self.dense_bytes)
        peak = baseline_bytes + n * (2 * self.dense_bytes + working_set * growth)
        return Estimate(peak_bytes=peak, wall_s=wall_s * n / prev_n * growth, from_n=prev_n)

    def reason_to_skip(self, estimate: Estimate | None) -> str | None:
        if estimate is None:
            return None
        if estimate.wall_s > self.max_run_s:
            return f"time ~{estimate.wall_s:.0f} s > --max-run-s {self.max_run_s:.0f} (from n={estimate.from_n})"
        if estimate.peak_bytes > self.memory_budget_bytes:
            need, budget = estimate.peak_bytes / 2**30, self.memory_budget_bytes / 2**30
            return f"memory ~{need:.1f} GiB > budget {budget:.1f} GiB (from n={estimate.from_n})"
        return None

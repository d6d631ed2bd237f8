"""Local work of a counted point: fitted to full runs' measurements, charged to the counted records.

A counted point (``zensync.simulate.counted``) writes a step's collectives from index sets alone and
runs no kernels, so it has no measured local work. Its ranks' work is that of a full run of the same
scheme, which is mostly memory passes: over the rank's dense tensor (finding its non-zeros, writing
the result) and over the records it sends and receives (bucketing, encoding, aggregating,
decoding). ``calibrate`` measures it on full runs of the same workload made smaller (fewer rows, the
same density, skew and overlap; a few world sizes) and fits, per rank,

    seconds = fixed_s + per_dense_byte_s * D + per_moved_byte_s * (S_r + R_r)

with D the rank's dense tensor bytes, S_r and R_r the payload bytes it sends and receives
(``bytes_moved``), by non-negative least squares (``fit``). ``charge`` puts the fitted work on a
counted point's records: ``fixed_s + per_dense_byte_s * D + per_moved_byte_s * S_r`` before the
rank's first call (finding and packing what it sends), ``per_moved_byte_s * R_r`` after its last (a
``local`` call: unpacking what it received).

The fit's own error on its samples is part of the result (``max_relative_error``); how well it
extrapolates to the counted point's size is what ``experiments/`` checks against full runs.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from zensync.simulate.record import Call, received_bytes, sent_bytes

__all__ = ["CALIBRATION_RANKS", "LocalWorkFit", "bytes_moved", "calibrate", "calibration_rows", "charge", "fit"]

CALIBRATION_RANKS = (2, 4, 8)
"""World sizes of the full runs a fit is made of."""
_CALIBRATION_BYTES = 64 * 1024 * 1024
"""Largest dense tensor per rank in a calibration run (8 ranks: 512 MiB together)."""
_MIN_ROWS = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class LocalWorkFit:
    """Seconds of one rank's local work in one step of ``scheme`` (module docstring)."""

    scheme: str
    fixed_s: float
    per_dense_byte_s: float
    per_moved_byte_s: float
    samples: int
    """Per-rank measurements the fit is made of."""
    max_relative_error: float
    """The largest |fitted - measured| / measured over those samples."""

    def seconds(self, dense_bytes: float, moved_bytes: float) -> float:
        return self.fixed_s + self.per_dense_byte_s * dense_bytes + self.per_moved_byte_s * moved_bytes


def bytes_moved(calls: Sequence[Sequence[Call]]) -> list[tuple[int, int]]:
    """Per rank (indexed by global rank), the payload bytes it sends and receives in ``calls``.

    The k-th call a rank makes on a group is matched with its members' k-th (SPMD order, as the
    timeline matches them). Sent: ``record.sent_bytes``; received: ``record.received_bytes`` (a
    send_recv's message counts for its sender only).
    """
    moved = [[0, 0] for _ in calls]
    by_group: dict[tuple[tuple[int, ...], int], dict[int, Call]] = collections.defaultdict(dict)
    for rank, per_rank in enumerate(calls):
        seen: dict[tuple[int, ...], int] = collections.Counter()
        for call in per_rank:
            moved[rank][0] += sent_bytes(call, rank)
            if call.op in ("local", "send_recv"):
                continue
            by_group[(call.group, seen[call.group])][rank] = call
            seen[call.group] += 1
    for (group, _), members in by_group.items():
        ordered = [members[rank] for rank in group]
        for index, rank in enumerate(group):
            moved[rank][1] += received_bytes(ordered, index)
    return [(sent, received) for sent, received in moved]


def fit(scheme: str, samples: Sequence[tuple[float, float, float]]) -> LocalWorkFit:
    """Non-negative least squares of measured seconds on (dense bytes, moved bytes).

    ``samples`` are (dense bytes, moved bytes, seconds) per rank and run. Every subset of the three
    coefficients is fitted by least squares and the best fit with no negative coefficient wins (the
    all-zero fit always qualifies), so a coefficient the data cannot support is 0, not negative.

    Raises:
        ValueError: If there are no samples.
    """
    if not samples:
        raise ValueError(f"fit({scheme!r}): no samples")
    data = np.asarray(samples, dtype=np.float64)
    columns = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    seconds = data[:, 2]
    best = np.zeros(3)
    best_residual = float(np.sum(seconds**2))
    for size in (1, 2, 3):
        for chosen in itertools.combinations(range(3), size):
            coef, *_ = np.linalg.lstsq(columns[:, chosen], seconds, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(3)
            full[list(chosen)] = coef
            residual = float(np.sum((columns @ full - seconds) ** 2))
            if residual < best_residual:
                best, best_residual = full, residual
    fitted = columns @ best
    relative = np.abs(fitted - seconds) / np.maximum(seconds, 1e-12)
    return LocalWorkFit(
        scheme=scheme, fixed_s=float(best[0]), per_dense_byte_s=float(best[1]), per_moved_byte_s=float(best[2]),
        samples=len(data), max_relative_error=float(relative.max()),
    )  # fmt: skip


def calibration_rows(num_items: int, item_bytes: int) -> tuple[int, int]:
    """The two row counts a fit's full runs use: the workload's, capped at 64 MiB per rank, and an
    eighth of that (two sizes, so the dense-tensor term is told apart from the moved-bytes one)."""
    big = min(num_items, max(_MIN_ROWS, _CALIBRATION_BYTES // item_bytes))
    return big, max(1, big // 8)


def calibrate(
    scheme: str,
    full_calls: Callable[[int, int], list[list[Call]]],
    *,
    num_items: int,
    item_bytes: int,
    ranks: Sequence[int] = CALIBRATION_RANKS,
) -> LocalWorkFit:
    """Fit ``scheme``'s local work on full runs: ``full_calls(world_size, rows)`` records one step of
    the workload cut to ``rows`` rows (``calibration_rows``) at each of ``ranks``."""
    samples = []
    for rows in calibration_rows(num_items, item_bytes):
        for n in ranks:
            calls = full_calls(n, rows)
            network = [[c for c in per_rank if c.op != "local"] for per_rank in calls]
            for per_rank, (sent, received) in zip(calls, bytes_moved(network), strict=True):
                samples.append((rows * item_bytes, sent + received, sum(c.compute_s for c in per_rank)))
    return fit(scheme, samples)


def charge(
    calls: Sequence[Sequence[Call]], work: LocalWorkFit, dense_bytes: Callable[[int], float]
) -> list[list[Call]]:
    """``calls`` (a counted point's, no local work) with ``work`` put on every rank (module docstring).

    ``dense_bytes(rank)`` is the rank's dense tensor bytes. A rank with no call gets only its tail.
    """
    out = []
    for rank, ((sent, received), per_rank) in enumerate(zip(bytes_moved(calls), calls, strict=True)):
        before = work.fixed_s + work.per_dense_byte_s * dense_bytes(rank) + work.per_moved_byte_s * sent
        after = work.per_moved_byte_s * received
        mine = list(per_rank)
        phase = mine[-1].phase if mine else "other"
        if mine:
            mine[0] = dataclasses.replace(mine[0], compute_s=mine[0].compute_s + before)
        else:
            after += before
        mine.append(Call(op="local", group=(rank,), phase=phase, compute_s=after))
        out.append(mine)
    return out

"""Measuring the group's alpha-beta parameters with a few ring allreduces (reference/backends.md).

A ring allreduce of B bytes over n ranks takes T(B) = 2(n-1) * alpha + 2(n-1)/n * B / beta. Timing
a few sizes and fitting T = a + b * B by least squares gives alpha = a / (2(n-1)) and
beta = 2(n-1)/n / b. Every rank takes the mean over ranks of each timing (one extra allreduce) and
rank 0's fit of it (one broadcast), so all ranks hold bit-identical models and later make the same
decisions.

Import it as ``zensync.cost.calibrate``: it is the one cost module that runs collectives, so the
package does not import it (the planner stays offline).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from zensync.cost.collectives import _ring_allreduce_fraction, _ring_allreduce_steps
from zensync.cost.network import CostModel, fit_affine

if TYPE_CHECKING:  # the cost package never imports the transport layer at runtime
    from zensync.transport import Transport

__all__ = ["CALIBRATION_BYTES", "calibrate", "calibrate_async"]

CALIBRATION_BYTES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024)
"""Payload sizes timed: one latency-bound, two bandwidth-bound."""
_MIN_LATENCY_S = 1e-7
_MIN_BANDWIDTH = 1e6


def calibrate(transport: Transport, device: torch.device, repeats: int = 3) -> CostModel:
    """Fit alpha (s) and beta (bytes/s) on ``transport``; collective: every rank must call it (blocking).

    Returns the model with the median of ``repeats`` timings per size (after one warm-up).
    """
    return transport.run(calibrate_async(transport, device, repeats))


async def calibrate_async(transport: Transport, device: torch.device, repeats: int = 3) -> CostModel:
    """``calibrate`` as a coroutine of the transport's non-blocking collectives (the hook's step jobs await it)."""
    n = transport.world_size
    if n == 1:
        return CostModel(latency_s=0.0, bandwidth_bytes_per_s=float("inf"))
    medians = []
    for nbytes in CALIBRATION_BYTES:
        payload = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        await transport.all_reduce_async(payload)  # warm-up: connection setup, allocator
        times = []
        for _ in range(repeats):
            await transport.barrier_async()
            start = time.perf_counter()
            await transport.all_reduce_async(payload)
            times.append(time.perf_counter() - start)
        medians.append(sorted(times)[len(times) // 2])
    # The fit of the mean over ranks, as rank 0 computed it. Neither the allreduce nor the LAPACK fit
    # is bit-reproducible across processes (the sum order, the buffers' alignment), and ranks whose
    # models differ by an ulp can choose differently at a crossover: broadcast bits are identical.
    summed = await transport.all_reduce_async(torch.tensor(medians, dtype=torch.float64, device=device)) / n
    intercept, slope = fit_affine(CALIBRATION_BYTES, summed.cpu().tolist())  # host-device sync
    latency = max(_MIN_LATENCY_S, intercept / _ring_allreduce_steps(n))
    bandwidth = max(_MIN_BANDWIDTH, _ring_allreduce_fraction(n) / max(slope, 1e-15))
    fitted = torch.tensor([latency, bandwidth], dtype=torch.float64, device=device)
    latency, bandwidth = (await transport.broadcast_async(fitted, src=0)).cpu().tolist()  # host-device sync
    return CostModel(latency_s=latency, bandwidth_bytes_per_s=bandwidth)

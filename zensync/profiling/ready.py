"""Measuring a real model's backward: when each parameter's gradient becomes ready, over many iterations.

Each iteration runs forward, then backward with a post-accumulate-grad hook on every parameter
that records the clock (after synchronizing the device, so GPU times are completion times, not
launch times). Ready times are relative to the start of backward; tensors are ordered by their
mean ready time, and each gets the coefficient of variation of its ready time (Espresso requires
timings stable to a few percent; the profile reports how stable they were).

Example::

    profile = measure_ready_times(model, lambda: (x, y), loss_fn, iterations=20, name="mlp")
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from zensync import kernels
from zensync.planner import ModelProfile, TensorProfile

__all__ = ["measure_ready_times"]


def measure_ready_times(
    model: nn.Module,
    make_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    iterations: int = 100,
    warmup: int = 3,
    name: str = "model",
    batch: str = "",
) -> ModelProfile:
    """Profile ``model``: per-parameter gradient-ready times averaged over ``iterations``.

    Args:
        model: The model (its parameters' device is the device timed).
        make_batch: Returns (inputs, targets) for one iteration.
        loss_fn: (model output, targets) -> scalar loss.
        iterations: Timed iterations (after ``warmup`` untimed ones).
        warmup: Untimed iterations first (allocator, kernel selection).
        name: Model name recorded in the profile.
        batch: Human description of the batch recorded in the profile.

    Returns:
        A ``ModelProfile`` whose tensors are the parameters that received a gradient.

    Raises:
        ValueError: If ``iterations`` < 1 or no parameter received a gradient.
    """
    if iterations < 1 or warmup < 0:
        raise ValueError(f"iterations={iterations} must be >= 1 and warmup={warmup} >= 0")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    device = params[0][1].device if params else torch.device("cpu")
    marks: dict[str, float] = {}
    # Step 1: a hook per parameter records when its gradient is accumulated.
    handles = [p.register_post_accumulate_grad_hook(_marker(marks, n, device)) for n, p in params]
    ready: dict[str, list[float]] = {n: [] for n, _ in params}
    forward_s, backward_s = [], []
    try:
        for it in range(warmup + iterations):
            inputs, targets = make_batch()
            model.zero_grad(set_to_none=True)
            kernels.synchronize(device)
            start = time.perf_counter()
            loss = loss_fn(model(inputs), targets)
            kernels.synchronize(device)
            backward_start = time.perf_counter()
            marks.clear()
            loss.backward()
            kernels.synchronize(device)
            end = time.perf_counter()
            if it < warmup:
                continue
            # Step 2: times relative to the start of backward.
            forward_s.append(backward_start - start)
            backward_s.append(end - backward_start)
            for n in marks:
                ready[n].append(marks[n] - backward_start)
    finally:
        for handle in handles:
            handle.remove()
    # Step 3: order by mean ready time; CV per tensor.
    shapes = {n: tuple(p.shape) for n, p in params}
    measured = [(statistics.fmean(ts), n, ts) for n, ts in ready.items() if ts]
    if not measured:
        raise ValueError("no parameter received a gradient: check loss_fn and requires_grad")
    measured.sort()
    tensors = tuple(TensorProfile(name=n, shape=shapes[n], ready_s=mean, ready_cv=_cv(ts)) for mean, n, ts in measured)
    return ModelProfile(
        model=name,
        tensors=tensors,
        forward_s=statistics.fmean(forward_s),
        backward_s=max(statistics.fmean(backward_s), tensors[-1].ready_s),
        dtype_bytes=params[0][1].element_size(),
        device=f"measured:{kernels.device_name(device)}",
        batch=batch,
    )


def _marker(marks: dict[str, float], name: str, device: torch.device) -> Callable[[torch.Tensor], None]:
    def mark(_param: torch.Tensor) -> None:
        kernels.synchronize(device)
        marks[name] = time.perf_counter()

    return mark


def _cv(times: list[float]) -> float:
    mean = statistics.fmean(times)
    return statistics.pstdev(times) / mean if len(times) > 1 and mean > 0 else 0.0

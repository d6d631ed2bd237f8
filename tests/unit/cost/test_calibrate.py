"""``zensync.cost.calibrate`` inverts the ring model it documents: on a transport whose allreduce of B
bytes takes exactly T(B) = 2(n-1) alpha + 2(n-1)/n B / beta (a fake clock), it returns alpha and beta."""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

import pytest
import torch

from zensync.cost import CostModel
from zensync.cost import calibrate as calibrate_module
from zensync.cost.calibrate import calibrate

T = TypeVar("T")
FIT_REL = 1e-9
"""The fit is a float64 least squares on three exact points: only rounding separates it from the truth."""


class _Done(Generic[T]):
    """An awaitable that is already complete: awaiting it returns ``value`` without suspending."""

    def __init__(self, value: T) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, T]:
        return self.value
        yield  # a generator that never suspends


class _RingClock:
    """A transport of ``world_size`` identical ranks whose allreduces advance a fake clock by T(B)."""

    def __init__(self, world_size: int, model: CostModel) -> None:
        self.world_size = world_size
        self.model = model
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            coro.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        raise AssertionError("calibrate suspended on a handle that was already complete")

    def all_reduce_async(self, tensor: torch.Tensor) -> _Done[torch.Tensor]:
        n, nbytes = self.world_size, tensor.numel() * tensor.element_size()
        steps = 2 * (n - 1)
        self.now += steps * self.model.latency_s + steps / n * nbytes / self.model.bandwidth_bytes_per_s
        return _Done(tensor * n)  # every rank holds the same values: the sum is n times one rank's

    def barrier_async(self) -> _Done[None]:
        return _Done(None)

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> _Done[torch.Tensor]:
        assert src == 0
        return _Done(tensor)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_calibrate_recovers_alpha_and_beta(world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    truth = CostModel(latency_s=25e-6, bandwidth_bytes_per_s=1.25e9)
    transport = _RingClock(world_size, truth)
    monkeypatch.setattr(calibrate_module.time, "perf_counter", transport.perf_counter)
    fitted = calibrate(transport, torch.device("cpu"), repeats=3)  # type: ignore[arg-type]
    assert fitted.latency_s == pytest.approx(truth.latency_s, rel=FIT_REL)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(truth.bandwidth_bytes_per_s, rel=FIT_REL)


def test_one_rank_has_no_network() -> None:
    fitted = calibrate(_RingClock(1, CostModel(latency_s=1.0, bandwidth_bytes_per_s=1.0)), torch.device("cpu"))  # type: ignore[arg-type]
    assert fitted == CostModel(latency_s=0.0, bandwidth_bytes_per_s=float("inf"))

"""Every sync scheme's coroutine, driven by completion callbacks on one Lane per rank, equals the dense sum.

The DDP hook runs ``run_agreed_async`` coroutines one after another on one ``Lane`` per rank, driven
by the completion callbacks of the collectives they await (``Task``). Here several tensors are
submitted back to back on each rank's lane, in a world whose ranks see random completion delays
(different on every rank and every collective) and that submit at random moments, so a coroutine
starts sometimes on the submitting thread and sometimes on the thread that completed its
predecessor. The collectives must still be issued in the same order on every rank: each result
must equal the dense float64 sum exactly (integer-valued data, so every summation order is exact),
and each call's traffic must equal that of the same calls made blocking and in order without
delays. The coroutines may await only non-blocking collectives: the blocking forms raise here.
"""

from __future__ import annotations

import random
import time

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import zensync
from tests.strategies import examples
from zensync.kernels import reference
from zensync.sync.base import default_granularity, item_view
from zensync.sync.run import run_agreed, run_agreed_async
from zensync.transport import SimulatedWorld, Transport
from zensync.transport.handle import Lane

H0_SEED = 271828
OPTIONS = zensync.SyncOptions(h0_seed=H0_SEED, omnireduce_block=16)
MAX_DELAY_S = 0.003
"""Upper bound of a rank's random delay before each non-blocking collective (SimulatedWorld)."""
MAX_SUBMIT_GAP_S = 0.002
"""Upper bound of a rank's random pause between two submissions (the lane is then idle or busy)."""
LANE_TIMEOUT_S = 60.0
"""Generous: a whole lane run takes well under a second."""
SHAPES = ((997,), (61, 5), (300,), (40, 3))
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DENSITIES = (0.1, 0.3, 0.02, 0.6)
BLOCKING_FORMS = ("all_reduce", "all_gather", "all_gather_v", "all_to_all_v", "broadcast", "send_recv", "barrier")


def _input(rank: int, index: int, seed: int) -> torch.Tensor:
    """Integer-valued data in [-4, 4] (sums over <= 8 ranks are exact in float16 and bfloat16)."""
    gen = torch.Generator().manual_seed(seed * 1000 + index * 10 + rank)
    shape = SHAPES[index % len(SHAPES)]
    values = torch.randint(-4, 5, shape, generator=gen).to(torch.float64)
    mask = torch.rand(shape, generator=gen) < DENSITIES[index % len(DENSITIES)]
    return (values * mask).to(DTYPES[index % len(DTYPES)])


def _expected(n: int, index: int, seed: int) -> torch.Tensor:
    inputs = [_input(rank, index, seed) for rank in range(n)]
    return torch.stack([x.to(torch.float64) for x in inputs]).sum(0).to(inputs[0].dtype)


def _nnz_per_rank(n: int, index: int, seed: int) -> list[int]:
    """Every rank's non-zero item count (``auto`` needs it; sparse_allreduce measures it)."""
    counts = []
    for rank in range(n):
        x = _input(rank, index, seed)
        counts.append(reference.nonzero_items(item_view(x, default_granularity(x)).x2d).numel())
    return counts


def _calls(schemes: tuple[str, ...], n: int, seed: int) -> list[dict]:
    """Keyword arguments of every call, in the order every rank submits them."""
    return [
        {"scheme": scheme, "options": OPTIONS, "h0_seed": H0_SEED, "nnz_per_rank": _nnz_per_rank(n, i, seed)}
        for i, scheme in enumerate(schemes)
    ]


def _traffic(stats: zensync.SyncStats) -> dict[str, tuple[int, ...]]:
    """Bytes, messages and calls per phase (not the times)."""
    return {
        phase: (p.bytes_sent, p.bytes_recv, p.control_bytes_sent, p.control_bytes_recv, p.messages_sent, p.num_calls)
        for phase, p in stats.phases.items()
    }


def _forbid_blocking(transport: Transport) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a coroutine on the Lane called a blocking collective")

    for form in BLOCKING_FORMS:
        setattr(transport, form, refuse)


def _blocking_body(t: Transport, calls: list[dict], seed: int):
    """Every call with the blocking ``run_agreed``, in order."""
    outs = []
    for i, kwargs in enumerate(calls):
        x = _input(t.rank, i, seed)
        stats = zensync.SyncStats()
        result = run_agreed(item_view(x, default_granularity(x)), t, stats=stats, **kwargs)
        outs.append((result.view(x.shape), _traffic(stats)))
    return outs


def _lane_body(t: Transport, calls: list[dict], seed: int):
    """Every call submitted as a ``run_agreed_async`` coroutine to one Lane, back to back, at random moments."""
    _forbid_blocking(t)
    pause = random.Random(seed * 7919 + t.rank)
    lane, tasks, all_stats, shapes = Lane(), [], [], []
    for i, kwargs in enumerate(calls):
        x = _input(t.rank, i, seed)
        stats = zensync.SyncStats()
        tasks.append(lane.submit(run_agreed_async(item_view(x, default_granularity(x)), t, stats=stats, **kwargs)))
        all_stats.append(stats)
        shapes.append(x.shape)
        if pause.random() < 0.5:  # else the next submission finds the lane busy, most likely
            time.sleep(pause.random() * MAX_SUBMIT_GAP_S)
    assert lane.drain(LANE_TIMEOUT_S), f"rank {t.rank}: the lane did not drain"
    return [
        (task.wait(LANE_TIMEOUT_S).view(shape), _traffic(stats))
        for task, stats, shape in zip(tasks, all_stats, shapes, strict=True)
    ]


def _delays(n: int, seed: int):
    """Per rank, a random delay before each non-blocking collective (each rank draws from its own generator)."""
    generators = [random.Random(seed + rank) for rank in range(n)]
    return lambda rank: generators[rank].random() * MAX_DELAY_S


def _check(schemes: tuple[str, ...], n: int, seed: int) -> None:
    calls = _calls(schemes, n, seed)
    reference_run = SimulatedWorld(n, timeout_s=LANE_TIMEOUT_S).run(lambda t: _blocking_body(t, calls, seed))
    lane_run = SimulatedWorld(n, timeout_s=LANE_TIMEOUT_S, delay_s=_delays(n, seed)).run(
        lambda t: _lane_body(t, calls, seed)
    )
    for i, scheme in enumerate(schemes):
        expected = _expected(n, i, seed)
        for rank in range(n):
            (out, traffic), (_, ref_traffic) = lane_run[rank][i], reference_run[rank][i]
            where = f"rank {rank}, call {i} ({scheme}, {expected.dtype}, {tuple(expected.shape)})"
            assert out.dtype == expected.dtype and torch.equal(out, expected), f"{where}: not the dense sum"
            assert traffic == ref_traffic, f"{where}: traffic differs from the blocking run in order"


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("scheme", zensync.SCHEMES)
def test_each_scheme_back_to_back_on_a_lane_equals_the_dense_sum(scheme: str, n: int) -> None:
    _check((scheme,) * len(SHAPES), n, seed=n)


@given(
    n=st.integers(1, 6),
    schemes=st.lists(st.sampled_from(zensync.SCHEMES), min_size=2, max_size=6).map(tuple),
    seed=st.integers(0, 2**20),
)
@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mixed_schemes_back_to_back_on_a_lane_equal_the_dense_sum(n: int, schemes: tuple[str, ...], seed: int) -> None:
    """Different schemes (different collectives, counts and sizes) interleaved on one lane."""
    _check(schemes, n, seed)

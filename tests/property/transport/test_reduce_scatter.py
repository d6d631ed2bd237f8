"""Reduce-scatter on the simulated world: every algorithm's chunk equals the float64 sum's, and the
bytes each rank moves equal the closed forms of ``zensync.transport.reduce_scatter``.

Inputs are small integers, so every dtype sums them exactly in any order. Closed forms, with
chunk_j the size of torch.tensor_split's chunk j and E the element size:

    ring, halving   sent = (numel - chunk_r) E        ((n-1)/n of the tensor when n divides it)
                    received = (numel - chunk_{r-1}) E (ring); halving: the chunks of the half
                    kept at each step (n/2 + n/4 + ... + 1 chunks: (n-1)/n again when n divides numel)
                    control = 8 per step: n - 1 steps (ring), lg n (halving)
    native          the all-reduce cut to the chunk: 2 (numel - chunk_r) E each way (gloo's cost)
    every one       control += 16 (n - 1): each rank's size and dtype, checked before the algorithm
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from zensync.transport import SimulatedWorld, TrafficLog
from zensync.transport.reduce_scatter import bounds

DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.float16, torch.bfloat16)


def _inputs(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, (numel,), generator=gen).to(dtype)


def _run(num_ranks: int, numel: int, dtype: torch.dtype, algorithm: str) -> list[tuple[torch.Tensor, TrafficLog]]:
    def body(t):
        log = TrafficLog()
        with t.recording(log), t.phase("rs"):
            out = t.reduce_scatter(_inputs(t.rank, numel, dtype), algorithm=algorithm)
        return out, log

    return SimulatedWorld(num_ranks, timeout_s=60).run(body)


def _received(chunk: list[int], r: int, algorithm: str) -> int:
    """Elements rank r receives: every chunk but r-1's (ring); each step's kept half (halving)."""
    if algorithm != "halving":
        return sum(chunk) - chunk[r - 1]
    lo, hi, total = 0, len(chunk), 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if r < mid else (mid, hi)
        total += sum(chunk[lo:hi])
    return total


@settings(max_examples=examples(40), deadline=None)
@given(
    num_ranks=st.integers(1, 8),
    numel=st.integers(0, 50),
    dtype=st.sampled_from(DTYPES),
    algorithm=st.sampled_from(["ring", "halving", "native", "auto"]),
)
def test_chunk_and_bytes_equal_the_definition(num_ranks: int, numel: int, dtype: torch.dtype, algorithm: str) -> None:
    if algorithm == "halving" and num_ranks & (num_ranks - 1):
        num_ranks = 1 << (num_ranks.bit_length() - 1)  # the nearest power of two below
    results = _run(num_ranks, numel, dtype, algorithm)
    total = sum(_inputs(r, numel, torch.float64) for r in range(num_ranks))
    edges = bounds(numel, num_ranks)
    chunk = [edges[j + 1] - edges[j] for j in range(num_ranks)]
    item = torch.empty(0, dtype=dtype).element_size()
    for r, (out, log) in enumerate(results):
        assert out.dtype == dtype
        assert torch.equal(out, total[edges[r] : edges[r + 1]].to(dtype)), (r, out)
        phase = log.phases["rs"]
        if num_ranks == 1:
            assert (phase.bytes_sent, phase.bytes_recv) == (0, 0)
        elif algorithm == "native":
            assert phase.bytes_sent == phase.bytes_recv == 2 * (numel - chunk[r]) * item
        else:  # the simulated world's auto is the ring
            assert phase.bytes_sent == (numel - chunk[r]) * item
            assert phase.bytes_recv == _received(chunk, r, algorithm) * item
            steps = num_ranks - 1 if algorithm != "halving" else num_ranks.bit_length() - 1
            assert phase.control_bytes_sent == phase.control_bytes_recv == 8 * steps + 16 * (num_ranks - 1)


@pytest.mark.parametrize("num_ranks", [2, 3, 4, 6])
def test_ring_moves_half_of_what_the_all_reduce_moves(num_ranks: int) -> None:
    """Over the ranks, the ring sends (n-1)/n of each tensor: half of the all-reduce's 2(n-1)/n."""
    numel = 1200
    ring = sum(log.phases["rs"].bytes_sent for _, log in _run(num_ranks, numel, torch.float32, "ring"))
    native = sum(log.phases["rs"].bytes_sent for _, log in _run(num_ranks, numel, torch.float32, "native"))
    assert ring == (num_ranks - 1) * numel * 4
    assert native == 2 * ring


def test_bad_arguments_fail_on_every_rank() -> None:
    def body(t):
        errors = []
        for kwargs, x in (({"algorithm": "tree"}, torch.ones(4)), ({}, torch.ones(4, dtype=torch.bool))):
            try:
                t.reduce_scatter(x, **kwargs)
            except (ValueError, TypeError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        try:
            t.reduce_scatter(torch.ones(4), algorithm="halving")
        except ValueError as exc:
            errors.append(str(exc))
        return errors

    results = SimulatedWorld(3, timeout_s=30).run(body)
    assert all(r == results[0] for r in results)
    assert "valid: auto, ring, halving, native" in results[0][0]
    assert results[0][1].startswith("TypeError") and "bool" in results[0][1]
    assert "power-of-two group size, got 3" in results[0][2]


@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_ranks_with_different_sizes_or_dtypes_fail_alike_instead_of_summing_garbage(algorithm: str) -> None:
    def body(t):
        x = torch.ones(6 + (t.rank == 2), dtype=torch.float64 if t.rank == 1 else torch.float32)
        return t.reduce_scatter(x, algorithm=algorithm)

    results = SimulatedWorld(3, timeout_s=30).run(body, return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results), results
    assert str(results[0]).endswith("rank 0: 6 x torch.float32, rank 1: 6 x torch.float64, rank 2: 7 x torch.float32")
    assert len({str(r) for r in results}) == 1

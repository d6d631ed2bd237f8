"""TorchTransport's gloo collectives by message size: small all-gathers through all_to_all_single,
large uneven ones as a point-to-point ring; exact results either way, and the bytes each rank really
sends (a ring forwards its neighbours' blocks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed._launch import launch, pytest_generate_tests, world_size_fixture  # noqa: F401 - class data world_size
from zensync.transport import TrafficLog, transport_for_group
from zensync.transport.torch_dist import SMALL_GATHER_BYTES

SMALL = SMALL_GATHER_BYTES // 4 // 2
"""float32 elements well under the small-gather limit."""
LARGE = SMALL_GATHER_BYTES // 4 * 2
"""float32 elements over it."""
# name -> numel of rank r's tensor among n ranks
CASES = {
    "equal small": lambda r, n: SMALL,
    "equal large": lambda r, n: LARGE,
    "uneven small": lambda r, n: SMALL - 7 * r,
    "uneven large": lambda r, n: LARGE - 11 * r,
    "one large, others tiny": lambda r, n: LARGE if r == 0 else 5 * r,
    "empty on one rank": lambda r, n: 0 if r == n - 1 else LARGE,
}


def _data(r: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * 0.5 + 1000 * r


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    transport = transport_for_group(None)
    out: dict[str, Any] = {}
    for name, size in CASES.items():
        sizes = [size(r, world_size) for r in range(world_size)]
        log = TrafficLog()
        with transport.recording(log):
            got = transport.all_gather_v(_data(rank, sizes[rank]))
        equal_sizes = len(set(sizes)) == 1
        if equal_sizes:
            with transport.recording(log), transport.phase("plain"):
                plain = transport.all_gather(_data(rank, sizes[rank]))
            assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
        phase = log.phases["other"]
        out[name] = {
            "exact": all(torch.equal(got[r], _data(r, sizes[r])) for r in range(world_size)),
            "sent": phase.bytes_sent,
            "recv": phase.bytes_recv,
            "control_sent": phase.control_bytes_sent,
            "control_recv": phase.control_bytes_recv,
        }
    return out


class TestGlooTransportSizes:
    world_size = [3]

    @pytest.fixture(scope="class")
    @classmethod
    def results(cls, world_size: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        return launch(_worker, world_size, (), tmp_path_factory.mktemp(f"transport{world_size}"))

    @pytest.mark.parametrize("name", list(CASES))
    def test_all_gather_v_exact_and_accounted(self, results: list[dict[str, Any]], world_size: int, name: str) -> None:
        n = world_size
        sizes = [CASES[name](r, n) for r in range(n)]
        ring = len(set(sizes)) > 1 and max(sizes) * 4 > SMALL_GATHER_BYTES
        for rank, per_rank in enumerate(results):
            record = per_rank[name]
            assert record["exact"], (rank, name)
            forwarded = sum(s for j, s in enumerate(sizes) if j != (rank + 1) % n)
            assert record["sent"] == 4 * (forwarded if ring else sizes[rank] * (n - 1)), (rank, name)
            assert record["recv"] == 4 * (sum(sizes) - sizes[rank])
            assert record["control_sent"] == record["control_recv"] == 8 * (n - 1)


# --------------------------------------------------------------------------------------------------
# Non-blocking collectives issued back to back keep the call order on the wire.
def _issue_order_worker(rank: int, world_size: int, late_rank: int) -> list[list[float]]:
    """Multi-call collectives (sizes, then payload) followed at once by single-call ones.

    ``late_rank`` pauses between its calls, so on that rank the size exchange completes before the
    next call while on the others it does not: without the transport's issue slot the payload would
    reach gloo after the next collective on some ranks and before it on others.
    """
    import time

    transport = transport_for_group(None)
    handles = []
    for i in range(4):
        handles.append(
            transport.all_to_all_v_async(torch.arange(world_size, dtype=torch.float32) + 10 * rank, [1] * world_size)
        )
        if rank == late_rank:
            time.sleep(0.05)
        handles.append(transport.all_reduce_async(torch.full((3 + i,), float(rank + 1))))
        handles.append(transport.all_gather_v_async(torch.full((rank + i + 1,), float(rank))))
    out = []
    for i in range(4):
        (received, _), summed, gathered = (h.wait(timeout=60) for h in handles[3 * i : 3 * i + 3])
        out.append([*received.tolist(), *summed.tolist(), *torch.cat(gathered).tolist()])
    return out


@pytest.mark.parametrize("late_rank", [0, pytest.param(1, marks=pytest.mark.slow)])  # 1: the same, mirrored
def test_back_to_back_async_collectives_keep_call_order(late_rank: int, tmp_path: Any) -> None:
    n = 3
    results = launch(_issue_order_worker, n, (late_rank,), tmp_path)
    for rank, out in enumerate(results):
        for i, values in enumerate(out):
            received = [rank + 10.0 * r for r in range(n)]
            summed = [float(n * (n + 1) // 2)] * (3 + i)
            gathered = [float(r) for r in range(n) for _ in range(r + i + 1)]
            assert values == received + summed + gathered, (rank, i)

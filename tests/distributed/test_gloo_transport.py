"""TorchTransport's gloo collectives by message size: small all-gathers through all_to_all_single,
large uneven ones padded to a ring all_gather; same results either way, padding counted as control."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _launch import launch, pytest_generate_tests, world_size_fixture  # noqa: F401 - class data world_size

from zensync.transport import TrafficLog, transport_for_group
from zensync.transport.torch_dist import PAD_WASTE_LIMIT, SMALL_GATHER_BYTES

pytestmark = pytest.mark.distributed

SMALL = SMALL_GATHER_BYTES // 4 // 2
"""float32 elements well under the small-gather limit."""
LARGE = SMALL_GATHER_BYTES // 4 * 2
"""float32 elements over it."""
# name -> numel of rank r's tensor among n ranks
CASES = {
    "equal small": lambda r, n: SMALL,
    "equal large": lambda r, n: LARGE,
    "uneven small": lambda r, n: SMALL - 7 * r,
    "uneven large, little waste": lambda r, n: LARGE - 11 * r,  # padded ring
    "uneven large, much waste": lambda r, n: LARGE if r == 0 else 5 * r,  # all_to_all
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
        largest = max(sizes)
        padded = (
            len(set(sizes)) > 1 and largest * 4 > SMALL_GATHER_BYTES and n * largest <= PAD_WASTE_LIMIT * sum(sizes)
        )
        for rank, per_rank in enumerate(results):
            record = per_rank[name]
            assert record["exact"], (rank, name)
            assert record["sent"] == 4 * sizes[rank] * (n - 1)
            assert record["recv"] == 4 * (sum(sizes) - sizes[rank])
            pad_sent = 4 * (largest - sizes[rank]) * (n - 1) if padded else 0
            pad_recv = sum(4 * (largest - s) for j, s in enumerate(sizes) if j != rank) if padded else 0
            assert record["control_sent"] == 8 * (n - 1) + pad_sent
            assert record["control_recv"] == 8 * (n - 1) + pad_recv

    def test_padded_case_is_really_padded(self, world_size: int) -> None:
        sizes = [CASES["uneven large, little waste"](r, world_size) for r in range(world_size)]
        assert world_size * max(sizes) <= PAD_WASTE_LIMIT * sum(sizes) and max(sizes) * 4 > SMALL_GATHER_BYTES
        sizes = [CASES["uneven large, much waste"](r, world_size) for r in range(world_size)]
        assert world_size * max(sizes) > PAD_WASTE_LIMIT * sum(sizes)

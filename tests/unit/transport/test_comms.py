"""The comms logger: one record per completed collective, nccl-tests' sizes and bus-bandwidth factors."""

from __future__ import annotations

import json

import pytest
import torch

from zensync.transport import CommsLogger, SimulatedWorld, Transport
from zensync.transport.comms import bus_factor


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 4, 1.5),
        ("all_gather", 4, 0.75),
        ("broadcast", 8, 1.0),
        ("all_to_all_v", 2, 0.5),
        ("all_reduce", 1, 1.0),
        ("other", 4, 1.0),
    ],
)
def test_bus_factors_are_nccl_tests(op: str, n: int, factor: float) -> None:
    assert bus_factor(op, n) == factor


def test_every_collective_is_logged_with_its_size_and_bandwidths(tmp_path) -> None:
    n = 4

    def body(t: Transport) -> list:
        log = CommsLogger(str(tmp_path / f"rank{t.rank}.jsonl"))
        t.comms_logger = log
        with t.phase("p"):
            t.all_reduce(torch.ones(1000))
            t.all_gather(torch.ones(10, dtype=torch.float64))
            t.all_gather_v(torch.ones(t.rank + 1, dtype=torch.int32))
            t.all_to_all_v(torch.ones(2 * n), [2] * n)
            t.broadcast(torch.ones(7), src=0)
            t.send_recv(
                torch.ones(5, dtype=torch.uint8), dst=(t.rank + 1) % n, src=(t.rank - 1) % n, device=torch.device("cpu")
            )
            t.barrier()  # neither timed nor counted: not logged
        return log.records

    for rank, records in enumerate(SimulatedWorld(n).run(body)):
        sizes = [(r.op, r.size_bytes) for r in records]
        assert sizes == [
            ("all_reduce", 4000),
            ("all_gather", n * 80),
            ("all_gather_v", 4 * sum(range(1, n + 1))),
            ("all_to_all_v", 2 * n * 4),
            ("broadcast", 28),
            ("send_recv", 5),
        ]
        for record in records:
            assert record.backend == "SimulatedTransport" and record.world_size == n and record.rank == rank
            assert record.phase == "p" and record.seconds > 0
            assert record.algbw_bytes_per_s == pytest.approx(record.size_bytes / record.seconds)
            assert record.busbw_bytes_per_s == pytest.approx(record.algbw_bytes_per_s * bus_factor(record.op, n))
        lines = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["op"] for line in lines] == [op for op, _ in sizes]


def test_summary_groups_calls_by_op_and_size() -> None:
    def body(t: Transport) -> str:
        t.comms_logger = log = CommsLogger()
        for _ in range(3):
            t.all_reduce(torch.ones(16))
        t.all_reduce(torch.ones(32))
        rows = log.summary()
        assert [(r["op"], r["size_bytes"], r["calls"]) for r in rows] == [("all_reduce", 64, 3), ("all_reduce", 128, 1)]
        return log.table()

    table = SimulatedWorld(2).run(body)[0]
    assert table.splitlines()[0].startswith("| op | backend | size (bytes) | calls |") and "| 64 | 3 |" in table

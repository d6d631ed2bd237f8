"""MixedTransport: each call on the backend the table names, in one order on every rank, with the
results and bytes of a single backend; the tuning table's routing, its JSON, and ``tune``'s agreement."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from zensync.transport import MixedTransport, SimulatedWorld, TrafficLog, Transport, TuningTable, tune
from zensync.transport.mixed import TuningEntry, interleaved_samples

SMALL_TO_B = TuningTable(
    default="a",
    entries=(
        TuningEntry(op="all_reduce", backend="b", max_bytes=64),
        TuningEntry(op="all_gather_v", backend="b"),
        TuningEntry(op="broadcast", backend="b", dtype="int64"),
    ),
)


def _pair(t: Transport, table: TuningTable = SMALL_TO_B) -> MixedTransport:
    return MixedTransport({"a": t, "b": t.split(0)}, table)  # split(0): a second group of the same ranks


def test_each_call_takes_the_backend_its_op_dtype_and_size_name() -> None:
    assert SMALL_TO_B.backend_for("all_reduce", torch.float32, 64) == "b"
    assert SMALL_TO_B.backend_for("all_reduce", torch.float32, 65) == "a"
    assert SMALL_TO_B.backend_for("broadcast", torch.int64, 8) == "b"
    assert SMALL_TO_B.backend_for("broadcast", torch.float32, 8) == "a"
    assert SMALL_TO_B.backend_for("all_gather_v", torch.float16, None) == "b"

    def body(t: Transport) -> tuple[dict[str, int], list[torch.Tensor]]:
        mixed = _pair(t)
        r = t.rank
        out = [
            mixed.all_reduce(torch.full((16,), float(r + 1))),  # 64 bytes: b
            mixed.all_reduce(torch.full((17,), float(r + 1))),  # 68 bytes: a
            torch.cat(mixed.all_gather_v(torch.full((r + 1,), float(r)))),  # b
            mixed.broadcast(torch.arange(3) + r, src=1),  # int64: b
        ]
        return dict(mixed.routed), out

    for routed, out in SimulatedWorld(3).run(body):
        assert routed == {"b": 3, "a": 1}
        assert torch.equal(out[0], torch.full((16,), 6.0)) and torch.equal(out[1], torch.full((17,), 6.0))
        assert torch.equal(out[2], torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 2.0]))
        assert torch.equal(out[3], torch.arange(3) + 1)


OPS = st.sampled_from(["all_reduce", "all_gather", "all_gather_v", "all_to_all_v", "broadcast"])


@given(calls=st.lists(st.tuples(OPS, st.integers(1, 40)), min_size=1, max_size=12), seed=st.integers(0, 2**16))
@settings(max_examples=examples(20))
def test_random_interleaved_calls_on_two_backends_never_hang_and_equal_one_backend(calls: list, seed: int) -> None:
    """The same random sequence of operations and sizes on every rank, all issued at once and
    awaited in a different random order per rank, completions delayed at random: every result and
    every byte count equal those of the same calls on the one backend (the world times out on a hang)."""
    n = 3

    def issue(t: Transport) -> list:
        r = t.rank
        handles = []
        for op, size in calls:
            x = torch.arange(size, dtype=torch.float32) + 100 * r
            if op == "all_reduce":
                handles.append(t.all_reduce_async(x))
            elif op == "all_gather":
                handles.append(t.all_gather_async(x))
            elif op == "all_gather_v":
                handles.append(t.all_gather_v_async(x[: 1 + (size + r) % size]))
            elif op == "all_to_all_v":
                counts = [(size + r + j) % 4 for j in range(n)]
                handles.append(t.all_to_all_v_async(torch.ones(sum(counts)) * r, counts))
            else:
                handles.append(t.broadcast_async(x, src=size % n))
        order = list(range(len(handles)))
        random.Random(seed * 10 + r).shuffle(order)
        got = {i: handles[i].wait(20) for i in order}
        return [got[i] for i in range(len(handles))]

    def body(t: Transport) -> tuple[list, list, dict, dict]:
        mixed = _pair(
            t,
            TuningTable(
                default="a",
                entries=(
                    TuningEntry(op="all_reduce", backend="b", max_bytes=80),
                    TuningEntry(op="all_to_all_v", backend="b"),
                ),
            ),
        )
        mixed_log, plain_log = TrafficLog(), TrafficLog()
        with mixed.recording(mixed_log):
            mixed_out = issue(mixed)
        with t.recording(plain_log):
            plain_out = issue(t)
        return mixed_out, plain_out, mixed_log.phases, plain_log.phases

    world = SimulatedWorld(n, timeout_s=30, delay_s=lambda r: random.random() * 0.002)
    for mixed_out, plain_out, mixed_phases, plain_phases in world.run(body):
        assert str(mixed_out) == str(plain_out)
        for phase, traffic in plain_phases.items():
            other = mixed_phases[phase]
            assert (other.bytes_sent, other.bytes_recv, other.control_bytes_sent, other.num_calls) == (
                traffic.bytes_sent,
                traffic.bytes_recv,
                traffic.control_bytes_sent,
                traffic.num_calls,
            )


def test_table_json_round_trip_and_refusals() -> None:
    table = TuningTable(
        default="gloo",
        entries=(
            TuningEntry(op="all_reduce", backend="mpi", max_bytes=16384),
            TuningEntry(op="all_gather", backend="mpi"),
        ),
        world_size=2,
    )
    again = TuningTable.from_json(table.to_json())
    assert again == table and math.isinf(again.entries[1].max_bytes)
    with pytest.raises(ValueError, match="version"):
        TuningTable.from_json('{"version": 2, "default": "a", "entries": []}')
    with pytest.raises(ValueError, match="unknown operations"):
        TuningTable.from_json('{"version": 1, "default": "a", "entries": [{"op": "reduce", "backend": "a"}]}')
    with pytest.raises(ValueError, match="not a tuning table"):
        TuningTable.from_json("[1, 2]")

    def body(t: Transport) -> list[str]:
        errors = []
        cases = (({"a": t}, SMALL_TO_B), ({"a": t, "b": t}, table), ({}, SMALL_TO_B), ({"gloo": t, "mpi": t}, table))
        for backends, tab in cases:
            try:
                MixedTransport(backends, tab)
            except ValueError as exc:
                errors.append(str(exc))
        return errors

    errors = SimulatedWorld(3).run(body)[0]
    assert "names backends ['b'] that are not given" in errors[0]
    assert "names backends ['gloo', 'mpi'] that are not given" in errors[1]
    assert "at least one backend" in errors[2]
    assert "measured on 2 ranks, this group has 3" in errors[3]


def test_tune_gives_every_rank_one_table_that_covers_every_size() -> None:
    def body(t: Transport) -> tuple[str, dict]:
        backends = {"a": t, "b": t.split(0)}
        table, seconds = tune(backends, sizes=[8, 512, 4096], reps=2)
        mixed = MixedTransport(backends, table)
        assert torch.equal(mixed.all_reduce(torch.ones(1000)), torch.full((1000,), 3.0))
        return table.to_json(), seconds

    results = SimulatedWorld(3).run(body)
    tables = {json for json, _ in results}
    assert len(tables) == 1  # rank 0's decision on every rank
    table = TuningTable.from_json(tables.pop())
    assert table.world_size == 3 and table.backends() <= {"a", "b"}
    for op in ("all_reduce", "all_gather", "broadcast"):
        mine = [e for e in table.entries if e.op == op]
        assert mine and math.isinf(mine[-1].max_bytes)  # every size has a backend
        seconds = results[0][1][op]
        for size in (8, 512, 4096):  # the entry for each measured size is its fastest backend
            chosen = table.backend_for(op, torch.float32, size)
            assert seconds[size][chosen] == min(seconds[size].values())
    assert all(s[op][size] == results[0][1][op][size] for _, s in results for op in s for size in s[op])


def test_interleaved_samples_rotate_the_order_and_fence_each_burst_on_its_backend() -> None:
    events: list[str] = []
    ticks = iter(range(1000))

    class Fence:
        def __init__(self, name: str) -> None:
            self.name = name

        def barrier(self) -> None:
            events.append(f"barrier:{self.name}")

    def call(name: str) -> Callable[[], None]:
        return lambda: events.append(name)

    calls = {"a": call("a"), "b": call("b"), "mixed": call("mixed")}
    fences = {"a": Fence("a"), "b": Fence("b"), "mixed": Fence("a")}  # mixed routed to a: a's barrier
    samples = interleaved_samples(calls, fences, reps=3, burst=2, clock=lambda: float(next(ticks)))  # type: ignore[arg-type]
    bursts = [["a", "a"], ["b", "b"], ["mixed", "mixed"]]
    expected = []
    for rep in range(3):
        for k in range(3):
            name = ["a", "b", "mixed"][(rep + k) % 3]
            expected += [f"barrier:{'a' if name == 'mixed' else name}", *bursts[["a", "b", "mixed"].index(name)]]
    assert events == expected
    assert samples == {"a": [0.5] * 3, "b": [0.5] * 3, "mixed": [0.5] * 3}  # one tick per burst of 2 calls

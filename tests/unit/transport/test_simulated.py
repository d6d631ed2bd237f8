"""The simulated world's collectives move the right data and account bytes with the documented model."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from zensync.transport import Handle, SimulatedWorld, TrafficLog, Transport, WorldAborted

WORLD_SIZES = [1, 2, 3, 5, 8]


def _run_logged(n: int, fn):
    def body(t: Transport):
        log = TrafficLog()
        with t.recording(log), t.phase("p"):
            result = fn(t)
        return result, log.get("p")

    return SimulatedWorld(n, timeout_s=30).run(body)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_reduce_sums_and_counts_ring_bytes(n: int) -> None:
    numel = 103
    outs = _run_logged(n, lambda t: t.all_reduce(torch.full((numel,), float(t.rank + 1))))
    for rank, (out, traffic) in enumerate(outs):
        assert torch.equal(out, torch.full((numel,), n * (n + 1) / 2))  # rank r gives r+1
        chunk = numel // n + (1 if rank < numel % n else 0)
        assert traffic.bytes_recv == traffic.bytes_sent == (2 * (numel - chunk) * 4 if n > 1 else 0)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_gather_v_uneven(n: int) -> None:
    outs = _run_logged(n, lambda t: t.all_gather_v(torch.arange(t.rank + 1, dtype=torch.int32)))
    for rank, (gathered, traffic) in enumerate(outs):
        assert [g.tolist() for g in gathered] == [list(range(j + 1)) for j in range(n)]
        assert traffic.bytes_sent == 4 * (rank + 1) * (n - 1)
        assert traffic.bytes_recv == 4 * sum(j + 1 for j in range(n) if j != rank)
        assert traffic.control_bytes_recv == 8 * (n - 1)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_to_all_v_uneven(n: int) -> None:
    # rank r sends (r + j) copies of value 100*r + j to rank j
    def body(t: Transport):
        counts = [t.rank + j for j in range(n)]
        data = torch.cat([torch.full((c,), 100 * t.rank + j) for j, c in enumerate(counts)])
        return t.all_to_all_v(data, counts)

    outs = _run_logged(n, body)
    for rank, ((received, recv_counts), traffic) in enumerate(outs):
        assert recv_counts == [j + rank for j in range(n)]
        expected = torch.cat([torch.full((j + rank,), 100 * j + rank) for j in range(n)])
        assert torch.equal(received, expected)
        assert traffic.bytes_recv == 8 * sum(j + rank for j in range(n) if j != rank)
        assert traffic.bytes_sent == 8 * sum(rank + j for j in range(n) if j != rank)


def test_all_to_all_v_rejects_bad_counts() -> None:
    world = SimulatedWorld(2, timeout_s=5)
    with pytest.raises(ValueError, match="send_counts"):
        world.run(lambda t: t.all_to_all_v(torch.zeros(3), [1, 1]))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_broadcast_and_send_recv(n: int) -> None:
    def body(t: Transport):
        value = t.broadcast(torch.tensor([t.rank + 7]), src=n - 1)
        right, left = (t.rank + 1) % n, (t.rank - 1) % n
        got = t.send_recv(torch.full((t.rank + 1,), t.rank, dtype=torch.uint8), right, left, device=torch.device("cpu"))
        t.barrier()
        return value, got

    for rank, ((value, got), traffic) in enumerate(_run_logged(n, body)):
        assert value.item() == n - 1 + 7
        left = (rank - 1) % n
        assert got is not None and got.tolist() == [left] * (left + 1)
        root_sent = 8 * (n - 1) if rank == n - 1 else 0
        assert traffic.bytes_sent == root_sent + rank + 1


def test_failing_rank_aborts_the_others_without_hanging() -> None:
    def body(t: Transport) -> None:
        if t.rank == 1:
            raise KeyError("boom")
        t.barrier()

    world = SimulatedWorld(4, timeout_s=30)
    with pytest.raises(KeyError, match="boom"):
        world.run(body)
    outcomes = world.run(body, return_exceptions=True)
    assert isinstance(outcomes[1], KeyError)
    assert all(isinstance(o, WorldAborted) for i, o in enumerate(outcomes) if i != 1)


def test_missing_rank_times_out() -> None:
    def body(t: Transport) -> None:
        if t.rank != 0:
            t.barrier()

    outcomes = SimulatedWorld(3, timeout_s=0.5).run(body, return_exceptions=True)
    assert all(isinstance(o, WorldAborted) for o in outcomes[1:])


def test_many_ranks() -> None:
    outs = SimulatedWorld(256, timeout_s=60).run(lambda t: t.all_reduce(torch.ones(3)))
    assert all(torch.equal(o, torch.full((3,), 256.0)) for o in outs)
    assert threading.active_count() < 50  # threads were joined


def test_non_blocking_traffic_goes_to_the_logs_and_phase_of_the_call() -> None:
    """Issued under a phase and a log, accounted to them, though the collective runs after both ended."""

    def body(t: Transport) -> tuple[dict, dict]:
        if t.rank == 1:
            time.sleep(0.2)  # rank 0's progress thread waits in the first rendezvous meanwhile
        first = t.all_reduce_async(torch.ones(4))
        log, blocking_log = TrafficLog(), TrafficLog()
        with t.recording(log), t.phase("push"):
            second = t.all_gather_async(torch.ones(3))
        first.wait(10), second.wait(10)
        with t.recording(blocking_log), t.phase("push"):
            t.all_gather(torch.ones(3))
        return log.phases, blocking_log.phases

    for phases, blocking in SimulatedWorld(2, timeout_s=30).run(body):
        assert set(phases) == {"push"}
        assert phases["push"].bytes_sent == blocking["push"].bytes_sent == 3 * 4
        assert phases["push"].num_calls == 1


@pytest.mark.parametrize("seed", range(3))
def test_fenced_non_blocking_collectives_keep_their_order_and_sums(seed: int) -> None:
    generators = [random.Random(seed * 10 + r) for r in range(4)]
    world = SimulatedWorld(4, timeout_s=30, delay_s=lambda r: generators[r].random() * 0.003)

    def issue(t: Transport) -> list:
        handles = []
        for i in range(4):
            handles.append(t.all_to_all_v_async(torch.arange(4.0) + 10 * t.rank, [1, 1, 1, 1]))
            handles.append(t.all_reduce_async(torch.full((i + 1,), float(t.rank + 1))))
        return [h.wait(10) for h in handles]

    def body(t: Transport):
        log, plain = TrafficLog(), TrafficLog()
        with t.recording(log), t.fenced():
            results = issue(t)
        with t.recording(plain):
            assert [str(r) for r in issue(t)] == [str(r) for r in results]
        return results, log.get("other"), plain.get("other")

    for rank, (results, fenced, plain) in enumerate(world.run(body)):
        for i in range(4):
            (received, counts), summed = results[2 * i], results[2 * i + 1]
            assert counts == [1, 1, 1, 1]
            assert torch.equal(received, torch.tensor([10.0 * r + rank for r in range(4)]))
            assert torch.equal(summed, torch.full((i + 1,), 10.0))
        # The barriers are neither counted nor sent as traffic.
        fenced.comm_time_s = plain.comm_time_s = 0.0
        assert fenced == plain


def test_a_failing_byte_count_fails_the_call_not_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    original = Transport._gather_traffic

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ArithmeticError("accounting bug")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Transport, "_gather_traffic", flaky)
    world = SimulatedWorld(1, timeout_s=30)

    def body(t: Transport):
        with pytest.raises(ArithmeticError, match="accounting bug"):
            t.all_gather_async(torch.ones(2)).wait(5)
        return t.all_gather_async(torch.ones(2)).wait(5)

    (out,) = world.run(body)
    assert torch.equal(out[0], torch.ones(2))


def test_timed_sections_go_to_every_installed_log() -> None:
    """``timed`` adds a section's wall time to each installed log (nested ones too), only while
    installed; ``note_time`` adds a given time the same way."""
    sleep_s = 0.02

    def body(t: Transport) -> tuple[TrafficLog, TrafficLog]:
        outer, inner = TrafficLog(), TrafficLog()
        with t.timed("ignored"):  # no log installed: nothing to add to
            pass
        with t.recording(outer):
            with t.timed("compress"):
                time.sleep(sleep_s)
            with t.recording(inner), t.timed("compress"):
                time.sleep(sleep_s)
            t.note_time("codec", 0.5)
        return outer, inner

    (outer, inner), *_ = SimulatedWorld(2, timeout_s=30).run(body)
    assert set(outer.work_s) == {"compress", "codec"} and set(inner.work_s) == {"compress"}
    assert outer.work_s["compress"] >= 2 * sleep_s and sleep_s <= inner.work_s["compress"] < outer.work_s["compress"]
    assert outer.work_s["codec"] == 0.5


def test_hold_starts_later_collectives_when_the_guard_passes() -> None:
    """Collectives issued after ``hold`` wait for the guard, then run in their order."""

    def body(t: Transport) -> tuple[bool, list[torch.Tensor]]:
        guard: Handle[None] = Handle()
        t.hold(guard)
        first = t.all_reduce_async(torch.full((3,), float(t.rank + 1)))
        second = t.all_gather_async(torch.tensor([t.rank]))
        time.sleep(0.05)
        waited = not first.done() and not second.done()
        guard.set_result(None)
        return waited, [first.wait(), torch.cat(second.wait())]

    n = 3
    for waited, (summed, gathered) in SimulatedWorld(n, timeout_s=30).run(body):
        assert waited
        assert torch.equal(summed, torch.full((3,), n * (n + 1) / 2))
        assert torch.equal(gathered, torch.arange(n))


def test_a_failed_hold_fails_every_later_collective_until_release() -> None:
    """A failed guard's exception (its own type and message) fails the collectives that waited
    and those issued later, none of which starts; after ``release`` they run again."""

    class CheckFailed(ValueError):
        pass

    def body(t: Transport) -> tuple[list[str], torch.Tensor]:
        guard: Handle[None] = Handle()
        t.hold(guard)
        waiting = t.all_reduce_async(torch.ones(2))
        guard.set_exception(CheckFailed("ranks [1] hold another engine state"))
        later = t.all_gather_async(torch.tensor([t.rank]))
        errors = []
        for handle in (waiting, later):
            with pytest.raises(CheckFailed, match="another engine state") as caught:
                handle.wait()
            errors.append(type(caught.value).__name__)
        t.release()
        return errors, t.all_reduce(torch.ones(2))

    n = 2
    for errors, summed in SimulatedWorld(n, timeout_s=30).run(body):
        assert errors == ["CheckFailed", "CheckFailed"]
        assert torch.equal(summed, torch.full((2,), float(n)))


def _covered_time(spans: list[tuple[float, float]]) -> float:
    log = TrafficLog()
    for span in spans:
        Transport._account_to([log], "p", 0, 0, 0, 0, span)
    return log.get("p").comm_time_s


@pytest.mark.parametrize(
    ("spans", "union"),
    [
        ([(0.0, 1.0), (2.0, 3.0)], 2.0),  # one after the other: the sum
        ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # in flight together: once
        ([(1.0, 2.0), (0.0, 3.0)], 3.0),  # the longer one completes last
        ([(0.0, 1.0), (2.0, 3.0), (0.5, 4.0)], 4.0),  # one across a gap between two others
        ([(0.0, 4.0), (1.0, 2.0), (3.0, 5.0)], 5.0),
        ([(0.0, 1.0), (1.0, 2.0), (0.0, 2.0)], 2.0),
    ],
)
def test_a_phase_counts_collectives_in_flight_together_once(spans: list, union: float) -> None:
    assert _covered_time(spans) == pytest.approx(union, abs=1e-12)


def test_a_phase_keeps_its_last_64_stretches() -> None:
    """70 disjoint collectives, then one over all of them: the 6 oldest stretches are forgotten
    and count again (the documented bound), the 64 kept ones once."""
    spans = [(2.0 * i, 2.0 * i + 1) for i in range(70)]
    assert _covered_time([*spans, (0.0, 139.0)]) == pytest.approx(139.0 + 6, abs=1e-9)


@pytest.mark.parametrize("n", [1, 3])
def test_broadcast_text_gives_every_rank_the_source_ranks_text(n: int) -> None:
    src = n - 1
    texts = ["", "ß-zen ✓ " * 1000, "x"]
    outs = SimulatedWorld(n).run(lambda t: [t.broadcast_text(f"{t.rank}:{s}", src=src) for s in texts])
    for out in outs:
        assert out == [f"{src}:{s}" for s in texts]

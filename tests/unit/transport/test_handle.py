"""Handles, tasks and lanes: outcomes keep their exception type, lanes run coroutines in submission order."""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import torch

from zensync.transport import Handle, Lane, SimulatedWorld, Task, TrafficLog, hand_on, handed_on, run_sync


class _Boom(KeyError):
    pass


def _later(value: object, delay_s: float, error: BaseException | None = None) -> Handle[object]:
    """A handle completed from another thread after ``delay_s``."""
    handle: Handle[object] = Handle()

    def complete() -> None:
        time.sleep(delay_s)
        if error is None:
            handle.set_result(value)
        else:
            handle.set_exception(error)

    threading.Thread(target=complete, daemon=True).start()
    return handle


def test_wait_returns_value_and_reraises_original_exception() -> None:
    assert Handle.completed(3).wait() == 3
    failed = Handle.from_call(lambda: (_ for _ in ()).throw(_Boom("words")))
    with pytest.raises(_Boom, match="words"):
        failed.wait()
    assert isinstance(failed.error, _Boom)


def test_wait_times_out() -> None:
    with pytest.raises(TimeoutError):
        Handle().wait(timeout=0.01)


def test_completing_twice_is_an_error() -> None:
    handle = Handle.completed(1)
    with pytest.raises(RuntimeError, match="completed twice"):
        handle.set_result(2)


def test_then_chains_values_and_passes_failures_on() -> None:
    assert Handle.completed(2).then(lambda v: v * 5).wait() == 10
    failed: Handle[int] = Handle()
    failed.set_exception(_Boom("first"))
    with pytest.raises(_Boom, match="first"):
        failed.then(lambda v: v + 1).wait()
    with pytest.raises(ZeroDivisionError):
        Handle.completed(0).then(lambda v: 1 / v).wait()


def test_callbacks_run_before_waiters_wake() -> None:
    seen: list[str] = []
    handle: Handle[int] = Handle()
    handle.add_done_callback(lambda h: (time.sleep(0.02), seen.append("callback")))
    threading.Thread(target=handle.set_result, args=(1,), daemon=True).start()
    handle.wait()
    seen.append("waiter")
    assert seen == ["callback", "waiter"]


def test_torch_future_quotes_the_original_error() -> None:
    ok = Handle.completed(torch.ones(2)).to_torch_future()
    assert torch.equal(ok.wait(), torch.ones(2))
    failed: Handle[torch.Tensor] = Handle()
    failed.set_exception(_Boom("lost type"))
    with pytest.raises(RuntimeError, match="_Boom: 'lost type'"):
        failed.to_torch_future().wait()


def test_task_drives_a_coroutine_across_threads_and_keeps_exception_type() -> None:
    async def body() -> int:
        a = await _later(1, 0.01)
        b = await _later(2, 0.0)
        with contextlib.suppress(_Boom):  # the awaited handle's own exception, caught inside the coroutine
            await _later(None, 0.01, _Boom("inside"))
        return a + b

    assert Task(body()).start().wait(timeout=5) == 3

    async def failing() -> int:
        await _later(None, 0.01, _Boom("escapes"))
        return 0

    with pytest.raises(_Boom, match="escapes"):
        Task(failing()).start().wait(timeout=5)


def test_task_refuses_awaiting_something_else() -> None:
    class _NotAHandle:
        def __await__(self):
            yield 42

    async def body() -> None:
        await _NotAHandle()

    with pytest.raises(TypeError, match="not a Handle"):
        Task(body()).start().wait(timeout=5)


def test_run_sync_drives_to_completion() -> None:
    async def body() -> int:
        return (await _later(4, 0.01)) * 2

    assert run_sync(body()) == 8


@pytest.mark.parametrize("seed", range(5))
def test_lane_runs_coroutines_one_at_a_time_in_submission_order(seed: int) -> None:
    rng = random.Random(seed)
    lane = Lane()
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    async def job(i: int) -> int:
        with lock:
            events.append(("start", i))
        for _ in range(3):
            await _later(None, rng.random() * 0.003)
        with lock:
            events.append(("end", i))
        return i

    tasks = [lane.submit(job(i)) for i in range(8)]
    assert [t.wait(timeout=10) for t in tasks] == list(range(8))
    assert events == [(kind, i) for i in range(8) for kind in ("start", "end")]


def test_lane_goes_on_after_a_failed_job_and_drains() -> None:
    lane = Lane()

    async def bad() -> None:
        await _later(None, 0.01, _Boom("bad"))

    async def good() -> int:
        return await _later(7, 0.0)  # type: ignore[return-value]

    first, second = lane.submit(bad()), lane.submit(good())
    assert second.wait(timeout=5) == 7
    assert isinstance(first.error, _Boom)
    assert lane.drain(timeout=5)


def test_transport_issue_order_is_call_order_whatever_the_completion_order() -> None:
    """Non-blocking collectives issued back to back (no awaits between) still pair up across ranks."""
    generators = [random.Random(11 + r) for r in range(4)]
    world = SimulatedWorld(4, timeout_s=30, delay_s=lambda r: generators[r].random() * 0.003)

    async def body(t):
        handles = []
        for i in range(6):
            x = torch.full((i + 1,), float(t.rank + 1))
            handles.append(t.all_reduce_async(x))
            handles.append(t.all_gather_v_async(torch.ones(t.rank + i)))
            handles.append(t.all_to_all_v_async(torch.arange(4.0) + 10 * t.rank, [1, 1, 1, 1]))
        return [await h for h in handles]

    results = world.run(lambda t: t.run(body(t)))
    for rank, out in enumerate(results):
        for i in range(6):
            summed, gathered, (received, counts) = out[3 * i : 3 * i + 3]
            assert torch.equal(summed, torch.full((i + 1,), 10.0))
            assert [g.numel() for g in gathered] == [r + i for r in range(4)]
            assert torch.equal(received, torch.tensor([rank + 10.0 * r for r in range(4)]))
            assert counts == [1, 1, 1, 1]


def test_a_raising_callback_does_not_stop_the_others() -> None:
    handle: Handle[int] = Handle()
    seen: list[int] = []

    def bad(_: Handle[int]) -> None:
        raise _Boom("callback bug")

    handle.add_done_callback(bad)
    handle.add_done_callback(lambda done: seen.append(done.outcome()))
    handle.set_result(5)  # logs the bug, raises nothing here
    assert seen == [5]
    assert handle.wait(timeout=1) == 5


def test_a_task_failing_after_another_keeps_no_foreign_exception_context() -> None:
    # The second task starts from the first one's completion: its exception must not be chained to
    # the first one's ("During handling of the above exception, another exception occurred").
    lane = Lane()

    async def fails_later() -> None:
        await _later(None, 0.005)
        raise _Boom("first")

    async def fails_at_once() -> None:
        raise _Boom("second")

    first, second = lane.submit(fails_later()), lane.submit(fails_at_once())
    assert lane.drain(timeout=5)
    assert isinstance(first.error, _Boom) and isinstance(second.error, _Boom)
    assert second.error.__context__ is None


def test_lane_starts_many_finished_coroutines_without_recursion() -> None:
    """Coroutines that finish as soon as they start (a failed step's buckets) cost no stack depth."""
    lane = Lane()
    gate: Handle[None] = Handle()
    order: list[int] = []

    async def blocked() -> None:
        await gate

    async def instant(i: int) -> int:
        order.append(i)
        return i

    first = lane.submit(blocked())
    n = 5000  # about 7 frames each if started recursively: far past the recursion limit
    tasks = [lane.submit(instant(i)) for i in range(n)]
    gate.set_result(None)
    assert first.wait(timeout=5) is None
    assert [t.wait(timeout=5) for t in tasks] == list(range(n))
    assert order == list(range(n))
    assert lane.drain(timeout=5)


def test_lane_with_a_thread_starts_coroutines_there_in_order() -> None:
    lane = Lane(thread_name="test-lane")
    threads: list[str] = []

    async def job(i: int) -> int:
        threads.append(threading.current_thread().name)
        await Handle.completed(None)  # a backend whose futures complete at once (NCCL's)
        await _later(None, 0.001 * (i % 3))
        return i

    tasks = [lane.submit(job(i)) for i in range(20)]
    assert [t.wait(timeout=5) for t in tasks] == list(range(20))
    assert lane.drain(timeout=5)
    assert threads[0] == "test-lane"  # the first start: on the lane's thread, not the submitter's
    assert "MainThread" not in threads


def test_lane_thread_ends_with_the_lane() -> None:
    import gc

    lane = Lane(thread_name="test-lane-ends")
    assert lane.submit(_instant()).wait(timeout=5) == 1
    assert any(t.name == "test-lane-ends" for t in threading.enumerate())
    del lane
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.name == "test-lane-ends" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "test-lane-ends" for t in threading.enumerate())


async def _instant() -> int:
    return 1


# -- hand-on: the next coroutine starts once the previous one issued its last collective ----------------
@pytest.mark.parametrize("seed", range(5))
def test_lane_hand_on_starts_the_next_job_while_the_first_still_waits(seed: int) -> None:
    """Jobs start in submission order; a job that hands on lets the next start before it ends,
    one that does not keeps the lane; drain waits for every unfinished job, handed on or not."""
    rng = random.Random(seed)
    lane = Lane()
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    hands = [rng.random() < 0.6 for _ in range(10)]

    async def job(i: int) -> int:
        with lock:
            events.append(("start", i))
        await _later(None, rng.random() * 0.002)
        if hands[i]:
            hand_on()
            hand_on()  # a second call does nothing
            assert handed_on()
            await _later(None, 0.02)  # "the collective": the next job runs meanwhile
        else:
            assert not handed_on()
            await _later(None, 0.002)
        with lock:
            events.append(("end", i))
        return i

    tasks = [lane.submit(job(i)) for i in range(10)]
    assert lane.drain(timeout=10)
    assert all(t.done() for t in tasks)
    assert [t.outcome() for t in tasks] == list(range(10))
    starts = [i for kind, i in events if kind == "start"]
    assert starts == list(range(10))
    for i in range(9):
        start_next, end_this = events.index(("start", i + 1)), events.index(("end", i))
        if hands[i]:
            assert start_next < end_this, (i, events)  # overlapped
        else:
            assert end_this < start_next, (i, events)  # the lane was held to the end


def test_hand_on_outside_a_lane_does_nothing() -> None:
    async def body() -> int:
        hand_on()
        assert not handed_on()
        return 3

    assert run_sync(body()) == 3
    assert Task(body()).start().wait(timeout=5) == 3


def test_a_collective_after_hand_on_is_refused_with_a_clear_error() -> None:
    """Issuing after handing on would let the ranks' orders differ: every rank fails, none hangs."""
    world = SimulatedWorld(2, timeout_s=10)

    async def job(t) -> None:
        first = t.all_reduce_async(torch.ones(2))
        hand_on()
        await first
        await t.all_reduce_async(torch.ones(2))

    def body(t):
        lane = Lane()
        task = lane.submit(job(t))
        assert lane.drain(timeout=10)
        return task.error

    for error in world.run(body):
        assert isinstance(error, RuntimeError) and "after its coroutine handed the lane on" in str(error)


@pytest.mark.parametrize("seed", range(3))
def test_overlapping_jobs_keep_their_own_phase_and_log(seed: int) -> None:
    """Two jobs of a lane overlap (hand-on); each one's collectives count in its own log and phase,
    whatever thread runs which segment, and the sums pair up across ranks in submission order."""
    generators = [random.Random(seed * 10 + r) for r in range(3)]
    world = SimulatedWorld(3, timeout_s=30, delay_s=lambda r: generators[r].random() * 0.004)

    async def job(t, i: int, log: TrafficLog) -> torch.Tensor:
        with t.recording(log), t.phase(f"job{i}"):
            first = await t.all_reduce_async(torch.full((i + 1,), float(t.rank)))
            last = t.all_gather_v_async(torch.ones(i + 1 + t.rank))
            hand_on()
            gathered = await last
            with t.timed(f"decode{i}"):
                time.sleep(0.001)
        return first + sum(g.sum() for g in gathered)

    def body(t):
        lane = Lane()
        logs = [TrafficLog() for _ in range(4)]
        tasks = [lane.submit(job(t, i, logs[i])) for i in range(4)]
        assert lane.drain(timeout=20)
        return [task.outcome() for task in tasks], logs

    for out, logs in world.run(body):
        for i in range(4):
            gathered = sum(i + 1 + r for r in range(3))
            assert torch.equal(out[i], torch.full((i + 1,), 3.0 + gathered))
            assert set(logs[i].phases) == {f"job{i}"}
            assert logs[i].phases[f"job{i}"].num_calls == 2
            assert set(logs[i].work_s) == {f"decode{i}"}

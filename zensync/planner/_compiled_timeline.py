"""The planner's timeline event loop compiled with numba, and a local search built on it.

``iteration_time`` computes exactly what ``zensync.planner.simulator.iteration_time`` computes (same
floating-point operations in the same order, same tie-breaking), on flat arrays instead of ``Unit``
objects: about a hundred times faster, which makes a search that re-simulates the whole iteration
for every (tensor, option) pair affordable. The Python event loop stays the reference (it also
records the timeline); the unit tests compare the two on random units.

Array layout (``n`` units, at most ``S`` stages each):

- ``ready[n]``: profiled ready time after the start of backward; ``compute[n]``: encode time charged
  to the compute stream;
- ``resource[n, S]``: ``WAIT`` (no shared resource), ``COMM`` (the FIFO comm stream) or ``CPU`` (the
  earliest free CPU worker); ``seconds[n, S]``; ``num_stages[n]``: stages actually used.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["COMM", "CPU", "WAIT", "descend", "iteration_time"]

WAIT, COMM, CPU = 0, 1, 2
"""Stage resource codes."""


@numba.njit(cache=True, nogil=True)
def _before(time_a: float, index_a: int, stage_a: int, time_b: float, index_b: int, stage_b: int) -> bool:
    """Request a sorts before request b: by time, then unit, then stage (Python's tuple order)."""
    if time_a != time_b:
        return time_a < time_b
    if index_a != index_b:
        return index_a < index_b
    return stage_a < stage_b


@numba.njit(cache=True, nogil=True)
def _skip_waits(
    resource: np.ndarray, seconds: np.ndarray, num_stages: np.ndarray, index: int, stage: int, time: float
) -> tuple[float, int]:
    while stage < num_stages[index] and resource[index, stage] == WAIT:
        time += seconds[index, stage]
        stage += 1
    return time, stage


@numba.njit(cache=True, nogil=True)
def _push(heap_t: np.ndarray, heap_i: np.ndarray, heap_s: np.ndarray, size: int, t: float, i: int, s: int) -> int:
    position = size
    while position > 0:
        parent = (position - 1) // 2
        if not _before(t, i, s, heap_t[parent], heap_i[parent], heap_s[parent]):
            break
        heap_t[position], heap_i[position], heap_s[position] = heap_t[parent], heap_i[parent], heap_s[parent]
        position = parent
    heap_t[position], heap_i[position], heap_s[position] = t, i, s
    return size + 1


@numba.njit(cache=True, nogil=True)
def _pop(heap_t: np.ndarray, heap_i: np.ndarray, heap_s: np.ndarray, size: int) -> int:
    """Remove the root (read it before calling); returns the new size."""
    size -= 1
    t, i, s = heap_t[size], heap_i[size], heap_s[size]
    position = 0
    while True:
        child = 2 * position + 1
        if child >= size:
            break
        if child + 1 < size and _before(
            heap_t[child + 1], heap_i[child + 1], heap_s[child + 1], heap_t[child], heap_i[child], heap_s[child]
        ):
            child += 1
        if not _before(heap_t[child], heap_i[child], heap_s[child], t, i, s):
            break
        heap_t[position], heap_i[position], heap_s[position] = heap_t[child], heap_i[child], heap_s[child]
        position = child
    heap_t[position], heap_i[position], heap_s[position] = t, i, s
    return size


@numba.njit(cache=True, nogil=True)
def iteration_time(
    forward_s: float,
    backward_s: float,
    ready: np.ndarray,
    compute: np.ndarray,
    resource: np.ndarray,
    seconds: np.ndarray,
    num_stages: np.ndarray,
    cpu_workers: int,
    stop_at: float = np.inf,
) -> float:
    """Forward + max(backward end with encode delays, the last unit's completion).

    With ``stop_at``, returns as soon as some stage ends at or after it (a search only needs to know
    the trial is not faster): the value returned is then a lower bound >= ``stop_at``, not the time.

    Example::

        iteration_time(
            0.0,
            2e-3,
            np.zeros(1),
            np.zeros(1),
            np.full((1, 1), COMM, np.int8),
            np.full((1, 1), 1e-3),
            np.ones(1, np.int64),
            1,
        )  # 2e-3
    """
    n = ready.shape[0]
    # Step 1: the compute stream; each unit's first request, waits applied.
    first_t = np.empty(n)
    first_s = np.empty(n, np.int64)
    delay = 0.0
    for index in range(n):
        first_t[index], first_s[index] = _skip_waits(
            resource, seconds, num_stages, index, 0, forward_s + ready[index] + delay
        )
        delay += compute[index]
    backward_end = forward_s + backward_s + delay
    if backward_end >= stop_at:
        return backward_end
    order = np.argsort(first_t, kind="mergesort")  # stable: ties keep unit order, as tuples sort
    # Step 2: serve requests in time order; follow-up requests go through a heap.
    capacity = n * max(resource.shape[1], 1) + 1
    heap_t, heap_i, heap_s = np.empty(capacity), np.empty(capacity, np.int64), np.empty(capacity, np.int64)
    size, position = 0, 0
    comm_free = 0.0
    workers = np.zeros(cpu_workers)
    end_s = backward_end
    while position < n or size > 0:
        if size > 0 and (
            position == n
            or _before(
                heap_t[0], heap_i[0], heap_s[0], first_t[order[position]], order[position], first_s[order[position]]
            )
        ):
            time, index, stage = heap_t[0], heap_i[0], heap_s[0]
            size = _pop(heap_t, heap_i, heap_s, size)
        else:
            index = order[position]
            time, stage = first_t[index], first_s[index]
            position += 1
        if stage >= num_stages[index]:
            end_s = max(end_s, time)
            continue
        duration = seconds[index, stage]
        if resource[index, stage] == COMM:
            start = comm_free if comm_free > time else time
            comm_free = start + duration
        else:
            worker = int(np.argmin(workers))
            start = workers[worker] if workers[worker] > time else time
            workers[worker] = start + duration
        if start + duration >= stop_at:
            return start + duration  # every later completion of this unit ends no earlier
        following_t, following_s = _skip_waits(resource, seconds, num_stages, index, stage + 1, start + duration)
        if following_s < num_stages[index]:
            size = _push(heap_t, heap_i, heap_s, size, following_t, index, following_s)
        else:
            end_s = max(end_s, following_t)
    return end_s


@numba.njit(cache=True, nogil=True)
def _set_unit(
    unit: int,
    option: int,
    compute: np.ndarray,
    resource: np.ndarray,
    seconds: np.ndarray,
    num_stages: np.ndarray,
    option_compute: np.ndarray,
    option_resource: np.ndarray,
    option_seconds: np.ndarray,
    option_stages: np.ndarray,
) -> None:
    compute[unit] = option_compute[option, unit]
    num_stages[unit] = option_stages[option]
    for stage in range(option_resource.shape[1]):
        resource[unit, stage] = option_resource[option, stage]
        seconds[unit, stage] = option_seconds[option, unit, stage]


@numba.njit(cache=True, nogil=True)
def descend(
    forward_s: float,
    backward_s: float,
    ready: np.ndarray,
    option_compute: np.ndarray,
    option_resource: np.ndarray,
    option_seconds: np.ndarray,
    option_stages: np.ndarray,
    choice: np.ndarray,
    candidates: np.ndarray,
    cpu_workers: int,
    max_sweeps: int,
    eps: float,
) -> float:
    """Coordinate descent: per candidate unit in turn, the option that minimises ``iteration_time``.

    ``option_compute[K, n]``, ``option_resource[K, S]`` (a stage's resource depends on the option
    only), ``option_seconds[K, n, S]``, ``option_stages[K]`` price option k for unit u. ``choice[n]``
    (option per unit) is updated in place; a change is kept only if it gains more than ``eps``.
    Sweeps over ``candidates`` (in their order) until one changes nothing, at most ``max_sweeps``.

    Returns:
        The iteration time of the final ``choice``.
    """
    n = ready.shape[0]
    num_options, max_stages = option_resource.shape
    compute = np.empty(n)
    resource = np.empty((n, max_stages), np.int8)
    seconds = np.empty((n, max_stages))
    num_stages = np.empty(n, np.int64)
    for unit in range(n):
        _set_unit(
            unit, choice[unit], compute, resource, seconds, num_stages,
            option_compute, option_resource, option_seconds, option_stages,
        )  # fmt: skip
    best = iteration_time(forward_s, backward_s, ready, compute, resource, seconds, num_stages, cpu_workers)
    for _ in range(max_sweeps):
        changed = False
        for unit in candidates:
            current = choice[unit]
            for option in range(num_options):
                if option == current:
                    continue
                _set_unit(
                    unit, option, compute, resource, seconds, num_stages,
                    option_compute, option_resource, option_seconds, option_stages,
                )  # fmt: skip
                time = iteration_time(
                    forward_s, backward_s, ready, compute, resource, seconds, num_stages, cpu_workers, best - eps
                )
                if time < best - eps:
                    best, current, changed = time, option, True
            choice[unit] = current
            _set_unit(
                unit, current, compute, resource, seconds, num_stages,
                option_compute, option_resource, option_seconds, option_stages,
            )  # fmt: skip
        if not changed:
            break
    return best

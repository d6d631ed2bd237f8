"""``IdleGate``: idle until a sync begins, busy until it ends; the windows are counted and a chunk's delay
on a sync is measured from the sync's start (scripted clock: exact values)."""

from __future__ import annotations

import threading

from zensync.resilience.gate import IdleGate

WAIT_S = 10.0
"""Far above the few milliseconds the waiting thread needs; a hang fails instead."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_windows_and_delays() -> None:
    clock = _Clock()
    gate = IdleGate(clock)
    assert gate.wait_idle(0) == (0, 0.0)  # idle before any sync
    clock.now = 1.0
    window, sent_s = gate.wait_idle(0)  # a chunk sent at t = 1, in the first window
    assert window == 0
    clock.now = 1.5
    gate.sync_begins()  # a sync begins mid-chunk
    assert gate.wait_idle(0) is None  # busy: no chunk may start
    clock.now = 1.75
    assert gate.chunk_done(sent_s) == 0.25  # the chunk ended 0.25 s into the sync
    clock.now = 2.0
    gate.sync_ends()
    assert gate.windows == 1 and gate.syncs == 1 and gate.wait_idle(0) == (1, 2.0)
    assert gate.chunk_done(2.0) == 0.0  # sent after the sync began: no delay


def test_a_sender_waits_for_the_sync_to_end() -> None:
    gate = IdleGate()
    gate.sync_begins()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(gate.wait_idle(WAIT_S)))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive() and not got  # still waiting while the sync runs
    gate.sync_ends()
    waiter.join(WAIT_S)
    assert got and got[0] is not None and got[0][0] == 1

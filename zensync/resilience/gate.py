"""The network's idle windows, as the gradient-sync engine reports them, for checkpoint traffic.

``IdleGate`` is a ``zensync.hooks.SyncListener``: zensync's DDP hook calls ``sync_begins`` at a
step's first bucket and ``sync_ends`` once its last bucket's collectives are done, so the windows
between (the optimizer step, the checkpoint save, the next forward and the backward up to its first
bucket) carry no gradient traffic. The replicator sends one chunk at a time, and only while the
gate is idle; a chunk still in flight when a step's sync begins delays that step's collectives by
at most the chunk's wire time, which ``chunk_done`` measures: from the moment the sync began to
the chunk's end.

A gate no hook reports to stays idle (no step is ever known to be syncing).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["IdleGate"]


class IdleGate:
    """Idle/busy state of the network for one rank, with the windows counted and delays measured.

    Args:
        clock: Seconds, monotonic (a test scripts it).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._busy = False
        self.windows = 0
        """Idle windows begun (one per finished sync, plus the first)."""
        self.syncs = 0
        """Syncs begun (steps)."""
        self._busy_since: float | None = None

    # -- the hook's side (zensync.hooks.SyncListener) ----------------------------------------------
    def sync_begins(self) -> None:
        """A step's gradient collectives begin (its first bucket)."""
        with self._cond:
            self._busy, self._busy_since = True, self._clock()
            self.syncs += 1

    def sync_ends(self) -> None:
        """The step's gradient collectives are done: an idle window begins."""
        with self._cond:
            self._busy = False
            self.windows += 1
            self._cond.notify_all()

    # -- the sender's side -------------------------------------------------------------------------
    def wait_idle(self, timeout_s: float | None = None) -> tuple[int, float] | None:
        """Block until the network is idle; returns (the window's index, the time now), or None when
        ``timeout_s`` passed first."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._busy, timeout_s):
                return None
            return self.windows, self._clock()

    def now(self) -> tuple[int, float]:
        """(the current window's index, the time now), for a chunk sent without waiting."""
        with self._cond:
            return self.windows, self._clock()

    def chunk_done(self, started_s: float) -> float:
        """The delay a chunk sent from ``started_s`` imposed: seconds from the first sync that began
        after it started to now (0 when no sync began meanwhile)."""
        now = self._clock()
        with self._cond:
            if self._busy_since is None or self._busy_since < started_s:
                return 0.0
            return max(0.0, now - self._busy_since)

"""Strategy "auto" with ``profile="warmup"``: the step profile measured from the hook's own first steps.

The hook marks, on the training thread, during the first ``warmup_steps`` steps it sees (plain
allreduce while in warm-up): each forward's start (DDP's forward pre-hook) and end (a forward
hook), each bucket's hook call (its gradients are ready) and the return of each step's last bucket.
At the next step, before its first bucket syncs, every rank (``WarmupProfiler.profile``):

1. compute, agreed over ranks (``zensync.profiling.agreed_compute``), from the second half of the
   marked steps (the first is DDP's initial buckets, and the next ones still run slower):
   forward = forward end - start; backward = last bucket's call - forward end (the loss and the
   backward, as the planner counts it; the warm-up's dense buckets run beside it, as
   communication will); a parameter is ready at its bucket's call - forward end; the rest of the
   step = next forward's start - the last bucket's return, after its collectives (optimizer,
   zeroing, data), the least rank's per step: the training loop may wait there for the other
   ranks (a barrier, a logged loss's allreduce), and the rank that arrives last waits the least;
2. the links and the compressors at the buckets' sizes (``zensync.profiling.profile_links``), in
   the hook's own group, on the training thread (blocking collectives: this step pays for them once);
3. the planner's choice (``ZenSyncState.measure_warmup_profile``), as with a profile given to ``register``.

A rank that missed a mark (a forward without grad, say) makes every rank fail with the same error.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from zensync.planner import StepProfile
from zensync.profiling import agreed_compute, profile_links
from zensync.transport import Transport

__all__ = ["WarmupProfiler"]


@dataclasses.dataclass(slots=True)
class _Marks:
    """One step's marks (the profiler's clock)."""

    forward_start: float | None = None
    forward_end: float | None = None
    buckets: list[tuple[tuple[str, ...], float]] = dataclasses.field(default_factory=list)
    end: float | None = None


class WarmupProfiler:
    """Marks ``steps`` steps from the first it sees on, then measures the step profile (``profile``).

    Args:
        steps: Steps to mark; the first half is not timed (``untimed``: DDP rebuilds its buckets after
            the first, and the next ones still run slower).
        shapes: Each parameter's shape, by name.
        dtype_bytes: Bytes per gradient element.
        specs: The compressors to time (``HookConfig.auto_compressors``).
        clock: Seconds, monotonic (tests pass their own).
    """

    __slots__ = ("_clock", "_marks", "_shapes", "done", "dtype_bytes", "first_step", "specs", "steps")

    def __init__(
        self,
        steps: int,
        shapes: dict[str, tuple[int, ...]],
        dtype_bytes: int,
        specs: Sequence[str],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._clock = clock
        self.steps = steps
        self._shapes = shapes
        self.dtype_bytes = dtype_bytes
        self.specs = tuple(specs)
        self.first_step: int | None = None
        """The first step marked (the hook's step counter at the first forward)."""
        self.done = False
        self._marks: dict[int, _Marks] = {}

    def _at(self, step: int) -> _Marks | None:
        if self.done:
            return None
        if self.first_step is None:
            self.first_step = step
        if not self.first_step <= step <= self.first_step + self.steps:  # the adopting step's start too
            return None
        return self._marks.setdefault(step, _Marks())

    def forward_start(self, step: int) -> None:
        marks = self._at(step)
        if marks is not None:
            marks.forward_start = self._clock()

    def forward_end(self, step: int) -> None:
        marks = self._at(step)
        if marks is not None:
            marks.forward_end = self._clock()

    def bucket(self, step: int, names: Sequence[str]) -> None:
        marks = self._at(step)
        if marks is not None:
            marks.buckets.append((tuple(names), self._clock()))

    def step_end(self, step: int) -> None:
        marks = self._at(step)
        if marks is not None:
            marks.end = self._clock()

    @property
    def untimed(self) -> int:
        """Marked steps left out first: half of them, at least DDP's first (its initial buckets); the
        first steps after it still run slower (caches, allocator, the optimizer's first buffers)."""
        return max(1, self.steps // 2)

    def due(self, step: int) -> bool:
        """Whether ``step`` is the one that measures the profile (the first after the marked ones)."""
        return not self.done and self.first_step is not None and step >= self.first_step + self.steps

    def profile(self, transport: Transport, repeats: int = 5) -> StepProfile:
        """Steps 1 and 2 of the module docstring (collective); the same ``StepProfile`` on every rank.

        Raises:
            RuntimeError: On every rank, when any rank lacks a mark of the timed steps.
        """
        assert self.first_step is not None
        self.done = True
        timed = range(self.first_step + self.untimed, self.first_step + self.steps)
        missing = [s for s in timed if not self._complete(s)]
        flags = transport.all_gather(torch.tensor([len(missing)], dtype=torch.int64))
        if any(int(f.item()) for f in flags):
            ranks = [r for r, f in enumerate(flags) if int(f.item())]
            raise RuntimeError(
                f"zensync auto profile='warmup': rank(s) {ranks} did not see every forward, bucket and step end "
                f"of steps {timed.start}-{timed.stop - 1} (a forward without grad or under no_sync in the "
                f"warm-up?); pass a measured profile instead (zensync.profile_group)"
            )
        forward, backward, other = [], [], []
        ready: dict[str, list[float]] = {name: [] for name in self._shapes}
        for s in timed:
            marks, following = self._marks[s], self._marks[s + 1]
            assert marks.forward_start is not None and marks.forward_end is not None and marks.end is not None
            assert following.forward_start is not None
            forward.append(marks.forward_end - marks.forward_start)
            backward.append(marks.buckets[-1][1] - marks.forward_end)
            other.append(following.forward_start - marks.end)
            for names, called in marks.buckets:
                for name in names:
                    ready[name].append(called - marks.forward_end)
        buckets = tuple(names for names, _ in self._marks[timed.stop - 1].buckets)
        measured = {name: times for name, times in ready.items() if times}
        device = f"measured in warm-up steps {timed.start}-{timed.stop - 1}, x{transport.world_size} ranks"
        profile, other_s = agreed_compute(
            transport,
            forward,
            backward,
            other,
            measured,
            self._shapes,
            buckets,
            self.dtype_bytes,
            "warmup",
            device,
            other_waits=True,
        )
        self._marks.clear()
        return profile_links(transport, profile, other_s, buckets, self.specs, repeats)

    def _complete(self, step: int) -> bool:
        marks, following = self._marks.get(step), self._marks.get(step + 1)
        return (
            marks is not None
            and following is not None
            and None not in (marks.forward_start, marks.forward_end, marks.end, following.forward_start)
            and bool(marks.buckets)
        )

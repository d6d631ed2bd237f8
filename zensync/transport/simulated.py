"""An in-process world of p logical ranks: threads running the same SPMD function.

Used by the tests (world sizes 1..8 in one process, no sockets) and by the scale experiments
(p = 64..1024 on one machine). Collectives are real data exchanges between the threads through
shared slots and a barrier, so every algorithm runs exactly the code it runs on torch.distributed;
byte accounting is the transport's logical model (``zensync.transport.base``).

Example::

    world = SimulatedWorld(num_ranks=4)
    results = world.run(lambda t: zensync.sparse_allreduce(x[t.rank], group=t))

A rank that raises aborts the world: the others fail at their next collective instead of waiting,
and ``run`` re-raises the first root-cause exception (or returns every rank's outcome with
``return_exceptions=True``).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from zensync.transport.base import Transport, _ring_chunk
from zensync.transport.handle import Handle

__all__ = ["SimulatedTransport", "SimulatedWorld", "WorldAborted"]

T = TypeVar("T")


class WorldAborted(RuntimeError):
    """Raised in a rank whose collective was interrupted because another rank failed."""


class _Barrier:
    """A reusable barrier whose abort breaks only waits that have not completed.

    (threading.Barrier.abort also breaks threads already released but not yet woken up, so a rank
    that fails right after a completed rendezvous would wrongly interrupt its peers.)
    """

    def __init__(self, parties: int) -> None:
        self._parties = parties
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._broken = False

    def wait(self, timeout: float) -> None:
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._arrived += 1
            if self._arrived == self._parties:
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return
            self._cond.wait_for(lambda: self._generation != generation or self._broken, timeout)
            if self._generation != generation:
                return
            self._broken = True
            self._cond.notify_all()
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()


@dataclasses.dataclass(kw_only=True, slots=True)
class _Shared:
    num_ranks: int
    timeout_s: float
    barrier: _Barrier
    slots: list[Any]
    mailboxes: dict[tuple[int, int], queue.Queue[torch.Tensor]]
    mailbox_lock: threading.Lock
    aborted: threading.Event
    children: list[_Shared] = dataclasses.field(default_factory=list)
    """Worlds split from this one (``split``): aborted with it."""
    delay_s: Callable[[int], float] | None = None
    """Seconds by which the completion of each non-blocking collective of a rank reaches its caller
    (tests: random completion delays per rank, so completions arrive out of order); None: at once."""
    transports: list[SimulatedTransport] = dataclasses.field(default_factory=list)
    """Every transport of this world (and its splits) with a progress thread, closed by ``run``."""

    def abort(self) -> None:
        self.aborted.set()
        self.barrier.abort()
        for child in list(self.children):
            child.abort()


def _new_shared(num_ranks: int, timeout_s: float, delay_s: Callable[[int], float] | None = None) -> _Shared:
    return _Shared(
        num_ranks=num_ranks,
        timeout_s=timeout_s,
        delay_s=delay_s,
        barrier=_Barrier(num_ranks),
        slots=[None] * num_ranks,
        mailboxes={},
        mailbox_lock=threading.Lock(),
        aborted=threading.Event(),
    )


_STOP = object()


class SimulatedTransport(Transport):
    """One logical rank of a ``SimulatedWorld``.

    Its collectives are rendezvous of the rank threads, so they block: a blocking call runs on the
    calling thread. The non-blocking forms need someone to wait in the rendezvous while the caller
    goes on, so they run on this rank's progress thread (started by the first one; the simulated
    world has no asynchronous backend to hand them to, which is why this thread exists). Once it
    exists every collective of the rank goes through it, in call order (``Transport._issue``).
    """

    def __init__(self, shared: _Shared, rank: int) -> None:
        super().__init__(rank, shared.num_ranks)
        self._shared = shared
        self._progress: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    # -- issue: inline when blocking, else on the progress thread ----------------------------------
    def _issue(
        self,
        start_op: Any,
        traffic: Any,
        start: Any,
        *,
        blocking: bool,
        multi_stage: bool = False,
        captured: Any = None,
        op: str = "other",
        size: Any = None,
    ) -> Any:
        on_progress = threading.current_thread() is self._progress
        blocking = blocking or self._driven_here()  # a coroutine driven by ``run`` on this thread
        captured = captured if captured is not None else self._capture()  # the call's, not the job's
        if on_progress or (blocking and self._progress is None):
            return super()._issue(
                start_op, traffic, start, blocking=True, multi_stage=multi_stage, captured=captured, op=op, size=size
            )
        self._ensure_progress()
        handle: Handle[Any] = Handle()
        delay = self._shared.delay_s if not blocking else None

        def job() -> None:
            try:
                inner = super(SimulatedTransport, self)._issue(
                    start_op,
                    traffic,
                    start,
                    blocking=True,
                    multi_stage=multi_stage,
                    captured=captured,
                    op=op,
                    size=size,
                )
            except BaseException as exc:  # noqa: BLE001 - the call fails; the progress thread lives on
                handle.set_exception(exc)
                return
            if delay is None:
                inner.forward_to(handle)
                return
            # The collective ran in issue order; its completion reaches the caller later, from
            # another thread, so completions arrive out of order, as a backend's worker threads
            # deliver them.
            timer = threading.Timer(delay(self.rank), inner.forward_to, args=(handle,))
            timer.daemon = True
            timer.start()

        self._jobs.put(job)
        return handle

    def _ensure_progress(self) -> None:
        if self._progress is None:
            self._progress = threading.Thread(target=self._loop, name=f"sim-progress-{self.rank}", daemon=True)
            self._shared.transports.append(self)
            self._progress.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            job()

    def close(self) -> None:
        """Stop the progress thread after the queued collectives (``SimulatedWorld.run`` calls it)."""
        if self._progress is not None and self._progress is not threading.current_thread():
            self._jobs.put(_STOP)
            self._progress.join(timeout=self._shared.timeout_s)
            self._progress = None

    # One rendezvous: deposit, wait, read everyone's deposit, wait again before slots are reused.
    def _exchange(self, item: Any) -> list[Any]:
        shared = self._shared
        shared.slots[self.rank] = item
        self._wait()
        items = list(shared.slots)
        self._wait()
        return items

    def _wait(self) -> None:
        try:
            self._shared.barrier.wait(timeout=self._shared.timeout_s)
        except threading.BrokenBarrierError:
            self._shared.aborted.set()
            raise WorldAborted(
                f"rank {self.rank}: collective interrupted (another rank failed, or a rank did not "
                f"reach the collective within {self._shared.timeout_s} s)"
            ) from None

    def _all_reduce(self, tensor: torch.Tensor) -> Handle[torch.Tensor]:
        return Handle.from_call(lambda: self._all_reduce_now(tensor))

    def _all_reduce_now(self, tensor: torch.Tensor) -> torch.Tensor:
        inputs = self._exchange(tensor)
        # Step 1: reduce-scatter. Rank r sums chunk r over ranks in rank order (deterministic);
        # chunk bounds as torch.tensor_split, computed directly (O(1) per input, not O(n)).
        numel, n, r = tensor.numel(), self.world_size, self.rank
        start = r * (numel // n) + min(r, numel % n)
        stop = start + _ring_chunk(numel, n, r)
        mine = inputs[0][start:stop].clone()
        for other in inputs[1:]:
            mine += other[start:stop]
        # Step 2: all-gather of the reduced chunks, written back in place.
        torch.cat(self._exchange(mine), out=tensor)
        return tensor

    def _all_gather(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        return Handle.from_call(lambda: self._all_gather_now(tensor))

    def _all_gather_now(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        items = self._exchange(tensor)
        if any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in items):
            raise ValueError(
                f"all_gather needs equal shapes and dtypes on every rank, got "
                f"{[(tuple(t.shape), t.dtype) for t in items]}"
            )
        return items

    def _all_gather_v(self, tensor: torch.Tensor) -> Handle[tuple[list[torch.Tensor], int | None]]:
        # Received tensors are shared with their owners: callers must not modify them in place.
        return Handle.from_call(lambda: (self._exchange(tensor), None))

    def _all_to_all_v(
        self, tensor: torch.Tensor, counts: list[int], recv_counts: list[int] | None
    ) -> Handle[tuple[torch.Tensor, list[int]]]:
        return Handle.from_call(lambda: self._all_to_all_v_now(tensor, counts, recv_counts))

    def _all_to_all_v_now(
        self, tensor: torch.Tensor, counts: list[int], known: list[int] | None
    ) -> tuple[torch.Tensor, list[int]]:
        offsets = list(itertools.accumulate(counts, initial=0))
        items = self._exchange((tensor, counts, offsets))
        received, recv_counts = [], []
        for src_tensor, src_counts, src_offsets in items:
            offset = src_offsets[self.rank]
            received.append(src_tensor[offset : offset + src_counts[self.rank]])
            recv_counts.append(src_counts[self.rank])
        if known is not None and known != recv_counts:  # a real backend would fail or misplace data
            raise ValueError(f"all_to_all_v: recv_counts={known} on rank {self.rank}, but the peers send {recv_counts}")
        return torch.cat(received), recv_counts

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        return Handle.from_call(lambda: self._exchange(tensor)[src].clone())

    def _mailbox(self, src: int, dst: int) -> queue.Queue[torch.Tensor]:
        shared = self._shared
        with shared.mailbox_lock:
            box = shared.mailboxes.get((src, dst))
            if box is None:
                box = shared.mailboxes[(src, dst)] = queue.Queue()
            return box

    def _send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> Handle[torch.Tensor | None]:
        return Handle.from_call(lambda: self._send_recv_now(tensor, dst, src, device))

    def _send_recv_now(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> torch.Tensor | None:
        if tensor is not None and dst is not None:
            self._mailbox(self.rank, dst).put(tensor.clone())
        if src is None:
            return None
        box = self._mailbox(src, self.rank)
        waited = 0.0
        while True:
            if self._shared.aborted.is_set():
                raise WorldAborted(f"rank {self.rank}: receive from rank {src} interrupted (another rank failed)")
            try:
                return box.get(timeout=0.05).to(device)
            except queue.Empty:
                waited += 0.05
                if waited >= self._shared.timeout_s:
                    self._shared.abort()
                    raise TimeoutError(
                        f"rank {self.rank}: no message from rank {src} within {self._shared.timeout_s} s"
                    ) from None

    def _barrier(self) -> Handle[None]:
        return Handle.from_call(self._wait)

    def _split(self, color: int) -> SimulatedTransport:
        colors = self._exchange(color)
        members = [r for r, c in enumerate(colors) if c == color]
        # The lowest member creates its group's shared state; everyone picks up its leader's.
        mine = None
        if members[0] == self.rank:
            mine = _new_shared(len(members), self._shared.timeout_s, self._shared.delay_s)
            mine.transports = self._shared.transports  # closed with the world
            with self._shared.mailbox_lock:
                self._shared.children.append(mine)
        offered = self._exchange(mine)
        return SimulatedTransport(offered[members[0]], members.index(self.rank))


class SimulatedWorld:
    """Runs an SPMD function on ``num_ranks`` logical ranks, one thread each.

    Args:
        num_ranks: Number of logical ranks (1..4096).
        timeout_s: How long a rank waits at a collective before the world is declared hung.
        single_thread_torch: Run torch with one intra-op thread while the world runs (restored
            afterwards): p ranks are already p threads, and more would only contend.
        delay_s: Each non-blocking collective of a rank completes for its caller ``delay_s(rank)``
            seconds after it ran (delivered from a timer thread), so completions arrive in another
            order on every rank: tests of the issue order use it. None: at once.
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        timeout_s: float = 120.0,
        single_thread_torch: bool = True,
        delay_s: Callable[[int], float] | None = None,
    ) -> None:
        if not 1 <= num_ranks <= 4096:
            raise ValueError(f"num_ranks={num_ranks} must be in 1..4096")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        self.single_thread_torch = single_thread_torch
        self.delay_s = delay_s

    def run(
        self,
        fn: Callable[[SimulatedTransport], T],
        *,
        return_exceptions: bool = False,
    ) -> list[T] | list[T | BaseException]:
        """Call ``fn(transport)`` on every rank concurrently; return the per-rank results in rank order.

        With ``return_exceptions=True`` a rank's exception is returned in its place instead of raised.
        """
        shared = _new_shared(self.num_ranks, self.timeout_s, self.delay_s)
        outcomes: list[Any] = [None] * self.num_ranks
        failed = [False] * self.num_ranks

        def body(rank: int) -> None:
            try:
                outcomes[rank] = fn(SimulatedTransport(shared, rank))
            except BaseException as exc:  # noqa: BLE001 - re-raised by run() below
                outcomes[rank], failed[rank] = exc, True
                shared.abort()

        previous_threads = torch.get_num_threads()
        if self.single_thread_torch:
            torch.set_num_threads(1)
        try:
            threads = [threading.Thread(target=body, args=(r,), name=f"sim-rank-{r}") for r in range(self.num_ranks)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            torch.set_num_threads(previous_threads)
            for transport in list(shared.transports):
                transport.close()
        if return_exceptions or not any(failed):
            return outcomes
        root_causes = [o for o, f in zip(outcomes, failed, strict=True) if f and not isinstance(o, WorldAborted)]
        raise (root_causes or [o for o, f in zip(outcomes, failed, strict=True) if f])[0]

"""One communication thread per hook state: buckets are synchronized in FIFO order, off the autograd thread.

DDP calls a comm hook on its autograd thread as each bucket becomes ready and waits for the returned
futures only at the end of backward, so work queued here overlaps the rest of backward. Every
collective of a state goes through this one thread, in the order the hook was called, which is the
same on every rank: the ranks' collectives always match.

Errors: DDP's reducer reads a hook's Future in C++, which cannot hold a Python exception object (a
Python ``Future.set_exception`` reaches the user as "Unable to cast ... to Tensor"). A ``Job``'s
``future`` therefore fails through a chained callback (a RuntimeError quoting the original), and
``Job.result()`` re-raises the original exception itself, with its type, for a caller that waits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

__all__ = ["CommWorker", "Job"]

_STOP = object()


class Job:
    """One queued callable: ``future`` for DDP, ``result()`` for a caller that waits on the hook's thread."""

    __slots__ = ("_done", "_error", "_raw", "_value", "future", "work")

    def __init__(self, work: Callable[[], torch.Tensor]) -> None:
        self.work = work
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._value: torch.Tensor | None = None
        self._raw: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self.future: torch.futures.Future[torch.Tensor] = self._raw.then(self._unwrap)
        """Completes with the work's tensor, or fails with a RuntimeError quoting the work's exception."""

    def _unwrap(self, raw: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        return raw.value()

    def run(self) -> None:
        """Run the work (on the worker thread) and complete the job."""
        try:
            self._value = self.work()
        except BaseException as exc:  # noqa: BLE001 - kept for result() and the future; re-raised there
            self._error = exc
        self._done.set()
        self._raw.set_result(self._value if self._value is not None else torch.empty(0))

    def result(self) -> torch.Tensor:
        """Wait for the job; its tensor, or its exception re-raised with the original type and message."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


class CommWorker:
    """A daemon thread running submitted callables in order."""

    __slots__ = ("_queue", "_thread")

    def __init__(self, name: str = "zensync-comm") -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], torch.Tensor]) -> Job:
        """Queue ``work``; the returned Job completes with its result or its exception."""
        job = Job(work)
        self._queue.put(job)
        return job

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            assert isinstance(item, Job)
            item.run()

    def close(self) -> None:
        """Stop the thread after the queued work."""
        self._queue.put(_STOP)
        self._thread.join(timeout=60)

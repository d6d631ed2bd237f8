"""One communication thread per hook state: buckets are synchronized in FIFO order, off the autograd thread.

DDP calls a comm hook on its autograd thread as each bucket becomes ready and waits for the returned
futures only at the end of backward, so work queued here overlaps the rest of backward. Every
collective of a state goes through this one thread, in the order the hook was called, which is the
same on every rank: the ranks' collectives always match.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import cast

import torch

__all__ = ["CommWorker"]

_STOP = object()


class CommWorker:
    """A daemon thread running submitted callables in order, fulfilling one Future each."""

    __slots__ = ("_queue", "_thread")

    def __init__(self, name: str = "zensync-comm") -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        """Queue ``work``; the returned Future gets its result or its exception."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._queue.put((work, future))
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            work, future = cast(tuple[Callable[[], torch.Tensor], torch.futures.Future[torch.Tensor]], item)
            try:
                result = work()
            except BaseException as exc:  # noqa: BLE001 - handed to the Future; DDP re-raises it
                future.set_exception(exc)  # type: ignore[arg-type]  # torch stubs say Tensor
            else:
                future.set_result(result)

    def close(self) -> None:
        """Stop the thread after the queued work."""
        self._queue.put(_STOP)
        self._thread.join(timeout=60)

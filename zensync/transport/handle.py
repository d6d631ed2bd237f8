"""Handles of pending collectives, the coroutines that chain them, and the lane that orders them.

Every collective of a ``Transport`` has a non-blocking form returning a ``Handle``: a thread-safe
future that keeps the original exception of a failed collective (type and message), unlike a
``torch.futures.Future``, whose Python errors reach DDP's C++ reducer as "Unable to cast ...".

Code that issues several dependent collectives is written as a coroutine that awaits handles::

    async def summed_twice(transport, x):
        once = await transport.all_reduce_async(x)
        return await transport.all_reduce_async(once * 2)

and is driven either to completion on the calling thread (``run_sync``, the blocking APIs) or by
the handles' completion callbacks (``Task``), as torch's own hooks chain ``fut.then(...)``: a
``Task`` runs each segment of its coroutine on whatever thread completed the awaited handle, so no
thread of zensync's own waits for the network.

Ordering rule: the ranks of a group must issue its collectives in the same order. Callbacks fire in
completion order, which differs between ranks (torch's PowerSGD hook breaks exactly there on gloo
with several buckets), so coroutines that share a group run one at a time on a ``Lane``, in the
order they were submitted, which is the order of the hook calls and the same on every rank.

A coroutine that has issued its last collective may hand the lane on (``hand_on``): the next one
starts then, while the first still waits for its collective and decodes its result, so the
compression of DDP's bucket i overlaps the transfer of bucket i-1, and the issue order is still the
submission order (a collective issued after handing on is refused: ``handed_on``).

Each Task runs its segments in a ``contextvars.Context`` of its own (copied when it is made), so
context variables set in one segment (the transport's phase and logs, a compressor's open step)
are the Task's, whatever thread runs the next segment and whatever other Task runs meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

import torch

__all__ = ["Handle", "Lane", "Task", "gather", "hand_on", "handed_on", "run_sync"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
U = TypeVar("U")

SegmentContext = Callable[[], contextlib.AbstractContextManager[Any]]
"""Entered around every segment of a Task (e.g. the caller's CUDA stream; see kernels.device)."""


class Handle(Generic[T]):
    """The pending result of a collective (or of a chain of them).

    ``wait()`` returns the value or re-raises the original exception; ``add_done_callback`` runs a
    callback once done (at once, on the caller's thread, when already done); ``await handle``
    inside a coroutine driven by ``Task`` or ``run_sync`` gives the value.
    """

    __slots__ = ("_callbacks", "_done", "_error", "_finished", "_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finished = False
        """Set (under the lock) when the outcome is known; callbacks added from then on run at once."""
        self._done = threading.Event()
        """Set after every callback ran: a waiter sees the byte accounting and chained state done."""
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle[T]], None]] = []

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def completed(cls, value: T) -> Handle[T]:
        """A handle that is already done with ``value``."""
        handle: Handle[T] = cls()
        handle.set_result(value)
        return handle

    @classmethod
    def from_call(cls, fn: Callable[[], T]) -> Handle[T]:
        """A done handle holding ``fn()``, or its exception (a blocking backend's collective)."""
        handle: Handle[T] = cls()
        value, error = _call(fn)
        handle._complete(value, error)
        return handle

    @classmethod
    def from_torch(cls, future: torch.futures.Future[Any], convert: Callable[[Any], T]) -> Handle[T]:
        """The handle of a torch Future (a backend's work), its value passed through ``convert``.

        Chained with ``then``: for CUDA futures torch makes the callback's current stream wait for
        the collective, so ``convert`` and everything chained after it see the finished data.
        """
        handle: Handle[T] = cls()

        def complete(done: torch.futures.Future[Any]) -> None:
            # done.value() re-raises a failed collective with its own type.
            value, error = _call(lambda: convert(done.value()))
            handle._complete(value, error)

        future.then(complete)
        return handle

    # -- completion --------------------------------------------------------------------------------
    def set_result(self, value: T) -> None:
        """Complete with ``value`` and run the callbacks (in the order they were added)."""
        self._complete(value, None)

    def set_exception(self, error: BaseException) -> None:
        """Fail with ``error`` (kept as is) and run the callbacks."""
        self._complete(None, error)

    def forward_to(self, other: Handle[T]) -> None:
        """When done, complete ``other`` the same way."""
        self.add_done_callback(lambda done: other._complete(done._value, done._error))

    def _complete(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._finished:
                raise RuntimeError("a zensync Handle was completed twice")
            self._value, self._error = value, error
            callbacks, self._callbacks = self._callbacks, []
            self._finished = True
        try:
            for callback in callbacks:
                _run_callback(callback, self)
        finally:
            self._done.set()

    # -- observation -------------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the outcome is known (callbacks may still be running on the completing thread)."""
        return self._finished

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait for completion without raising; False when ``timeout`` passed first."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> T:
        """The value; re-raises the collective's own exception. TimeoutError after ``timeout`` s."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"zensync: collective not done within {timeout} s")
        return self.outcome()

    def outcome(self) -> T:
        """The value of a finished handle, or its exception raised (no waiting; for callbacks)."""
        assert self._finished, "outcome() of a pending Handle"
        if self._error is not None:
            raise self._error
        return self._value

    @property
    def error(self) -> BaseException | None:
        """The exception of a failed handle (None while pending or after success)."""
        return self._error

    def add_done_callback(self, callback: Callable[[Handle[T]], None]) -> None:
        """Run ``callback(self)`` once done: on the completing thread, or now if already done."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(callback)
                return
        _run_callback(callback, self)

    def then(self, fn: Callable[[T], U]) -> Handle[U]:
        """A handle of ``fn(value)``; a failure (of this handle or of ``fn``) passes on unchanged."""
        chained: Handle[U] = Handle()

        def step(done: Handle[T]) -> None:
            if done._error is not None:
                chained.set_exception(done._error)
                return
            value, error = _call(lambda: fn(done._value))
            chained._complete(value, error)

        self.add_done_callback(step)
        return chained

    def to_torch_future(self) -> torch.futures.Future[T]:
        """A torch Future for DDP: the value, or a RuntimeError quoting the original exception.

        (DDP's reducer reads the Future in C++, which cannot carry a Python exception object.)
        """
        future: torch.futures.Future[T] = torch.futures.Future()

        def complete(done: Handle[T]) -> None:
            if done._error is not None:
                error = done._error
                future.set_exception(RuntimeError(f"{type(error).__name__}: {error}"))  # type: ignore[arg-type]
            else:
                future.set_result(done._value)

        self.add_done_callback(complete)
        return future

    def __await__(self) -> Generator[Handle[T], None, T]:
        if not self._finished:
            yield self  # the driver resumes this coroutine once the handle is finished
        return self.outcome()


def _call(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``(fn(), None)``, or ``(None, its exception)``.

    The caller completes a handle with it after the ``except`` clause has ended, so the callbacks
    that completion runs (the next bucket's coroutine, say) do not run "during handling of" this
    exception: their own exceptions would otherwise carry it as their ``__context__``.
    """
    try:
        return fn(), None
    except BaseException as exc:  # noqa: BLE001 - kept in a handle, re-raised by wait()
        return None, exc


def _run_callback(callback: Callable[[Handle[T]], None], handle: Handle[T]) -> None:
    # A callback runs on the thread that completed the handle (a backend's completion thread): an
    # exception escaping it would be lost there, and would stop the handle's later callbacks (a
    # DDP future's completion, the next task of a lane), so it is logged with its traceback and
    # the other callbacks still run. zensync's own callbacks (Task steps, accounting, forwarding)
    # catch their errors into handles themselves; this is the net under a bug.
    try:
        callback(handle)
    except BaseException:  # logged; see above
        logger.exception("zensync: a Handle callback raised")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Drive ``coro`` to completion on this thread, waiting for each handle it awaits (blocking APIs)."""
    while True:
        try:
            awaited = coro.send(None)
        except StopIteration as stop:
            return stop.value
        awaited.wait_done()  # then the coroutine reads the outcome (or its exception) itself


async def gather(*handles: Handle[Any]) -> list[Any]:
    """Every handle's value, in order (awaits them one by one; they proceed concurrently)."""
    return [await handle for handle in handles]


class Task(Handle[T]):
    """A coroutine driven by the completion callbacks of the handles it awaits.

    Each segment (the code between two awaits) runs inside ``context()`` on the thread that
    completed the previous handle; the first segment runs on the thread that calls ``start``.
    Every segment runs in the Task's own ``contextvars.Context``, copied from the thread that made
    the Task. The task completes with the coroutine's return value or its exception (original type).
    """

    __slots__ = ("_context", "_coro", "_ctx")

    def __init__(self, coro: Coroutine[Any, Any, T], context: SegmentContext | None = None) -> None:
        super().__init__()
        self._coro = coro
        self._context: SegmentContext = context or contextlib.nullcontext
        self._ctx = contextvars.copy_context()

    def start(self) -> Task[T]:
        self._step()
        return self

    def _segment(self) -> Any:
        with self._context():
            return self._coro.send(None)

    def _step(self, _: object = None) -> None:
        while True:  # loop over handles that are already done: no recursion, no callback per step
            finished, value, error = False, None, None
            try:
                awaited = self._ctx.run(self._segment)
            except StopIteration as stop:
                finished, value = True, stop.value
            except BaseException as exc:  # noqa: BLE001 - the task's outcome, re-raised by wait()
                finished, error = True, exc
            if finished:  # completed after the except clause: see _call
                self._complete(value, error)
                return
            if not isinstance(awaited, Handle):
                self._coro.close()
                self.set_exception(TypeError(f"a zensync Task awaited {type(awaited).__name__}, not a Handle"))
                return
            if not awaited.done():
                awaited.add_done_callback(self._step)
                return


_LANE_TASK: contextvars.ContextVar[tuple[Lane, Task[Any]] | None] = contextvars.ContextVar(
    "zensync_lane_task", default=None
)
"""In the context of a Task a Lane runs: that lane and task (for ``hand_on`` and ``handed_on``)."""


def hand_on() -> None:
    """Let the lane start its next coroutine now: the calling one has issued its last collective.

    Called from a coroutine running on a ``Lane`` (elsewhere it does nothing; so does a second
    call). The caller goes on (waits for its collectives, decodes) beside the next coroutine; a
    collective it issues afterwards would break the issue order, and the transports refuse it
    (``handed_on``).
    """
    slot = _LANE_TASK.get()
    if slot is not None:
        slot[0]._hand_on(slot[1])


def handed_on() -> bool:
    """Whether the calling coroutine runs on a lane it has handed on (``hand_on``)."""
    slot = _LANE_TASK.get()
    return slot is not None and slot[0]._is_handed_on(slot[1])


class Lane:
    """Runs coroutines one at a time, in the order they were submitted.

    Each coroutine starts when the previous one has finished (successfully or not) or handed the
    lane on (``hand_on``), on the thread that did so, or at once on the submitting thread when the
    lane is idle. Submitting in the same order on every rank (DDP calls its comm hook bucket by
    bucket, in the same order on every rank) therefore issues the group's collectives in the same
    order on every rank, whatever order the backend completes them in.

    With ``thread_name``, the coroutines start on a thread of the lane's own instead (one per lane,
    started on first use, ended with the lane): for backends whose futures complete as soon as the
    work is queued (NCCL), a coroutine would otherwise run to its end inline on the submitting
    thread, host synchronizations (``.tolist()`` of gathered counts) included, and stall it (DDP's
    autograd thread), as a comm thread avoids.

    Starting is a loop, not a recursion: coroutines that finish as soon as they start (every
    bucket of a step that already failed) cost no stack depth, however many are queued.
    """

    __slots__ = (
        "__weakref__",
        "_busy",
        "_handed",
        "_lock",
        "_looping",
        "_more",
        "_queue",
        "_thread_name",
        "_unfinished",
        "_wake",
    )

    def __init__(self, *, thread_name: str | None = None) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[Task[Any]] = collections.deque()
        self._busy = False
        """A submitted coroutine holds the lane (running and not handed on, or queued behind one)."""
        self._looping = False
        """A thread is in ``_loop`` (starting the next coroutine)."""
        self._more = False
        """The coroutine ``_loop`` started let the lane go while it was starting: start the next one."""
        self._unfinished: set[Task[Any]] = set()
        """Submitted tasks that have not finished (``drain`` waits for each)."""
        self._handed: set[Task[Any]] = set()
        """Tasks that handed the lane on before finishing (their end no longer moves the lane)."""
        self._thread_name = thread_name
        self._wake: queue.SimpleQueue[bool] | None = None

    def submit(self, coro: Coroutine[Any, Any, T], context: SegmentContext | None = None) -> Task[T]:
        """Queue ``coro``; the returned Task completes with its outcome."""
        task = Task(coro, context)
        task._ctx.run(_LANE_TASK.set, (self, task))
        task.add_done_callback(self._on_done)
        with self._lock:
            self._queue.append(task)
            self._unfinished.add(task)
            if self._busy:  # the running coroutine's end (or hand-on) starts the next
                return task
            self._busy = self._looping = True
        self._kick()
        return task

    def _on_done(self, done: Handle[Any]) -> None:
        with self._lock:
            self._unfinished.discard(done)
            if done in self._handed:  # the lane went on already
                self._handed.discard(done)
                return
        self._advance()

    def _hand_on(self, task: Task[Any]) -> None:
        with self._lock:
            if task in self._handed or task not in self._unfinished:
                return
            self._handed.add(task)
        self._advance()

    def _is_handed_on(self, task: Task[Any]) -> bool:
        with self._lock:
            return task in self._handed

    def _advance(self) -> None:
        """The coroutine holding the lane let it go: start the next one (or let ``_loop`` do it)."""
        with self._lock:
            if self._looping:  # finished inside _loop's start(): the loop goes on
                self._more = True
                return
            self._looping = True
        self._kick()

    def _kick(self) -> None:
        """Run ``_loop`` (the caller set ``_looping``): here, or on the lane's thread."""
        if self._thread_name is None:
            self._loop()
            return
        if self._wake is None:
            self._wake = queue.SimpleQueue()
            threading.Thread(
                target=_lane_thread, args=(weakref.ref(self), self._wake), name=self._thread_name, daemon=True
            ).start()
            weakref.finalize(self, self._wake.put, False)  # ends the thread with the lane
        self._wake.put(True)

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._busy = self._looping = False
                    return
                task = self._queue.popleft()
                self._more = False
            task.start()
            with self._lock:
                if not self._more:  # still holds the lane: its end or hand-on goes on from there
                    self._looping = False
                    return

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted coroutine has finished (handed on or not); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._unfinished:  # the hook's dense steps, every step
                    return True
                task = next(iter(self._unfinished))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not task.wait_done(left):  # returns after the done callbacks: _on_done removed it
                return False


def _lane_thread(lane_ref: weakref.ref[Lane], wake: queue.SimpleQueue[bool]) -> None:
    """The thread of a Lane made with ``thread_name``: runs its loop when kicked, ends with it."""
    while wake.get():
        lane = lane_ref()
        if lane is None:
            return
        lane._loop()
        del lane

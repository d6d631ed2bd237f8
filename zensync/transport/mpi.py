"""The MPI transport: every collective of ``Transport`` through mpi4py, for jobs started by mpiexec.

Launch with ``mpiexec -n 4 python -m mpi4py train.py``: ``-m mpi4py`` makes an uncaught exception
on one rank abort the whole job (``MPI_Abort``) instead of leaving the others waiting in a
collective. Install: ``pip install "zensync[mpi]"`` (mpi4py and the MPICH wheel, which brings
``mpiexec``); torch's own "mpi" backend exists only in source builds of torch and is not used.

Buffers: a CPU tensor reaches MPI as its own memory (a numpy view of its bytes; no staging copy:
``MPITransport.buffer_of``). Data moves (gathers, all-to-all, broadcast, point-to-point) go as
``MPI.BYTE``, so every dtype moves, bfloat16 and bool included. Sums use MPI's ``SUM`` on the C
types; float16 and bfloat16, which most MPI builds cannot sum, go through a user-defined
commutative op that adds in torch, each partial sum rounded to the dtype (as gloo sums them).

Device tensors (unmeasured: no GPU here): with a CUDA-aware MPI (``cuda_aware``, or
``ZENSYNC_MPI_CUDA_AWARE=1``) the device memory itself, after the issuing thread synchronised its
current stream (the producer); otherwise through pinned host memory: copied out on the issuing
thread (synchronous, after the producer), the result copied back synchronously before the handle
completes, so every stream that reads it afterwards sees it.

Progress: a transport's MPI calls run in issue order on one thread of its own ("zensync-mpi"), so
the non-blocking forms return at once and that thread completes their handles; a blocking call
made while nothing of the transport is pending runs on the caller's thread instead (no hand-off:
an 8-byte allreduce of 2 local ranks took 21-22 us through this transport, 320 us through gloo's
``TorchTransport``: experiments/results/mixed_dispatch_p2_*). The communicator is a duplicate of the
one given (``MPI.COMM_WORLD`` by default), so zensync's collectives never interleave with the
program's own. MPI must be initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py's default).

Timeout: MPI has no per-call timeout. A collective still running after ``timeout`` (a peer that
died or never calls it) aborts the job with ``MPI_Abort`` after writing which collective on which
rank waited: every rank stops within the timeout, none hangs.

Example::

    transport = MPITransport()  # mpiexec -n 2 python -m mpi4py script.py
    total = transport.all_reduce(torch.ones(4))  # tensor([2., 2., 2., 2.]) on both ranks
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import queue
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from zensync.transport.base import Transport
from zensync.transport.handle import Handle
from zensync.transport.reduce_scatter import Traffic, bounds

__all__ = ["DEFAULT_TIMEOUT", "MPITransport", "init_torch_distributed", "mpi_module"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""A collective's timeout when none is given: torch.distributed's default for gloo groups."""

_SUM_TYPES = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.int8: "INT8_T",
    torch.int16: "INT16_T",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
    torch.uint8: "UINT8_T",
    torch.complex64: "C_FLOAT_COMPLEX",
    torch.complex128: "C_DOUBLE_COMPLEX",
}
"""MPI's own datatype for the sum of each torch dtype."""

_HALF_TYPES = (torch.float16, torch.bfloat16)
"""Summed by a user-defined op (``_half_sum``), moved as 16-bit integers."""

_WATCH_PERIOD_S = 0.5
"""How often the watchdog looks at the running collectives."""

_STOP = object()


def mpi_module() -> Any:
    """``mpi4py.MPI`` (initialising MPI on first use), or an ImportError that says what to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            "zensync's MPI transport needs mpi4py and an MPI library: pip install 'zensync[mpi]' "
            "(mpi4py and the mpich wheel), then launch with mpiexec -n N python -m mpi4py script.py"
        ) from exc
    return MPI


_HALF_OPS: dict[torch.dtype, Any] = {}
_HALF_OPS_LOCK = threading.Lock()


def _half_sum(dtype: torch.dtype) -> Any:
    """The MPI op that sums ``dtype`` (float16 or bfloat16) elementwise in torch, created once."""
    with _HALF_OPS_LOCK:
        op = _HALF_OPS.get(dtype)
        if op is None:
            MPI = mpi_module()

            def add(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                del datatype  # always the 16-bit integer type the buffers were sent as
                out = torch.from_numpy(np.frombuffer(inoutbuf, dtype=np.int16)).view(dtype)
                if out.numel():
                    out.add_(torch.from_numpy(np.frombuffer(inbuf, dtype=np.int16).copy()).view(dtype))

            op = _HALF_OPS[dtype] = MPI.Op.Create(add, commute=True)
        return op


class MPITransport(Transport):
    """``Transport`` over an MPI communicator (see the module docstring).

    Args:
        comm: An mpi4py communicator; None: ``MPI.COMM_WORLD``. It is duplicated (a collective of
            its ranks), and the duplicate is freed by ``close``.
        timeout: How long one collective may run before the job is aborted (a ``timedelta`` or
            seconds); None: ``DEFAULT_TIMEOUT``.
        cuda_aware: Hand device tensors to MPI directly; None: the ``ZENSYNC_MPI_CUDA_AWARE``
            environment variable ("1": yes), else pinned host staging.

    Raises:
        ImportError: Without mpi4py.
        RuntimeError: If MPI was initialised below ``MPI_THREAD_MULTIPLE``.
        ValueError: On a timeout that is not a positive duration.
    """

    def __init__(
        self,
        comm: Any = None,
        *,
        timeout: datetime.timedelta | float | None = None,
        cuda_aware: bool | None = None,
        _duplicate: bool = True,
    ) -> None:
        MPI = mpi_module()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "MPITransport needs MPI initialised with MPI_THREAD_MULTIPLE (its collectives run on a "
                "thread of their own); mpi4py initialises so unless mpi4py.rc.thread_level was lowered "
                "before 'from mpi4py import MPI'"
            )
        self._MPI = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        self.comm = base.Dup() if _duplicate else base
        self._owns_comm = True
        super().__init__(self.comm.Get_rank(), self.comm.Get_size())
        self.timeout = _as_timedelta(timeout)
        """How long one collective may run before the job is aborted."""
        if cuda_aware is None:
            cuda_aware = os.environ.get("ZENSYNC_MPI_CUDA_AWARE", "") == "1"
        self.cuda_aware = cuda_aware
        self._state = threading.Lock()
        """Guards ``_pending`` and the queue's order (held briefly, never during an MPI call)."""
        self._calls = threading.Lock()
        """Held around every MPI call of this transport: one at a time, in issue order."""
        self._pending = 0
        """Jobs queued or running (a blocking call runs inline only when there are none)."""
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._blocking = threading.local()
        self._running: tuple[float, str] | None = None
        """(perf_counter start, name) of the MPI call now running, for the watchdog."""
        self._closed = False
        _WATCHDOG.watch(self)
        _close_at_exit()

    # -- setup ------------------------------------------------------------------------------------
    @staticmethod
    def check_world(rank: int, world_size: int) -> None:
        """Raise unless this process is ``rank`` of ``world_size`` in ``MPI.COMM_WORLD`` (no collective).

        Raises:
            ImportError: Without mpi4py.
            ValueError: If the worlds differ (a job not started by mpiexec is a world of one).
        """
        MPI = mpi_module()
        mine = (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
        if mine != (rank, world_size):
            raise ValueError(
                f"transport='mpi': this process is rank {mine[0]} of {mine[1]} in MPI_COMM_WORLD but rank "
                f"{rank} of {world_size} in the DDP group; launch with mpiexec -n {world_size} python -m mpi4py "
                f"script.py and join torch.distributed with zensync.transport.mpi.init_torch_distributed()"
            )

    def duplicate(self, timeout: datetime.timedelta | float | None = None) -> MPITransport:
        """A transport on a duplicate of this communicator (a collective of its ranks; blocking)."""
        comm = self._submit(self.comm.Dup, "duplicate", inline=True).wait()
        return MPITransport(comm, timeout=self.timeout if timeout is None else timeout, _duplicate=False)

    def _split(self, color: int) -> MPITransport:
        comm = self._submit(lambda: self.comm.Split(color, self.rank), "split", inline=True).wait()
        return MPITransport(comm, timeout=self.timeout, cuda_aware=self.cuda_aware, _duplicate=False)

    def close(self) -> None:
        """Finish the queued collectives, stop the MPI thread and free the communicator (idempotent)."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self._jobs.put(_STOP)
            thread.join()
        if self._owns_comm and not self._MPI.Is_finalized():
            self.comm.Free()
        _WATCHDOG.forget(self)

    @property
    def control_device(self) -> torch.device:
        return torch.device("cpu")

    # -- issue: inline when blocking and idle, else on the MPI thread ------------------------------
    def _issue(self, start_op: Any, traffic: Any, start: Any, *, blocking: bool, **kwargs: Any) -> Any:
        # Whether the caller waits right away: read by ``_submit`` below, on this thread only (a
        # backend hook called later from another thread, after a multi-call collective, queues).
        self._caller_blocks(blocking or self._driven_here())
        try:
            return super()._issue(start_op, traffic, start, blocking=blocking, **kwargs)
        finally:
            self._caller_blocks(False)

    def _caller_blocks(self, blocking: bool) -> None:
        self._blocking.value = blocking

    def _submit(self, fn: Callable[[], T], name: str, *, inline: bool = False) -> Handle[T]:
        """Run ``fn`` (MPI calls) after every earlier job of this transport: on this thread when the
        caller blocks (``inline`` or a blocking issue) and nothing is pending, else on the MPI thread."""
        inline = inline or getattr(self._blocking, "value", False)
        on_thread = threading.current_thread() is self._thread
        with self._state:
            if self._closed:
                raise RuntimeError(f"MPITransport (rank {self.rank}): {name} after close()")
            run_here = inline and self._pending == 0 and not on_thread
            self._pending += 1
            if not run_here:
                handle: Handle[T] = Handle()
                self._jobs.put((fn, name, handle))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="zensync-mpi", daemon=True)
                    self._thread.start()
        if run_here:
            return self._run(fn, name)
        if inline and on_thread:
            # A blocking call from a completion callback on the MPI thread: it would wait for itself.
            # This thread runs the queue up to it instead (the jobs before it first, in order).
            while not handle.done():
                job = self._jobs.get()
                if job is _STOP:  # close() came first: stop after this call
                    self._jobs.put(_STOP)
                    raise RuntimeError(f"MPITransport (rank {self.rank}): {name} after close()")
                self._run(job[0], job[1]).forward_to(job[2])
        return handle

    def _run(self, fn: Callable[[], T], name: str) -> Handle[T]:
        try:
            with self._calls:
                self._running = (time.perf_counter(), name)
                try:
                    return Handle.from_call(fn)
                finally:
                    self._running = None
        finally:
            with self._state:
                self._pending -= 1

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, name, handle = job
            self._run(fn, name).forward_to(handle)

    # -- buffers ------------------------------------------------------------------------------------
    @staticmethod
    def buffer_of(tensor: torch.Tensor) -> np.ndarray:
        """The bytes of a contiguous CPU tensor as a numpy view of its own memory (what MPI reads and writes)."""
        flat = tensor.reshape(-1)
        if not flat.numel():
            return np.empty(0, dtype=np.uint8)
        return flat.view(torch.uint8).numpy()

    def _device_buffer(self, tensor: torch.Tensor) -> Any:
        """What MPI gets for ``tensor``: its host bytes, or (CUDA-aware) the device tensor's bytes."""
        if tensor.device.type == "cpu":
            return self.buffer_of(tensor)
        return tensor.reshape(-1).view(torch.uint8)  # __cuda_array_interface__ / DLPack, read by mpi4py

    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """On the issuing thread: the tensor MPI works on (itself on CPU; see the module docstring)."""
        tensor = tensor.contiguous()
        if tensor.device.type == "cpu":
            return tensor
        if self.cuda_aware:
            torch.accelerator.current_stream(tensor.device).synchronize()  # the producer's writes are done
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)  # a device tensor: CUDA is there
        host.copy_(tensor)  # synchronous: after the producing stream's work
        return host

    @staticmethod
    def _unstage(result: torch.Tensor, device: torch.device) -> torch.Tensor:
        """On the MPI thread: ``result`` on ``device`` (a synchronous copy back where it was staged)."""
        return result if result.device == device else result.to(device)

    def _sum_spec(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        """(MPI datatype, op) of the sum of ``tensor``'s dtype; TypeError for one MPI cannot sum."""
        MPI = self._MPI
        if tensor.dtype in _HALF_TYPES:
            return MPI.INT16_T, _half_sum(tensor.dtype)
        name = _SUM_TYPES.get(tensor.dtype)
        if name is None:
            raise TypeError(
                f"MPITransport.all_reduce: cannot sum {tensor.dtype} (supported: "
                f"{', '.join(str(d) for d in (*_SUM_TYPES, *_HALF_TYPES))})"
            )
        return getattr(MPI, name), MPI.SUM

    def _typed(self, tensor: torch.Tensor) -> Any:
        """``tensor``'s memory as MPI reads it in a sum (16-bit floats as int16)."""
        if tensor.device.type != "cpu":
            return tensor.reshape(-1).view(torch.int16) if tensor.dtype in _HALF_TYPES else tensor.reshape(-1)
        flat = tensor.reshape(-1)
        return (flat.view(torch.int16) if tensor.dtype in _HALF_TYPES else flat).numpy()

    # -- backend hooks ------------------------------------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor) -> Handle[torch.Tensor]:
        datatype, op = self._sum_spec(tensor)
        staged = self._stage(tensor)

        def run() -> torch.Tensor:
            if staged.numel():
                self.comm.Allreduce(self._MPI.IN_PLACE, [self._typed(staged), datatype], op=op)
            return tensor if staged is tensor else tensor.copy_(staged)  # synchronous from host

        return self._submit(run, "all_reduce")

    def _all_gather(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        n, device, staged = self.world_size, tensor.device, self._stage(tensor)

        def run() -> list[torch.Tensor]:
            out = torch.empty(n * staged.numel(), dtype=staged.dtype, device=staged.device)
            if staged.numel():
                self.comm.Allgather(
                    [self._device_buffer(staged), self._MPI.BYTE], [self._device_buffer(out), self._MPI.BYTE]
                )
            out = self._unstage(out, device)
            return list(out.chunk(n)) if staged.numel() else [out[:0]] * n

        return self._submit(run, "all_gather")

    def _all_gather_v(self, tensor: torch.Tensor) -> Handle[tuple[list[torch.Tensor], int | None]]:
        n, device, staged = self.world_size, tensor.device, self._stage(tensor)

        def run() -> tuple[list[torch.Tensor], int | None]:
            MPI = self._MPI
            sizes = np.empty(n, dtype=np.int64)
            self.comm.Allgather([np.array([staged.numel()], dtype=np.int64), MPI.INT64_T], [sizes, MPI.INT64_T])
            counts = [int(s) for s in sizes]
            out = torch.empty(sum(counts), dtype=staged.dtype, device=staged.device)
            item = staged.element_size()
            byte_counts = [c * item for c in counts]
            displacements = np.cumsum([0, *byte_counts[:-1]]).tolist()
            if out.numel():
                self.comm.Allgatherv(
                    [self._device_buffer(staged), MPI.BYTE],
                    [self._device_buffer(out), (byte_counts, displacements), MPI.BYTE],
                )
            return list(self._unstage(out, device).split(counts)), None

        return self._submit(run, "all_gather_v")

    def _all_to_all_v(
        self, tensor: torch.Tensor, counts: list[int], recv_counts: list[int] | None
    ) -> Handle[tuple[torch.Tensor, list[int]]]:
        device, staged = tensor.device, self._stage(tensor)

        def run() -> tuple[torch.Tensor, list[int]]:
            MPI = self._MPI
            if recv_counts is None:
                received = np.empty(self.world_size, dtype=np.int64)
                self.comm.Alltoall([np.asarray(counts, dtype=np.int64), MPI.INT64_T], [received, MPI.INT64_T])
                got = [int(c) for c in received]
            else:
                got = list(recv_counts)
            out = torch.empty(sum(got), dtype=staged.dtype, device=staged.device)
            item = staged.element_size()
            send_bytes, recv_bytes = [c * item for c in counts], [c * item for c in got]
            send_at = np.cumsum([0, *send_bytes[:-1]]).tolist()
            recv_at = np.cumsum([0, *recv_bytes[:-1]]).tolist()
            self.comm.Alltoallv(
                [self._device_buffer(staged), (send_bytes, send_at), MPI.BYTE],
                [self._device_buffer(out), (recv_bytes, recv_at), MPI.BYTE],
            )
            return self._unstage(out, device), got

        return self._submit(run, "all_to_all_v")

    def _auto_reduce_scatter(self, tensor: torch.Tensor) -> str:
        del tensor
        return "native"  # MPICH picks recursive halving or pairwise exchange: (n-1)/n of the tensor

    def _native_reduce_scatter(self, tensor: torch.Tensor) -> Handle[Traffic]:
        """``MPI_Reduce_scatter`` with torch.tensor_split's chunk sizes. Traffic as pairwise exchange
        counts it: rank r sends every chunk but its own and receives chunk r from each peer."""
        datatype, op = self._sum_spec(tensor)
        n, r, device, staged = self.world_size, self.rank, tensor.device, self._stage(tensor)
        edges = bounds(tensor.numel(), n)
        counts = [edges[j + 1] - edges[j] for j in range(n)]
        item = tensor.element_size()

        def run() -> Traffic:
            out = torch.empty(counts[r], dtype=staged.dtype, device=staged.device)
            if staged.numel():
                self.comm.Reduce_scatter([self._typed(staged), datatype], [self._typed(out), datatype], counts, op=op)
            sent = (tensor.numel() - counts[r]) * item if n > 1 else 0
            recv = (n - 1) * counts[r] * item
            messages = sum(1 for j, c in enumerate(counts) if j != r and c)
            return self._unstage(out, device), sent, recv, messages, 0

        return self._submit(run, "reduce_scatter")

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        device = tensor.device
        staged = self._stage(tensor)
        out = staged.clone() if staged is tensor else staged  # a staged copy is the broadcast's own

        def run() -> torch.Tensor:
            if out.numel():
                self.comm.Bcast([self._device_buffer(out), self._MPI.BYTE], root=src)
            return self._unstage(out, device)

        return self._submit(run, "broadcast")

    def _send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> Handle[torch.Tensor | None]:
        staged = None if tensor is None or dst is None else self._stage(tensor)

        def run() -> torch.Tensor | None:
            MPI = self._MPI
            requests = []
            if staged is not None:
                size = np.array([staged.numel() * staged.element_size()], dtype=np.int64)
                requests.append(self.comm.Isend([size, MPI.INT64_T], dest=dst, tag=_SIZE_TAG))
            recv_size = np.empty(1, dtype=np.int64)
            if src is not None:
                requests.append(self.comm.Irecv([recv_size, MPI.INT64_T], source=src, tag=_SIZE_TAG))
            MPI.Request.Waitall(requests)
            requests = []
            if staged is not None and staged.numel():
                requests.append(self.comm.Isend([self._device_buffer(staged), MPI.BYTE], dest=dst, tag=_DATA_TAG))
            received = None
            if src is not None:
                direct = device.type == "cpu" or self.cuda_aware
                received = torch.empty(int(recv_size[0]), dtype=torch.uint8, device=device if direct else "cpu")
                if received.numel():
                    requests.append(
                        self.comm.Irecv([self._device_buffer(received), MPI.BYTE], source=src, tag=_DATA_TAG)
                    )
            MPI.Request.Waitall(requests)
            return None if received is None else self._unstage(received, device)

        return self._submit(run, "send_recv")

    def _barrier(self) -> Handle[None]:
        return self._submit(self.comm.Barrier, "barrier")


def init_torch_distributed(
    backend: str = "gloo", *, timeout: datetime.timedelta | float | None = None, comm: Any = None
) -> tuple[int, int]:
    """Join torch.distributed's default group from an MPI job: one job, both worlds.

    The group's ranks are the communicator's (``MPI.COMM_WORLD`` by default). Rank 0 opens the
    rendezvous store on a free port of its host (no race for the port) and broadcasts address and
    port over MPI: ``MASTER_ADDR`` where set (rank 0's), else 127.0.0.1 when every rank runs on rank
    0's host, else the address of rank 0's host name. A DDP model on this group and an ``MPITransport`` then live in
    the same process (``zensync.register(ddp, transport="mpi")``). A collective call on every rank
    of ``comm``.

    Args:
        backend: torch.distributed's backend ("gloo" on CPU, "nccl" on GPU).
        timeout: The group's collective timeout (timedelta or seconds); None: ``DEFAULT_TIMEOUT``.
        comm: The mpi4py communicator; None: ``MPI.COMM_WORLD``.

    Returns:
        (rank, world_size).

    Example::

        rank, size = init_torch_distributed("gloo", timeout=120)  # under mpiexec -n 4 python -m mpi4py
    """
    MPI = mpi_module()
    comm = MPI.COMM_WORLD if comm is None else comm
    delta = _as_timedelta(timeout)
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(MPI.Get_processor_name())
    store = None
    address: tuple[str, int] | None = None
    if rank == 0:
        one_host = len(set(hosts)) == 1
        host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host else socket.gethostbyname(hosts[0]))
        store = dist.TCPStore(host, 0, size, is_master=True, timeout=delta, wait_for_workers=False)
        address = (host, store.port)
    host, port = comm.bcast(address, root=0)
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=delta)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=delta)
    return rank, size


_SIZE_TAG, _DATA_TAG = 71, 72
"""Point-to-point tags of ``send_recv``'s size and payload (one send_recv runs at a time per transport)."""


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise ValueError(f"timeout={timeout!r} must be a positive timedelta or number of seconds")
    return datetime.timedelta(seconds=float(seconds))


class _Watchdog:
    """One thread that aborts the MPI job when a transport's collective outlives its timeout."""

    def __init__(self) -> None:
        self._transports: weakref.WeakSet[MPITransport] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, transport: MPITransport) -> None:
        with self._lock:
            self._transports.add(transport)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="zensync-mpi-watchdog", daemon=True)
                self._thread.start()

    def forget(self, transport: MPITransport) -> None:
        with self._lock:
            self._transports.discard(transport)

    def live(self) -> list[MPITransport]:
        with self._lock:
            return list(self._transports)

    def _loop(self) -> None:
        while True:
            time.sleep(_WATCH_PERIOD_S)
            now = time.perf_counter()
            for transport in self.live():
                running = transport._running
                if running is not None and now - running[0] > transport.timeout.total_seconds():
                    _abort(transport, running[1], now - running[0])


def _abort(transport: MPITransport, name: str, waited_s: float) -> None:
    message = (
        f"zensync MPITransport: rank {transport.rank} of {transport.world_size}: {name} did not complete "
        f"within the timeout of {transport.timeout.total_seconds():g} s (waited {waited_s:.1f} s: a peer "
        f"died or never called it); aborting the MPI job"
    )
    logger.error(message)
    print(message, file=sys.stderr, flush=True)
    transport.comm.Abort(1)


_WATCHDOG = _Watchdog()


def _close_all() -> None:
    """At exit, before mpi4py finalises MPI: every transport's queued collectives done, its thread stopped."""
    for transport in _WATCHDOG.live():
        try:
            transport.close()
        except Exception as exc:  # noqa: BLE001 - at exit: report, go on with the others
            logger.debug("zensync: MPITransport not closed at exit: %s", exc)


_AT_EXIT: list[bool] = []


def _close_at_exit() -> None:
    """Register ``_close_all`` once, after mpi4py initialised MPI: exit handlers run last-in first-out,
    so it runs before mpi4py's own finalisation."""
    if not _AT_EXIT:
        _AT_EXIT.append(True)
        atexit.register(_close_all)

"""The one interface every sync algorithm is written against, and its byte accounting.

A ``Transport`` is one rank's handle on a group of ``world_size`` ranks. It offers the collectives the
engine needs on 1-D tensors (any dtype the backend moves; byte tensors for packed payloads):

    all_reduce(x)                  -> sum over ranks (new tensor, or x itself with inplace=True)
    all_gather(x)                  -> list of every rank's x (equal sizes)
    all_gather_v(x)                -> list of every rank's x (sizes may differ)
    all_to_all_v(x, send_counts)   -> (received, recv_counts); x is cut into world_size chunks
    reduce_scatter(x)              -> this rank's chunk of the sum (chunks as torch.tensor_split)
    broadcast(x, src)              -> src's x
    send_recv(x, dst, src)         -> sends bytes x to dst while receiving bytes from src
    barrier()
    split(color)                   -> transport over the ranks with the same color

Every collective but ``split`` also has a non-blocking form, ``all_reduce_async(x)`` and so on,
returning a ``Handle`` (``zensync.transport.handle``) that coroutines await. Issue order: a rank's
collectives reach the backend in the order it called them, blocking or not (``_issue``); callers
keep that order the same on every rank (the DDP hook runs its buckets on one ``Lane``).

Device tensors: a backend enqueues its collective on the caller's current CUDA stream or on a
stream that waits for it (NCCL), and its handle completes through ``torch.futures.Future.then``, so
code chained after a collective runs on streams that see its result; nothing here synchronizes the
host with the device except where a size must be read (marked "host-device sync").

Byte accounting is done here, once, with one logical model, so that every implementation (the
in-process simulated world, torch.distributed, and MPI later) reports the same numbers for the same
inputs. With n ranks, rank r, and B the byte size of a tensor:

    all_reduce:    ring. The numel is cut into n chunks (sizes as torch.tensor_split); rank r sends
                   and receives 2 * (numel - chunk_r) elements, in 2(n-1) messages.
    all_gather(_v): rank r sends its B_r to each of the n-1 others and receives sum_{j!=r} B_j.
                   all_gather_v first exchanges sizes: 8 control bytes to and from each peer. A
                   backend that forwards the tensors around a ring (gloo, large uneven
                   messages) reports what rank r really sends: sum_{j != r+1} B_j (the same total
                   over ranks; received bytes unchanged).
    all_to_all_v:  rank r sends chunk j to rank j (j != r) and receives rank j's chunk r. Counts are
                   exchanged first: 8 control bytes to and from each peer.
    broadcast:     the root sends B to each of the n-1 others; each other rank receives B.
    reduce_scatter: what the algorithm moved (``zensync.transport.reduce_scatter``): ring and
                   halving send numel - chunk_r elements, (n-1)/n of B; a backend's native one
                   reports its own model (gloo's all-reduce in disguise: 2(numel - chunk_r)).
    send_recv:     B_send sent, B_recv received, plus 8 control bytes each way for the size.

A rank's own chunk never crosses the network and is not counted. Traffic is attributed to the phase
set with ``phase(name)`` and accumulated into the ``TrafficLog`` installed with ``recording()``.
Both are context variables: they hold for the code of the calling thread, or of the ``Task`` whose
segment sets them (across its awaits, on whatever thread runs it), and not for other Tasks running
meanwhile (the DDP hook's buckets overlap: each counts its own bytes and times).

Timing: each collective's ``comm_time_s`` runs from the call to its return, so it includes waiting
for ranks that arrive later. Benchmarks that want the transfer alone wrap the calls in ``fenced()``:
every collective then starts with an (unaccounted, untimed) barrier.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import torch

from zensync.transport import reduce_scatter as _rs
from zensync.transport.comms import CommRecord, CommsLogger
from zensync.transport.handle import Handle, Task, handed_on, run_sync
from zensync.types import PhaseTraffic

__all__ = ["CONTROL_BYTES_PER_COUNT", "TrafficLog", "Transport"]

CONTROL_BYTES_PER_COUNT = 8
"""Size exchanges move one int64 per count."""

R = TypeVar("R")
T = TypeVar("T")
_Traffic = tuple[int, int, int, int, "int | None"]
"""(bytes sent, bytes received, control bytes sent, messages sent, control bytes received or None:
as sent) of one collective on this rank."""
_CallContext = tuple["list[TrafficLog]", str, bool]
"""What a collective takes from the moment it is called: the installed logs, the phase, fenced or not."""
_ACCOUNTING_LOCK = threading.Lock()

_LOGS: contextvars.ContextVar[tuple[tuple[Transport, TrafficLog], ...]] = contextvars.ContextVar(
    "zensync_transport_logs", default=()
)
"""The (transport, log) pairs ``recording`` installed in this context, innermost last."""
_PHASES: contextvars.ContextVar[tuple[tuple[Transport, str], ...]] = contextvars.ContextVar(
    "zensync_transport_phases", default=()
)
"""The (transport, phase) pairs ``phase`` set in this context, innermost last."""
"""Completions are accounted on backend threads, several at once (gloo's workers, the p2p thread)."""

_KEPT_STRETCHES = 64
"""Disjoint stretches of collective time a log keeps per phase, to count overlapping calls once."""


class TrafficLog:
    """Per-phase traffic of one rank, filled by the transport while it is installed."""

    __slots__ = ("_covered", "phases", "work_s")

    def __init__(self) -> None:
        self.phases: dict[str, PhaseTraffic] = {}
        self.work_s: dict[str, float] = {}
        """Wall seconds of the sections timed with ``Transport.timed``, by name (local work:
        compression, error feedback, detection scans; a section awaiting a collective includes it)."""
        self._covered: dict[str, list[list[float]]] = {}
        """Per phase, the disjoint [start, end] stretches its collectives covered, in time order
        (the last ``_KEPT_STRETCHES``): ``comm_time_s`` is their union, not the sum of overlapping calls."""

    def _cover(self, phase: str, start: float, end: float) -> float:
        """Seconds of [start, end] that no earlier collective of ``phase`` covered; adds it (caller holds the lock).

        Collectives in flight together (the casts' pieces) count once. A stretch older than the
        last ``_KEPT_STRETCHES`` is forgotten: a collective overlapping it would count it again.
        """
        stretches = self._covered.setdefault(phase, [])
        if not stretches or start > stretches[-1][1]:  # after everything covered so far: the usual case
            stretches.append([start, end])
            if len(stretches) > _KEPT_STRETCHES:
                del stretches[0]
            return end - start
        new = end - start
        merged = [start, end]
        keep = []
        for stretch in stretches:
            if stretch[1] < merged[0] or stretch[0] > merged[1]:
                keep.append(stretch)
            else:
                new -= min(stretch[1], end) - max(stretch[0], start)
                merged = [min(merged[0], stretch[0]), max(merged[1], stretch[1])]
        keep.append(merged)
        keep.sort()
        self._covered[phase] = keep[-_KEPT_STRETCHES:]
        return max(0.0, new)

    def get(self, phase: str) -> PhaseTraffic:
        """The record for ``phase``, created empty on first use."""
        with _ACCOUNTING_LOCK:
            record = self.phases.get(phase)
            if record is None:
                record = self.phases[phase] = PhaseTraffic()
            return record

    @property
    def total_sent(self) -> int:
        """Payload plus control bytes sent, over every phase."""
        return sum(p.bytes_sent + p.control_bytes_sent for p in self.phases.values())

    @property
    def total_recv(self) -> int:
        """Payload plus control bytes received, over every phase."""
        return sum(p.bytes_recv + p.control_bytes_recv for p in self.phases.values())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _ring_chunk(numel: int, world_size: int, rank: int) -> int:
    """Size of chunk ``rank`` when ``numel`` elements are split as torch.tensor_split does."""
    return numel // world_size + (1 if rank < numel % world_size else 0)


class Transport(abc.ABC):
    """One rank's view of a group; see the module docstring for the contract and byte model."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._fenced = False
        self._issue_lock = threading.Lock()
        self._waiting: collections.deque[tuple[Callable[[], Handle[Any]], bool, Callable[[Handle[Any]], None]]] = (
            collections.deque()
        )
        self._in_flight = False
        """Whether a multi-call collective (or a ``hold``) holds the issue slot (``_issue``)."""
        self._stopped: BaseException | None = None
        """A failed ``hold``'s exception: every collective fails with it instead of starting, until ``release``."""
        self._driver = threading.local()
        """Per thread: how deep this thread is in ``run`` on this transport."""
        self.comms_logger: CommsLogger | None = None
        """Gets a ``CommRecord`` for each collective of this transport that completes (None: none kept)."""

    @property
    def control_device(self) -> torch.device:
        """Device of small control tensors (counts, flags) on this transport: CPU unless the backend needs GPU."""
        return torch.device("cpu")

    # ----------------------------------------------------------------------------------------------
    # Phase and recording control
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the traffic of the enclosed collectives (of this context: module docstring) to ``name``."""
        token = _PHASES.set((*_PHASES.get(), (self, name)))
        try:
            yield
        finally:
            _PHASES.reset(token)

    @property
    def _phase(self) -> str:
        """The phase ``phase`` set for this transport in this context ("other" when none)."""
        for transport, name in reversed(_PHASES.get()):
            if transport is self:
                return name
        return "other"

    @property
    def _logs(self) -> list[TrafficLog]:
        """The logs ``recording`` installed for this transport in this context."""
        return [log for transport, log in _LOGS.get() if transport is self]

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the enclosed section's wall time to ``work_s[name]`` of every installed log.

        Costs two clock reads where a log is installed, nothing otherwise: the DDP hook times its
        phases (detection, division, compression, error feedback) every step with it.
        """
        logs = self._logs
        if not logs:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._note_time(logs, name, time.perf_counter() - start)

    def note_time(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to ``work_s[name]`` of every installed log (a section ``timed`` cannot
        enclose: one interleaved with waits the caller subtracts)."""
        logs = self._logs
        if logs:
            self._note_time(logs, name, seconds)

    @staticmethod
    def _note_time(logs: list[TrafficLog], name: str, seconds: float) -> None:
        with _ACCOUNTING_LOCK:
            for log in logs:
                log.work_s[name] = log.work_s.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def recording(self, log: TrafficLog) -> Iterator[TrafficLog]:
        """Install ``log`` to receive this rank's traffic for the enclosed calls.

        Recordings nest: traffic goes to every installed log (a hook's per-step log and the per-call
        log of a sparse sync inside it both see the sync's bytes). They hold in this context
        (module docstring): a Task made inside one records into it too.
        """
        token = _LOGS.set((*_LOGS.get(), (self, log)))
        try:
            yield log
        finally:
            _LOGS.reset(token)

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """Benchmark instrumentation: each enclosed collective starts after a barrier.

        The barrier is neither timed nor counted, so ``comm_time_s`` measures the transfer itself
        rather than waiting for the slowest rank. Costs one extra round per collective: never for
        production use.
        """
        previous, self._fenced = self._fenced, True
        try:
            yield
        finally:
            self._fenced = previous

    def _start(self) -> float:
        """Start time of a collective (under ``fenced()``, ``_issue`` restarts it after the barrier)."""
        return time.perf_counter()

    def _capture(self) -> _CallContext:
        """The call's logs, phase and fencing, taken when the collective is called (see ``_issue``).

        Raises:
            RuntimeError: If the calling coroutine handed its lane on (``handle.hand_on``): the
                next one may have issued its collectives already, so this one would leave the
                ranks in different orders.
        """
        if handed_on():
            raise RuntimeError(
                "zensync: a collective was issued after its coroutine handed the lane on (hand_on): "
                "the issue order would differ between ranks; hand on after the last collective"
            )
        return self._logs, self._phase, self._fenced

    @staticmethod
    def _account_to(
        logs: list[TrafficLog],
        phase: str,
        sent: int,
        recv: int,
        control: int,
        messages: int,
        span: tuple[float, float],
        control_recv: int | None = None,
    ) -> None:
        """Add one completed collective, which ran over ``span`` (perf_counter start, end), to ``logs``."""
        with _ACCOUNTING_LOCK:
            for log in logs:
                record = log.phases.get(phase)  # not log.get: it takes the lock held here
                if record is None:
                    record = log.phases[phase] = PhaseTraffic()
                record.bytes_sent += sent
                record.bytes_recv += recv
                record.control_bytes_sent += control
                record.control_bytes_recv += control if control_recv is None else control_recv
                record.messages_sent += messages
                record.num_calls += 1
                # A size exchange before the payload is one more backend collective.
                record.collectives += 2 if control or control_recv else 1
                record.comm_time_s += log._cover(phase, *span)

    # ----------------------------------------------------------------------------------------------
    # Public collectives: each has a blocking form and a non-blocking ``*_async`` form returning a
    # Handle. Both validate, time, call the backend through ``_issue`` (which keeps the issue order)
    # and account the bytes when the collective completes, to the logs and phase installed at the call.
    def all_reduce(self, tensor: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """Element-wise sum over ranks of a 1-D tensor: a new tensor, or ``tensor`` itself if ``inplace``.

        ``inplace`` needs a contiguous tensor and saves a copy of it (the DDP hook's bucket buffer).
        """
        return self._all_reduce_op(tensor, inplace=inplace, blocking=True).wait()

    def all_reduce_async(self, tensor: torch.Tensor, *, inplace: bool = False) -> Handle[torch.Tensor]:
        """Non-blocking ``all_reduce``: a Handle of the sum (``tensor`` itself with ``inplace``)."""
        return self._all_reduce_op(tensor, inplace=inplace, blocking=False)

    def _all_reduce_op(self, tensor: torch.Tensor, *, inplace: bool, blocking: bool) -> Handle[torch.Tensor]:
        if inplace and not tensor.is_contiguous():
            raise ValueError("all_reduce(inplace=True) needs a contiguous tensor")
        start = self._start()
        target = tensor if inplace else tensor.contiguous().clone()
        nbytes, messages = self._ring_traffic(tensor)
        size = _nbytes(tensor)
        return self._issue(
            lambda: self._all_reduce(target),
            lambda _: (nbytes, nbytes, 0, messages, None),
            start,
            blocking=blocking,
            op="all_reduce",
            size=lambda _: size,
        )

    def _ring_traffic(self, tensor: torch.Tensor) -> tuple[int, int]:
        """(bytes sent = bytes received, messages sent) of this rank in a ring allreduce of ``tensor``."""
        n = self.world_size
        if n == 1:
            return 0, 0
        nbytes = 2 * (tensor.numel() - _ring_chunk(tensor.numel(), n, self.rank)) * tensor.element_size()
        return nbytes, 2 * (n - 1) if nbytes else 0

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D tensor, in rank order; all ranks must pass the same size."""
        return self._all_gather_op(tensor, blocking=True).wait()

    def all_gather_async(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        """Non-blocking ``all_gather``."""
        return self._all_gather_op(tensor, blocking=False)

    def _all_gather_op(self, tensor: torch.Tensor, *, blocking: bool) -> Handle[list[torch.Tensor]]:
        start = self._start()
        x = tensor.contiguous()
        return self._issue(
            lambda: self._all_gather(x),
            lambda out: self._gather_traffic(tensor, out, 0),
            start,
            blocking=blocking,
            op="all_gather",
            size=lambda out: sum(_nbytes(t) for t in out),
        )

    def all_gather_v(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D tensor, in rank order; sizes may differ (dtype may not)."""
        return self._all_gather_v_op(tensor, blocking=True).wait()

    def all_gather_v_async(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        """Non-blocking ``all_gather_v``."""
        return self._all_gather_v_op(tensor, blocking=False)

    def _all_gather_v_op(self, tensor: torch.Tensor, *, blocking: bool) -> Handle[list[torch.Tensor]]:
        start = self._start()
        x = tensor.contiguous()
        control = CONTROL_BYTES_PER_COUNT * (self.world_size - 1)

        def traffic(result: tuple[list[torch.Tensor], int | None]) -> _Traffic:
            out, forwarded = result
            return self._gather_traffic(tensor, out, control, sent=forwarded)

        raw = self._issue(
            lambda: self._all_gather_v(x),
            traffic,
            start,
            blocking=blocking,
            multi_stage=True,
            op="all_gather_v",
            size=lambda result: sum(_nbytes(t) for t in result[0]),
        )
        return raw.then(lambda result: result[0])

    def _gather_traffic(
        self, tensor: torch.Tensor, out: list[torch.Tensor], control: int, sent: int | None = None
    ) -> _Traffic:
        if sent is None:
            sent = _nbytes(tensor) * (self.world_size - 1)
        recv = sum(_nbytes(t) for j, t in enumerate(out) if j != self.rank)
        messages = (self.world_size - 1) if tensor.numel() else 0
        return sent, recv, control, messages, None

    def all_to_all_v(
        self, tensor: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Send ``tensor[offset_j : offset_j + send_counts[j]]`` to rank j; receive likewise.

        Returns the concatenation of the chunks received (in source-rank order) and their counts.
        ``recv_counts``: what each rank sends this one, where the caller knows it (agreed in an
        exchange it made anyway): the size exchange is skipped, one collective instead of two.
        They must be exact (a backend that cannot check them may fail or deliver garbage).
        """
        return self._all_to_all_v_op(tensor, send_counts, recv_counts, blocking=True).wait()

    def all_to_all_v_async(
        self, tensor: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int] | None = None
    ) -> Handle[tuple[torch.Tensor, list[int]]]:
        """Non-blocking ``all_to_all_v``."""
        return self._all_to_all_v_op(tensor, send_counts, recv_counts, blocking=False)

    def _all_to_all_v_op(
        self, tensor: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int] | None, *, blocking: bool
    ) -> Handle[tuple[torch.Tensor, list[int]]]:
        counts = [int(c) for c in send_counts]
        if len(counts) != self.world_size or sum(counts) != tensor.numel() or min(counts, default=0) < 0:
            raise ValueError(
                f"all_to_all_v: send_counts={counts} must have world_size={self.world_size} "
                f"non-negative entries summing to tensor.numel()={tensor.numel()}"
            )
        known = None if recv_counts is None else [int(c) for c in recv_counts]
        if known is not None and (len(known) != self.world_size or min(known, default=0) < 0):
            raise ValueError(
                f"all_to_all_v: recv_counts={known} must have world_size={self.world_size} non-negative entries"
            )
        start = self._start()
        x = tensor.contiguous()
        esize = tensor.element_size()
        control = 0 if known is not None else CONTROL_BYTES_PER_COUNT * (self.world_size - 1)

        def traffic(result: tuple[torch.Tensor, list[int]]) -> _Traffic:
            received = result[1]
            sent = sum(c for j, c in enumerate(counts) if j != self.rank) * esize
            recv = sum(c for j, c in enumerate(received) if j != self.rank) * esize
            messages = sum(1 for j, c in enumerate(counts) if j != self.rank and c)
            return sent, recv, control, messages, None

        return self._issue(
            lambda: self._all_to_all_v(x, counts, known),
            traffic,
            start,
            blocking=blocking,
            multi_stage=known is None,
            op="all_to_all_v",
            size=lambda _: sum(counts) * esize,
        )

    def reduce_scatter(self, tensor: torch.Tensor, *, algorithm: str = "auto") -> torch.Tensor:
        """This rank's chunk of the element-wise sum over ranks of a 1-D tensor (same size on every rank).

        Chunks are cut as ``torch.tensor_split(tensor, world_size)``: rank r gets chunk r.
        ``algorithm``: "ring" or "halving" (power-of-two groups) from point-to-point steps, moving
        (n-1)/n of the tensor each way; "native" the backend's own (MPI's; NCCL's; on gloo an
        all-reduce cut to the chunk, twice the traffic); "auto" the backend's bandwidth-correct
        choice (``zensync.transport.reduce_scatter``).

        Raises:
            ValueError: On an unknown algorithm, or "halving" in a group whose size is not a power of two.
            TypeError: For torch.bool (no sum).
        """
        return self._reduce_scatter_op(tensor, algorithm, blocking=True).wait()

    def reduce_scatter_async(self, tensor: torch.Tensor, *, algorithm: str = "auto") -> Handle[torch.Tensor]:
        """Non-blocking ``reduce_scatter``."""
        return self._reduce_scatter_op(tensor, algorithm, blocking=False)

    def _reduce_scatter_op(self, tensor: torch.Tensor, algorithm: str, *, blocking: bool) -> Handle[torch.Tensor]:
        _rs.check_algorithm(algorithm, self.world_size)
        _rs.check_summable(tensor.dtype)
        start = self._start()
        x = tensor.contiguous()
        size = _nbytes(tensor)

        def traffic(result: _rs.Traffic) -> _Traffic:
            return result[1], result[2], result[4], result[3], None

        raw = self._issue(
            lambda: self._reduce_scatter(x, algorithm),
            traffic,
            start,
            blocking=blocking,
            multi_stage=True,  # the point-to-point algorithms are several backend calls
            op="reduce_scatter",
            size=lambda _: size,
        )
        return raw.then(lambda result: result[0])

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``src``'s tensor on every rank (others pass a tensor of the same size and dtype)."""
        return self._broadcast_op(tensor, src, blocking=True).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        """Non-blocking ``broadcast``."""
        return self._broadcast_op(tensor, src, blocking=False)

    def _broadcast_op(self, tensor: torch.Tensor, src: int, *, blocking: bool) -> Handle[torch.Tensor]:
        start = self._start()
        x = tensor.contiguous()
        nbytes = _nbytes(tensor)
        if self.rank == src:
            sent, recv, messages = nbytes * (self.world_size - 1), 0, self.world_size - 1
        else:
            sent, recv, messages = 0, nbytes, 0
        traffic = (sent, recv, 0, messages if nbytes else 0, None)
        return self._issue(
            lambda: self._broadcast(x, src),
            lambda _: traffic,
            start,
            blocking=blocking,
            op="broadcast",
            size=lambda _: nbytes,
        )

    def broadcast_text(self, text: str, src: int = 0) -> str:
        """``src``'s ``text`` on every rank (others may pass anything): its size, then its UTF-8 bytes.

        What a decision one rank made (a fit, a table) becomes, so that no rank decides apart.
        """
        if self.world_size == 1:
            return text
        mine = (
            torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)
        )
        size = int(self.broadcast(torch.tensor([mine.numel()], dtype=torch.int64), src=src)[0])
        payload = mine if self.rank == src else torch.zeros(size, dtype=torch.uint8)
        return bytes(self.broadcast(payload, src=src).tolist()).decode()

    def send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, *, device: torch.device
    ) -> torch.Tensor | None:
        """Send the byte tensor ``tensor`` to ``dst`` while receiving a byte tensor from ``src``.

        Either side may be None (send only, or receive only). Sizes may differ: the size travels
        first. Payloads are uint8 (pack typed data with ``zensync.transport.packing``). The received
        tensor lives on ``device``. Returns None when ``src`` is None.
        """
        return self._send_recv_op(tensor, dst, src, device=device, blocking=True).wait()

    def send_recv_async(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, *, device: torch.device
    ) -> Handle[torch.Tensor | None]:
        """Non-blocking ``send_recv``."""
        return self._send_recv_op(tensor, dst, src, device=device, blocking=False)

    def _send_recv_op(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, *, device: torch.device, blocking: bool
    ) -> Handle[torch.Tensor | None]:
        if (dst is None) != (tensor is None):
            raise ValueError("send_recv: pass both tensor and dst, or neither")
        if tensor is not None and tensor.dtype != torch.uint8:
            raise ValueError(f"send_recv moves uint8 payloads, got dtype={tensor.dtype}")
        start = self._start()
        x = None if tensor is None else tensor.contiguous()
        sent = 0 if tensor is None else _nbytes(tensor)

        def traffic(out: torch.Tensor | None) -> _Traffic:
            recv = 0 if out is None else _nbytes(out)
            control_recv = CONTROL_BYTES_PER_COUNT * (src is not None)
            return sent, recv, CONTROL_BYTES_PER_COUNT * (dst is not None), int(sent > 0), control_recv

        return self._issue(
            lambda: self._send_recv(x, dst, src, device),
            traffic,
            start,
            blocking=blocking,
            multi_stage=True,
            op="send_recv",
            size=lambda _: sent,
        )

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        self.barrier_async(blocking=True).wait()

    def barrier_async(self, *, blocking: bool = False) -> Handle[None]:
        """Non-blocking ``barrier`` (neither timed nor counted)."""
        return self._issue(self._barrier, None, None, blocking=blocking)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Drive a coroutine of this transport's ``*_async`` collectives to completion, here (blocking).

        While it runs, the coroutine's collectives count as blocking calls of this thread (a
        blocking backend then runs them on this thread instead of handing them to another).
        """
        self._driver.depth = getattr(self._driver, "depth", 0) + 1
        try:
            return run_sync(coro)
        finally:
            self._driver.depth -= 1

    def _caller_blocks(self, blocking: bool) -> None:
        """A wrapping transport (``MixedTransport``) says whether the call it issues now blocks this
        thread; a backend that can run it inline then does (``MPITransport``). Default: ignored."""
        del blocking

    def _driven_here(self) -> bool:
        """Whether this thread is inside ``run`` on this transport."""
        return getattr(self._driver, "depth", 0) > 0

    # ----------------------------------------------------------------------------------------------
    # Issue order. A collective that needs several backend calls (sizes first, then the payload)
    # holds the issue slot until it completes: collectives issued meanwhile wait in a queue, so the
    # backend sees every rank's calls in the order they were made on that rank, whatever order
    # their completions arrive in. Single-call collectives are issued at once when nothing waits.
    def _issue(
        self,
        start_op: Callable[[], Handle[R]],
        traffic: Callable[[R], _Traffic] | None,
        start: float | None,
        *,
        blocking: bool,
        multi_stage: bool = False,
        captured: _CallContext | None = None,
        op: str = "other",
        size: Callable[[R], int] | None = None,
    ) -> Handle[R]:
        """Issue one collective (``start_op`` calls the backend) in order; account it when done.

        ``op`` and ``size`` (its message size, from the result: ``zensync.transport.comms``) name it
        for the ``comms_logger``.

        The returned handle completes after the accounting, so whoever awaits it sees the bytes.
        Logs, phase and fencing are those of the call (``captured``, taken by ``_capture`` on the
        calling thread when a backend issues later, on another thread). Under ``fenced()`` the
        barrier is part of the issued collective (it holds the issue slot, as a multi-call one
        does), so it takes its place in the issue order, and the clock restarts after it.
        """
        del blocking  # the default issue is the same for both forms; SimulatedTransport's is not
        handle: Handle[R] = Handle()
        logs, phase, fenced = captured if captured is not None else self._capture()
        clock = [start]
        if fenced:
            start_op, multi_stage = self._fenced_op(start_op, clock), True

        def finish(done: Handle[R]) -> None:
            if traffic is not None and done.error is None:
                try:
                    sent, recv, control, messages, control_recv = traffic(done.outcome())
                except BaseException as exc:  # noqa: BLE001 - a bug in the accounting fails the call, not the thread
                    done = Handle()
                    done.set_exception(exc)
                else:
                    assert clock[0] is not None
                    span = (clock[0], time.perf_counter())
                    self._account_to(logs, phase, sent, recv, control, messages, span, control_recv)
                    if self.comms_logger is not None and size is not None:
                        self._log_comm(op, size(done.outcome()), span, phase)
            done.forward_to(handle)

        with self._issue_lock:
            queued = self._in_flight or bool(self._waiting)
            if queued:
                self._waiting.append((start_op, multi_stage, finish))
            elif multi_stage:
                self._in_flight = True
        if not queued:
            self._launch(start_op, multi_stage, finish)
        return handle

    def _log_comm(self, op: str, size_bytes: int, span: tuple[float, float], phase: str) -> None:
        logger = self.comms_logger
        if logger is not None:
            record = CommRecord(
                op=op,
                backend=type(self).__name__,
                world_size=self.world_size,
                rank=self.rank,
                size_bytes=size_bytes,
                seconds=span[1] - span[0],
                phase=phase,
            )
            logger.record(record)

    def _fenced_op(self, start_op: Callable[[], Handle[R]], clock: list[float | None]) -> Callable[[], Handle[R]]:
        """``start_op`` after a barrier, restarting ``clock`` when the barrier is done."""

        async def after_barrier() -> R:
            await self._barrier()
            clock[0] = time.perf_counter()
            return await start_op()

        return lambda: Task(after_barrier()).start()

    def hold(self, guard: Handle[Any]) -> None:
        """Collectives issued from now on start when ``guard`` completes, in their order.

        If ``guard`` fails, they fail with its exception (its original type) instead of starting,
        as does every collective issued later, until ``release``. A guard that every rank
        evaluates alike (an agreement check: one small all-gather and a comparison) thus runs
        beside the work that follows it, and no collective of that work leaves any rank unless
        it passed. ``guard`` must have issued its own collectives before this call (they would
        otherwise wait for it).
        """
        gate: Handle[None] = Handle()

        def settle(done: Handle[Any]) -> None:
            if done.error is not None:
                with self._issue_lock:
                    self._stopped = done.error
            gate.set_result(None)  # the slot is freed either way; ``_stopped`` carries the failure

        self._issue(lambda: gate, None, None, blocking=False, multi_stage=True)
        guard.add_done_callback(settle)

    def release(self) -> None:
        """Let collectives start again after a failed ``hold`` (the next step's)."""
        with self._issue_lock:
            self._stopped = None

    def _launch(
        self, start_op: Callable[[], Handle[Any]], multi_stage: bool, finish: Callable[[Handle[Any]], None]
    ) -> None:
        stopped = self._stopped
        try:
            if stopped is not None:
                raise stopped
            inner = start_op()
        except BaseException as exc:  # noqa: BLE001 - the collective's failure, kept in its handle
            inner = Handle()
            inner.set_exception(exc)
        if multi_stage:
            inner.add_done_callback(self._multi_stage_done)
        inner.add_done_callback(finish)

    def _multi_stage_done(self, _: Handle[Any]) -> None:
        """The in-flight multi-call collective completed: issue what waited, in order."""
        while True:
            with self._issue_lock:
                if not self._waiting:
                    self._in_flight = False
                    return
                start_op, multi_stage, finish = self._waiting.popleft()
                if multi_stage:  # it takes the slot over; the rest waits for it
                    self._in_flight = True
            self._launch(start_op, multi_stage, finish)
            if multi_stage:
                return

    def split(self, color: int) -> Transport:
        """A transport over the ranks that pass the same ``color``, ranked by their rank here.

        A collective of every rank of this transport (each gets the group of its own color). Used
        for hierarchical schemes: ``split(rank // gpus_per_node)`` gives the intra-node group,
        ``split(rank % gpus_per_node)`` the inter-node group of one local rank. The setup exchange
        is neither timed nor counted. Blocking, and only between steps: no non-blocking collective
        of this transport may be pending.
        """
        if isinstance(color, bool) or not isinstance(color, int) or color < 0:
            raise ValueError(f"split(color={color!r}): color must be an int >= 0")
        return self._split(color)

    # ----------------------------------------------------------------------------------------------
    # Backend hooks: each starts the backend's collective and returns its Handle (done at once on a
    # blocking backend, ``Handle.from_call``). Sizes and data as in the public forms above.
    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor) -> Handle[torch.Tensor]:
        """Sum ``tensor`` over ranks in place (the caller owns ``tensor``); the handle holds it."""

    @abc.abstractmethod
    def _all_gather(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]: ...

    @abc.abstractmethod
    def _all_gather_v(self, tensor: torch.Tensor) -> Handle[tuple[list[torch.Tensor], int | None]]:
        """Every rank's tensor, and the bytes this rank sent if not B_r to each peer (a ring forwards)."""

    @abc.abstractmethod
    def _all_to_all_v(
        self, tensor: torch.Tensor, counts: list[int], recv_counts: list[int] | None
    ) -> Handle[tuple[torch.Tensor, list[int]]]:
        """The exchange; ``recv_counts`` known (exact): no size exchange."""

    def _reduce_scatter(self, tensor: torch.Tensor, algorithm: str) -> Handle[_rs.Traffic]:
        """This rank's chunk of the sum and the traffic (``reduce_scatter.Traffic``), after a check that
        every rank passed the same size and dtype. Default: "auto" is the ring from point-to-point;
        "native" an all-reduce cut to the chunk. A backend with a real reduce-scatter overrides
        ``_native_reduce_scatter`` and ``_auto_reduce_scatter``."""
        return Task(self._reduce_scatter_steps(tensor, algorithm)).start()

    async def _reduce_scatter_steps(self, tensor: torch.Tensor, algorithm: str) -> _rs.Traffic:
        # Step 1: every rank sees every rank's size and dtype (16 bytes each), so a mismatch fails
        # alike everywhere instead of on the ranks whose neighbours differ (the others would wait).
        if self.world_size > 1:
            mine = torch.tensor(_rs.signature(tensor), dtype=torch.int64, device=self.control_device)
            _rs.check_signatures(torch.stack(await self._all_gather(mine)).tolist())  # host-device sync
        # Step 2: the algorithm.
        if algorithm == "auto":
            algorithm = self._auto_reduce_scatter(tensor)
        if algorithm == "native":
            chunk, sent, recv, messages, control = await self._native_reduce_scatter(tensor)
        else:
            run = _rs.ring if algorithm == "ring" else _rs.halving

            def send_recv(payload: torch.Tensor, dst: int, src: int) -> Handle[torch.Tensor | None]:
                return self._send_recv(payload, dst, src, tensor.device)

            chunk, sent, recv, messages, control = await run(tensor, self.rank, self.world_size, send_recv)
        check_bytes = _rs.SIGNATURE_BYTES * (self.world_size - 1)
        return chunk, sent, recv, messages, control + check_bytes

    def _auto_reduce_scatter(self, tensor: torch.Tensor) -> str:
        """The algorithm "auto" runs on this backend (default: the ring, bandwidth-correct anywhere)."""
        del tensor
        return "ring"

    def _native_reduce_scatter(self, tensor: torch.Tensor) -> Handle[_rs.Traffic]:
        """The backend's own reduce-scatter; default: an all-reduce of a copy, cut to this rank's chunk."""
        edges = _rs.bounds(tensor.numel(), self.world_size)
        nbytes, messages = self._ring_traffic(tensor)

        def cut(total: torch.Tensor) -> _rs.Traffic:
            return total[edges[self.rank] : edges[self.rank + 1]].clone(), nbytes, nbytes, messages, 0

        return self._all_reduce(tensor.clone()).then(cut)

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]: ...

    @abc.abstractmethod
    def _send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> Handle[torch.Tensor | None]: ...

    @abc.abstractmethod
    def _barrier(self) -> Handle[None]: ...

    @abc.abstractmethod
    def _split(self, color: int) -> Transport: ...

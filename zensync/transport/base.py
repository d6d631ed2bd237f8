"""The one interface every sync algorithm is written against, and its byte accounting.

A ``Transport`` is one rank's handle on a group of ``world_size`` ranks. It offers the collectives the
engine needs on 1-D tensors (any dtype the backend moves; byte tensors for packed payloads):

    all_reduce(x)                  -> sum over ranks (new tensor, or x itself with inplace=True)
    all_reduce_async(x)            -> Future of x summed in place
    all_gather(x)                  -> list of every rank's x (equal sizes)
    all_gather_v(x)                -> list of every rank's x (sizes may differ)
    all_to_all_v(x, send_counts)   -> (received, recv_counts); x is cut into world_size chunks
    broadcast(x, src)              -> src's x
    send_recv(x, dst, src)         -> sends bytes x to dst while receiving bytes from src
    barrier()
    split(color)                   -> transport over the ranks with the same color

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
    send_recv:     B_send sent, B_recv received, plus 8 control bytes each way for the size.

A rank's own chunk never crosses the network and is not counted. Traffic is attributed to the phase
set with ``phase(name)`` and accumulated into the ``TrafficLog`` installed with ``recording()``.

Timing: each collective's ``comm_time_s`` runs from the call to its return, so it includes waiting
for ranks that arrive later. Benchmarks that want the transfer alone wrap the calls in ``fenced()``:
every collective then starts with an (unaccounted, untimed) barrier.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from zensync.types import PhaseTraffic

__all__ = ["CONTROL_BYTES_PER_COUNT", "TrafficLog", "Transport"]

CONTROL_BYTES_PER_COUNT = 8
"""Size exchanges move one int64 per count."""


class TrafficLog:
    """Per-phase traffic of one rank, filled by the transport while it is installed."""

    __slots__ = ("phases",)

    def __init__(self) -> None:
        self.phases: dict[str, PhaseTraffic] = {}

    def get(self, phase: str) -> PhaseTraffic:
        """The record for ``phase``, created empty on first use."""
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
        self._phase = "other"
        self._logs: list[TrafficLog] = []
        self._fenced = False
        self.h0_seed: int | None = None
        """Seed of Zen's first-level hash, agreed on at first use (see zensync.sync.partition)."""

    @property
    def control_device(self) -> torch.device:
        """Device of small control tensors (counts, flags) on this transport: CPU unless the backend needs GPU."""
        return torch.device("cpu")

    # ----------------------------------------------------------------------------------------------
    # Phase and recording control
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the traffic of the enclosed collectives to ``name``."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    @contextlib.contextmanager
    def recording(self, log: TrafficLog) -> Iterator[TrafficLog]:
        """Install ``log`` to receive this rank's traffic for the enclosed calls.

        Recordings nest: traffic goes to every installed log (a hook's per-step log and the per-call
        log of a sparse sync inside it both see the sync's bytes).
        """
        self._logs.append(log)
        try:
            yield log
        finally:
            self._logs.remove(log)

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
        """Start time of a collective (after the fence barrier when ``fenced()`` is active)."""
        if self._fenced:
            self._barrier()
        return time.perf_counter()

    def _account(
        self, sent: int, recv: int, control: int, messages: int, seconds: float, control_recv: int | None = None
    ) -> None:
        self._account_to(self._logs, self._phase, sent, recv, control, messages, seconds, control_recv)

    @staticmethod
    def _account_to(
        logs: list[TrafficLog],
        phase: str,
        sent: int,
        recv: int,
        control: int,
        messages: int,
        seconds: float,
        control_recv: int | None = None,
    ) -> None:
        for log in logs:
            record = log.get(phase)
            record.bytes_sent += sent
            record.bytes_recv += recv
            record.control_bytes_sent += control
            record.control_bytes_recv += control if control_recv is None else control_recv
            record.messages_sent += messages
            record.num_calls += 1
            record.comm_time_s += seconds

    # ----------------------------------------------------------------------------------------------
    # Public collectives: validate, time, call the backend, account.
    def all_reduce(self, tensor: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """Element-wise sum over ranks of a 1-D tensor: a new tensor, or ``tensor`` itself if ``inplace``.

        ``inplace`` needs a contiguous tensor and saves a copy of it (the DDP hook's bucket buffer).
        """
        start = self._start()
        if inplace and not tensor.is_contiguous():
            raise ValueError("all_reduce(inplace=True) needs a contiguous tensor")
        out = self._all_reduce(tensor if inplace else tensor.contiguous().clone())
        nbytes, messages = self._ring_traffic(tensor)
        self._account(nbytes, nbytes, 0, messages, time.perf_counter() - start)
        return out

    def _ring_traffic(self, tensor: torch.Tensor) -> tuple[int, int]:
        """(bytes sent = bytes received, messages sent) of this rank in a ring allreduce of ``tensor``."""
        n = self.world_size
        if n == 1:
            return 0, 0
        nbytes = 2 * (tensor.numel() - _ring_chunk(tensor.numel(), n, self.rank)) * tensor.element_size()
        return nbytes, 2 * (n - 1) if nbytes else 0

    def all_reduce_async(
        self, tensor: torch.Tensor, on_error: Callable[[BaseException], None] | None = None
    ) -> torch.futures.Future[torch.Tensor]:
        """Sum the contiguous 1-D ``tensor`` over ranks in place, asynchronously where the backend can.

        Returns a Future holding ``tensor``. Traffic goes to the logs and phase installed at the
        call, with the time from the call to completion. Callers must issue their async and blocking
        collectives of a group in the same order on every rank.

        Args:
            tensor: The contiguous 1-D tensor to sum in place.
            on_error: Called with the collective's own exception (original type) when it fails; the
                returned Future then fails too, with a RuntimeError quoting it (a torch Future
                callback cannot pass an exception object on).
        """
        if not tensor.is_contiguous():
            raise ValueError("all_reduce_async needs a contiguous tensor")
        start = self._start()
        logs, phase = list(self._logs), self._phase
        nbytes, messages = self._ring_traffic(tensor)

        def account(done: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                result = done.value()  # re-raises a failed collective
            except BaseException as exc:
                if on_error is not None:
                    on_error(exc)
                raise
            if isinstance(result, list):  # a backend's work future holds [tensor]
                (result,) = result
            self._account_to(logs, phase, nbytes, nbytes, 0, messages, time.perf_counter() - start)
            return result

        return self._all_reduce_async(tensor).then(account)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D tensor, in rank order; all ranks must pass the same size."""
        start = self._start()
        out = self._all_gather(tensor.contiguous())
        self._account_gather(tensor, out, control=0, start=start)
        return out

    def all_gather_v(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D tensor, in rank order; sizes may differ (dtype may not)."""
        start = self._start()
        out, forwarded = self._all_gather_v(tensor.contiguous())
        control = CONTROL_BYTES_PER_COUNT * (self.world_size - 1)
        self._account_gather(tensor, out, control=control, start=start, sent=forwarded)
        return out

    def _account_gather(
        self, tensor: torch.Tensor, out: list[torch.Tensor], control: int, start: float, sent: int | None = None
    ) -> None:
        if sent is None:
            sent = _nbytes(tensor) * (self.world_size - 1)
        recv = sum(_nbytes(t) for j, t in enumerate(out) if j != self.rank)
        messages = (self.world_size - 1) if tensor.numel() else 0
        self._account(sent, recv, control, messages, time.perf_counter() - start)

    def all_to_all_v(self, tensor: torch.Tensor, send_counts: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """Send ``tensor[offset_j : offset_j + send_counts[j]]`` to rank j; receive likewise.

        Returns the concatenation of the chunks received (in source-rank order) and their counts.
        """
        counts = [int(c) for c in send_counts]
        if len(counts) != self.world_size or sum(counts) != tensor.numel() or min(counts, default=0) < 0:
            raise ValueError(
                f"all_to_all_v: send_counts={counts} must have world_size={self.world_size} "
                f"non-negative entries summing to tensor.numel()={tensor.numel()}"
            )
        start = self._start()
        out, recv_counts = self._all_to_all_v(tensor.contiguous(), counts)
        esize = tensor.element_size()
        sent = sum(c for j, c in enumerate(counts) if j != self.rank) * esize
        recv = sum(c for j, c in enumerate(recv_counts) if j != self.rank) * esize
        messages = sum(1 for j, c in enumerate(counts) if j != self.rank and c)
        control = CONTROL_BYTES_PER_COUNT * (self.world_size - 1)
        self._account(sent, recv, control, messages, time.perf_counter() - start)
        return out, recv_counts

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``src``'s tensor on every rank (others pass a tensor of the same size and dtype)."""
        start = self._start()
        out = self._broadcast(tensor.contiguous(), src)
        nbytes = _nbytes(tensor)
        if self.rank == src:
            sent, recv, messages = nbytes * (self.world_size - 1), 0, self.world_size - 1
        else:
            sent, recv, messages = 0, nbytes, 0
        self._account(sent, recv, 0, messages if nbytes else 0, time.perf_counter() - start)
        return out

    def send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, *, device: torch.device
    ) -> torch.Tensor | None:
        """Send the byte tensor ``tensor`` to ``dst`` while receiving a byte tensor from ``src``.

        Either side may be None (send only, or receive only). Sizes may differ: the size travels
        first. Payloads are uint8 (pack typed data with ``zensync.sync.packing``). The received
        tensor lives on ``device``. Returns None when ``src`` is None.
        """
        if (dst is None) != (tensor is None):
            raise ValueError("send_recv: pass both tensor and dst, or neither")
        if tensor is not None and tensor.dtype != torch.uint8:
            raise ValueError(f"send_recv moves uint8 payloads, got dtype={tensor.dtype}")
        start = self._start()
        out = self._send_recv(None if tensor is None else tensor.contiguous(), dst, src, device)
        sent = 0 if tensor is None else _nbytes(tensor)
        recv = 0 if out is None else _nbytes(out)
        self._account(
            sent,
            recv,
            CONTROL_BYTES_PER_COUNT * (dst is not None),
            int(sent > 0),
            time.perf_counter() - start,
            control_recv=CONTROL_BYTES_PER_COUNT * (src is not None),
        )
        return out

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        self._barrier()

    def split(self, color: int) -> Transport:
        """A transport over the ranks that pass the same ``color``, ranked by their rank here.

        A collective of every rank of this transport (each gets the group of its own color). Used
        for hierarchical schemes: ``split(rank // gpus_per_node)`` gives the intra-node group,
        ``split(rank % gpus_per_node)`` the inter-node group of one local rank. The setup exchange
        is neither timed nor counted.
        """
        if isinstance(color, bool) or not isinstance(color, int) or color < 0:
            raise ValueError(f"split(color={color!r}): color must be an int >= 0")
        return self._split(color)

    # ----------------------------------------------------------------------------------------------
    # Backend hooks
    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it (the caller owns ``tensor``)."""

    def _all_reduce_async(self, tensor: torch.Tensor) -> torch.futures.Future[Any]:
        """In-place sum as a Future of ``tensor`` (or ``[tensor]``); this default runs it now (a done Future)."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(self._all_reduce(tensor))
        return future

    @abc.abstractmethod
    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    @abc.abstractmethod
    def _all_gather_v(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], int | None]:
        """Every rank's tensor, and the bytes this rank sent if not B_r to each peer (a ring forwards)."""

    @abc.abstractmethod
    def _all_to_all_v(self, tensor: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]: ...

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> torch.Tensor | None: ...

    @abc.abstractmethod
    def _barrier(self) -> None: ...

    @abc.abstractmethod
    def _split(self, color: int) -> Transport: ...

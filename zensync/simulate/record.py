"""What every rank asked of the network: a transport that records each collective, then runs it.

``RecordingTransport(inner, calls)`` is a ``Transport`` whose backend hooks append a ``Call`` (the
operation, this rank's sizes, the phase it was issued under, the global ranks of its group) to
``calls`` and hand the collective to ``inner``, unchanged: the algorithms run their real code on the
real data, and the record is what ``zensync.simulate.timeline`` prices. Sizes are what the backend
was given, so they are the bytes the algorithm really moves:

- all_reduce, all_gather, all_gather_v, reduce_scatter, broadcast: this rank's tensor, in bytes;
- all_to_all_v: the bytes this rank sends to each rank of the group;
- send_recv: the bytes sent and the destination (global rank), or none; the source it receives from;
- barrier: nothing;
- local: no collective: the rank's local work after its last call (``RecordingTransport.finish``).

Each call also carries ``compute_s``: the CPU seconds the issuing thread spent since this rank's
previous call (``time.thread_time``), minus what the transport itself spent issuing that call, i.e.
the rank's own local work (kernels, encoding, compression) that prepared this one. It is measured
per thread, so work done on another thread than the one issuing the collectives is not seen; the
simulated world runs each rank's algorithm on its own thread with one torch thread and
single-threaded numba kernels, so the figure is the local work on one CPU core of this machine.

A group split from a recording transport records into the same list, with its members' global
ranks, so the calls of several groups (Zen's hierarchical sync, two-level schemes) line up per group.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from zensync.transport.base import Transport
from zensync.transport.handle import Handle

__all__ = ["Call", "RecordingTransport", "network_calls", "received_bytes", "sent_bytes"]


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One collective as one rank issued it."""

    op: str
    group: tuple[int, ...]
    """Global ranks of the group, in group-rank order."""
    phase: str
    nbytes: int = 0
    """This rank's tensor in bytes (for all_to_all_v: the total it sends; send_recv: what it sends)."""
    sent: tuple[int, ...] = ()
    """all_to_all_v: bytes to each group rank; send_recv: (destination global rank,) or ()."""
    source: int | None = None
    """send_recv: the global rank it receives from (None: it only sends)."""
    sizes_first: bool = False
    """Whether the backend exchanges sizes before the payload (all_gather_v; all_to_all_v without
    known receive counts): one more round, 8 bytes per peer."""
    compute_s: float = 0.0
    """CPU seconds of this rank's local work before this call (module docstring; 0: not measured)."""


class _LocalClock:
    """Per thread, the CPU time at which the rank's transport last handed control back to it.

    Shared by a recording transport and the groups split from it (one rank, one clock).
    """

    def __init__(self) -> None:
        self._marks: dict[int, float] = {}

    def start(self) -> None:
        self._marks[threading.get_ident()] = time.thread_time()

    def elapsed(self) -> float:
        """CPU seconds this thread spent since its mark (0 on a thread never marked)."""
        mark = self._marks.get(threading.get_ident())
        return 0.0 if mark is None else max(0.0, time.thread_time() - mark)


def sent_bytes(call: Call, rank: int) -> int:
    """Payload bytes global rank ``rank`` sends in ``call``, in the transport's byte model
    (``TrafficLog.bytes_sent``): all-to-all what leaves the rank, all-gather n-1 copies, a message its
    bytes, ring all-reduce 2 (n-1)/n and reduce-scatter (n-1)/n of the tensor, broadcast the tensor."""
    n = len(call.group)
    if call.op == "all_to_all_v":
        return sum(b for d, b in enumerate(call.sent) if call.group[d] != rank)
    if call.op in ("all_gather", "all_gather_v"):
        return call.nbytes * (n - 1)
    if call.op in ("send_recv", "broadcast"):
        return call.nbytes
    if call.op == "all_reduce":
        return 2 * (n - 1) * call.nbytes // n
    if call.op == "reduce_scatter":
        return (n - 1) * call.nbytes // n
    return 0


def received_bytes(members: Sequence[Call], index: int) -> int:
    """Payload bytes group member ``index`` receives in one collective, from its group's calls
    (``members``, in group order): all-to-all what each peer sends it, all-gather every peer's tensor,
    the ring all-reduce and reduce-scatter what they send, broadcast the tensor; a send_recv's message
    is not in its receiver's call (0)."""
    call = members[index]
    if call.op == "all_to_all_v":
        return sum(other.sent[index] for j, other in enumerate(members) if j != index)
    if call.op in ("all_gather", "all_gather_v"):
        return sum(other.nbytes for j, other in enumerate(members) if j != index)
    if call.op in ("all_reduce", "reduce_scatter", "broadcast"):
        return sent_bytes(call, call.group[index])
    return 0


def network_calls(calls: list[list[Call]]) -> list[list[Call]]:
    """Each rank's calls without their local work: no ``local`` calls, every ``compute_s`` 0 (what
    the network alone sees; what a counted run records)."""
    return [[dataclasses.replace(c, compute_s=0.0) for c in per_rank if c.op != "local"] for per_rank in calls]


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class RecordingTransport(Transport):
    """Records each collective into ``calls`` and runs it on ``inner`` (module docstring).

    Args:
        inner: The transport that runs the collectives (a ``SimulatedTransport`` in ``simulate``).
        calls: This rank's record, appended to in issue order.
        group: Global ranks of ``inner``'s group (default: ``range(inner.world_size)``).
    """

    def __init__(
        self,
        inner: Transport,
        calls: list[Call],
        group: tuple[int, ...] | None = None,
        *,
        _clock: _LocalClock | None = None,
    ) -> None:
        super().__init__(inner.rank, inner.world_size)
        self.inner = inner
        self.calls = calls
        self.group = tuple(range(inner.world_size)) if group is None else group
        self._issued_phase = "other"
        self._issued_compute_s = 0.0
        self._clock = _LocalClock() if _clock is None else _clock
        self._clock.start()

    def finish(self) -> None:
        """Record the local work after the last call (a ``local`` call), under the last call's phase."""
        phase = self.calls[-1].phase if self.calls else "other"
        me = (self.group[self.rank],)
        self.calls.append(Call(op="local", group=me, phase=phase, compute_s=self._clock.elapsed()))
        self._clock.start()

    @property
    def control_device(self) -> torch.device:
        return self.inner.control_device

    def _issue(self, start_op: Any, traffic: Any, start: Any, *, blocking: bool, **kwargs: Any) -> Any:
        captured = kwargs.pop("captured", None) or self._capture()
        phase = captured[1]
        compute_s = self._clock.elapsed()  # the rank's work since the transport last returned

        def started() -> Any:
            # Read by the hooks that start_op calls (on this thread, or later on the one that
            # finishes the call queued before it).
            self._issued_phase, self._issued_compute_s = phase, compute_s
            return start_op()

        try:
            return super()._issue(started, traffic, start, blocking=blocking, captured=captured, **kwargs)
        finally:
            self._clock.start()  # the transport's own work on this thread is not the rank's

    def _record(
        self, op: str, nbytes: int = 0, sent: tuple[int, ...] = (), source: int | None = None, sizes_first: bool = False
    ) -> None:
        call = Call(
            op=op, group=self.group, phase=self._issued_phase, nbytes=nbytes, sent=sent, source=source,
            sizes_first=sizes_first, compute_s=self._issued_compute_s,
        )  # fmt: skip
        self._issued_compute_s = 0.0
        self.calls.append(call)

    def _all_reduce(self, tensor: torch.Tensor) -> Handle[torch.Tensor]:
        self._record("all_reduce", _nbytes(tensor))
        return self.inner._all_reduce(tensor)

    def _all_gather(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        self._record("all_gather", _nbytes(tensor))
        return self.inner._all_gather(tensor)

    def _all_gather_v(self, tensor: torch.Tensor) -> Handle[tuple[list[torch.Tensor], int | None]]:
        self._record("all_gather_v", _nbytes(tensor), sizes_first=True)
        return self.inner._all_gather_v(tensor)

    def _all_to_all_v(
        self, tensor: torch.Tensor, counts: list[int], recv_counts: list[int] | None
    ) -> Handle[tuple[torch.Tensor, list[int]]]:
        item = tensor.element_size()
        sent = tuple(c * item for c in counts)
        self._record("all_to_all_v", sum(sent), sent, sizes_first=recv_counts is None)
        return self.inner._all_to_all_v(tensor, counts, recv_counts)

    def _reduce_scatter(self, tensor: torch.Tensor, algorithm: str) -> Handle[Any]:
        self._record("reduce_scatter", _nbytes(tensor))
        return self.inner._reduce_scatter(tensor, algorithm)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        self._record("broadcast", _nbytes(tensor))
        return self.inner._broadcast(tensor, src)

    def _send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> Handle[torch.Tensor | None]:
        sent = () if tensor is None or dst is None else (self.group[dst],)
        self._record("send_recv", _nbytes(tensor) if sent else 0, sent, None if src is None else self.group[src])
        return self.inner._send_recv(tensor, dst, src, device)

    def _barrier(self) -> Handle[None]:
        self._record("barrier")
        return self.inner._barrier()

    def subgroup(self, inner: Transport, members: tuple[int, ...]) -> RecordingTransport:
        """A group of this rank's (run on ``inner``; ``members``: its global ranks in group order)
        that records into the same list, with the same local-work clock."""
        return RecordingTransport(inner, self.calls, members, _clock=self._clock)

    def _split(self, color: int) -> RecordingTransport:
        part = self.inner.split(color)
        members = part.all_gather(torch.tensor([self.group[self.rank]], dtype=torch.int64))
        return self.subgroup(part, tuple(int(m) for m in members))

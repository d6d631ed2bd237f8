"""What every rank asked of the network: a transport that records each collective, then runs it.

``RecordingTransport(inner, calls)`` is a ``Transport`` whose backend hooks append a ``Call`` (the
operation, this rank's sizes, the phase it was issued under, the global ranks of its group) to
``calls`` and hand the collective to ``inner``, unchanged: the algorithms run their real code on the
real data, and the record is what ``zensync.simulate.timeline`` prices. Sizes are what the backend
was given, so they are the bytes the algorithm really moves:

- all_reduce, all_gather, all_gather_v, reduce_scatter, broadcast: this rank's tensor, in bytes;
- all_to_all_v: the bytes this rank sends to each rank of the group;
- send_recv: the bytes sent and the destination (global rank), or none; the source it receives from;
- barrier: nothing.

A group split from a recording transport records into the same list, with its members' global
ranks, so the calls of several groups (Zen's hierarchical sync, two-level schemes) line up per group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zensync.transport.base import Transport
from zensync.transport.handle import Handle

__all__ = ["Call", "RecordingTransport"]


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


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class RecordingTransport(Transport):
    """Records each collective into ``calls`` and runs it on ``inner`` (module docstring).

    Args:
        inner: The transport that runs the collectives (a ``SimulatedTransport`` in ``simulate``).
        calls: This rank's record, appended to in issue order.
        group: Global ranks of ``inner``'s group (default: ``range(inner.world_size)``).
    """

    def __init__(self, inner: Transport, calls: list[Call], group: tuple[int, ...] | None = None) -> None:
        super().__init__(inner.rank, inner.world_size)
        self.inner = inner
        self.calls = calls
        self.group = tuple(range(inner.world_size)) if group is None else group
        self._issued_phase = "other"

    @property
    def control_device(self) -> torch.device:
        return self.inner.control_device

    def _issue(self, start_op: Any, traffic: Any, start: Any, *, blocking: bool, **kwargs: Any) -> Any:
        captured = kwargs.pop("captured", None) or self._capture()
        phase = captured[1]

        def started() -> Any:
            self._issued_phase = phase  # read by the hooks that start_op calls
            return start_op()

        return super()._issue(started, traffic, start, blocking=blocking, captured=captured, **kwargs)

    def _record(
        self, op: str, nbytes: int = 0, sent: tuple[int, ...] = (), source: int | None = None, sizes_first: bool = False
    ) -> None:
        call = Call(
            op=op, group=self.group, phase=self._issued_phase, nbytes=nbytes, sent=sent, source=source,
            sizes_first=sizes_first,
        )  # fmt: skip
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

    def _split(self, color: int) -> RecordingTransport:
        part = self.inner.split(color)
        members = part.all_gather(torch.tensor([self.group[self.rank]], dtype=torch.int64))
        return RecordingTransport(part, self.calls, tuple(int(m) for m in members))

"""Price recorded calls on a ``Topology``: a clock per rank, each collective in the order it was issued.

``price(calls_per_rank, topology)`` replays what every rank recorded (``zensync.simulate.record``) as
events in time:

- A collective of a group starts when the last of its members reaches it and ends ``topology``'s
  time for it later, for every member: the k-th call a rank made on a group is the k-th call of every
  member on that group (SPMD order; a mismatch is an error, which the real run would have been too).
  Collectives of disjoint groups (the nodes' intra-node steps of a two-level scheme) therefore run
  side by side.
- A collective whose backend exchanges sizes first (all_gather_v, all_to_all_v without known
  receive counts) pays that round too: 8 bytes per peer.
- A point-to-point call (send_recv) posts its message when the sender reaches it; the message
  arrives ``latency + bytes / bandwidth`` later over the intra or inter link between the two ranks
  (at ``Topology.exchange_efficiency`` of the bandwidth when the call also receives from that rank),
  and the call ends when this rank's own send has left (``bytes / bandwidth``) and its receive, if any,
  has arrived. The k-th receive from a source matches that source's k-th send to this rank.
- Local work: before each call its rank computes for the call's ``compute_s`` times
  ``compute_scale`` CPU seconds; a ``local`` call is that alone (the work after a rank's last
  collective). With ``cores=None`` every rank has a core of its own, so the work takes that long.
  With ``cores=k`` the ranks share k cores as a processor-sharing CPU: while m ranks have local work
  pending, each progresses at ``min(1, k / m)`` CPU seconds per second (n hosts emulated on one
  machine; n GPU processes sharing a host's cores for CPU-side compression), and a rank that waits on
  the network uses none.

The result: the time at which the last rank finishes; per phase the longest any rank spent in that
phase (its calls, its waits for the group's last member and its local work); and the largest local
work of any rank (in seconds of its clock), so a report can say how much of the time is the network.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from collections.abc import Sequence

from zensync.cost.topology import Topology
from zensync.simulate.record import Call

__all__ = ["Priced", "price"]


@dataclasses.dataclass(frozen=True, slots=True)
class Priced:
    """What ``price`` found."""

    seconds: float
    """When the last rank finished its last call."""
    phase_seconds: dict[str, float]
    """Per phase: the largest, over ranks, of the seconds that rank spent in calls of that phase."""
    calls: int
    """Collectives priced (each once, not once per rank) plus point-to-point calls (per rank)."""
    compute_seconds: float = 0.0
    """The largest, over ranks, of the seconds its clock spent on local work (``compute_s`` times
    the scale, stretched by the cores' sharing when ``price`` was given ``cores``)."""


_RANK_OPS = ("send_recv", "local")
"""Calls priced per rank, not as a group's collective."""
_SIZE_BYTES = 8
"""One int64 size per peer in a size exchange."""


def _collective_s(topology: Topology, op: str, members: Sequence[Call]) -> float:
    group = members[0].group
    n = len(group)
    if members[0].sizes_first:  # the backend's size round, then the payload
        first = dataclasses.replace(members[0], sizes_first=False)
        if op == "all_gather_v":
            return topology.all_gather_s([_SIZE_BYTES] * n, group) + _collective_s(topology, op, [first, *members[1:]])
        sizes = [[_SIZE_BYTES] * n] * n
        return topology.all_to_all_s(sizes, group) + _collective_s(topology, op, [first, *members[1:]])
    if op == "all_reduce":
        return topology.all_reduce_s(n, members[0].nbytes, group)
    if op == "reduce_scatter":
        return topology.reduce_scatter_s(n, members[0].nbytes, group)
    if op in ("all_gather", "all_gather_v"):
        return topology.all_gather_s([c.nbytes for c in members], group)
    if op == "broadcast":
        return topology.broadcast_s(n, members[0].nbytes, group)
    if op == "barrier":
        return topology.barrier_s(n, group)
    if op == "all_to_all_v":
        return topology.all_to_all_s([c.sent for c in members], group)
    raise ValueError(f"price: no time model for collective {op!r}")


def price(
    calls: Sequence[Sequence[Call]], topology: Topology, *, compute_scale: float = 1.0, cores: float | None = None
) -> Priced:
    """Replay every rank's ``calls`` (indexed by global rank) on ``topology`` (module docstring).

    ``compute_scale`` multiplies the recorded local work (0: the network alone); ``cores``: how many
    cores the ranks' local work shares (None: one per rank).

    Raises:
        ValueError: If the ranks' records do not line up (a group's members issued different
            collectives at the same position, or a rank waits for a message never sent), or if
            ``compute_scale`` or ``cores`` is out of range.
    """
    if not compute_scale >= 0:
        raise ValueError(f"compute_scale={compute_scale} must be >= 0 (0: the network alone)")
    if cores is not None and not (cores > 0 and math.isfinite(cores)):
        raise ValueError(f"cores={cores} must be finite and > 0 (None: a core per rank)")
    return _Replay(calls, topology, compute_scale, cores).run()


class _Replay:
    """The event loop behind ``price``.

    Each rank is in one of three states: computing the local work before its head call (on the
    processor-sharing CPU), waiting at its head call (for the group's last member, or for a message),
    or in a call until a known time. The CPU is a virtual clock: ``served`` counts the CPU seconds every
    computing rank has received so far (they all progress at the same rate), so a rank that starts
    ``w`` seconds of work when ``served`` is ``v`` finishes when ``served`` reaches ``v + w``.
    """

    def __init__(self, calls: Sequence[Sequence[Call]], topology: Topology, scale: float, cores: float | None) -> None:
        self.calls, self.topology, self.scale, self.cores = calls, topology, scale, cores
        ranks = len(calls)
        self.now = 0.0
        self.served = 0.0
        self.computing: list[tuple[float, int]] = []  # (served at which its work is done, rank)
        self.ending: list[tuple[float, int]] = []  # (time its call ends, rank)
        self.heads = [0] * ranks
        self.began = [0.0] * ranks  # when the rank's previous call ended (its head's span starts)
        self.work_began = [0.0] * ranks
        self.computed = [0.0] * ranks
        self.spent: list[dict[str, float]] = [collections.defaultdict(float) for _ in range(ranks)]
        self.waiting: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        self.inbox: dict[tuple[int, int], collections.deque[float]] = collections.defaultdict(collections.deque)
        self.receiving: dict[tuple[int, int], tuple[int, float]] = {}  # (source, rank) -> (rank, its send's end)
        self.priced = 0
        self.ready: list[int] = []  # ranks whose local work is done, to start their head call now

    def run(self) -> Priced:
        for r in range(len(self.calls)):
            self._next(r)
        while True:
            while self.ready:
                self._start(self.ready.pop())
            if not self._advance():
                break
        unfinished = {r: c[self.heads[r]] for r, c in enumerate(self.calls) if self.heads[r] < len(c)}
        if unfinished:
            raise ValueError(f"price: the records do not line up; ranks waiting: {dict(list(unfinished.items())[:4])}")
        phases = sorted({p for per_rank in self.spent for p in per_rank})
        return Priced(
            seconds=max(self.began, default=0.0),
            phase_seconds={p: max(per_rank.get(p, 0.0) for per_rank in self.spent) for p in phases},
            calls=self.priced,
            compute_seconds=max(self.computed, default=0.0),
        )

    def _rate(self) -> float:
        """CPU seconds per second each computing rank receives now."""
        if self.cores is None or not self.computing:
            return 1.0
        return min(1.0, self.cores / len(self.computing))

    def _advance(self) -> bool:
        """Move time to the next event (a rank's local work done, or its call ended) and handle
        every event due then; False when nothing is pending."""
        rate = self._rate()
        work_at = self.now + (self.computing[0][0] - self.served) / rate if self.computing else math.inf
        call_at = self.ending[0][0] if self.ending else math.inf
        at = min(work_at, call_at)
        if at == math.inf:
            return False
        if self.computing:
            self.served += (at - self.now) * rate
        self.now = max(self.now, at)
        if work_at <= call_at:
            target, r = heapq.heappop(self.computing)
            self.served = max(self.served, target)
            self.computed[r] += self.now - self.work_began[r]
            self.ready.append(r)
        else:
            _, r = heapq.heappop(self.ending)
            self._finish(r, self.now)
        return True

    def _next(self, r: int) -> None:
        """Rank r begins its head call's local work (or is done)."""
        if self.heads[r] >= len(self.calls[r]):
            return
        work = self.calls[r][self.heads[r]].compute_s * self.scale
        if work > 0:
            self.work_began[r] = self.now
            heapq.heappush(self.computing, (self.served + work, r))
        else:
            self.ready.append(r)

    def _finish(self, r: int, end: float) -> None:
        """Rank r's head call ends at ``end``: its span goes to the call's phase; its next call begins."""
        call = self.calls[r][self.heads[r]]
        self.spent[r][call.phase] += end - self.began[r]
        self.began[r] = end
        self.heads[r] += 1
        self._next(r)

    def _start(self, r: int) -> None:
        """Rank r's local work is done: start its head call, or wait for what the call needs."""
        call = self.calls[r][self.heads[r]]
        if call.op == "local":
            self._finish(r, self.now)
        elif call.op == "send_recv":
            self._p2p(r, call)
        else:
            waiting = self.waiting[call.group]
            waiting.append(r)
            if len(waiting) == len(call.group):
                del self.waiting[call.group]
                self._collective(call)

    def _collective(self, call: Call) -> None:
        """Every member of ``call.group`` waits at its head call on that group: run it."""
        members = [self.calls[m][self.heads[m]] for m in call.group]
        ops = {c.op for c in members}
        if len(ops) != 1 or any(c.group != call.group for c in members):
            raise ValueError(
                f"price: the next call of group {call.group} is {sorted(ops)} on its members: "
                "the ranks issued different collectives"
            )
        end = self.now + _collective_s(self.topology, call.op, members)
        for m in call.group:
            heapq.heappush(self.ending, (end, m))
        self.priced += 1

    def _p2p(self, r: int, call: Call) -> None:
        """One send_recv of rank r: its send is posted now; the call ends when the send has left and
        the message it receives (the k-th from that source) has arrived."""
        end = self.now
        if call.sent:
            (dst,) = call.sent
            exchange = call.source == dst  # both ways at once over one pair (Topology.exchange_efficiency)
            end = self.now + self.topology.send_s(r, dst, call.nbytes, exchange=exchange)
            arrives = self.now + self.topology.send_recv_s(r, dst, call.nbytes, exchange=exchange)
            if (r, dst) in self.receiving:  # dst waits for this message
                waiter, its_end = self.receiving.pop((r, dst))
                heapq.heappush(self.ending, (max(its_end, arrives), waiter))
            else:
                self.inbox[(r, dst)].append(arrives)
        self.priced += 1
        if call.source is None:
            heapq.heappush(self.ending, (end, r))
        elif self.inbox[(call.source, r)]:
            heapq.heappush(self.ending, (max(end, self.inbox[(call.source, r)].popleft()), r))
        else:
            self.receiving[(call.source, r)] = (r, end)

"""Price recorded calls on a ``Topology``: a clock per rank, each collective in the order it was issued.

``price(calls_per_rank, topology)`` replays what every rank recorded (``zensync.simulate.record``) as
events in time:

- A collective of a group starts when the last of its members reaches it and ends ``topology``'s
  time for it later, for every member (a ring all-gather: for each member when its own last step
  ends, ``Topology.all_gather_ends``; a member's transport CPU then holds back only its own end):
  the k-th call a rank made on a group is the k-th call of every member on that group (SPMD order;
  a mismatch is an error, which the real run would have been too). Collectives of disjoint groups
  (the nodes' intra-node steps of a two-level scheme) therefore run side by side.
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
- Transport CPU (``transport_cpu``, per collective op: CPU seconds per byte a rank sends or receives):
  a backend's copies and the kernel's network stack work on the same cores. A call then also gives
  each member that much CPU work for the bytes it moves (sent + received), shared with everyone's
  local work, and the call ends, for all its members, when its network time has passed and every
  member's work for it is done (a ring all-gather: each member when its own part and its own work
  are done): a collective of many ranks on few cores is CPU-bound (emulated hosts at 1 Gbit/s on one
  2-core machine). An equal-block all_gather_v is charged the ``all_gather`` cost where one is
  given (``TRANSPORT_CPU_OPS``).

The result: the time at which the last rank finishes; per phase the longest any rank spent in that
phase (its calls, its waits for the group's last member and its local work); and the largest local
work of any rank (in seconds of its clock), so a report can say how much of the time is the network.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence

from zensync.cost.topology import Topology, backend_all_gather
from zensync.simulate.record import Call, received_bytes, sent_bytes

__all__ = ["TRANSPORT_CPU_OPS", "Priced", "price"]


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
    rank_call_seconds: tuple[dict[str, float], ...] = ()
    """Per rank, per phase: the seconds from each call's start (its local work done) to its end:
    the waits for the group's other members and the call itself (what a rank times inside its
    collectives)."""


TRANSPORT_CPU_OPS = (
    "all_reduce", "reduce_scatter", "all_gather", "all_gather_v", "all_to_all_v", "broadcast", "send_recv",
)  # fmt: skip
"""The calls that move payload bytes: the ops ``price``'s ``transport_cpu`` can charge. An
``all_gather_v`` whose blocks are all equal is charged the ``all_gather`` cost where one is given:
the torch transport runs it as the backend's own all-gather, not as its ring of point-to-point steps
(``zensync.transport.torch_dist``), and the two cost different CPU per byte."""


def _cost_key(op: str, members: Sequence[Call]) -> str:
    if op == "all_gather_v" and backend_all_gather([c.nbytes for c in members]):
        return "all_gather"
    return op


_SIZE_BYTES = 8
"""One int64 size per peer in a size exchange."""


def _collective_ends(topology: Topology, op: str, members: Sequence[Call]) -> list[float]:
    """Per member, the seconds after the collective's start at which its part ends: the ring
    all-gathers' ranks end one by one (``Topology.all_gather_ends``), every other collective's
    members together."""
    group = members[0].group
    n = len(group)
    if members[0].sizes_first:  # the backend's size round, then the payload
        first = dataclasses.replace(members[0], sizes_first=False)
        if op == "all_gather_v":
            sizes_s = topology.all_gather_s([_SIZE_BYTES] * n, group)
        else:
            sizes_s = topology.all_to_all_s([[_SIZE_BYTES] * n] * n, group)
        return [sizes_s + s for s in _collective_ends(topology, op, [first, *members[1:]])]
    if op in ("all_gather", "all_gather_v"):
        return [float(s) for s in topology.all_gather_ends([c.nbytes for c in members], group)]
    return [_collective_s(topology, op, members)] * n


def _collective_s(topology: Topology, op: str, members: Sequence[Call]) -> float:
    group = members[0].group
    n = len(group)
    if op == "all_reduce":
        return topology.all_reduce_s(n, members[0].nbytes, group)
    if op == "reduce_scatter":
        return topology.reduce_scatter_s(n, members[0].nbytes, group)
    if op == "broadcast":
        return topology.broadcast_s(n, members[0].nbytes, group)
    if op == "barrier":
        return topology.barrier_s(n, group)
    if op == "all_to_all_v":
        return topology.all_to_all_s([c.sent for c in members], group)
    raise ValueError(f"price: no time model for collective {op!r}")


def price(
    calls: Sequence[Sequence[Call]],
    topology: Topology,
    *,
    compute_scale: float = 1.0,
    cores: float | None = None,
    transport_cpu: Mapping[str, float] | None = None,
) -> Priced:
    """Replay every rank's ``calls`` (indexed by global rank) on ``topology`` (module docstring).

    ``compute_scale`` multiplies the recorded local work (0: the network alone); ``cores``: how many
    cores the ranks share (None: one per rank); ``transport_cpu``: per collective op, the CPU seconds
    per byte a rank sends or receives in it (module docstring; None or a missing op: none).

    Raises:
        ValueError: If the ranks' records do not line up (a group's members issued different
            collectives at the same position, or a rank waits for a message never sent), or if
            ``compute_scale``, ``cores`` or a ``transport_cpu`` cost is out of range.
    """
    if not compute_scale >= 0:
        raise ValueError(f"compute_scale={compute_scale} must be >= 0 (0: the network alone)")
    if cores is not None and not (cores > 0 and math.isfinite(cores)):
        raise ValueError(f"cores={cores} must be finite and > 0 (None: a core per rank)")
    costs = dict(transport_cpu or {})
    bad = {op: c for op, c in costs.items() if not (c >= 0 and math.isfinite(c))}
    if bad:
        raise ValueError(f"transport_cpu: {bad}: CPU seconds per byte must be finite and >= 0")
    return _Replay(calls, topology, compute_scale, cores, costs).run()


def _moved_bytes(members: Sequence[Call]) -> list[int]:
    """Per member of a collective (its group's calls in group order), the bytes it sends plus the
    bytes it receives (``record.sent_bytes``, ``record.received_bytes``)."""
    return [sent_bytes(c, c.group[i]) + received_bytes(members, i) for i, c in enumerate(members)]


class _Join:
    """A call's ranks end together once its network time has passed and every member's CPU work
    for it is done: ``pending`` counts what is still running."""

    __slots__ = ("pending", "ranks")

    def __init__(self, ranks: list[int], pending: int) -> None:
        self.ranks, self.pending = ranks, pending


class _Replay:
    """The event loop behind ``price``.

    Each rank is in one of three states: computing the local work before its head call, waiting at
    its head call (for the group's last member, or for a message), or in a call (its ``_Join``: the
    network's time, and its transport CPU work when priced). The CPU is processor sharing with a
    virtual clock: ``served`` counts the CPU seconds every rank with CPU work has received so far
    (they all progress at the same rate), so a job of ``w`` seconds started when ``served`` is ``v``
    is done when ``served`` reaches ``v + w``. A job's heap entry carries its version; a job that
    grows (a message received after the call began) is pushed again and the old entry skipped.
    """

    def __init__(
        self,
        calls: Sequence[Sequence[Call]],
        topology: Topology,
        scale: float,
        cores: float | None,
        costs: dict[str, float],
    ) -> None:
        self.calls, self.topology, self.scale, self.cores, self.costs = calls, topology, scale, cores, costs
        ranks = len(calls)
        self.now = 0.0
        self.served = 0.0
        self.jobs: list[tuple[float, int, int]] = []  # (served at which the job is done, rank, version)
        self.job_target: list[float | None] = [None] * ranks  # the rank's running job, if any
        self.job_version = [0] * ranks
        self.running = 0  # ranks with a job
        self.ending: list[tuple[float, int, _Join]] = []  # (time the network part of a call ends, seq, join)
        self.seq = 0
        self.join_of: list[_Join | None] = [None] * ranks  # the call a rank is in
        self.heads = [0] * ranks
        self.began = [0.0] * ranks  # when the rank's previous call ended (its head's span starts)
        self.work_began = [0.0] * ranks
        self.computed = [0.0] * ranks
        self.spent: list[dict[str, float]] = [collections.defaultdict(float) for _ in range(ranks)]
        self.in_calls: list[dict[str, float]] = [collections.defaultdict(float) for _ in range(ranks)]
        self.call_began = [0.0] * ranks
        self.waiting: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        self.inbox: dict[tuple[int, int], collections.deque[tuple[float, int]]] = collections.defaultdict(
            collections.deque
        )  # (source, rank) -> messages in flight: (arrival, bytes)
        self.receiving: dict[tuple[int, int], tuple[_Join, float]] = {}  # (source, rank) -> its call, send's end
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
            rank_call_seconds=tuple(dict(per_rank) for per_rank in self.in_calls),
        )

    # -- the processor-sharing CPU -------------------------------------------------------------------------

    def _rate(self) -> float:
        """CPU seconds per second each rank with CPU work receives now."""
        if self.cores is None or not self.running:
            return 1.0
        return min(1.0, self.cores / self.running)

    def _job(self, r: int, seconds: float) -> None:
        """Give rank r ``seconds`` more CPU work (a new job, or its running one grows)."""
        target = self.job_target[r]
        if target is None:
            self.running += 1
            target = self.served
        self.job_target[r] = target + seconds
        self.job_version[r] += 1
        heapq.heappush(self.jobs, (target + seconds, r, self.job_version[r]))

    def _head_job(self) -> tuple[float, int, int] | None:
        while self.jobs and self.jobs[0][2] != self.job_version[self.jobs[0][1]]:
            heapq.heappop(self.jobs)  # a job that grew since
        return self.jobs[0] if self.jobs else None

    def _advance(self) -> bool:
        """Move time to the next event (a rank's CPU job done, or a call's network part over) and
        handle it; False when nothing is pending."""
        rate, job = self._rate(), self._head_job()
        job_at = self.now + (job[0] - self.served) / rate if job is not None else math.inf
        call_at = self.ending[0][0] if self.ending else math.inf
        at = min(job_at, call_at)
        if at == math.inf:
            return False
        if self.running:
            self.served += (at - self.now) * rate
        self.now = max(self.now, at)
        if job is not None and job_at <= call_at:
            target, r, _ = heapq.heappop(self.jobs)
            self.served = max(self.served, target)
            self.job_target[r] = None
            self.running -= 1
            join = self.join_of[r]
            if join is None:  # local work before its head call
                self.computed[r] += self.now - self.work_began[r]
                self.ready.append(r)
            else:
                self._done(join)
        else:
            _, _, join = heapq.heappop(self.ending)
            self._done(join)
        return True

    # -- calls ---------------------------------------------------------------------------------------------

    def _next(self, r: int) -> None:
        """Rank r begins its head call's local work (or is done)."""
        if self.heads[r] >= len(self.calls[r]):
            return
        work = self.calls[r][self.heads[r]].compute_s * self.scale
        if work > 0:
            self.work_began[r] = self.now
            self._job(r, work)
        else:
            self.ready.append(r)

    def _done(self, join: _Join) -> None:
        """One part of ``join``'s call is over; when all are, its ranks end it now."""
        join.pending -= 1
        if join.pending == 0:
            for r in join.ranks:
                self.join_of[r] = None
                self._finish(r, self.now)

    def _finish(self, r: int, end: float) -> None:
        """Rank r's head call ends at ``end``: its span goes to the call's phase; its next call begins."""
        call = self.calls[r][self.heads[r]]
        self.spent[r][call.phase] += end - self.began[r]
        if call.op != "local":
            self.in_calls[r][call.phase] += end - self.call_began[r]
        self.began[r] = end
        self.heads[r] += 1
        self._next(r)

    def _network_ends(self, at: float, join: _Join) -> None:
        self.seq += 1
        heapq.heappush(self.ending, (at, self.seq, join))

    def _start(self, r: int) -> None:
        """Rank r's local work is done: start its head call, or wait for what the call needs."""
        call = self.calls[r][self.heads[r]]
        self.call_began[r] = self.now
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
        ends = _collective_ends(self.topology, call.op, members)
        together = min(ends) == max(ends)
        joins = [_Join(list(call.group), 1)] * len(ends) if together else [_Join([m], 1) for m in call.group]
        cost = self.costs.get(_cost_key(call.op, members), self.costs.get(call.op, 0.0))
        for m, join, moved in zip(call.group, joins, _moved_bytes(members), strict=True):
            self.join_of[m] = join
            if cost and moved:
                join.pending += 1
                self._job(m, cost * moved)
        for join, end in dict(zip(joins, ends, strict=True)).items():  # each distinct join once
            self._network_ends(self.now + end, join)
        self.priced += 1

    def _p2p(self, r: int, call: Call) -> None:
        """One send_recv of rank r: its send is posted now; the call ends when the send has left, the
        message it receives (the k-th from that source) has arrived and its CPU work for both is done."""
        join = _Join([r], 1)
        self.join_of[r] = join
        cost = self.costs.get("send_recv", 0.0)
        end = self.now
        if call.sent:
            (dst,) = call.sent
            exchange = call.source == dst  # both ways at once over one pair (Topology.exchange_efficiency)
            end = self.now + self.topology.send_s(r, dst, call.nbytes, exchange=exchange)
            arrives = self.now + self.topology.send_recv_s(r, dst, call.nbytes, exchange=exchange)
            if (r, dst) in self.receiving:  # dst waits for this message
                waiter, its_end = self.receiving.pop((r, dst))
                self._received(dst, waiter, its_end, arrives, call.nbytes)
            else:
                self.inbox[(r, dst)].append((arrives, call.nbytes))
            self._cpu(r, join, cost * call.nbytes)
        self.priced += 1
        if call.source is None:
            self._network_ends(end, join)
        elif self.inbox[(call.source, r)]:
            arrives, nbytes = self.inbox[(call.source, r)].popleft()
            self._received(r, join, end, arrives, nbytes)
        else:
            self.receiving[(call.source, r)] = (join, end)

    def _received(self, r: int, join: _Join, send_end: float, arrives: float, nbytes: int) -> None:
        """Rank r's call (``join``) has its message: its network part ends when the message has
        arrived and its own send has left; receiving costs it CPU work too."""
        self._cpu(r, join, self.costs.get("send_recv", 0.0) * nbytes)
        self._network_ends(max(send_end, arrives), join)

    def _cpu(self, r: int, join: _Join, seconds: float) -> None:
        """Rank r's call needs ``seconds`` more CPU work (a job of its own until done)."""
        if seconds <= 0:
            return
        if self.job_target[r] is None:
            join.pending += 1
        self._job(r, seconds)

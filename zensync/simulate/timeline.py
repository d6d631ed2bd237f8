"""Price recorded calls on a ``Topology``: a clock per rank, each collective in the order it was issued.

``price(calls_per_rank, topology)`` replays what every rank recorded (``zensync.simulate.record``):

- A collective of a group starts when the last of its members reaches it (the largest member clock)
  and ends ``topology``'s time for it later, for every member: the k-th call a rank made on a group
  is the k-th call of every member on that group (SPMD order; a mismatch is an error, which the real
  run would have been too). Collectives of disjoint groups (the nodes' intra-node steps of a
  two-level scheme) therefore run side by side.
- A collective whose backend exchanges sizes first (all_gather_v, all_to_all_v without known
  receive counts) pays that round too: 8 bytes per peer.
- A point-to-point call (send_recv) posts its message when the sender reaches it; the message
  arrives ``latency + bytes / bandwidth`` later over the intra or inter link between the two ranks
  (at ``Topology.exchange_efficiency`` of the bandwidth when the call also receives from that rank),
  and the call ends when this rank's own send has left (``bytes / bandwidth``) and its receive, if any,
  has arrived. The k-th receive from a source matches that source's k-th send to this rank.

- Local work: before each call, its rank's clock advances by the call's ``compute_s`` times
  ``compute_scale``; a ``local`` call is that alone (the work after a rank's last collective).

The result: the time at which the last rank finishes; per phase the longest any rank spent in that
phase (its calls, its waits for the group's last member and its local work); and the largest local
work of any rank, so a report can say how much of the time is the network.
"""

from __future__ import annotations

import collections
import dataclasses
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
    """The largest, over ranks, of the local work charged (``compute_s`` times the scale)."""


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


def price(calls: Sequence[Sequence[Call]], topology: Topology, *, compute_scale: float = 1.0) -> Priced:
    """Replay every rank's ``calls`` (indexed by global rank) on ``topology`` (module docstring).

    ``compute_scale`` multiplies the recorded local work (0: the network alone).

    Raises:
        ValueError: If the ranks' records do not line up (a group's members issued different
            collectives at the same position, or a rank waits for a message never sent).
    """
    if not compute_scale >= 0:
        raise ValueError(f"compute_scale={compute_scale} must be >= 0 (0: the network alone)")
    ranks = len(calls)
    clock = [0.0] * ranks
    computed = [0.0] * ranks
    charged = [False] * ranks  # whether the head call's local work is on the rank's clock
    heads = [0] * ranks
    inbox: dict[tuple[int, int], collections.deque[float]] = collections.defaultdict(collections.deque)
    spent: list[dict[str, float]] = [collections.defaultdict(float) for _ in range(ranks)]
    posted = [False] * ranks
    priced = 0
    remaining = sum(len(c) for c in calls)

    def charge(r: int) -> None:
        """Put the local work before rank r's head call on its clock (once)."""
        if not charged[r]:
            call = calls[r][heads[r]]
            work = call.compute_s * compute_scale
            clock[r] += work
            computed[r] += work
            spent[r][call.phase] += work
            charged[r] = True

    while remaining:
        progressed = False
        for r in range(ranks):
            while heads[r] < len(calls[r]):
                call = calls[r][heads[r]]
                charge(r)
                if call.op == "local":
                    heads[r] += 1
                    charged[r] = False
                elif call.op == "send_recv":
                    if not _p2p(r, call, clock, inbox, spent, topology, posted):
                        break
                    heads[r] += 1
                    charged[r] = False
                else:
                    heads_of = [calls[m][heads[m]] if heads[m] < len(calls[m]) else None for m in call.group]
                    members = [c for c in heads_of if c is not None and c.group == call.group and c.op not in _RANK_OPS]
                    if len(members) != len(call.group):
                        break
                    for m in call.group:
                        charge(m)
                    ops = {c.op for c in members}  # each member's next call on this group
                    if len(ops) != 1:
                        raise ValueError(
                            f"price: the next call of group {call.group} is {sorted(ops)} on its members: "
                            "the ranks issued different collectives"
                        )
                    start = max(clock[m] for m in call.group)
                    duration = _collective_s(topology, call.op, members)
                    for m, c in zip(call.group, members, strict=True):
                        spent[m][c.phase] += start + duration - clock[m]  # the wait for the last member too
                        clock[m] = start + duration
                        heads[m] += 1
                        charged[m] = False
                    remaining -= len(call.group) - 1
                    priced += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: calls[r][heads[r]] for r in range(ranks) if heads[r] < len(calls[r])}
            raise ValueError(f"price: the records do not line up; ranks waiting: {dict(list(stuck.items())[:4])}")
    phases = sorted({p for per_rank in spent for p in per_rank})
    return Priced(
        seconds=max(clock, default=0.0),
        phase_seconds={p: max(per_rank.get(p, 0.0) for per_rank in spent) for p in phases},
        calls=priced,
        compute_seconds=max(computed, default=0.0),
    )


def _p2p(
    rank: int,
    call: Call,
    clock: list[float],
    inbox: dict[tuple[int, int], collections.deque[float]],
    spent: list[dict[str, float]],
    topology: Topology,
    posted: list[bool],
) -> bool:
    """One send_recv of ``rank``; False when the message it receives has not been sent yet (try
    later). Its own send is posted at the first try (``posted``), so two ranks that exchange
    messages in one call each find the other's."""
    start = clock[rank]
    end = start
    if call.sent:
        (dst,) = call.sent
        exchange = call.source == dst  # both ways at once over one pair (Topology.exchange_efficiency)
        end = start + topology.send_s(rank, dst, call.nbytes, exchange=exchange)
        if not posted[rank]:
            inbox[(rank, dst)].append(start + topology.send_recv_s(rank, dst, call.nbytes, exchange=exchange))
            posted[rank] = True
    if call.source is not None and not inbox[(call.source, rank)]:
        return False
    posted[rank] = False
    if call.source is not None:
        end = max(end, inbox[(call.source, rank)].popleft())
    spent[rank][call.phase] += end - start
    clock[rank] = end
    return True

"""Time of one collective on a two-level network: ranks in nodes, links inside a node, a link per node out.

``Topology(ranks_per_node, intra, inter)`` describes the cluster ``zensync simulate`` charges: ranks
``r`` and ``s`` share a node when ``r // ranks_per_node == s // ranks_per_node``; inside a node they
talk over ``intra`` (NVLink, PCIe, shared memory), and each node reaches the others through one
``inter`` link (its NIC), full duplex, shared by its ranks. A ``Link`` is alpha-beta: ``latency_s``
per message on the critical path, ``bandwidth_bytes_per_s`` per direction.

Each function prices one collective from what every rank passed to it (the per-rank sizes the
recording transport saw), with the same latency convention as ``zensync.cost.sparse.predict_time``:
alpha per sequential message (a ring allreduce pays ``2 (n-1)`` of them), because
``zensync.cost.calibrate`` fits alpha per message. Algorithms, as NCCL and gloo run them:

- all_reduce: ring, ``2 (n-1)/n M`` per rank over the slowest hop;
- reduce_scatter: ring, ``(n-1)/n M``;
- all_gather (equal or uneven blocks): ring; step ``j`` moves every rank's block ``r - j`` one hop.
  Equal blocks: ``(n-1) b`` over the slowest hop, at ``all_gather_efficiency`` of its rate (the
  backend's own all-gather). Uneven blocks: the ranks are not in lockstep (each message leaves when
  both its ends reach its step), so the largest block passes hop by hop and the last rank ends after
  ``n-1`` hops of it, at most ``(n-1) max_r b_r`` over the slowest hop (this is why a skewed sparse
  all-gather pays its largest rank's size n-1 times), while the ranks it has passed end earlier
  (``all_gather_ends``);
- all_to_all_v: direct; each rank's bytes to its node's peers over ``intra``, each node's bytes to and
  from other nodes over its ``inter`` link, whichever takes longest, after ``n - 1`` latencies times
  ``all_to_all_latency_scale`` (default 1: one message after another; a backend that posts its
  ``n - 1`` messages at once overlaps part of them, gloo on the emulated hosts about half). An
  endpoint that sends ``out`` and receives ``in`` bytes takes ``(max(out, in) - both + both / e) / B``
  with ``both = min(out, in)``: the bytes that flow one way only run at the link's rate, those that
  flow both ways at once at ``e = all_to_all_efficiency`` of it (default 1: full duplex, the time is
  ``max(out, in) / B``). Emulated hosts (gloo over tbf-shaped namespaces) move data one way at the
  full rate but reach only part of it each way when both directions are busy: an equal-block
  all-to-all (``out = in``) takes ``out / (e B)``, which is how experiments/simulate_validation.py
  calibrates e;
- broadcast: pipelined chain, ``M`` over the slowest hop after ``ceil(log2 n)`` latencies;
- barrier: ``ceil(log2 n)`` latencies (dissemination).

A link may hold a token bucket (``Link.burst_bytes``, 0 by default: a NIC sends at its rate and
no faster): a tbf-shaped link, as the emulated hosts of ``zensync.testbed`` have, sends the first
``burst_bytes`` after an idle spell at once and the rest at its rate, and its bucket refills at the
rate while it idles. Every call finds its links' buckets full (the ranks computed before it); inside
a ring a link idles for the latency between its messages, so each later step gets
``min(burst, latency x rate)`` bytes free: while ``latency x rate`` fits the bucket, a
bandwidth-bound ring pays no latency at all, and a ring that moves one large block along idle links
(a skewed all-gather) gets a full bucket at every hop. The calibration of
experiments/simulate_validation.py shows both: the large all-reduces' intercept is about
``2 (n-1) max(0, alpha - burst / rate)``, not ``2 (n-1) alpha``. An all-to-all, a broadcast and a
point-to-point message get the bucket once per endpoint and direction.

The slowest hop of a ring that spans several nodes is the node boundary: one ring crosses each NIC
once each way, so ``inter`` bounds it whatever the number of rings (k rings carry M/k each over the
same NIC). With one node, everything runs on ``intra``.

Example::

    flat = Topology(1, Link(50e-6, 125e6), Link(50e-6, 125e6))  # 1 Gbit/s between single-GPU hosts
    flat.all_reduce_s(ranks=4, nbytes=32e6)  # 6 * 50 us + 1.5 * 32e6 / 125e6 = 0.3843 s
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["Link", "Topology", "backend_all_gather"]


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """An alpha-beta link: seconds per message, and bytes per second in each direction."""

    latency_s: float
    bandwidth_bytes_per_s: float
    burst_bytes: float = 0.0
    """Token-bucket depth: what the link sends at once after idling (module docstring; 0: none)."""

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"Link: latency_s={self.latency_s} must be finite and >= 0")
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ValueError(f"Link: bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} must be finite and > 0")
        if not (self.burst_bytes >= 0 and math.isfinite(self.burst_bytes)):
            raise ValueError(f"Link: burst_bytes={self.burst_bytes} must be finite and >= 0")

    def free_bytes(self, nbytes: float) -> float:
        """Of a message of ``nbytes`` sent on this link after it idled, the bytes its bucket sends at once."""
        return min(self.burst_bytes, nbytes)

    def ring_s(self, steps: int, chunk: float) -> float:
        """``steps`` messages of ``chunk`` bytes one after another, each after a latency: the first
        finds the bucket full, each later one what refilled during its latency (module docstring)."""
        if steps <= 0:
            return 0.0
        refilled = min(self.burst_bytes, self.latency_s * self.bandwidth_bytes_per_s, chunk)
        free = self.free_bytes(chunk) + (steps - 1) * refilled
        return steps * (self.latency_s + chunk / self.bandwidth_bytes_per_s) - free / self.bandwidth_bytes_per_s


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """``ranks_per_node`` ranks per node over ``intra``; one ``inter`` link per node (module docstring)."""

    ranks_per_node: int
    intra: Link
    inter: Link
    all_to_all_efficiency: float = 1.0
    """In a direct all-to-all, the fraction of the links' rate that bytes flowing both ways at once
    achieve each way, in (0, 1] (module docstring; 1: full duplex)."""
    exchange_efficiency: float = 1.0
    """In a point-to-point exchange (two ranks each sending the other a message in one call), the
    fraction of the link's rate each direction achieves, in (0, 1] (1: full duplex; the emulated
    hosts' gloo reaches about 0.5)."""
    all_to_all_latency_scale: float = 1.0
    """The factor on a direct all-to-all's ``n - 1`` latencies, > 0 (module docstring; 1: its messages
    one after another; below 1 where the backend overlaps them)."""
    all_gather_efficiency: float = 1.0
    """An all-gather of equal blocks, which zensync's torch transport hands to the backend's own
    all-gather, moves its bytes at this fraction of the links' rate, in (0, 1] (1: a ring at the
    rate; gloo's on the emulated hosts is slower than zensync's ring of point-to-point steps, which
    uneven blocks take and which runs at the rate)."""

    def __post_init__(self) -> None:
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"Topology: ranks_per_node={self.ranks_per_node!r} must be an int >= 1")
        for name in ("all_to_all_efficiency", "exchange_efficiency", "all_gather_efficiency"):
            if not 0 < getattr(self, name) <= 1:  # also rejects NaN
                raise ValueError(
                    f"Topology: {name}={getattr(self, name)!r} must be in (0, 1]: the fraction of the links' rate "
                    "the bytes reach"
                )
        if not (self.all_to_all_latency_scale > 0 and math.isfinite(self.all_to_all_latency_scale)):
            raise ValueError(
                f"Topology: all_to_all_latency_scale={self.all_to_all_latency_scale!r} must be finite and > 0: "
                "the factor on an all-to-all's n - 1 latencies"
            )

    @classmethod
    def flat(
        cls,
        link: Link,
        *,
        all_to_all_efficiency: float = 1.0,
        exchange_efficiency: float = 1.0,
        all_to_all_latency_scale: float = 1.0,
        all_gather_efficiency: float = 1.0,
    ) -> Topology:
        """One rank per node: every pair of ranks talks over ``link`` (the Eq. 1 setting)."""
        return cls(
            1, link, link, all_to_all_efficiency, exchange_efficiency, all_to_all_latency_scale, all_gather_efficiency
        )

    def nodes(self, ranks: int) -> int:
        return -(-ranks // self.ranks_per_node)

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link(self, a: int, b: int) -> Link:
        """The link between global ranks ``a`` and ``b``."""
        return self.intra if self.node(a) == self.node(b) else self.inter

    def _spans(self, ranks: int, members: Sequence[int] | None) -> bool:
        """Whether a group (global ranks ``members``, default ``0..ranks-1``) spans several nodes."""
        if members is None:
            return self.nodes(ranks) > 1
        return len({self.node(m) for m in members}) > 1

    def _hop(self, ranks: int, members: Sequence[int] | None = None) -> Link:
        """The slowest hop of a ring over the group: the node boundary when it spans nodes."""
        if not self._spans(ranks, members):
            return self.intra
        slow = min((self.intra, self.inter), key=lambda link: link.bandwidth_bytes_per_s)
        return Link(max(self.intra.latency_s, self.inter.latency_s), slow.bandwidth_bytes_per_s, slow.burst_bytes)

    def all_reduce_s(self, ranks: int, nbytes: float, members: Sequence[int] | None = None) -> float:
        if ranks <= 1:
            return 0.0
        return self._hop(ranks, members).ring_s(2 * (ranks - 1), nbytes / ranks)

    def reduce_scatter_s(self, ranks: int, nbytes: float, members: Sequence[int] | None = None) -> float:
        if ranks <= 1:
            return 0.0
        return self._hop(ranks, members).ring_s(ranks - 1, nbytes / ranks)

    def all_gather_s(self, block_bytes: Sequence[float], members: Sequence[int] | None = None) -> float:
        """Ring all-gather of rank r's ``block_bytes[r]`` (equal or not): when its last rank is done."""
        return float(self.all_gather_ends(block_bytes, members).max(initial=0.0))

    def all_gather_ends(
        self, block_bytes: Sequence[float], members: Sequence[int] | None = None
    ) -> npt.NDArray[np.float64]:
        """Per rank (group order), the seconds after the start at which its part of a ring all-gather
        of uneven blocks ends: the ring is not in lockstep, each rank's step ``j`` (send block
        ``r - j`` to ``r + 1``, receive block ``r - j - 1`` from ``r - 1``) starts when its step
        ``j - 1`` is done and each message leaves once both its ends have reached that step, after a
        latency. A large block therefore passes along the ring hop by hop while the ranks it has
        passed finish early (zensync's uneven ring of point-to-point steps runs so,
        ``zensync.transport.torch_dist``). Equal blocks: every rank ends after ``n - 1`` steps of the
        block (``Link.ring_s``) at ``all_gather_efficiency`` of the rate (the backend's own all-gather)."""
        blocks = np.asarray(block_bytes, dtype=np.float64)
        ranks = len(blocks)
        if ranks <= 1:
            return np.zeros(ranks)
        hop = self._hop(ranks, members)
        if backend_all_gather(blocks):
            rate = hop.bandwidth_bytes_per_s * self.all_gather_efficiency
            backend = Link(hop.latency_s, rate, hop.burst_bytes)
            return np.full(ranks, backend.ring_s(ranks - 1, float(blocks[0])))
        return _ring_ends(hop, blocks)

    def broadcast_s(self, ranks: int, nbytes: float, members: Sequence[int] | None = None) -> float:
        if ranks <= 1:
            return 0.0
        hop = self._hop(ranks, members)
        return (
            math.ceil(math.log2(ranks)) * hop.latency_s + (nbytes - hop.free_bytes(nbytes)) / hop.bandwidth_bytes_per_s
        )

    def barrier_s(self, ranks: int, members: Sequence[int] | None = None) -> float:
        if ranks <= 1:
            return 0.0
        return math.ceil(math.log2(ranks)) * self._hop(ranks, members).latency_s

    def all_to_all_s(
        self, sent: Sequence[Sequence[float]] | npt.ArrayLike, members: Sequence[int] | None = None
    ) -> float:
        """Direct all-to-all: ``sent[s][d]`` bytes from group rank s to group rank d (the diagonal
        stays local); group rank i is global rank ``members[i]`` (default i)."""
        matrix = np.array(sent, dtype=np.float64)
        ranks = matrix.shape[0] if matrix.ndim == 2 else 0
        if matrix.ndim != 2 or matrix.shape[1] != ranks:
            raise ValueError(f"all_to_all_s: sent must be a square ranks x ranks matrix, got shape {matrix.shape}")
        if ranks <= 1:
            return 0.0
        np.fill_diagonal(matrix, 0.0)
        node = (np.arange(ranks) if members is None else np.asarray(members, dtype=np.int64)) // self.ranks_per_node
        same = node[:, None] == node[None, :]
        intra = np.where(same, matrix, 0.0)
        byte_s = self._duplex_s(intra.sum(1), intra.sum(0), self.intra)
        latency = self.intra.latency_s
        if self._spans(ranks, members):
            inter = np.where(same, 0.0, matrix)
            out_node = np.bincount(node, weights=inter.sum(1))
            in_node = np.bincount(node, weights=inter.sum(0))
            byte_s = max(byte_s, self._duplex_s(out_node, in_node, self.inter))
            latency = max(latency, self.inter.latency_s)
        return float((ranks - 1) * latency * self.all_to_all_latency_scale + byte_s)

    def _duplex_s(self, out: npt.ArrayLike, into: npt.ArrayLike, link: Link) -> float:
        """The slowest endpoint's seconds to send ``out`` and receive ``into`` bytes at once over ``link``:
        one-way bytes at its rate, bytes both ways at ``all_to_all_efficiency`` of it (module docstring)."""
        sent, received = np.asarray(out, dtype=np.float64), np.asarray(into, dtype=np.float64)
        sent, received = sent - np.minimum(sent, link.burst_bytes), received - np.minimum(received, link.burst_bytes)
        both = np.minimum(sent, received)
        seconds = (np.maximum(sent, received) - both + both / self.all_to_all_efficiency) / link.bandwidth_bytes_per_s
        return float(seconds.max())

    def send_recv_s(self, src: int, dst: int, nbytes: float, *, exchange: bool = False) -> float:
        """One message; ``exchange``: its call also receives from ``dst`` (both ways at once)."""
        return self.link(src, dst).latency_s + self.send_s(src, dst, nbytes, exchange=exchange)

    def send_s(self, src: int, dst: int, nbytes: float, *, exchange: bool = False) -> float:
        """The seconds ``nbytes`` take to leave ``src`` for ``dst`` (no latency; the bucket's bytes at once)."""
        link = self.link(src, dst)
        rate = link.bandwidth_bytes_per_s * (self.exchange_efficiency if exchange else 1.0)
        return (nbytes - link.free_bytes(nbytes)) / rate


def backend_all_gather(block_bytes: Sequence[float] | npt.NDArray[np.float64]) -> bool:
    """Whether an all-gather of these blocks runs as the backend's own all-gather: zensync's torch
    transport hands it equal blocks (``Topology.all_gather_efficiency``) and runs uneven ones as its
    ring of point-to-point steps (``zensync.transport.torch_dist``)."""
    return min(block_bytes) == max(block_bytes)


def _ring_ends(hop: Link, blocks: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``Topology.all_gather_ends`` for uneven blocks: link r carries rank r's messages to r + 1; its
    bucket starts full and refills at the link's rate while the link idles. An empty block is no
    message: the step of a rank that neither sends nor receives one is over at once."""
    rate, burst = hop.bandwidth_bytes_per_s, hop.burst_bytes
    step_end = np.zeros(len(blocks))  # per rank: when its previous step ended
    tokens = np.full(len(blocks), burst)
    link_free = np.zeros(len(blocks))  # per link: when its previous message arrived
    for step in range(len(blocks) - 1):
        carried = np.roll(blocks, step)  # link r carries block r - step
        sent = carried > 0
        begins = np.maximum(step_end, np.roll(step_end, -1)) + hop.latency_s  # sender and receiver both there
        tokens = np.where(sent, np.minimum(burst, tokens + (begins - link_free) * rate), tokens)
        arrives = np.where(sent, begins + np.maximum(0.0, carried - tokens) / rate, -np.inf)
        link_free = np.where(sent, arrives, link_free)
        tokens = np.where(sent, np.maximum(0.0, tokens - carried), tokens)
        step_end = np.maximum(step_end, np.maximum(arrives, np.roll(arrives, 1)))  # its send and its receive
    return step_end

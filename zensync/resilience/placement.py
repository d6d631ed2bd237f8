"""Where each rank's checkpoint shard is replicated: Gemini's group placement, or a ring.

Placement is decided per host, since a replica on its own host dies with it: the hosts are the
blocks of ``ranks_per_host`` consecutive ranks, and rank r's replicas go to the ranks of the same
local index on ``m`` other hosts.

- **group** (Gemini, SOSP'23 Sec. 4.2, the default): the hosts form groups of m + 1 consecutive
  hosts, and each host's shard goes to the other m members of its group. A group keeps its
  checkpoints as long as one member survives: any m failures lose nothing, and m + 1 lose a shard
  only when they fall in one group, which is less likely than under any other placement (Gemini's
  Theorem 1). When m + 1 does not
  divide the hosts, the last group takes the remainder and uses a ring inside itself (Gemini's
  mixed placement).
- **ring**: host h's shard goes to hosts h + 1, ..., h + m.

Example::

    replica_peers(0, 8, 1)  # [1]: groups {0,1} {2,3} {4,5} {6,7}
    replica_peers(0, 8, 1, placement="ring")  # [1]
    replica_peers(1, 8, 1)  # [0]; with the ring: [2]
    replica_peers(4, 5, 1)  # [2]: the last group {2,3,4} is a ring
"""

from __future__ import annotations

from typing import Literal

__all__ = ["PLACEMENTS", "replica_peers", "replica_sources"]

Placement = Literal["group", "ring"]
PLACEMENTS: tuple[Placement, ...] = ("group", "ring")


def _host_peers(host: int, hosts: int, m: int, placement: str) -> list[int]:
    if placement == "ring":
        return [(host + k) % hosts for k in range(1, m + 1)]
    size = m + 1
    full = hosts // size - (1 if hosts % size else 0)  # the groups of exactly m + 1 hosts
    first = full * size
    if host < first:
        start = host - host % size
        return [start + (host - start + k) % size for k in range(1, size)]
    tail = hosts - first  # the last group (m + 1 <= tail < 2 (m + 1)): a ring inside it
    return [first + (host - first + k) % tail for k in range(1, m + 1)]


def replica_peers(
    rank: int, world_size: int, m: int, *, ranks_per_host: int = 1, placement: str = "group"
) -> list[int]:
    """The ranks that hold replicas of ``rank``'s shard (on ``m`` hosts other than its own).

    Raises:
        ValueError: For an unknown placement, ``ranks_per_host`` that does not divide ``world_size``,
            or ``m`` outside [1, hosts - 1].
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: choose one of {list(PLACEMENTS)}")
    if ranks_per_host < 1 or world_size % ranks_per_host:
        raise ValueError(f"ranks_per_host={ranks_per_host} must divide world_size={world_size}")
    hosts = world_size // ranks_per_host
    if not 1 <= m < hosts:
        raise ValueError(f"m={m} replicas need 1 <= m < hosts={hosts} (a replica on its own host dies with it)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")
    host, local = divmod(rank, ranks_per_host)
    return [peer * ranks_per_host + local for peer in _host_peers(host, hosts, m, placement)]


def replica_sources(
    rank: int, world_size: int, m: int, *, ranks_per_host: int = 1, placement: str = "group"
) -> list[int]:
    """The ranks whose shards ``rank`` holds replicas of (``replica_peers`` inverted), ascending.

    Raises:
        ValueError: As ``replica_peers``, and for a ``rank`` outside ``world_size``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")
    return [
        source
        for source in range(world_size)
        if rank in replica_peers(source, world_size, m, ranks_per_host=ranks_per_host, placement=placement)
    ]

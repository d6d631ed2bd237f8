"""zensync.resilience.placement: hand-computed placements (Gemini's groups, the mixed tail group, the ring, several
ranks per host); for every size, each rank has m distinct peers on other hosts at its own local index and is the peer
of exactly m sources (replica_sources inverts replica_peers); with groups dividing the hosts, the groups are cliques
and no m host failures lose a shard; bad arguments raise a ValueError naming the parameter."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.resilience import PLACEMENTS, replica_peers, replica_sources


def _all_peers(world_size: int, m: int, ranks_per_host: int = 1, placement: str = "group") -> list[list[int]]:
    return [replica_peers(r, world_size, m, ranks_per_host=ranks_per_host, placement=placement)
            for r in range(world_size)]  # fmt: skip


def test_group_placement_pairs_consecutive_hosts() -> None:
    assert _all_peers(8, 1) == [[1], [0], [3], [2], [5], [4], [7], [6]]  # groups {0,1} {2,3} {4,5} {6,7}
    assert _all_peers(9, 2) == [[1, 2], [2, 0], [0, 1], [4, 5], [5, 3], [3, 4], [7, 8], [8, 6], [6, 7]]


def test_ring_placement_sends_to_the_next_m_hosts() -> None:
    assert _all_peers(8, 1, placement="ring") == [[1], [2], [3], [4], [5], [6], [7], [0]]
    assert _all_peers(5, 3, placement="ring") == [[1, 2, 3], [2, 3, 4], [3, 4, 0], [4, 0, 1], [0, 1, 2]]


def test_the_last_group_takes_the_remainder_as_a_ring() -> None:
    assert _all_peers(5, 1) == [[1], [0], [3], [4], [2]]  # {0,1}, then the ring {2,3,4}
    assert _all_peers(7, 2) == [[1, 2], [2, 0], [0, 1], [4, 5], [5, 6], [6, 3], [3, 4]]  # {0,1,2}, ring {3,4,5,6}
    assert _all_peers(4, 2) == _all_peers(4, 2, placement="ring")  # one group of 4 hosts: all ring


def test_several_ranks_per_host_keep_their_local_index() -> None:
    assert replica_peers(5, 8, 1, ranks_per_host=2) == [7]  # host 2 local 1 -> host 3 local 1
    assert _all_peers(8, 1, ranks_per_host=2) == [[2], [3], [0], [1], [6], [7], [4], [5]]
    assert _all_peers(8, 1, ranks_per_host=2, placement="ring") == [[2], [3], [4], [5], [6], [7], [0], [1]]
    assert replica_sources(7, 8, 1, ranks_per_host=2) == [5]
    assert replica_sources(0, 8, 1, ranks_per_host=2, placement="ring") == [6]


@st.composite
def layouts(draw) -> tuple[int, int, int, str]:
    hosts = draw(st.integers(2, 40))
    return hosts, draw(st.integers(1, hosts - 1)), draw(st.integers(1, 4)), draw(st.sampled_from(PLACEMENTS))


@settings(max_examples=150, deadline=None)
@given(layout=layouts())
def test_every_rank_has_m_peers_off_its_host_and_m_sources(layout: tuple[int, int, int, str]) -> None:
    hosts, m, ranks_per_host, placement = layout
    world = hosts * ranks_per_host
    peers = _all_peers(world, m, ranks_per_host, placement)
    for rank, mine in enumerate(peers):
        assert len(mine) == m and len(set(mine)) == m, (rank, mine)
        assert all(0 <= p < world for p in mine)
        assert all(p // ranks_per_host != rank // ranks_per_host for p in mine), (rank, mine)  # another host
        assert all(p % ranks_per_host == rank % ranks_per_host for p in mine), (rank, mine)  # same local index
    for rank in range(world):
        sources = replica_sources(rank, world, m, ranks_per_host=ranks_per_host, placement=placement)
        assert sources == sorted(s for s in range(world) if rank in peers[s])
        assert len(sources) == m, (rank, sources)  # in-degree m: replicas spread evenly


@st.composite
def divided_hosts(draw) -> tuple[int, int]:
    m = draw(st.integers(1, 19))
    return draw(st.integers(1, 40 // (m + 1))) * (m + 1), m


@settings(max_examples=100, deadline=None)
@given(hosts_m=divided_hosts(), data=st.data())
def test_groups_dividing_the_hosts_are_cliques_that_survive_m_failures(hosts_m: tuple[int, int],
                                                                       data: st.DataObject) -> None:  # fmt: skip
    hosts, m = hosts_m
    peers = _all_peers(hosts, m)
    for host in range(hosts):
        start = host - host % (m + 1)
        assert set(peers[host]) == set(range(start, start + m + 1)) - {host}  # Gemini's group: the other m members
        assert all(host in peers[p] for p in peers[host])  # symmetric
    failed = set(data.draw(st.lists(st.integers(0, hosts - 1), min_size=m, max_size=m, unique=True)))
    for host in range(hosts):
        assert {host, *peers[host]} - failed, (host, failed)  # its shard is still on a live host


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_no_m_failures_lose_a_shard_small_worlds_exhaustively(placement: str) -> None:
    for hosts in range(2, 9):
        for m in range(1, hosts):
            peers = _all_peers(hosts, m, placement=placement)
            for failed in itertools.combinations(range(hosts), m):
                assert all({h, *peers[h]} - set(failed) for h in range(hosts)), (hosts, m, failed)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0, 4, 0), {}, r"m=0 .*1 <= m < hosts=4"),
        ((0, 4, 4), {}, r"m=4 .*hosts=4"),
        ((0, 4, 2), {"ranks_per_host": 2}, r"m=2 .*hosts=2"),
        ((0, 4, 1), {"placement": "random"}, r"placement='random'.*'group', 'ring'"),
        ((0, 4, 1), {"ranks_per_host": 3}, r"ranks_per_host=3 must divide world_size=4"),
        ((0, 4, 1), {"ranks_per_host": 0}, r"ranks_per_host=0"),
    ],
)
def test_bad_arguments_name_the_parameter(args: tuple[int, int, int], kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replica_peers(*args, **kwargs)
    with pytest.raises(ValueError, match=match):
        replica_sources(*args, **kwargs)  # validated through replica_peers


@pytest.mark.parametrize("rank", [4, -1])
def test_a_rank_outside_the_world_is_refused(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"rank={rank} is outside world_size=4"):
        replica_peers(rank, 4, 1)


@pytest.mark.parametrize("rank", [8, -1])
def test_replica_sources_refuses_a_rank_outside_the_world(rank: int) -> None:
    with pytest.raises(ValueError, match=f"rank={rank}"):
        replica_sources(rank, 8, 1)

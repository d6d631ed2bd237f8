"""``Topology.all_to_all_efficiency``: in a direct all-to-all, the bytes an endpoint moves both ways at once
run at that fraction of the link's rate, one-way bytes at the full rate; its latency term and every other
collective unchanged."""

from __future__ import annotations

import math

import pytest

from zensync.cost.topology import Link, Topology

GBIT = Link(50e-6, 125e6)
NVLINK = Link(5e-6, 150e9)
EVEN_4 = [[0.0 if s == d else 1e6 for d in range(4)] for s in range(4)]
"""4 ranks, 1 MB from every rank to every other: 3 MB out of and into each rank."""


def test_equal_blocks_divide_the_byte_term_alone() -> None:
    # 3 latencies + 3e6 B / 125e6 B/s = 150 us + 24 ms; at efficiency 0.6 the 24 ms become 40 ms.
    assert Topology.flat(GBIT).all_to_all_s(EVEN_4) == pytest.approx(150e-6 + 0.024, rel=1e-12)
    assert Topology.flat(GBIT, all_to_all_efficiency=0.6).all_to_all_s(EVEN_4) == pytest.approx(
        150e-6 + 0.040, rel=1e-12
    )


def test_two_level_all_to_all_divides_the_slowest_links_byte_term() -> None:
    # 2 ranks per node: each node sends 2 ranks x 2 MB = 4 MB over its NIC (32 ms), intra 1 MB (~7 us).
    topo = Topology(2, NVLINK, GBIT, all_to_all_efficiency=0.5)
    assert topo.all_to_all_s(EVEN_4) == pytest.approx(3 * 50e-6 + 0.032 / 0.5, rel=1e-12)
    # One node: intra only, 3 MB at 150 GB/s = 20 us, over 0.5 = 40 us.
    assert Topology(4, NVLINK, GBIT, all_to_all_efficiency=0.5).all_to_all_s(EVEN_4) == pytest.approx(
        3 * 5e-6 + 40e-6, rel=1e-12
    )


def test_one_way_bytes_run_at_the_full_rate() -> None:
    # Incast: ranks 1-3 send 1 MB each to rank 0, which sends nothing: 3 MB in, one way, 24 ms.
    incast = [[0.0] * 4] + [[1e6, 0.0, 0.0, 0.0] for _ in range(3)]
    assert Topology.flat(GBIT, all_to_all_efficiency=0.5).all_to_all_s(incast) == pytest.approx(
        150e-6 + 0.024, rel=1e-12
    )
    # Rank 0 sends 1 MB and receives 3 MB: 2 MB one way (16 ms), 1 MB both ways at half rate (16 ms).
    mixed = [[0.0, 1e6], [3e6, 0.0]]
    assert Topology.flat(GBIT, all_to_all_efficiency=0.5).all_to_all_s(mixed) == pytest.approx(50e-6 + 0.032, rel=1e-12)
    assert Topology.flat(GBIT).all_to_all_s(mixed) == pytest.approx(50e-6 + 0.024, rel=1e-12)


def test_other_collectives_ignore_it_and_one_is_the_default() -> None:
    slow = Topology.flat(GBIT, all_to_all_efficiency=0.25)
    base = Topology.flat(GBIT)
    assert base == Topology(1, GBIT, GBIT, 1.0)
    assert slow.all_reduce_s(4, 32e6) == base.all_reduce_s(4, 32e6) == pytest.approx(0.3843, rel=1e-12)
    assert slow.all_gather_s([1e6, 2e6]) == base.all_gather_s([1e6, 2e6])
    assert slow.broadcast_s(4, 1e6) == base.broadcast_s(4, 1e6)
    assert slow.send_recv_s(0, 1, 1e6) == base.send_recv_s(0, 1, 1e6)


@pytest.mark.parametrize("efficiency", [0.0, -0.1, 1.01, math.nan])
def test_an_efficiency_outside_zero_one_is_refused(efficiency: float) -> None:
    with pytest.raises(ValueError, match="all_to_all_efficiency"):
        Topology.flat(GBIT, all_to_all_efficiency=efficiency)

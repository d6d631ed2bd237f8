"""The two-level network model against its definitions: a flat network gives the sync engine's Eq. 1
times, and the hierarchical all-to-all equals a per-link loop written out in float64."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from zensync.cost import CostModel, TensorShape, predict_time
from zensync.cost.topology import Link, Topology

GBIT = Link(50e-6, 125e6)
NVLINK = Link(5e-6, 150e9)


def test_flat_all_reduce_is_the_sync_engines_dense_time() -> None:
    for ranks in (2, 3, 8, 1024):
        shape = TensorShape(world_size=ranks, num_items=8_000_000, item_bytes=4, index_bytes=4, nnz=0)
        expected = predict_time("dense", shape, lambda m: 0.0, CostModel(latency_s=50e-6, bandwidth_bytes_per_s=125e6))
        assert Topology.flat(GBIT).all_reduce_s(ranks, 32e6) == pytest.approx(expected, rel=1e-12)
    assert Topology.flat(GBIT).all_reduce_s(1, 32e6) == 0.0


def test_the_docstring_example() -> None:
    assert Topology.flat(GBIT).all_reduce_s(ranks=4, nbytes=32e6) == pytest.approx(0.3843, rel=1e-12)


def test_one_node_runs_on_the_intra_link_and_several_on_the_slowest_hop() -> None:
    topo = Topology(8, NVLINK, GBIT)
    assert topo.all_reduce_s(8, 1e9) == pytest.approx(14 * 5e-6 + 1.75 * 1e9 / 150e9)
    assert topo.all_reduce_s(16, 1e9) == pytest.approx(30 * 50e-6 + 30 / 16 * 1e9 / 125e6)
    assert topo.reduce_scatter_s(16, 1e9) == pytest.approx(15 * 50e-6 + 15 / 16 * 1e9 / 125e6)
    assert topo.broadcast_s(16, 1e6) == pytest.approx(4 * 50e-6 + 1e6 / 125e6)
    assert topo.barrier_s(9) == pytest.approx(4 * 50e-6) and topo.barrier_s(8) == pytest.approx(3 * 5e-6)


def test_uneven_all_gather_pays_the_largest_block_at_every_step() -> None:
    topo = Topology.flat(GBIT)
    assert topo.all_gather_s([100.0, 100.0, 100.0]) == pytest.approx(2 * (50e-6 + 100 / 125e6))
    assert topo.all_gather_s([10.0, 1000.0, 10.0, 10.0]) == pytest.approx(3 * (50e-6 + 1000 / 125e6))
    assert topo.all_gather_s([5.0]) == 0.0


def _all_to_all_by_links(topo: Topology, sent: list[list[float]]) -> float:
    """The definition, one link at a time: each rank's intra traffic each way, each node's NIC each way."""
    n = len(sent)
    nodes = topo.nodes(n)
    intra_out = [sum(sent[s][d] for d in range(n) if d != s and topo.node(d) == topo.node(s)) for s in range(n)]
    intra_in = [sum(sent[s][d] for s in range(n) if s != d and topo.node(s) == topo.node(d)) for d in range(n)]
    nic_out = [
        sum(sent[s][d] for s in range(n) for d in range(n) if topo.node(s) == k != topo.node(d)) for k in range(nodes)
    ]
    nic_in = [
        sum(sent[s][d] for s in range(n) for d in range(n) if topo.node(d) == k != topo.node(s)) for k in range(nodes)
    ]
    seconds = max(max(intra_out), max(intra_in)) / topo.intra.bandwidth_bytes_per_s
    latency = topo.intra.latency_s
    if nodes > 1:
        seconds = max(seconds, max(max(nic_out), max(nic_in)) / topo.inter.bandwidth_bytes_per_s)
        latency = max(latency, topo.inter.latency_s)
    return (n - 1) * latency + seconds


@settings(max_examples=examples(60), deadline=None)
@given(
    ranks=st.integers(1, 9),
    ranks_per_node=st.integers(1, 4),
    data=st.data(),
)
def test_all_to_all_equals_the_per_link_definition(ranks: int, ranks_per_node: int, data: st.DataObject) -> None:
    sent = [[data.draw(st.integers(0, 10_000)) * 1.0 for _ in range(ranks)] for _ in range(ranks)]
    topo = Topology(ranks_per_node, NVLINK, GBIT)
    expected = 0.0 if ranks == 1 else _all_to_all_by_links(topo, sent)
    assert topo.all_to_all_s(sent) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_bad_descriptions_are_refused() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        Link(1e-6, 0.0)
    with pytest.raises(ValueError, match="latency"):
        Link(math.nan, 1e9)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology(0, GBIT, GBIT)
    with pytest.raises(ValueError, match="square"):
        Topology.flat(GBIT).all_to_all_s([[1.0, 2.0]])
    assert Topology.flat(GBIT).send_recv_s(0, 1, 125e6) == pytest.approx(1 + 50e-6)
    assert Topology(2, NVLINK, GBIT).send_recv_s(0, 1, 150e9) == pytest.approx(1 + 5e-6)


# -- a link with a token bucket (tbf-shaped emulated hosts) ----------------------------------------------

TBF = Link(2e-3, 12.5e6, 65536.0)
"""100 Mbit/s, 2 ms per message, a 64 KiB bucket: a latency refills 25 kB of it."""


def test_a_ring_with_a_bucket_gets_the_bucket_once_and_the_latencys_refill_at_every_later_step() -> None:
    # 2 ms of latency refills 25 kB per step; the first step finds the whole bucket.
    n, nbytes = 8, 8e6
    chunk, steps, refill = nbytes / n, 2 * (n - 1), 2e-3 * 12.5e6
    expected = steps * (2e-3 + chunk / 12.5e6) - (65536 + (steps - 1) * refill) / 12.5e6
    assert Topology.flat(TBF).all_reduce_s(n, nbytes) == pytest.approx(expected, rel=1e-12)
    # The refill covers the latency exactly: a bandwidth-bound ring pays one latency in all.
    assert expected == pytest.approx(2e-3 + 2 * (n - 1) / n * nbytes / 12.5e6 - 65536 / 12.5e6, rel=1e-12)
    assert Topology.flat(TBF).reduce_scatter_s(n, nbytes) == pytest.approx(
        (n - 1) * (2e-3 + chunk / 12.5e6) - (65536 + (n - 2) * refill) / 12.5e6, rel=1e-12
    )


def test_a_latency_longer_than_the_bucket_leaves_the_rest_of_it_on_every_step() -> None:
    slow = Link(10e-3, 12.5e6, 65536.0)  # 10 ms refills 125 kB: the bucket caps it at 64 KiB
    n, nbytes = 4, 4e6
    expected = 2 * (n - 1) * (10e-3 + (nbytes / n - 65536) / 12.5e6)
    assert Topology.flat(slow).all_reduce_s(n, nbytes) == pytest.approx(expected, rel=1e-12)


def test_small_chunks_pass_inside_the_bucket_and_cost_their_latency_only() -> None:
    assert Topology.flat(TBF).all_reduce_s(8, 4096) == pytest.approx(14 * 2e-3, rel=1e-12)
    assert TBF.ring_s(0, 1e6) == 0.0


def test_one_large_block_carried_along_idle_links_finds_a_full_bucket_at_every_hop() -> None:
    n, hot = 8, 750_000.0
    blocks = [hot] + [0.0] * (n - 1)
    assert Topology.flat(TBF).all_gather_s(blocks) == pytest.approx(
        (n - 1) * (2e-3 + (hot - 65536) / 12.5e6), rel=1e-12
    )
    # Without the bucket, the same blocks cost the old ring: n - 1 steps of the largest block.
    plain = Link(2e-3, 12.5e6)
    assert Topology.flat(plain).all_gather_s(blocks) == pytest.approx((n - 1) * (2e-3 + hot / 12.5e6), rel=1e-12)


@given(
    st.lists(st.floats(0, 4e6), min_size=2, max_size=12),
    st.floats(0, 5e-3),
    st.floats(0, 2e5),
)
@settings(max_examples=examples(100), deadline=None)
def test_an_uneven_ring_with_a_bucket_lies_between_the_bucketless_ring_and_its_wire_bound(
    blocks: list[float], latency: float, burst: float
) -> None:
    link = Link(latency, 12.5e6, burst)
    with_bucket = Topology.flat(link).all_gather_s(blocks)
    without = Topology.flat(Link(latency, 12.5e6)).all_gather_s(blocks)
    n = len(blocks)
    assert with_bucket <= without + 1e-12
    # Each step still pays its latency, and the largest block's excess over a full bucket at every hop.
    assert with_bucket >= (n - 1) * (latency + max(0.0, max(blocks) - burst) / 12.5e6) - 1e-12
    # Equal blocks: the uneven recursion and the closed form agree.
    equal = Topology.flat(link).all_gather_s([max(blocks)] * n)
    assert equal == pytest.approx(link.ring_s(n - 1, max(blocks)), rel=1e-12, abs=1e-15)


def test_an_all_to_all_broadcast_and_message_get_the_bucket_once_per_endpoint() -> None:
    topo = Topology.flat(TBF)
    n, each = 4, 300_000.0
    sent = [[0.0 if s == d else each for d in range(n)] for s in range(n)]
    assert topo.all_to_all_s(sent) == pytest.approx(3 * 2e-3 + (3 * each - 65536) / 12.5e6, rel=1e-12)
    assert topo.broadcast_s(8, 1e6) == pytest.approx(3 * 2e-3 + (1e6 - 65536) / 12.5e6, rel=1e-12)
    assert topo.send_s(0, 1, 1e6) == pytest.approx((1e6 - 65536) / 12.5e6, rel=1e-12)
    assert topo.send_s(0, 1, 1000) == 0.0


def test_a_hierarchical_ring_takes_the_slow_hops_bucket() -> None:
    topo = Topology(2, Link(1e-6, 1e11), TBF)
    assert topo.all_reduce_s(4, 8e6) == pytest.approx(Topology.flat(TBF).all_reduce_s(4, 8e6), rel=1e-12)


@pytest.mark.parametrize("burst", [-1.0, math.nan, math.inf])
def test_a_bad_bucket_is_refused(burst: float) -> None:
    with pytest.raises(ValueError, match="burst_bytes"):
        Link(1e-3, 1e6, burst)


def test_a_hot_block_passes_the_ring_hop_by_hop_and_the_ranks_it_has_passed_end_early() -> None:
    """Rank 0 holds 1 MB, the others nothing (no message): rank r receives it at step r - 1 and
    forwards it at step r, so it is done after r + 1 hops, the last rank after n - 1."""
    hop = 1e-3 + 1e6 / 1e8
    ends = Topology.flat(Link(1e-3, 1e8)).all_gather_ends([1e6, 0, 0, 0])
    assert ends.tolist() == pytest.approx([hop, 2 * hop, 3 * hop, 3 * hop], rel=1e-12)
    # With a bucket each hop finds it full (its link idled): the bucket's bytes leave at once.
    bucket_hop = 1e-3 + (1e6 - 65536) / 1e8
    ends = Topology.flat(Link(1e-3, 1e8, 65536.0)).all_gather_ends([1e6, 0, 0, 0])
    assert ends.tolist() == pytest.approx([bucket_hop, 2 * bucket_hop, 3 * bucket_hop, 3 * bucket_hop], rel=1e-12)
    assert Topology.flat(Link(1e-3, 1e8)).all_gather_s([1e6, 0, 0, 0]) == pytest.approx(3 * hop, rel=1e-12)


def test_small_blocks_behind_a_large_one_wait_for_their_neighbours() -> None:
    """Two ranks with 1 MB and 0.5 MB: one step, both messages at once; each rank ends when its send
    and its receive are done, i.e. both at the larger message."""
    ends = Topology.flat(Link(1e-3, 1e8)).all_gather_ends([1e6, 5e5])
    assert ends.tolist() == pytest.approx([1e-3 + 0.01, 1e-3 + 0.01], rel=1e-12)


def test_the_backends_all_gather_of_equal_blocks_runs_at_its_efficiency_and_the_uneven_ring_at_the_rate() -> None:
    slow = Topology.flat(Link(1e-3, 1e8), all_gather_efficiency=0.5)
    assert slow.all_gather_s([1e6] * 4) == pytest.approx(3 * (1e-3 + 1e6 / 5e7), rel=1e-12)
    assert slow.all_gather_s([1e6, 0, 0, 0]) == pytest.approx(3 * (1e-3 + 1e6 / 1e8), rel=1e-12)
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="all_gather_efficiency"):
            Topology.flat(Link(1e-3, 1e8), all_gather_efficiency=bad)

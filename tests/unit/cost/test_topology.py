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

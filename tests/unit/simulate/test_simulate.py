"""``zensync.simulate``: the recorded calls are the transport's real bytes, and their price is the
topology's time for each collective, with groups and point-to-point messages replayed in order."""

from __future__ import annotations

import math

import pytest
import torch

import zensync
from zensync.simulate import Call, Link, Topology, price, simulate
from zensync.transport import Transport

GBIT = Link(50e-6, 125e6)
FAST = Link(1e-6, 100e9)
SCHEMES = ["zen", "agsparse", "sparcml", "sparse_ps", "omnireduce", "dense"]


def _gradients(ranks: int, rows: int = 2000, dim: int = 8, nnz: int = 100) -> list[torch.Tensor]:
    out = []
    for r in range(ranks):
        t = torch.zeros(rows, dim)
        gen = torch.Generator().manual_seed(r)
        t[torch.randperm(rows, generator=gen)[:nnz]] = torch.randint(1, 5, (nnz, dim), generator=gen).float()
        out.append(t)
    return out


def test_a_dense_all_reduce_costs_the_topologys_time() -> None:
    topo = Topology.flat(GBIT)
    sim = simulate(lambda t: t.all_reduce(torch.ones(1000)), 4, topo)
    assert all(torch.equal(r, torch.full((1000,), 4.0)) for r in sim.results)
    assert sim.priced.seconds == pytest.approx(topo.all_reduce_s(4, 4000), rel=1e-12)
    assert sim.priced.calls == 1 and not sim.compute_charged


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_is_lossless_and_records_the_bytes_the_transport_accounted(scheme: str) -> None:
    ranks = 4
    grads = _gradients(ranks)
    sim = simulate(
        lambda t: zensync.sparse_allreduce(grads[t.rank], group=t, scheme=scheme), ranks, Topology.flat(GBIT)
    )
    expected = sum(grads)
    assert all(torch.equal(result, expected) for result in sim.results)
    for rank in range(ranks):
        recorded: dict[str, int] = {}
        for call in sim.calls[rank]:
            if call.op == "all_to_all_v":
                sent = sum(b for d, b in enumerate(call.sent) if call.group[d] != rank)
            elif call.op in ("all_gather", "all_gather_v"):
                sent = call.nbytes * (ranks - 1)
            elif call.op == "send_recv":
                sent = call.nbytes
            elif call.op == "all_reduce":  # the ring: each of 2 (n-1) steps sends one chunk of the tensor
                sent = 2 * (ranks - 1) * call.nbytes // ranks
            else:
                continue
            recorded[call.phase] = recorded.get(call.phase, 0) + sent
        accounted = {p: v.bytes_sent for p, v in sim.traffic[rank].phases.items() if v.bytes_sent}
        assert recorded == accounted, (scheme, rank)
    assert sim.priced.seconds == pytest.approx(sum(sim.priced.phase_seconds.values()), rel=1e-9)


def test_zen_push_is_priced_as_its_all_to_all() -> None:
    topo = Topology(2, FAST, GBIT)
    grads = _gradients(4)
    sim = simulate(lambda t: zensync.sparse_allreduce(grads[t.rank], group=t, scheme="zen"), 4, topo)
    pushes = [next(c for c in calls if c.phase == "push") for calls in sim.calls]
    matrix = [list(c.sent) for c in pushes]
    sizes = topo.all_to_all_s([[8] * 4] * 4)  # the counts round before the payload
    assert sim.priced.phase_seconds["push"] == pytest.approx(sizes + topo.all_to_all_s(matrix), rel=1e-9)


def test_groups_split_from_the_world_run_side_by_side() -> None:
    """Two nodes' intra-node all-reduces at once, then one all-reduce across the nodes' first ranks."""
    topo = Topology(2, FAST, GBIT)

    def body(t: Transport) -> torch.Tensor:
        x = torch.ones(10_000)
        node = t.split(t.rank // 2)
        with node.phase("intra"):
            node.all_reduce(x, inplace=True)
        leaders = t.split(t.rank % 2)
        with leaders.phase("inter"):
            leaders.all_reduce(x, inplace=True)
        return x

    sim = simulate(body, 4, topo)
    assert all(torch.equal(r, torch.full((10_000,), 4.0)) for r in sim.results)
    intra = topo.all_reduce_s(2, 40_000, [0, 1])
    inter = topo.all_reduce_s(2, 40_000, [0, 2])
    assert intra == pytest.approx(topo.all_reduce_s(2, 40_000))  # one node: the fast link
    assert inter > 100 * intra  # across nodes: the slow one
    # The splits' own agreements (all-gathers of colors and members) are priced too; the two intra
    # all-reduces overlap, so the intra phase costs one of them, not two.
    assert sim.priced.phase_seconds["intra"] == pytest.approx(intra, rel=1e-9)
    assert sim.priced.phase_seconds["inter"] == pytest.approx(inter, rel=1e-9)


def test_point_to_point_exchanges_follow_the_messages() -> None:
    """A ring of sends: rank r sends to r+1 and receives from r-1, each in one call, twice."""
    topo = Topology.flat(GBIT)

    def body(t: Transport) -> list[int]:
        n, r = t.world_size, t.rank
        got = []
        for _ in range(2):
            payload = torch.full((1000,), r, dtype=torch.uint8)
            with t.phase("ring"):
                received = t.send_recv(payload, (r + 1) % n, (r - 1) % n, device=torch.device("cpu"))
            assert received is not None
            got.append(int(received[0]))
        return got

    sim = simulate(body, 3, topo)
    assert sim.results == [[2, 2], [0, 0], [1, 1]]
    hop = topo.send_recv_s(0, 1, 1000)
    assert sim.priced.phase_seconds["ring"] == pytest.approx(2 * hop, rel=1e-9)


def test_records_that_do_not_line_up_are_refused() -> None:
    group = (0, 1)
    reduce = Call(op="all_reduce", group=group, phase="p", nbytes=8)
    gather = Call(op="all_gather", group=group, phase="p", nbytes=8)
    with pytest.raises(ValueError, match="different collectives"):
        price([[reduce], [gather]], Topology.flat(GBIT))
    waits = Call(op="send_recv", group=group, phase="p", source=1)
    with pytest.raises(ValueError, match="do not line up"):
        price([[waits], []], Topology.flat(GBIT))
    assert price([[], []], Topology.flat(GBIT)).seconds == 0.0
    assert math.isfinite(price([[reduce], [reduce]], Topology.flat(GBIT)).seconds)

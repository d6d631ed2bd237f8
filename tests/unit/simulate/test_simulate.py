"""``zensync.simulate``: the recorded calls are the transport's real bytes, and their price is the
topology's time for each collective, with groups and point-to-point messages replayed in order, and
each rank's measured local work on its own clock."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zensync
from zensync.simulate import Call, Link, Topology, price, simulate
from zensync.simulate.record import received_bytes, sent_bytes
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
    sim = simulate(lambda t: t.all_reduce(torch.ones(1000)), 4, topo, compute_scale=0.0)
    assert all(torch.equal(r, torch.full((1000,), 4.0)) for r in sim.results)
    assert sim.priced.seconds == pytest.approx(topo.all_reduce_s(4, 4000), rel=1e-12)
    assert sim.priced.calls == 1 and sim.priced.compute_seconds == 0.0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_is_lossless_and_records_the_bytes_the_transport_accounted(scheme: str) -> None:
    ranks = 4
    grads = _gradients(ranks)
    sim = simulate(
        lambda t: zensync.sparse_allreduce(grads[t.rank], group=t, scheme=scheme),
        ranks,
        Topology.flat(GBIT),
        compute_scale=0.0,
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
    sim = simulate(lambda t: zensync.sparse_allreduce(grads[t.rank], group=t, scheme="zen"), 4, topo, compute_scale=0)
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

    sim = simulate(body, 4, topo, compute_scale=0.0)
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

    sim = simulate(body, 3, topo, compute_scale=0.0)
    assert sim.results == [[2, 2], [0, 0], [1, 1]]
    assert sim.priced.calls == 6  # point-to-point calls count per rank
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


def _busy(cpu_s: float) -> None:
    """Spend ``cpu_s`` seconds of this thread's CPU time."""
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        pass


BUSY_S = 0.05
SLACK_S = 0.03
"""CPU seconds of Python between the calls besides the busy loop (argument checks, the loop's own
overshoot, the transport's bookkeeping outside the call): generous, as CI machines are noisy."""


def test_local_work_is_measured_per_rank_and_put_on_its_clock() -> None:
    """Rank 1 works BUSY_S before the all-reduce, rank 0 after it: both wait for rank 1, then
    rank 0 works; the step ends when rank 0 is done."""
    topo = Topology.flat(GBIT)

    def body(t: Transport) -> torch.Tensor:
        if t.rank == 1:
            _busy(BUSY_S)
        out = t.all_reduce(torch.ones(1000))
        if t.rank == 0:
            _busy(BUSY_S)
        return out

    sim = simulate(body, 2, topo)
    before = [calls[0].compute_s for calls in sim.calls]
    after = [calls[-1].compute_s for calls in sim.calls]
    assert [calls[-1].op for calls in sim.calls] == ["local", "local"]
    assert BUSY_S <= before[1] < BUSY_S + SLACK_S and before[0] < SLACK_S
    assert BUSY_S <= after[0] < BUSY_S + SLACK_S and after[1] < SLACK_S
    network = topo.all_reduce_s(2, 4000)
    assert sim.priced.seconds == pytest.approx(before[1] + network + after[0], rel=1e-9)
    assert sim.priced.compute_seconds == pytest.approx(max(before[0] + after[0], before[1] + after[1]), rel=1e-9)
    halved = price(sim.calls, topo, compute_scale=0.5)
    assert halved.seconds == pytest.approx(0.5 * (before[1] + after[0]) + network, rel=1e-9)
    assert price(sim.calls, topo, compute_scale=0.0).seconds == pytest.approx(network, rel=1e-12)


def test_priced_local_work_by_hand() -> None:
    """Exact: rank 0 computes 1.0 s, rank 1 0.25 s before one all-reduce; rank 1 then 2.0 s alone."""
    group, topo = (0, 1), Topology.flat(GBIT)
    net = topo.all_reduce_s(2, 8)
    calls = [
        [Call(op="all_reduce", group=group, phase="a", nbytes=8, compute_s=1.0)],
        [Call(op="all_reduce", group=group, phase="a", nbytes=8, compute_s=0.25),
         Call(op="local", group=(1,), phase="b", compute_s=2.0)],
    ]  # fmt: skip
    priced = price(calls, topo)
    assert priced.seconds == pytest.approx(1.0 + net + 2.0, rel=1e-12)
    assert priced.compute_seconds == pytest.approx(2.25, rel=1e-12)
    # Phase a: rank 0's 1.0 s of work and the call; rank 1 waits for it (0.75 s) too.
    assert priced.phase_seconds == pytest.approx({"a": 1.0 + net, "b": 2.0}, rel=1e-12)
    # Inside the calls: rank 0 the all-reduce alone, rank 1 its 0.75 s wait for rank 0 too.
    assert priced.rank_call_seconds[0] == pytest.approx({"a": net}, rel=1e-12)
    assert priced.rank_call_seconds[1] == pytest.approx({"a": 0.75 + net}, rel=1e-12)
    with pytest.raises(ValueError, match="compute_scale"):
        price(calls, topo, compute_scale=-1.0)


def test_inputs_are_built_before_the_local_work_is_measured() -> None:
    """An input that takes BUSY_S of CPU to build costs the step nothing; a warm-up run is unrecorded."""
    built: list[int] = []

    def make(rank: int) -> torch.Tensor:
        built.append(rank)
        _busy(BUSY_S)
        return torch.full((100,), float(rank))

    sim = simulate(lambda t, x: t.all_reduce(x), 2, Topology.flat(GBIT), inputs=make, warmup=True)
    assert sorted(built) == [0, 0, 1, 1]  # one input for the warm-up and one for the step, per rank
    assert all(torch.equal(r, torch.full((100,), 1.0)) for r in sim.results)
    assert [len(calls) for calls in sim.calls] == [2, 2]  # the all-reduce and the tail, once
    assert all(c.compute_s < SLACK_S for calls in sim.calls for c in calls)


def test_an_exchange_runs_at_the_exchange_efficiency_and_a_one_way_message_at_full_rate() -> None:
    """Ranks 0 and 1 swap 1 MB in one call each (an exchange); rank 2 only sends to rank 3."""
    link = Link(1e-4, 1e8)
    topo = Topology.flat(link, exchange_efficiency=0.5)
    group = (0, 1, 2, 3)
    swap = [Call("send_recv", group, "x", 10**6, sent=(1 - r,), source=1 - r) for r in (0, 1)]
    one_way = [Call("send_recv", group, "x", 10**6, sent=(3,)), Call("send_recv", group, "x", 0, source=2)]
    priced = price([[swap[0]], [swap[1]], [one_way[0]], [one_way[1]]], topo)
    # The swap: latency + 1e6 / (0.5 * 1e8) = 20.1 ms; the one-way message: latency + 10 ms.
    assert priced.seconds == pytest.approx(1e-4 + 0.02, rel=1e-12)
    assert price([[], [], [one_way[0]], [one_way[1]]], topo).seconds == pytest.approx(1e-4 + 0.01, rel=1e-12)
    assert price([[swap[0]], [swap[1]], [], []], Topology.flat(link)).seconds == pytest.approx(1e-4 + 0.01, rel=1e-12)
    with pytest.raises(ValueError, match="exchange_efficiency"):
        Topology.flat(link, exchange_efficiency=0.0)


def test_an_all_to_alls_latency_scale_multiplies_its_n_minus_1_latencies_only() -> None:
    link = Link(1e-3, 1e8)
    sent = [[0, 10**6, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]  # rank 0 sends 1 MB to rank 1
    assert Topology.flat(link).all_to_all_s(sent) == pytest.approx(3e-3 + 0.01, rel=1e-12)
    overlapped = Topology.flat(link, all_to_all_latency_scale=0.5)
    assert overlapped.all_to_all_s(sent) == pytest.approx(1.5e-3 + 0.01, rel=1e-12)
    assert overlapped.all_reduce_s(4, 8) == Topology.flat(link).all_reduce_s(4, 8)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="all_to_all_latency_scale"):
            Topology.flat(link, all_to_all_latency_scale=bad)


def test_ranks_that_share_cores_compute_as_a_processor_sharing_cpu() -> None:
    """Exact, on one core: rank 0 needs 2 s, rank 1 1 s before their all-reduce. Both progress at
    half speed until rank 1 is done (t = 2, 1 s each), then rank 0 alone at full speed (t = 3)."""
    group, topo = (0, 1), Topology.flat(GBIT)
    net = topo.all_reduce_s(2, 8)
    calls = [
        [Call(op="all_reduce", group=group, phase="a", nbytes=8, compute_s=2.0)],
        [Call(op="all_reduce", group=group, phase="a", nbytes=8, compute_s=1.0)],
    ]
    shared = price(calls, topo, cores=1)
    assert shared.seconds == pytest.approx(3.0 + net, rel=1e-12)
    assert shared.compute_seconds == pytest.approx(3.0, rel=1e-12)  # rank 0's clock: 3 s of local work
    assert shared.phase_seconds == pytest.approx({"a": 3.0 + net}, rel=1e-12)
    # Half a core: a quarter speed each until t = 4, then rank 0's last 1 s at half speed.
    assert price(calls, topo, cores=0.5).seconds == pytest.approx(6.0 + net, rel=1e-12)
    # A core each (or more): no sharing; compute_scale still scales the work.
    assert price(calls, topo, cores=2).seconds == pytest.approx(price(calls, topo).seconds, rel=1e-12)
    assert price(calls, topo, cores=1, compute_scale=0.5).seconds == pytest.approx(1.5 + net, rel=1e-12)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="cores"):
            price(calls, topo, cores=bad)


def test_a_rank_waiting_on_the_network_leaves_the_cores_to_others() -> None:
    """One core, 3 ranks: rank 0 works 1 s before an all-reduce with rank 1, which waits for it;
    rank 2 works 1 s alone. Ranks 0 and 2 share the core until t = 2; rank 1 then works 1 s alone."""
    pair, topo = (0, 1), Topology.flat(GBIT)
    net = topo.all_reduce_s(2, 8)
    calls = [
        [Call(op="all_reduce", group=pair, phase="a", nbytes=8, compute_s=1.0)],
        [Call(op="all_reduce", group=pair, phase="a", nbytes=8),
         Call(op="local", group=(1,), phase="b", compute_s=1.0)],
        [Call(op="local", group=(2,), phase="c", compute_s=1.0)],
    ]  # fmt: skip
    priced = price(calls, topo, cores=1)
    assert priced.seconds == pytest.approx(2.0 + net + 1.0, rel=1e-12)
    assert priced.phase_seconds == pytest.approx({"a": 2.0 + net, "b": 1.0, "c": 2.0}, rel=1e-12)


@st.composite
def _ring_records(draw: st.DrawFn) -> list[list[Call]]:
    """SPMD records of ``n`` ranks: a random sequence of world all-reduces, all-to-alls and ring
    send_recvs, each with random local work per rank, and a local tail."""
    n = draw(st.integers(2, 6))
    world = tuple(range(n))
    work = st.floats(0.0, 2.0, allow_nan=False)
    calls: list[list[Call]] = [[] for _ in range(n)]
    for step in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["all_reduce", "all_to_all_v", "send_recv"]))
        nbytes = draw(st.integers(0, 10**6))
        for r in range(n):
            if kind == "all_reduce":
                call = Call("all_reduce", world, f"p{step}", nbytes, compute_s=draw(work))
            elif kind == "all_to_all_v":
                sent = tuple(draw(st.lists(st.integers(0, 10**5), min_size=n, max_size=n)))
                call = Call("all_to_all_v", world, f"p{step}", sum(sent), sent=sent, compute_s=draw(work))
            else:
                call = Call("send_recv", world, f"p{step}", nbytes, sent=((r + 1) % n,), source=(r - 1) % n,
                            compute_s=draw(work))  # fmt: skip
            calls[r].append(call)
    for r in range(n):
        calls[r].append(Call("local", (r,), "tail", compute_s=draw(work)))
    return calls


@given(calls=_ring_records(), cores=st.floats(0.25, 8.0))
@settings(max_examples=150, deadline=None)
def test_shared_cores_slow_the_step_by_at_most_the_share(calls: list[list[Call]], cores: float) -> None:
    """Sharing ``cores`` cores never makes a step faster than a core per rank, nor slower than every
    rank's work stretched by the worst share (n / cores; the timeline is monotone in each duration);
    with at least a core per rank it changes nothing."""
    n, topo = len(calls), Topology.flat(GBIT, exchange_efficiency=0.5)
    own = price(calls, topo).seconds
    shared = price(calls, topo, cores=cores).seconds
    worst = price(calls, topo, compute_scale=max(1.0, n / cores)).seconds
    assert own * (1 - 1e-9) <= shared <= worst * (1 + 1e-9)
    assert price(calls, topo, cores=n).seconds == pytest.approx(own, rel=1e-12)


def test_transport_cpu_makes_a_collective_on_shared_cores_cpu_bound() -> None:
    """Exact: 4 ranks all-reduce 1 MB (each sends and receives 1.5 MB on the ring) at 1 ns/byte of
    CPU: 3 ms of CPU per rank. With a core each the 100 Mbit/s wire (about 15 ms) is the limit; on
    one shared core the four 3 ms jobs take 12 ms, still under the wire; at 2 ns/byte, 24 ms: CPU-bound."""
    group, link = (0, 1, 2, 3), Link(1e-4, 1e8)
    topo = Topology.flat(link)
    calls = [[Call(op="all_reduce", group=group, phase="a", nbytes=10**6)] for _ in group]
    wire = topo.all_reduce_s(4, 10**6)
    assert price(calls, topo, transport_cpu={"all_reduce": 1e-9}).seconds == pytest.approx(wire, rel=1e-12)
    assert price(calls, topo, cores=1, transport_cpu={"all_reduce": 1e-9}).seconds == pytest.approx(wire, rel=1e-12)
    cpu_bound = price(calls, topo, cores=1, transport_cpu={"all_reduce": 2e-9})
    assert cpu_bound.seconds == pytest.approx(4 * 2e-9 * 3e6, rel=1e-12) and cpu_bound.seconds > wire
    assert cpu_bound.compute_seconds == 0.0  # transport work is not local work
    # Another op's cost does not apply; a rank's local work shares the core with the transport's.
    assert price(calls, topo, cores=1, transport_cpu={"all_to_all_v": 1.0}).seconds == pytest.approx(wire, rel=1e-12)
    tail = [[*c, Call(op="local", group=(r,), phase="b", compute_s=0.01)] for r, c in enumerate(calls)]
    assert price(tail, topo, cores=1, transport_cpu={"all_reduce": 2e-9}).seconds == pytest.approx(
        0.024 + 4 * 0.01, rel=1e-12
    )
    with pytest.raises(ValueError, match="transport_cpu"):
        price(calls, topo, transport_cpu={"all_reduce": -1.0})


def test_transport_cpu_of_point_to_point_counts_what_each_rank_sends_and_receives() -> None:
    """Rank 0 sends 1 MB to rank 1 (one way), on one shared core at 10 ns/byte: 10 ms of CPU each
    for the sender and the receiver, side by side: 20 ms, over the 10.1 ms wire. An exchange moves
    twice as many bytes through each rank: 40 ms."""
    group, link = (0, 1), Link(1e-4, 1e8)
    topo, costs = Topology.flat(link), {"send_recv": 1e-8}
    one_way = [[Call("send_recv", group, "x", 10**6, sent=(1,))], [Call("send_recv", group, "x", 0, source=0)]]
    assert price(one_way, topo).seconds == pytest.approx(1e-4 + 0.01, rel=1e-12)
    assert price(one_way, topo, transport_cpu=costs).seconds == pytest.approx(0.0101, rel=1e-12)  # a core each
    assert price(one_way, topo, cores=1, transport_cpu=costs).seconds == pytest.approx(0.02, rel=1e-12)
    # The receiver waits while the sender computes 5 ms alone; both transports' work starts at the send.
    late = [[dataclasses.replace(one_way[0][0], compute_s=0.005)], one_way[1]]
    assert price(late, topo, cores=1, transport_cpu=costs).seconds == pytest.approx(0.025, rel=1e-12)
    swap = [[Call("send_recv", group, "x", 10**6, sent=(1 - r,), source=1 - r)] for r in group]
    assert price(swap, topo, cores=1, transport_cpu=costs).seconds == pytest.approx(0.04, rel=1e-12)


@given(calls=_ring_records(), cores=st.floats(0.25, 8.0), cost=st.floats(0.0, 1e-6))
@settings(max_examples=100, deadline=None)
def test_transport_cpu_never_makes_a_step_faster(calls: list[list[Call]], cores: float, cost: float) -> None:
    topo = Topology.flat(GBIT, exchange_efficiency=0.5)
    costs = {op: cost for op in ("all_reduce", "all_to_all_v", "send_recv")}
    without = price(calls, topo, cores=cores).seconds
    with_cpu = price(calls, topo, cores=cores, transport_cpu=costs).seconds
    doubled = price(calls, topo, cores=cores, transport_cpu={op: 2 * c for op, c in costs.items()}).seconds
    assert without * (1 - 1e-9) <= with_cpu <= doubled * (1 + 1e-9)


def test_repeats_record_the_median_local_work_of_each_call() -> None:
    """Three recorded steps spend 0.01, 0.09 and 0.04 s before the all-reduce: the record keeps 0.04 s."""
    spent = iter([0.01, 0.09, 0.04] * 2)
    turns: dict[int, int] = {}

    def body(t: Transport) -> torch.Tensor:
        turns[t.rank] = turns.get(t.rank, 0) + 1
        if t.rank == 0:
            _busy(next(spent))
        return t.all_reduce(torch.ones(10))

    results, calls, _ = zensync.simulate.record(body, 2, repeats=3)
    assert turns == {0: 3, 1: 3} and all(torch.equal(r, torch.full((10,), 2.0)) for r in results)
    assert [c.op for c in calls[0]] == ["all_reduce", "local"]
    assert 0.04 <= calls[0][0].compute_s < 0.04 + SLACK_S
    with pytest.raises(ValueError, match="repeats=0"):
        zensync.simulate.record(body, 2, repeats=0)


def test_repeats_that_issue_different_calls_are_refused() -> None:
    sizes = iter([10, 10, 20, 20])

    def body(t: Transport) -> torch.Tensor:
        return t.all_reduce(torch.ones(next(sizes)))

    with pytest.raises(ValueError, match="different calls on repeats"):
        zensync.simulate.record(body, 2, repeats=2)


def test_the_ranks_of_an_uneven_ring_all_gather_leave_it_one_by_one() -> None:
    """Rank 0 gathers 1 MB to three peers that hold nothing; each rank's time in the call is its own
    end (Topology.all_gather_ends), and with transport CPU a rank waits for its own work only."""
    link, group = Link(1e-3, 1e8), (0, 1, 2, 3)
    topo = Topology.flat(link)
    calls = [[Call("all_gather_v", group, "pull", 10**6 if r == 0 else 0)] for r in range(4)]
    priced = price(calls, topo)
    hop = 1e-3 + 0.01
    assert [rank["pull"] for rank in priced.rank_call_seconds] == pytest.approx([hop, 2 * hop, 3 * hop, 3 * hop])
    assert priced.seconds == pytest.approx(3 * hop, rel=1e-12)
    # 10 ns per byte moved, on cores of their own: rank 0 sends 3 MB (30 ms of CPU, past its 11 ms on
    # the wire), each other rank receives 1 MB (10 ms, within its time on the wire): only rank 0 waits.
    moved = [sent_bytes(c[0], r) + received_bytes([c[0] for c in calls], r) for r, c in enumerate(calls)]
    assert moved == [3 * 10**6, 10**6, 10**6, 10**6]
    cpu = price(calls, topo, transport_cpu={"all_gather_v": 1e-8})
    assert [rank["pull"] for rank in cpu.rank_call_seconds] == pytest.approx([0.03, 2 * hop, 3 * hop, 3 * hop])


def test_an_equal_block_all_gather_v_is_charged_the_backends_all_gather_cost() -> None:
    """The torch transport runs equal blocks as gloo's own all-gather: its calibrated cost applies;
    without one, the all_gather_v cost does; uneven blocks always take the all_gather_v cost."""
    group, topo = (0, 1), Topology.flat(Link(0.0, 1e12))
    equal = [[Call("all_gather_v", group, "g", 10**6)] for _ in range(2)]
    uneven = [[Call("all_gather_v", group, "g", 10**6 + r)] for r in range(2)]
    costs = {"all_gather_v": 1e-9, "all_gather": 1e-8}
    # Each rank moves 2 MB (1 MB sent, 1 MB received): 20 ms at the all-gather's cost, 2 ms at the ring's.
    assert price(equal, topo, transport_cpu=costs).seconds == pytest.approx(0.02, rel=1e-6)
    assert price(equal, topo, transport_cpu={"all_gather_v": 1e-9}).seconds == pytest.approx(0.002, rel=1e-6)
    assert price(uneven, topo, transport_cpu=costs).seconds == pytest.approx((2 * 10**6 + 1) * 1e-9, rel=1e-6)

"""The timeline simulator: hand-computed timelines, encode delays, CPU offload overlap, fusion groups,
the upper-bound mode, rendering, and the planner's O(1) max-plus pricing against the simulator.

Times in the hand-checked cases are multiples of 1/4 s, so every sum is exact in binary floating point.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from zensync.cost import CompressorModel, allreduce_s
from zensync.planner import _compiled_timeline as timeline
from zensync.planner._pricing import MaxPlus, PricedOptions
from zensync.planner.cluster import ClusterSpec
from zensync.planner.options import FP32_OPTION, TensorOption
from zensync.planner.profile import ModelProfile, TensorProfile
from zensync.planner.simulator import Strategy, Unit, iteration_time, render_timeline, simulate, simulate_units

MAX_PLUS_REL = 1e-12
"""The max-plus expression and the event loop add the same floats in different orders."""


def _events(result, stream):
    return [(e.label, e.start_s, e.end_s) for e in result.events if e.stream == stream and e.kind != "backward"]


def test_three_tensor_comm_queue_by_hand() -> None:
    # forward 1; ready (after backward start) A 1, B 2, C 2.25; comm 1.5, 1, 0.5.
    units = [
        Unit(label="A", ready_s=1.0, stages=(("comm", 1.5),)),
        Unit(label="B", ready_s=2.0, stages=(("comm", 1.0),)),
        Unit(label="C", ready_s=2.25, stages=(("comm", 0.5),)),
    ]
    result = simulate_units(units, forward_s=1.0, backward_s=3.0)
    # A ready at 1 + 1 = 2, comm [2, 3.5]; B ready at 3, waits for A: [3.5, 4.5]; C ready at 3.25: [4.5, 5].
    assert _events(result, "comm") == [("A", 2.0, 3.5), ("B", 3.5, 4.5), ("C", 4.5, 5.0)]
    # Backward ends at 1 + 3 = 4; the stream is busy until 5.
    assert (result.backward_end_s, result.iteration_s) == (4.0, 5.0)
    assert result.comm_busy_s == 3.0
    assert result.exposed_comm_s == 1.0  # [4, 4.5] of B and all of C


def test_gpu_encode_delays_later_ready_times() -> None:
    # A: encode 0.25 on the compute stream (and before its comm); B: plain.
    encoded = Unit(label="A", ready_s=0.5, compute_s=0.25, stages=(("wait", 0.25), ("comm", 0.5)))
    plain = Unit(label="B", ready_s=1.0, stages=(("comm", 0.5),))
    result = simulate_units([encoded, plain], forward_s=0.0, backward_s=2.0)
    # A encodes [0.5, 0.75], sends [0.75, 1.25]; B is ready at 1 + 0.25 = 1.25, sends [1.25, 1.75].
    assert _events(result, "comm") == [("A", 0.75, 1.25), ("B", 1.25, 1.75)]
    assert [(e.start_s, e.end_s) for e in result.events if e.kind == "encode"] == [(0.5, 0.75)]
    assert result.backward_end_s == 2.25 and result.iteration_s == 2.25
    without = simulate_units(
        [Unit(label="A", ready_s=0.5, stages=(("comm", 0.5),)), plain], forward_s=0.0, backward_s=2.0
    )
    assert _events(without, "comm")[1] == ("B", 1.0, 1.5)  # no encode, no delay


def test_cpu_offload_runs_in_parallel_with_compute() -> None:
    # A on the CPU: encode 1, comm 0.25, decode 0.25; B on the GPU without compression.
    offloaded = Unit(label="A", ready_s=0.5, stages=(("cpu", 1.0), ("comm", 0.25), ("cpu", 0.25)))
    plain = Unit(label="B", ready_s=0.75, stages=(("comm", 0.25),))
    result = simulate_units([offloaded, plain], forward_s=0.0, backward_s=2.0)
    # The backward pass is not delayed; B's request (0.75) comes before A's (1.5) and goes first.
    assert result.backward_end_s == 2.0
    assert _events(result, "cpu0") == [("A", 0.5, 1.5), ("A", 1.75, 2.0)]
    assert _events(result, "comm") == [("B", 0.75, 1.0), ("A", 1.5, 1.75)]
    assert result.iteration_s == 2.0


@pytest.mark.parametrize(("workers", "second_start"), [(1, 1.0), (2, 0.0)])
def test_cpu_workers_serialise_or_overlap(workers: int, second_start: float) -> None:
    units = [Unit(label=name, ready_s=0.0, stages=(("cpu", 1.0), ("comm", 0.25))) for name in "AB"]
    result = simulate_units(units, forward_s=0.0, backward_s=0.0, cpu_workers=workers)
    starts = sorted(e.start_s for e in result.events if e.kind == "cpu")
    assert starts == [0.0, second_start]
    assert result.iteration_s == second_start + 1.25 + (0.25 if workers == 2 else 0.0)


def _profile(numels: list[int], ready: list[float], forward: float = 0.01, backward: float = 0.05) -> ModelProfile:
    tensors = tuple(
        TensorProfile(name=f"t{i}", shape=(n,), ready_s=r) for i, (n, r) in enumerate(zip(numels, ready, strict=True))
    )
    return ModelProfile(model="tiny", tensors=tensors, forward_s=forward, backward_s=backward)


ONE_NODE = ClusterSpec(
    nodes=1, gpus_per_node=4, intra_bandwidth_bytes_per_s=1e9, intra_latency_s=1e-4, inter_bandwidth_bytes_per_s=1e9
)
DGC = CompressorModel.family("dgc", bits_per_element=0.64, allreduce_compatible=False)


def test_simulate_prices_fp32_allreduce() -> None:
    profile = _profile([10**6, 2 * 10**6], [0.01, 0.02])
    result = simulate(profile, ONE_NODE, DGC, Strategy.uniform(FP32_OPTION, 2))
    first, second = (float(allreduce_s(4.0 * n, 4, 1e9, 1e-4)) for n in (10**6, 2 * 10**6))
    # t0 ready at 0.01 + 0.01 sends 6.1 ms, done 0.0261; t1 ready at 0.03, sends 12.1 ms -> 0.0421.
    comm = _events(result, "comm")
    assert comm[0][1:] == pytest.approx((0.02, 0.02 + first))
    assert comm[1][1:] == pytest.approx((0.03, 0.03 + second))
    assert result.iteration_s == pytest.approx(0.01 + 0.05)  # backward (0.06) ends after the comm (0.0421)


def test_fusion_group_sends_once_when_the_last_tensor_is_ready() -> None:
    profile = _profile([10**6, 10**6, 10**6], [0.01, 0.02, 0.03], backward=0.03)
    alone = simulate(profile, ONE_NODE, DGC, Strategy.uniform(FP32_OPTION, 3))
    fused = simulate(profile, ONE_NODE, DGC, Strategy(options=(FP32_OPTION,) * 3, groups=(0, 1, 1)))
    assert [label for label, _, _ in _events(fused, "comm")] == ["t0", "t1+1"]
    start, end = _events(fused, "comm")[1][1:]
    assert start == pytest.approx(0.04)  # t2's ready time, not t1's
    assert end - start == pytest.approx(float(allreduce_s(8e6, 4, 1e9, 1e-4)))  # one alpha for 8 MB
    assert fused.comm_busy_s == pytest.approx(alone.comm_busy_s - 1e-4)  # one latency saved


def test_strategy_validation() -> None:
    comp = TensorOption(kind="comp", scheme="ag")
    with pytest.raises(ValueError, match="has 2 ids for 3 tensors"):
        Strategy(options=(FP32_OPTION,) * 3, groups=(0, 1))
    with pytest.raises(ValueError, match=r"groups\[1\]=2 after 0"):
        Strategy(options=(FP32_OPTION,) * 2, groups=(0, 2))
    with pytest.raises(ValueError, match=r"groups\[0\]=-1 after -1"):
        Strategy(options=(FP32_OPTION,) * 2, groups=(-1, 0))
    with pytest.raises(ValueError, match="mixes options"):
        Strategy(options=(FP32_OPTION, comp), groups=(0, 0))
    with pytest.raises(ValueError, match="strategy has 1 options for 2 tensors"):
        simulate(_profile([1, 1], [0.0, 0.0]), ONE_NODE, DGC, Strategy.uniform(FP32_OPTION, 1))


def test_upper_bound_has_no_compression_cost() -> None:
    profile = _profile([2**22, 2**22], [0.01, 0.02], backward=0.02)
    strategy = Strategy.uniform(TensorOption(kind="comp", scheme="ag"), 2)
    real = simulate(profile, ONE_NODE, DGC, strategy)
    ideal = simulate(profile, ONE_NODE, DGC, strategy, upper_bound=True)
    assert real.backward_end_s > profile.forward_s + profile.backward_s  # encode delayed the backward pass
    assert ideal.backward_end_s == profile.forward_s + profile.backward_s
    assert ideal.gpu_compress_s == 0.0 and real.gpu_compress_s > 0
    assert ideal.iteration_s < real.iteration_s


def test_render_timeline() -> None:
    units = [Unit(label="A", ready_s=0.5, compute_s=0.25, stages=(("wait", 0.25), ("cpu", 0.5), ("comm", 1.0)))]
    text = render_timeline(simulate_units(units, forward_s=0.5, backward_s=1.0), width=20)
    rows = {line.split("|")[0].strip(): line.split("|")[1] for line in text.splitlines() if "|" in line}
    assert set(rows) == {"compute", "comm", "cpu0"} and all(len(row) == 20 for row in rows.values())
    assert rows["compute"] == "FFF====eee===......."  # forward 0.5 s of 2.75 s = 3.6 cells
    assert rows["cpu0"] == ".........cccc......." and rows["comm"] == "............########"
    assert "exposed comm" in text and "cpu0: busy" in text
    with pytest.raises(ValueError, match="width=5 must be >= 10"):
        render_timeline(simulate_units(units, forward_s=0.5, backward_s=1.0), width=5)


def test_max_plus_pricing_matches_the_simulator() -> None:
    """The search's O(1) pricing must equal the event loop on GPU-only strategies, and so must the
    price of every one-tensor change (the greedy pass relies on both)."""
    rng = random.Random(2)
    model = CompressorModel.family("efsignsgd", bits_per_element=1.0, allreduce_compatible=False)
    for _ in range(60):
        n = rng.randint(1, 10)
        numels = [rng.choice([2**10, 2**16, 2**20, 2**23]) for _ in range(n)]
        ready = list(itertools.accumulate(rng.choice([0.0, rng.uniform(0, 0.004)]) for _ in range(n)))
        profile = _profile(numels, ready, forward=0.003, backward=ready[-1] + rng.uniform(0, 0.01))
        cluster = ClusterSpec.from_strings(
            nodes=rng.choice([1, 2, 4]),
            gpus_per_node=rng.choice([1, 2, 8]),
            inter="25Gbit",
            intra=rng.choice(["nvlink", "pcie"]),
        )
        priced = PricedOptions(profile, cluster, model, two_level=True)
        rows, columns = np.array([rng.randrange(len(priced.gpu)) for _ in range(n)]), np.arange(n)
        timeline = MaxPlus(
            priced.ready,
            *(t[rows, columns] for t in (priced.compute, priced.wait, priced.comm)),
            0.003,
            profile.backward_s,
        )

        def simulated(chosen, priced=priced, profile=profile, cluster=cluster):
            options = tuple(priced.options[priced.gpu[r]] for r in chosen)
            return simulate(profile, cluster, model, Strategy(options=options), record_events=False).iteration_s

        assert timeline.time == pytest.approx(simulated(rows), rel=MAX_PLUS_REL)
        u = rng.randrange(n)
        changed = timeline.times_with(u, priced.compute[:, u], priced.wait[:, u], priced.comm[:, u])
        for r in range(len(priced.gpu)):
            assert changed[r] == pytest.approx(simulated(np.where(columns == u, r, rows)), rel=MAX_PLUS_REL)


def _unit_arrays(units: list[Unit], max_stages: int) -> tuple[np.ndarray, ...]:
    codes = {"wait": timeline.WAIT, "comm": timeline.COMM, "cpu": timeline.CPU}
    resource = np.full((len(units), max_stages), timeline.WAIT, np.int8)
    seconds = np.zeros((len(units), max_stages))
    for u, unit in enumerate(units):
        for s, (name, duration) in enumerate(unit.stages):
            resource[u, s], seconds[u, s] = codes[name], duration
    return (
        np.array([u.ready_s for u in units]),
        np.array([u.compute_s for u in units]),
        resource,
        seconds,
        np.array([len(u.stages) for u in units], np.int64),
    )


def test_compiled_event_loop_equals_the_python_one() -> None:
    """zensync.planner._compiled_timeline.iteration_time must reproduce simulator.iteration_time bit for bit,
    including ties (equal ready times, zero-length stages) and several CPU workers."""
    rng = random.Random(5)
    resources = ("wait", "comm", "cpu")
    for _ in range(300):
        n = rng.randint(1, 25)
        ready = list(itertools.accumulate(rng.choice([0.0, 0.0, rng.uniform(0, 2e-3)]) for _ in range(n)))
        units = [
            Unit(
                label=f"u{u}",
                ready_s=ready[u],
                compute_s=rng.choice([0.0, rng.uniform(0, 1e-3)]),
                stages=tuple(
                    (rng.choice(resources), rng.choice([0.0, 1e-3, rng.uniform(0, 3e-3)]))
                    for _ in range(rng.randint(0, 5))
                ),
            )
            for u in range(n)
        ]
        workers, forward, backward = rng.randint(1, 3), rng.uniform(0, 0.01), ready[-1] + rng.uniform(0, 0.01)
        expected = iteration_time(units, forward_s=forward, backward_s=backward, cpu_workers=workers)
        got = timeline.iteration_time(forward, backward, *_unit_arrays(units, 5), workers)
        assert got == expected

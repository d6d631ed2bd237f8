"""The hook's parts on their own: Decision labels, the step log, per-parameter memory, the decider."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.cost import CostModel, compressor_model
from zensync.hooks import HookConfig
from zensync.hooks.decider import DENSE_DENSITY, Decider
from zensync.hooks.decision import COMPRESSED_PREFIX, DENSE, Decision, DecisionKind
from zensync.hooks.memory import ParamMemory, ParamRecord
from zensync.hooks.steplog import ParamStep, StepLog
from zensync.hooks.strategy import resolve_strategy
from zensync.planner import Plan, builtin_profile, plan
from zensync.planner.cluster import ClusterSpec
from zensync.sync.base import item_view
from zensync.transport import TrafficLog

GBIT = CostModel(latency_s=50e-6, bandwidth_bytes_per_s=1.25e8)


# -- Decision -----------------------------------------------------------------------------------------
def test_decision_labels_are_the_step_records_scheme_strings() -> None:
    assert DENSE.label == "dense" and DENSE.kind is DecisionKind.DENSE
    assert Decision.sparse("dense") is DENSE
    zen = Decision.sparse("zen")
    assert (zen.kind, zen.label) == (DecisionKind.SPARSE, "zen")
    topk = Decision.compressed("topk:0.01", "allgather", "hier", fusion="fc.weight")
    assert topk.label == f"{COMPRESSED_PREFIX}topk:0.01|allgather|hier"
    assert topk.group_key == (topk.label, "fc.weight")
    assert Decision.compressed("topk:0.01", "allgather", "hier", fusion="fc.weight") == topk  # frozen, by value


# -- StepLog ------------------------------------------------------------------------------------------
def _traffic(phase: str, *, sent: int, recv: int, comm_s: float, work: dict[str, float]) -> TrafficLog:
    """A bucket's log: ``sent`` / ``recv`` payload bytes and ``comm_s`` in ``phase``, ``work`` timed."""
    log = TrafficLog()
    record = log.get(phase)
    record.bytes_sent, record.bytes_recv, record.comm_time_s = sent, recv, comm_s
    log.work_s.update(work)
    return log


def test_step_log_records_steps_and_writes_json_lines(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    log = StepLog(history_size=2, jsonl_path=str(path))
    for step in range(3):
        log.note("w", ParamStep(scheme="zen", density=0.5, gamma=None, bytes_sent=10 * step, measured_s=0.1))
        log.note("b", ParamStep(scheme="dense", density=1.0))
        log.note_traffic(0.25, _traffic("dense", sent=100, recv=50, comm_s=0.125, work={"divide": 0.5}))
        log.note_traffic(0.25, _traffic("compressed", sent=1, recv=2, comm_s=0.25, work={"divide": 0.25}))
        record = log.finish(ValueError("boom") if step == 2 else None)
        assert record.step == step
    assert log.step == 3 and log.current.step == 3 and not log.current.params
    kept = log.history
    assert [r.step for r in kept] == [1, 2]  # history_size
    assert kept[-1].failed == "ValueError: boom"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3
    assert lines[0] == {
        "step": 0,
        "comm_time_s": 0.5,
        "bytes_sent": 101,
        "bytes_recv": 52,
        "params": {
            "w": {"scheme": "zen", "density": 0.5, "bytes_sent": 0, "measured_s": 0.1},
            "b": {"scheme": "dense", "density": 1.0},
        },
        "phases_s": {"divide": 0.75, "wait:dense": 0.125, "wait:compressed": 0.25},
    }
    assert lines[2]["failed"] == "ValueError: boom" and "failed" not in lines[1]
    assert kept[-1].as_dict() == lines[2]
    log.restart(40)
    assert (log.step, log.current.step) == (40, 40)


# -- ParamMemory --------------------------------------------------------------------------------------
def test_param_memory_creates_records_and_compressed_syncs_once() -> None:
    memory = ParamMemory()
    assert memory.record("w") is memory.record("w")
    assert memory.record("w").scheme == "dense"
    sync = memory.compressed_sync("topk:0.1", "allgather")
    assert memory.compressed_sync("topk:0.1", "allgather") is sync
    assert memory.compressed_sync("topk:0.1", "auto") is not sync
    assert memory.compression_memory_bytes == 0
    sync.worker_memory.update("w", torch.ones(4), torch.zeros(4))
    assert memory.compression_memory_bytes == 16
    memory.restore({}, {"zen": 1.5})
    assert memory.records == {} and memory.scheme_correction == {"zen": 1.5}


# -- Decider ------------------------------------------------------------------------------------------
def _views(densities: list[float], rows: int = 1000, dim: int = 16) -> tuple[list, list[int]]:
    views, totals = [], []
    for d in densities:
        x = torch.zeros(rows, dim)
        x[: int(d * rows)] = 1.0
        views.append(item_view(x, "row"))
        totals.append(4 * int(d * rows))  # the same density on 4 ranks
    return views, totals


def _decider(strategy: str, **options) -> Decider:
    config = HookConfig(strategy=strategy, latency_s=50e-6, bandwidth_bytes_per_s=1.25e8, **options)
    return Decider(config, resolve_strategy(strategy), ParamMemory(), two_level=False)


def test_decider_natural_sparsity_zen_insisted_below_dense_density() -> None:
    decider = _decider("zen")
    views, totals = _views([0.01, 0.5, DENSE_DENSITY])
    decisions = decider.decide(0, ["a", "b", "c"], views, totals, [0, 0, 0], 4, GBIT)
    assert decisions == [Decision.sparse("zen"), Decision.sparse("zen"), DENSE]
    assert decider.memory.record("a").mean_density == pytest.approx(0.01)
    assert set(decider.memory.record("a").predicted_s) == {"dense", "zen"}


def test_decider_auto_picks_by_cost_model() -> None:
    decider = _decider("auto")
    views, totals = _views([0.001, 0.8])
    decisions = decider.decide(0, ["sparse", "dense"], views, totals, [0, 0], 4, GBIT)
    assert decisions[0].kind is DecisionKind.SPARSE and decisions[1] is DENSE


def test_decider_compressor_strategy_compresses_what_would_go_dense() -> None:
    views, totals = _views([0.001, 1.0])
    ef = _decider("topk:0.01").decide(0, ["emb", "fc"], views, totals, [0, 0], 4, GBIT)
    assert ef[0] == Decision.sparse("zen")  # naturally sparse: Zen
    assert ef[1] == Decision.compressed("topk:0.01", "auto", "flat", fusion="bucket")  # top-k fuses the bucket
    matrices = _decider("powersgd:2").decide(0, ["emb", "fc"], views, totals, [0, 0], 4, GBIT)
    # PowerSGD on the flat allreduce: the bucket, part by part (each matrix its own P and Q, shared rounds).
    assert matrices[1] == Decision.compressed("powersgd:2", "auto", "flat", fusion="bucket")
    fused = _decider("fp16").decide(0, ["emb", "fc"], None, [], [], 4, None)  # skipped detection
    assert fused == [Decision.compressed("fp16", "auto", "flat", fusion="bucket")] * 2  # casts fuse too
    assert _decider("fp16", warmup_steps=2).decide(1, ["fc"], None, [], [], 4, None) == [DENSE]  # warm-up


def test_decider_skips_detection_for_clearly_dense_buckets_between_rechecks() -> None:
    decider = _decider("auto", recheck_every=10)
    views, totals = _views([1.0])
    decider.decide(0, ["fc"], views, totals, [0], 4, GBIT)
    assert decider.memory.record("fc").scheme == "dense"
    assert not decider.skips_detection(0, ["fc"])  # a re-check step
    assert decider.skips_detection(1, ["fc"])
    assert not decider.skips_detection(1, ["never-seen"])
    assert _decider("dense").skips_detection(0, ["fc"])


def test_decider_reads_a_plan_and_warns_once_for_missing_parameters(caplog) -> None:
    profile = builtin_profile("lstm")
    cluster = ClusterSpec.from_strings(nodes=2, gpus_per_node=2, inter="10Gbit")
    made: Plan = plan(profile, cluster, compressor_model("dgc:0.01"))
    names = [t.name for t in made.tensors]
    strategy = resolve_strategy("auto")
    decider = Decider(HookConfig(strategy="auto"), strategy, ParamMemory(), two_level=True)
    object.__setattr__(decider, "strategy", type(strategy)("p.json", "plan", ("dense", "zen"), plan=made))
    with caplog.at_level(logging.WARNING, logger="zensync.hooks.decider"):
        decisions = decider.decide(0, [*names, "missing.a", "missing.b"], None, [], [], 4, None)
    assert decisions[-2:] == [DENSE, DENSE]
    assert any(d.kind is DecisionKind.COMPRESSED for d in decisions)  # the plan compresses something
    assert sum("not in plan" in r.message for r in caplog.records) == 1
    for name, decision in zip(names, decisions, strict=False):
        compression = made.compression_for(name)
        if compression is None:
            assert decision is DENSE
        else:
            assert (decision.compressor, decision.scheme) == compression
            assert decision.fusion == str(made.group_of(name))


# -- Runtime ------------------------------------------------------------------------------------------
def test_runtime_keeps_given_model_calibrates_otherwise_and_runs_on_cpu_without_streams() -> None:
    import contextlib

    from zensync.hooks.runtime import Runtime
    from zensync.transport import SimulatedWorld

    def body(transport):
        fixed = Runtime(transport, HookConfig(latency_s=1e-5, bandwidth_bytes_per_s=2e9), 7, torch.device("cpu"))
        measured = Runtime(transport, HookConfig(latency_s=1e-5), 7, torch.device("cpu"))
        model = transport.run(measured.ensure_cost_model(measured_config))
        again = transport.run(measured.ensure_cost_model(measured_config))  # measured once
        return fixed, model, again, measured

    measured_config = HookConfig(latency_s=1e-5)
    results = SimulatedWorld(2).run(body)
    for fixed, model, again, measured in results:
        assert fixed.cost_model == CostModel(latency_s=1e-5, bandwidth_bytes_per_s=2e9)
        assert fixed.transport is fixed.dense_transport  # a simulated group is not duplicated
        assert fixed.h0_seed == 7 and fixed.control_device() == torch.device("cpu")
        assert model.latency_s == 1e-5 and 0 < model.bandwidth_bytes_per_s < float("inf")  # the given part kept
        assert again is model
        assert measured.segment_context() is contextlib.nullcontext
    assert results[0][1] == results[1][1]  # rank 0's fit on every rank


def test_param_step_dicts_hold_the_fields_each_path_observes() -> None:
    from zensync.hooks.steplog import ParamStep

    assert ParamStep(scheme="dense", density=1.0).as_dict() == {"scheme": "dense", "density": 1.0}
    compressed = ParamStep(scheme="compress:fp16|allreduce|flat", density=1.0, bytes_sent=8, measured_s=0.5)
    assert set(compressed.as_dict()) == {"scheme", "density", "bytes_sent", "measured_s"}
    # Sparse: every key, None included (no densification measured yet, no prediction).
    sparse = ParamStep(scheme="zen", density=0.0, bytes_sent=0, bytes_recv=0, measured_s=0.1, observes_all=True)
    assert sparse.as_dict() == {
        "scheme": "zen",
        "density": 0.0,
        "gamma": None,
        "bytes_sent": 0,
        "bytes_recv": 0,
        "predicted_s": None,
        "measured_s": 0.1,
        "collectives": None,
    }


@pytest.mark.parametrize(("world_size", "expected"), [(4, "agsparse"), (64, "zen")])
def test_auto_picks_the_sparse_gradient_scheme_by_rounds_and_bytes(world_size: int, expected: str) -> None:
    """A 50,000-row table with 1 % of its rows touched per rank: at 4 ranks AGsparse's single all-gather
    is cheaper (Zen pays more rounds), at 64 ranks its (n-1) K volume loses to Zen's balanced push/pull."""
    from types import SimpleNamespace

    from zensync.cost import CostModel
    from zensync.hooks.memory import ParamRecord
    from zensync.hooks.pipeline import sparse_gradient_scheme
    from zensync.hooks.strategy import resolve_strategy
    from zensync.sync.base import item_view

    record = ParamRecord(scheme="zen", mean_density=0.01, gamma=1.5, steps=3)
    state = SimpleNamespace(
        strategy=resolve_strategy("auto"),
        record=lambda name: record,
        runtime=SimpleNamespace(transport=SimpleNamespace(world_size=world_size)),
        config=SimpleNamespace(switch_margin=0.1),
    )
    view = item_view(torch.zeros(50_000, 64), "row")
    model = CostModel(latency_s=1e-3, bandwidth_bytes_per_s=1.25e8)
    assert sparse_gradient_scheme(state, "emb.weight", view, model) == expected  # type: ignore[arg-type]
    assert set(record.predicted_s) == {"zen", "agsparse"}
    fresh = ParamRecord()  # no sync measured yet: Zen
    state.record = lambda name: fresh
    assert sparse_gradient_scheme(state, "emb.weight", view, model) == "zen"  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None)
@given(
    scheme=st.sampled_from(["dense", "zen", "agsparse"]),
    gamma=st.none() | st.floats(allow_nan=False),
    predicted=st.dictionaries(st.sampled_from(["dense", "zen"]), st.floats(allow_nan=False)),
    steps=st.integers(0, 10**6),
)
def test_a_param_records_dict_is_dataclasses_asdict_and_owns_its_dicts(scheme, gamma, predicted, steps) -> None:
    record = ParamRecord(scheme=scheme, gamma=gamma, predicted_s=predicted, correction=dict(predicted), steps=steps)
    got = record.as_dict()
    assert got == dataclasses.asdict(record)
    got["predicted_s"]["other"] = 1.0  # a checkpoint's copy: the record is not changed through it
    assert "other" not in record.predicted_s

"""The DDP hook with compressor strategies on gloo: exact where the compressor is, DDP-like otherwise.

- "none" (identity compressor) must equal DDP's default allreduce;
- "fp16" must equal torch's own fp16_compress_hook up to half-precision rounding;
- lossy compressors (top-k, PowerSGD, sign) must keep every rank's parameters identical, route the
  naturally sparse embedding through Zen, record each parameter's compression, and train;
- warm-up steps are plain allreduce;
- a strategy that fails on one rank (a plan file missing there) raises on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import zensync
from tests.distributed._launch import launch, pytest_generate_tests, slow_world, world_size_fixture  # noqa: F401 - class data world_size
from tests.distributed.hooks.test_ddp_hook import FLOAT32_ATOL, STEPS, _batch, _Net
from zensync.compress import cast
from zensync.planner import ClusterSpec, Plan, PlanTensor, Predictions, TensorOption

FP16_ATOL = 2e-3
"""fp16 sums of gradients of size ~1e-2 over a few steps (as test_ddp_hook's HALF_ATOL)."""
LOSSY_MAX_DIFF = 0.2
"""Parameters start at ~0.1-0.3 and move by lr * grad ~ 0.05 per step: a lossy run that diverged or
dropped whole updates would be off by more than this after STEPS steps."""
FIXED_MODEL = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e8, "adapt": False}
"""A fixed cost model: the embedding's sparse-vs-dense choice does not depend on this machine."""


def _train(
    rank: int, strategy: str | None, options: dict[str, Any], bucket_cap_mb: float = 0.01
) -> tuple[list[list[torch.Tensor]], Any, list[float]]:
    torch.manual_seed(0)
    model = _Net()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    state = None
    if strategy == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif strategy is not None:
        state = zensync.register(ddp, strategy=strategy, **{**FIXED_MODEL, **options})
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    snapshots, losses = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        ids, target = _batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(ids), target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots, state, losses


def _max_diff(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    return max(float((x - y).abs().max()) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "topk": ("topk:0.05", {}),
    "topk-alltoall": ("topk:0.05", {"compressed_scheme": "alltoall_allgather"}),
    "powersgd": ("powersgd:2", {}),
    "efsignsgd-gather": ("efsignsgd", {"compressed_scheme": "gather_broadcast"}),
    "warmup": ("topk:0.05", {"warmup_steps": 2}),
    "topk-serial": ("topk:0.05", {"overlap_buckets": False}),
    "powersgd-serial": ("powersgd:2", {"overlap_buckets": False}),
    "efsignsgd-gather-serial": ("efsignsgd", {"compressed_scheme": "gather_broadcast", "overlap_buckets": False}),
    "topk-thread": ("topk:0.05", {"comm_thread": True}),
    "powersgd-thread": ("powersgd:2", {"comm_thread": True}),
}
SERIAL = {
    "topk": "topk-serial",
    "powersgd": "powersgd-serial",
    "efsignsgd-gather": "efsignsgd-gather-serial",
    "topk-thread": "topk-serial",
    "powersgd-thread": "powersgd-serial",
}
"""Overlapped runs (the default: each bucket hands the lane on after its last collective; "-thread":
the jobs also start on the hook's own thread, beside backward) and the same runs with each bucket's
job run to its end first."""


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    reference, _, _ = _train(rank, None, {})
    torch_fp16, _, _ = _train(rank, "torch-fp16", {})
    out: dict[str, Any] = {}
    for case, (strategy, options) in CASES.items():
        snapshots, state, losses = _train(rank, strategy, options)
        out[case] = {
            "final": [p.clone() for p in snapshots[-1]],
            "diff_ddp": _max_diff(snapshots, reference),
            "diff_ddp_first2": _max_diff(snapshots[:2], reference[:2]),
            "diff_torch_fp16": _max_diff(snapshots, torch_fp16),
            "schemes": [{n: p["scheme"] for n, p in h["params"].items()} for h in state.history],
            "fc1_bytes": state.history[-1]["params"]["fc1.weight"].get("bytes_sent"),
            "dense_layer_bytes": sum(
                p.get("bytes_sent") or 0 for n, p in state.history[-1]["params"].items() if n.startswith("fc")
            ),
            "memory": state.compression_memory_bytes,
            "losses": losses,
            "phases": state.history[-1]["phases_s"],
            "agreed_steps": [h["step"] for h in state.history if "wait:agree" in h["phases_s"]],
            "comm_time_s": state.history[-1]["comm_time_s"],
        }
        state.close()
    out["fc1_shape"] = list(_Net().fc1.weight.shape)
    return out


def _pipelined_worker(rank: int, world_size: int) -> dict[str, Any]:
    """fp16 with the cast pipeline's pieces at 64 elements, so each bucket goes in several, beside
    torch's fp16 hook; the number of pieces of each pipelined call."""
    torch_fp16, _, _ = _train(rank, "torch-fp16", {})
    counts: list[int] = []
    pieces = cast.pipeline_pieces

    def counted(numel: int) -> list[tuple[int, int]]:
        bounds = pieces(numel)
        counts.append(len(bounds))
        return bounds

    cast._PIPELINE_PIECE, cast.pipeline_pieces = 64, counted
    snapshots, state, _ = _train(rank, "fp16", {})
    state.close()
    return {"diff_torch_fp16": _max_diff(snapshots, torch_fp16), "pieces": counts}


def test_fp16_in_pipelined_pieces_equals_torch_fp16_hook(tmp_path: Any) -> None:
    """Real gloo: the pieces' allreduces issued before the first is awaited, every bucket's sum
    as torch's one allreduce up to half-precision rounding."""
    for result in launch(_pipelined_worker, 2, (), tmp_path):
        assert result["diff_torch_fp16"] <= FP16_ATOL
        assert max(result["pieces"]) >= 3, result["pieces"]


class TestCompressedStrategies:
    world_size = [2, slow_world(3)]  # 3: an odd world size, same checks

    @pytest.fixture(scope="class")
    @classmethod
    def results(cls, world_size: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        return launch(_worker, world_size, (), tmp_path_factory.mktemp(f"compress{world_size}"))

    def test_identity_compressor_equals_ddp(self, results: list[dict[str, Any]]) -> None:
        for per_rank in results:
            assert per_rank["none"]["diff_ddp"] <= FLOAT32_ATOL

    def test_fp16_equals_torch_fp16_hook(self, results: list[dict[str, Any]]) -> None:
        for per_rank in results:
            assert per_rank["fp16"]["diff_torch_fp16"] <= FP16_ATOL

    @pytest.mark.parametrize("case", [c for c in CASES if c not in ("none", "fp16")])
    def test_lossy_strategies_keep_ranks_identical(self, results: list[dict[str, Any]], case: str) -> None:
        first = results[0][case]["final"]
        for per_rank in results[1:]:
            for a, b in zip(per_rank[case]["final"], first, strict=True):
                assert torch.equal(a, b), case

    @pytest.mark.parametrize("case", ["topk", "topk-alltoall", "powersgd", "efsignsgd-gather"])
    def test_embedding_takes_zen_dense_layers_compressed(self, results: list[dict[str, Any]], case: str) -> None:
        spec = CASES[case][0]
        for per_rank in results:
            last = per_rank[case]["schemes"][-1]
            assert last["emb.weight"] == "zen", last
            assert last["fc1.weight"].startswith(f"compress:{spec}|"), last

    def test_error_feedback_memory_reported(self, results: list[dict[str, Any]]) -> None:
        for per_rank in results:
            assert per_rank["topk"]["memory"] > 0
            assert per_rank["fp16"]["memory"] == 0  # fp16 keeps no residual

    def test_compression_cuts_bytes(self, results: list[dict[str, Any]]) -> None:
        for per_rank in results:
            none, fp16, topk = (per_rank[c]["fc1_bytes"] for c in ("none", "fp16", "topk"))
            assert 0.45 * none <= fp16 <= 0.55 * none, (none, fp16)
            assert topk < 0.5 * fp16, (fp16, topk)
            # PowerSGD rank 2 sends each matrix's (rows + cols) x 2 factors, the biases as they are:
            # fc1 32 x DIM and fc2 10 x 32, (32 + DIM) * 2 + 32 + (10 + 32) * 2 + 10 elements of the
            # 32 * DIM + 32 + 320 + 10 a dense send moves (which would be 4x over this bound).
            rows, cols = per_rank["fc1_shape"]
            sent = (rows + cols) * 2 + rows + (10 + 32) * 2 + 10
            dense = rows * cols + rows + 320 + 10
            none_all, powersgd = (per_rank[c]["dense_layer_bytes"] for c in ("none", "powersgd"))
            assert powersgd <= none_all * sent / dense * 1.25, (none_all, powersgd)  # ring chunks round up

    def test_warmup_steps_are_plain_allreduce(self, results: list[dict[str, Any]]) -> None:
        for per_rank in results:
            record = per_rank["warmup"]
            assert record["diff_ddp_first2"] <= FLOAT32_ATOL
            assert all(s == "dense" for s in record["schemes"][0].values())
            assert any(s.startswith("compress:") for s in record["schemes"][-1].values())

    @pytest.mark.parametrize(
        ("case", "sections"),
        [
            ("topk", {"compress", "decompress", "error_feedback", "finite_check", "wait:compressed"}),
            ("topk-alltoall", {"compress", "decompress", "error_feedback", "finite_check", "wait:compressed"}),
            ("efsignsgd-gather", {"compress", "decompress", "error_feedback", "finite_check", "wait:compressed"}),
            ("powersgd", {"codec", "error_feedback", "finite_check", "wait:compressed"}),
            ("fp16", {"codec", "wait:compressed"}),
        ],
    )
    def test_step_log_says_where_the_time_went(
        self, results: list[dict[str, Any]], case: str, sections: set[str]
    ) -> None:
        """Each compressed step's phases: the compressor's and error feedback's passes, the waits in
        its collectives, the detection the embedding needs and the lane's queue; the ranks'
        comparison of their engine states only at the first step (check_every=100)."""
        for per_rank in results:
            phases = per_rank[case]["phases"]
            assert per_rank[case]["agreed_steps"] == [0]
            expected = sections | {"detect", "divide", "queued", "wait:detect"}
            assert expected <= set(phases), sorted(phases)
            assert all(seconds >= 0 for seconds in phases.values()), phases
            # The sections run inside the buckets' syncs, whose wall time is comm_time_s.
            local = sum(phases[k] for k in sections if not k.startswith("wait:")) + phases["detect"]
            assert local <= per_rank[case]["comm_time_s"], (phases, per_rank[case]["comm_time_s"])

    @pytest.mark.parametrize("case", sorted(SERIAL))
    def test_overlapped_buckets_give_the_serial_results(self, results: list[dict[str, Any]], case: str) -> None:
        """Buckets that overlap (compression of one beside the transfer and decoding of the one
        before, with error feedback and PowerSGD's state per bucket) train exactly as serial ones."""
        for per_rank in results:
            for a, b in zip(per_rank[case]["final"], per_rank[SERIAL[case]]["final"], strict=True):
                assert torch.equal(a, b), case
            assert per_rank[case]["losses"] == per_rank[SERIAL[case]]["losses"]

    @pytest.mark.parametrize("case", ["topk", "topk-alltoall", "powersgd", "efsignsgd-gather"])
    def test_lossy_runs_stay_near_ddp(self, results: list[dict[str, Any]], case: str) -> None:
        """Error feedback keeps the lossy runs close to DDP's trajectory over these few steps."""
        for per_rank in results:
            assert 0 < per_rank[case]["diff_ddp"] < LOSSY_MAX_DIFF, per_rank[case]["diff_ddp"]


def _two_level_worker(rank: int, world_size: int) -> dict[str, Any]:
    snapshots, state, _ = _train(rank, "topk:0.1", {"ranks_per_node": 2, "compressed_scheme": "allgather"})
    result = {"final": snapshots[-1], "schemes": state.history[-1]["params"]}
    state.close()
    return result


def _write_plan(path: Any, world_size: int) -> None:
    """A hand-made plan for _Net: fc1.* top-k allgather fused into one group, fc2.weight fp16, emb fp32,
    fc2.bias absent."""
    options = {
        "emb.weight": (TensorOption(kind="fp32"), 0),
        "fc1.weight": (TensorOption(kind="comp", scheme="ag"), 1),
        "fc1.bias": (TensorOption(kind="comp", scheme="ag"), 1),
        "fc2.weight": (TensorOption(kind="fp16"), 2),
    }
    shapes = {n: tuple(p.shape) for n, p in _Net().named_parameters()}
    tensors = tuple(PlanTensor(name=n, numel=math.prod(shapes[n]), option=o, group=g) for n, (o, g) in options.items())
    cluster = ClusterSpec.from_strings(nodes=world_size, gpus_per_node=1, inter="1Gbit")
    predicted = Predictions(plan_s=1.0, fp32_s=1.0, fp16_s=1.0, upper_bound_s=1.0)
    plan = Plan(
        model="net", cluster=cluster, compressor="topk:0.05", tensors=tensors, predicted=predicted, selection_s=0.0
    )
    path.write_text(plan.to_json())


def _plan_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    _, state, _ = _train(rank, path, {}, bucket_cap_mb=25)  # one bucket: fusion groups are not cut
    schemes = {n: p["scheme"] for n, p in state.history[-1]["params"].items()}
    memories = {f"{spec}|{scheme}": sync.worker_memory.names() for (spec, scheme), sync in state.compressed.items()}
    state.close()
    return {"schemes": schemes, "memories": memories}


def _missing_plan_worker(rank: int, world_size: int, missing: str, present: str) -> str:
    ddp = nn.parallel.DistributedDataParallel(_Net())
    try:
        zensync.register(ddp, strategy=missing if rank == 1 else present, **FIXED_MODEL)
    except ValueError as exc:
        return str(exc)
    return "no error"


class TestTwoLevelAndErrors:
    world_size = [
        slow_world(4)
    ]  # two nodes of two ranks; 17 s, in the slow tier (.ci/run) to keep the README's run fast

    def test_two_level_ranks_identical(self, world_size: int, tmp_path: Any) -> None:
        results = launch(_two_level_worker, world_size, (), tmp_path)
        for per_rank in results[1:]:
            for a, b in zip(per_rank["final"], results[0]["final"], strict=True):
                assert torch.equal(a, b)
        assert results[0]["schemes"]["fc1.weight"]["scheme"] == "compress:topk:0.1|allgather|hier"

    def test_plan_file_sets_each_parameter(self, world_size: int, tmp_path: Any, caplog: Any) -> None:
        _write_plan(tmp_path / "plan.json", world_size)
        for result in launch(_plan_worker, world_size, (str(tmp_path / "plan.json"),), tmp_path):
            schemes = result["schemes"]
            assert schemes["fc1.weight"] == schemes["fc1.bias"] == "compress:topk:0.05|allgather|flat", schemes
            assert schemes["fc2.weight"] == "compress:fp16|allreduce|flat", schemes
            assert schemes["fc2.bias"] == "dense", schemes  # not in the plan
            assert schemes["emb.weight"] == "zen", schemes  # fp32 in the plan, naturally sparse
            # fc1.s two tensors are one fusion group: one error-feedback memory for both.
            names = result["memories"]["topk:0.05|allgather"]
            assert names == ["fused:fc1.bias"], names

    # Slow tier: the default tier checks the same agreement at 2 ranks (test_register_agreement.py, whose
    # cases include one rank's unreadable plan file).
    @pytest.mark.slow
    def test_missing_plan_on_one_rank_raises_everywhere(self, world_size: int, tmp_path: Any) -> None:
        _write_plan(tmp_path / "present.json", world_size)
        paths = (str(tmp_path / "missing.json"), str(tmp_path / "present.json"))
        messages = launch(_missing_plan_worker, world_size, paths, tmp_path)
        for rank, message in enumerate(messages):
            assert "zensync.register failed on rank(s) [1]: rank 1: ValueError" in message, (rank, message)
            assert "plan file not found" in message, (rank, message)  # every rank is told why


def test_unknown_compressor_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"strategy='topkk:0\.1' is unknown"):
        zensync.HookConfig(strategy="topkk:0.1")
    with pytest.raises(ValueError, match="compressed_scheme="):
        zensync.HookConfig(strategy="topk:0.1", compressed_scheme="ring")
    assert dist.is_available()

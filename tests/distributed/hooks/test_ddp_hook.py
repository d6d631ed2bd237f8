"""DDP training with zensync's comm hook equals DDP's default allreduce (gloo, world sizes 2 and 3).

Each worker trains the same seeded model twice on the same rank-dependent batches, once with DDP's
default (no hook) and once with ``zensync.register``, and compares the parameters after every step.
The model mixes an nn.Embedding (dense gradients with natural row sparsity) with dense layers.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zensync
from tests.distributed._launch import launch, pytest_generate_tests, slow_world, world_size_fixture  # noqa: F401 - class data world_size

STEPS = 4
VOCAB, DIM = 400, 16
# float32 sums in a different order (sparse owners vs ring): a few ulps of gradients of size ~1e-2,
# times lr and STEPS steps.
FLOAT32_ATOL = 1e-6
HALF_ATOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


class _Net(nn.Module):
    def __init__(self, unused: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, dtype=dtype)
        self.fc1 = nn.Linear(DIM, 32, dtype=dtype)
        self.fc2 = nn.Linear(32, 10, dtype=dtype)
        self.spare = nn.Linear(3, 3, dtype=dtype) if unused else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids).mean(1))))


def _batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    ids = (torch.rand(8, 6, generator=gen) ** 3 * VOCAB).long()  # skewed towards low ids, ~5 % of rows
    return ids, torch.randint(0, 10, (8,), generator=gen)


def _train(
    rank: int, strategy: str | None, scenario: str, dtype: torch.dtype, jsonl_path: str | None = None
) -> tuple[list[list[torch.Tensor]], Any]:
    torch.manual_seed(0)  # tests may seed the global RNG: identical init on every rank and run
    model = _Net(unused=scenario == "unused", dtype=dtype)
    ddp = nn.parallel.DistributedDataParallel(
        model,
        find_unused_parameters=scenario == "unused",
        static_graph=scenario == "static_graph",
        bucket_cap_mb=0.01,  # several buckets; DDP rebuilds them after the first step
    )
    options = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e8, "adapt": False}  # deterministic choices
    options["jsonl_path"] = jsonl_path
    state = zensync.register(ddp, strategy=strategy, **options) if strategy else None
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    snapshots = []
    for step in range(STEPS):
        optimizer.zero_grad()
        micro_batches = 2 if scenario == "no_sync" else 1
        for micro in range(micro_batches):
            context = ddp.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext()
            with context:
                ids, target = _batch(rank, step, micro)
                nn.functional.cross_entropy(ddp(ids).float(), target).backward()
        optimizer.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots, state


def _equivalence_worker(rank: int, world_size: int, cases: list[tuple[str, str, str]]) -> dict[str, Any]:
    results = {}
    for strategy, scenario, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        reference, _ = _train(rank, None, scenario, dtype)
        hooked, state = _train(rank, strategy, scenario, dtype)
        diffs = [
            max(float((a.float() - b.float()).abs().max()) for a, b in zip(r, h, strict=True))
            for r, h in zip(reference, hooked, strict=True)
        ]
        schemes = {name: rec.scheme for name, rec in state.records.items()}
        results[f"{strategy}/{scenario}/{dtype_name}"] = {
            "diffs": diffs,
            "schemes": schemes,
            "steps": state.step,
            "history": len(state.history),
            "bytes": [h["bytes_sent"] for h in state.history],
            "sparse_bytes": [sum(p.get("bytes_sent", 0) for p in h["params"].values()) for h in state.history],
            "recorded": [sorted(h["params"]) for h in state.history],
            "names": sorted(state.param_names.values()),
            "elements": sum(p.numel() for p in state.param_names),
            "hints": state.hints.stats() if state.hints is not None else None,
        }
        state.close()
    return results


CASES = [
    ("zen", "plain", "float32"),
    ("auto", "plain", "float32"),
    ("agsparse", "plain", "float32"),
    ("sparcml", "plain", "float32"),
    ("dense", "plain", "float32"),
    ("zen", "no_sync", "float32"),
    ("auto", "unused", "float32"),
    ("zen", "static_graph", "float32"),
    ("zen", "plain", "bfloat16"),
    ("zen", "plain", "float16"),
]


class TestDDPHookEquivalence:
    world_size = [2, slow_world(3)]  # 3: an odd world size, same checks

    @pytest.fixture(scope="class")
    @classmethod
    def results(cls, world_size: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        return launch(_equivalence_worker, world_size, (CASES,), tmp_path_factory.mktemp(f"ddp{world_size}"))

    @pytest.mark.parametrize("case", CASES, ids=["/".join(c) for c in CASES])
    def test_parameters_match_default_ddp(self, results: list[dict[str, Any]], case: tuple[str, str, str]) -> None:
        key = "/".join(case)
        atol = HALF_ATOL.get(getattr(torch, case[2]), FLOAT32_ATOL)
        for rank, per_rank in enumerate(results):
            record = per_rank[key]
            assert max(record["diffs"]) <= atol, (rank, record["diffs"])
            assert record["steps"] == STEPS and record["history"] == STEPS

    def test_row_hints_feed_the_embedding_detection(self, results: list[dict[str, Any]]) -> None:
        """The embedding's detection read its hint every step (under no_sync: both micro-batches' rows)."""
        for per_rank in results:
            for key in ("zen/plain/float32", "zen/no_sync/float32", "zen/static_graph/float32"):
                assert per_rank[key]["hints"] == {"emb.weight": {"uses": STEPS, "checks": 2, "disabled": False}}

    def test_sparse_scheme_used_for_embedding(self, results: list[dict[str, Any]]) -> None:
        for per_rank in results:
            assert per_rank["zen/plain/float32"]["schemes"]["emb.weight"] == "zen"
            # cross-entropy gives every row of the output layer a gradient: found dense, synced dense
            assert per_rank["zen/plain/float32"]["schemes"]["fc2.weight"] == "dense"
            assert per_rank["dense/plain/float32"]["schemes"]["emb.weight"] == "dense"

    def test_dense_buckets_account_every_parameter(self, results: list[dict[str, Any]]) -> None:
        # strategy "dense": every bucket but the last is allreduced asynchronously on DDP's group;
        # each step still records every parameter and the ring bytes of all of them.
        n = len(results)
        for per_rank in results:
            record = per_rank["dense/plain/float32"]
            assert all(names == record["names"] for names in record["recorded"])
            ring = 2 * (n - 1) / n * record["elements"] * 4
            for sent in record["bytes"]:
                assert abs(sent - ring) <= 8 * len(record["names"]), (sent, ring)

    def test_step_bytes_include_sparse_syncs(self, results: list[dict[str, Any]]) -> None:
        for per_rank in results:
            record = per_rank["zen/plain/float32"]
            assert all(s > 0 for s in record["sparse_bytes"])
            assert all(b > s for b, s in zip(record["bytes"], record["sparse_bytes"], strict=True))


def _state_dict_worker(rank: int, world_size: int, jsonl: str) -> dict[str, Any]:
    _, state = _train(rank, "auto", "plain", torch.float32, jsonl_path=jsonl)
    saved = state.state_dict()
    state.close()
    model = nn.parallel.DistributedDataParallel(_Net())
    fresh = zensync.register(model, strategy="auto", latency_s=1e-5, bandwidth_bytes_per_s=1e8)
    fresh.load_state_dict(saved)
    reloaded = fresh.state_dict()
    fresh.close()
    with open(jsonl.format(rank=rank)) as f:
        lines = [json.loads(line) for line in f]
    return {
        "equal": reloaded == saved,
        "step": reloaded["step"],
        "names": sorted(reloaded["records"]),
        "jsonl_steps": [line["step"] for line in lines],
    }


def _mismatch_worker(rank: int, world_size: int, kind: str) -> str:
    if kind == "model":
        model: nn.Module = _Net() if rank == 0 else nn.Sequential(nn.Linear(3, 3))
        strategy = "zen"
    else:
        model, strategy = _Net(), ("zen" if rank == 0 else "auto")
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        zensync.register(ddp, strategy=strategy, latency_s=1e-5, bandwidth_bytes_per_s=1e8)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class TestDDPHookState:
    world_size = [2]

    def test_state_dict_round_trip(self, world_size: int, tmp_path: Any) -> None:
        jsonl = str(tmp_path / "steps{rank}.jsonl")
        for result in launch(_state_dict_worker, world_size, (jsonl,), tmp_path):
            assert result["equal"] and result["step"] == STEPS
            assert result["jsonl_steps"] == list(range(STEPS))
            assert result["names"] == ["emb.weight", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]

    @pytest.mark.parametrize("kind", ["model", "strategy"])
    def test_mismatch_raises_on_every_rank(self, world_size: int, tmp_path: Any, kind: str) -> None:
        for rank, message in enumerate(launch(_mismatch_worker, world_size, (kind,), tmp_path)):
            assert message != "no error", f"rank {rank} did not raise"
            if kind == "strategy":
                assert "differ from rank 0" in message


def test_unknown_option_and_strategy() -> None:
    with pytest.raises(ValueError, match=r"unknown zensync\.register option"):
        zensync.HookConfig.from_options("auto", {"warmup": 3})
    with pytest.raises(ValueError, match=r"strategy='zenn' is unknown"):
        zensync.HookConfig(strategy="zenn")
    assert dist.is_available()


class _Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4000, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].sum()


def _drift_worker(rank: int, world_size: int) -> list[str]:
    """Full-density steps, then 0.5 %-density steps: auto must go dense, then switch to a sparse scheme."""
    torch.manual_seed(0)
    model = _Table()
    ddp = nn.parallel.DistributedDataParallel(model)
    # A fixed 1 Gbit/s model and no adaptation: the switch must follow the density alone.
    state = zensync.register(
        ddp, strategy="auto", latency_s=50e-6, bandwidth_bytes_per_s=1.25e8, recheck_every=1, adapt=False
    )
    for step in range(8):
        gen = torch.Generator().manual_seed(step * 10 + rank)
        count = 4000 if step < 4 else 20
        model.zero_grad()
        ddp(torch.randperm(4000, generator=gen)[:count]).backward()
    schemes = [h["params"]["weight"]["scheme"] for h in state.history]
    state.close()
    return schemes


class TestAutoFollowsDensity:
    world_size = [2]

    def test_dense_when_dense_then_sparse(self, world_size: int, tmp_path: Any) -> None:
        for schemes in launch(_drift_worker, world_size, (), tmp_path):
            assert schemes[:4] == ["dense"] * 4, schemes
            assert all(s != "dense" for s in schemes[5:]), schemes


def _insist_worker(rank: int, world_size: int, strategies: list[str]) -> dict[str, list[dict[str, str]]]:
    per_strategy = {}
    for strategy in strategies:
        torch.manual_seed(0)
        model = _Net()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        # A model that prices every sparse scheme far above dense (1 s per message): only the strategy
        # itself can make the embedding sparse.
        state = zensync.register(ddp, strategy=strategy, latency_s=1.0, bandwidth_bytes_per_s=1e12)
        for step in range(STEPS):
            ids, target = _batch(rank, step)
            nn.functional.cross_entropy(ddp(ids), target).backward()
        per_strategy[strategy] = [{name: p["scheme"] for name, p in r["params"].items()} for r in state.history]
        state.close()
    return per_strategy


INSIST_STRATEGIES = ["zen", "sparse_ps", "auto"]


def test_named_scheme_is_used_for_every_sparse_parameter(tmp_path: Any) -> None:
    # "zen" means Zen for every parameter the detector finds sparse, every step, whatever the cost
    # model predicts; "auto" keeps the measured choice (dense under this model).
    for per_strategy in launch(_insist_worker, 2, (INSIST_STRATEGIES,), tmp_path):
        for strategy, steps in per_strategy.items():
            assert len(steps) == STEPS
            expected = "dense" if strategy == "auto" else strategy
            assert [s["emb.weight"] for s in steps] == [expected] * STEPS, strategy
            assert all(s["fc2.weight"] == "dense" for s in steps)  # cross-entropy: every row non-zero

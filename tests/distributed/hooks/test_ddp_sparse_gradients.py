"""DDP with sparse-gradient embeddings (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``):
zensync's hook syncs them with Zen from their indices and trains to DDP's own parameters (gloo).

Each worker trains the same seeded model with DDP's default sparse allreduce and with
``zensync.register``, under SGD (all parameters) and under torch.optim.SparseAdam (the embeddings)
plus SGD (the dense layers), and compares the parameters after every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zensync
from tests.distributed._launch import launch
from zensync.hooks.pipeline import SPARSE_GRADIENT_CANDIDATES

STEPS = 4
VOCAB, DIM, BAG_VOCAB = 500, 8, 300
FLOAT32_ATOL = 1e-6  # a few ulps: owners sum in another order than gloo's sparse allreduce


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True, padding_idx=0)
        self.bag = nn.EmbeddingBag(BAG_VOCAB, DIM, mode="sum", sparse=True)
        self.fc = nn.Linear(DIM, 5)

    def forward(self, ids: torch.Tensor, bag_ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(1) + self.bag(bag_ids))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    ids = (torch.rand(6, 5, generator=gen) ** 2 * VOCAB).long()  # repeated rows, row 0 (padding) included
    bag_ids = torch.randint(0, BAG_VOCAB, (6, 4), generator=gen)
    return ids, bag_ids, torch.randint(0, 5, (6,), generator=gen)


def _train(rank: int, strategy: str | None, optimizer_name: str) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
    torch.manual_seed(0)
    model = _Net()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = zensync.register(ddp, strategy=strategy) if strategy else None
    sparse_params = [model.emb.weight, model.bag.weight]
    if optimizer_name == "sgd":
        optimizers: list[torch.optim.Optimizer] = [torch.optim.SGD(model.parameters(), lr=0.3)]
    else:
        optimizers = [torch.optim.SparseAdam(sparse_params, lr=0.05), torch.optim.SGD(model.fc.parameters(), lr=0.3)]
    snapshots, layouts = [], []
    for step in range(STEPS):
        for opt in optimizers:
            opt.zero_grad()
        ids, bag_ids, target = _batch(rank, step)
        nn.functional.cross_entropy(ddp(ids, bag_ids), target).backward()
        grad = model.emb.weight.grad
        assert grad is not None
        layouts.append((str(grad.layout), bool(grad.is_coalesced())))
        for opt in optimizers:
            opt.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    info: dict[str, Any] = {"layouts": layouts}
    if state is not None:
        last = state.last_step()
        assert last is not None
        info["schemes"] = {name: p["scheme"] for name, p in last["params"].items()}
        info["steps"] = state.step
        state.close()
    return snapshots, info


def _worker(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, Any]:
    del world_size
    results = {}
    for strategy, optimizer_name in cases:
        reference, ref_info = _train(rank, None, optimizer_name)
        hooked, info = _train(rank, strategy, optimizer_name)
        diffs = [
            max(float((a - b).abs().max()) for a, b in zip(r, h, strict=True))
            for r, h in zip(reference, hooked, strict=True)
        ]
        results[f"{strategy}/{optimizer_name}"] = {"diffs": diffs, "reference": ref_info, **info}
    return results


CASES = [("auto", "sgd"), ("zen", "sparse_adam"), ("auto", "sparse_adam"), ("agsparse", "sgd")]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(_worker, 2, (CASES,), tmp_path_factory.mktemp("ddp_sparse"))


@pytest.mark.parametrize("case", CASES, ids=["/".join(c) for c in CASES])
def test_parameters_match_ddp_sparse_allreduce(results: list[dict[str, Any]], case: tuple[str, str]) -> None:
    key = "/".join(case)
    for rank, per_rank in enumerate(results):
        record = per_rank[key]
        assert max(record["diffs"]) <= FLOAT32_ATOL, (rank, record["diffs"])
        assert record["steps"] == STEPS
        # DDP's own gradient and zensync's are both coalesced COO tensors
        assert record["layouts"] == record["reference"]["layouts"] == [("torch.sparse_coo", True)] * STEPS


def test_sparse_gradients_take_the_sparse_scheme(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        for name in ("emb.weight", "bag.weight"):
            assert per_rank["auto/sgd"]["schemes"][name] in SPARSE_GRADIENT_CANDIDATES  # the cost model's pick
            assert per_rank["zen/sparse_adam"]["schemes"][name] == "zen"
            assert per_rank["agsparse/sgd"]["schemes"][name] == "agsparse"

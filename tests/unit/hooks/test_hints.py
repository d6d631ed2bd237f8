"""Row hints give the same synced gradients as the full scan, and turn themselves off when wrong.

Every rank of a simulated world trains its own copy of a model with dense-gradient embeddings
(padding_idx, max_norm, EmbeddingBag modes and per-sample weights, lookups whose gradient is exactly
zero), hands the gradients to ``zensync_hook`` as one bucket per step, and the run with row hints
must give bit-for-bit the gradients of the run without (both are checked against the float64 mean).
"""

from __future__ import annotations

import copy
import logging

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import zensync
from tests.strategies import examples
from zensync.hooks import HookConfig, ZenSyncState, zensync_hook

STEPS = 3


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self._params = params
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def is_last(self) -> bool:
        return True


class _Net(nn.Module):
    def __init__(self, case: dict, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(case["seed"])
        vocab, dim = case["vocab"], case["dim"]
        self.emb = nn.Embedding(vocab, dim, padding_idx=case["padding_idx"], max_norm=case["max_norm"])
        self.bag = nn.EmbeddingBag(vocab // 2 + 1, dim, mode=case["bag_mode"])
        self.out = nn.Linear(dim, 3)
        self.tied = tied

    def forward(self, ids: torch.Tensor, bag_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # mask zeroes some lookups' contributions: those rows are in the input, their gradient is 0
        h = (self.emb(ids) * mask.unsqueeze(-1)).mean(1)
        weights = torch.rand(bag_ids.shape, generator=torch.Generator().manual_seed(int(ids.sum())))
        bag_kwargs = {"per_sample_weights": weights} if self.bag.mode == "sum" else {}
        h = h + self.bag(bag_ids, **bag_kwargs)
        y = self.out(h)
        if self.tied:  # the embedding weight used again, functionally: dense gradient rows
            y = y + nn.functional.linear(h, self.emb.weight).sum(1, keepdim=True)
        return y


def _run(case: dict, row_hints: bool, tied: bool = False) -> tuple[list[list[torch.Tensor]], list[dict]]:
    n = case["n"]
    initial = _Net(case, tied)  # built here: the global RNG is not for the ranks' threads

    def body(transport: zensync.Transport) -> tuple[list[torch.Tensor], dict]:
        model = copy.deepcopy(initial)
        params = list(model.parameters())
        named = list(model.named_parameters())
        state = ZenSyncState(transport, named, HookConfig(strategy="zen", row_hints=row_hints, hint_check_every=2))
        state.setup()
        state.attach_hints(model)
        grads = []
        try:
            for step in range(STEPS):
                model.zero_grad(set_to_none=True)
                gen = torch.Generator().manual_seed(1000 * step + transport.rank + case["seed"])
                ids = (torch.rand(case["batch"], 5, generator=gen) ** 2 * case["vocab"]).long()
                bag_ids = torch.randint(0, model.bag.num_embeddings, (case["batch"], 3), generator=gen)
                mask = (torch.rand(case["batch"], 5, generator=gen) > case["zero_fraction"]).float()
                model(ids, bag_ids, mask).square().sum().backward()
                grads.append(zensync_hook(state, _Bucket(params)).wait().clone())
        finally:
            state.close()
        return grads, state.hints.stats() if state.hints is not None else {}

    outcomes = zensync.SimulatedWorld(n, timeout_s=60).run(body)
    return [g for g, _ in outcomes], [s for _, s in outcomes]


@st.composite
def cases(draw: st.DrawFn) -> dict:
    vocab = draw(st.integers(20, 400))
    return {
        "n": draw(st.integers(2, 4)),
        "seed": draw(st.integers(0, 2**20)),
        "vocab": vocab,
        "dim": draw(st.integers(1, 6)),
        "batch": draw(st.integers(1, 8)),
        "padding_idx": draw(st.sampled_from([None, 0, vocab - 1])),
        "max_norm": draw(st.sampled_from([None, 0.5])),
        "bag_mode": draw(st.sampled_from(["sum", "mean", "max"])),
        "zero_fraction": draw(st.sampled_from([0.0, 0.3, 1.0])),
    }


@given(cases())
@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_hints_give_the_scans_gradients(case: dict) -> None:
    hinted, stats = _run(case, row_hints=True)
    scanned, no_stats = _run(case, row_hints=False)
    assert no_stats == [{}] * case["n"]
    for rank in range(case["n"]):
        for step in range(STEPS):
            assert torch.equal(hinted[rank][step], scanned[rank][step]), (rank, step)
            assert torch.equal(hinted[rank][step], hinted[0][step])
        # Both embeddings used their hints every step; the checks (uses 1 and 2, then every 2nd) agreed.
        assert set(stats[rank]) == {"emb.weight", "bag.weight"}
        for per_param in stats[rank].values():
            assert per_param == {"uses": STEPS, "checks": 2, "disabled": False}


def test_hints_match_the_float64_mean() -> None:
    case = {"n": 3, "seed": 5, "vocab": 300, "dim": 4, "batch": 6, "padding_idx": 0, "max_norm": None}
    case |= {"bag_mode": "sum", "zero_fraction": 0.3}
    hinted, _ = _run(case, row_hints=True)
    # The reference: each rank's local gradients (same models and batches, no sync), averaged in float64.
    local = []
    for rank in range(case["n"]):
        model = _Net(case, tied=False)
        per_step = []
        for step in range(STEPS):
            model.zero_grad(set_to_none=True)
            gen = torch.Generator().manual_seed(1000 * step + rank + case["seed"])
            ids = (torch.rand(case["batch"], 5, generator=gen) ** 2 * case["vocab"]).long()
            bag_ids = torch.randint(0, model.bag.num_embeddings, (case["batch"], 3), generator=gen)
            mask = (torch.rand(case["batch"], 5, generator=gen) > case["zero_fraction"]).float()
            model(ids, bag_ids, mask).square().sum().backward()
            per_step.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())  # type: ignore[union-attr]
        local.append(per_step)
    for step in range(STEPS):
        expected = sum(local[r][step] for r in range(case["n"])) / case["n"]
        for rank in range(case["n"]):
            torch.testing.assert_close(hinted[rank][step].double(), expected, rtol=1e-6, atol=1e-6)


def test_a_weight_used_outside_its_embedding_turns_its_hints_off(caplog: pytest.LogCaptureFixture) -> None:
    case = {"n": 2, "seed": 1, "vocab": 50, "dim": 3, "batch": 4, "padding_idx": None, "max_norm": None}
    case |= {"bag_mode": "mean", "zero_fraction": 0.0}
    with caplog.at_level(logging.WARNING, logger="zensync.hooks.hints"):
        hinted, stats = _run(case, row_hints=True, tied=True)
    scanned, _ = _run(case, row_hints=False, tied=True)
    for rank in range(case["n"]):
        for step in range(STEPS):
            assert torch.equal(hinted[rank][step], scanned[rank][step])
        assert stats[rank]["emb.weight"] == {"uses": 1, "checks": 1, "disabled": True}
        assert stats[rank]["bag.weight"]["disabled"] is False
    assert "emb.weight has non-zero gradient rows" in caplog.text


def test_no_hint_when_the_gradient_was_not_cleared() -> None:
    """An accumulated gradient keeps earlier rows: without zero_grad(set_to_none=True) the scan runs."""
    emb = nn.Embedding(30, 2)
    state_hints = zensync.SimulatedWorld(1, timeout_s=30).run(lambda t: _accumulate(t, emb))
    assert state_hints[0] == {"emb.weight": {"uses": 1, "checks": 1, "disabled": False}}


def _accumulate(transport: zensync.Transport, emb: nn.Embedding) -> dict:
    holder = nn.Module()
    holder.emb = emb
    state = ZenSyncState(transport, list(holder.named_parameters()), HookConfig(strategy="zen"))
    state.setup()
    state.attach_hints(holder)
    try:
        for step in range(2):
            if step == 0:
                emb.zero_grad(set_to_none=True)
            emb(torch.tensor([step, 2 * step + 1])).sum().backward()  # step 1 keeps step 0's gradient
            out = zensync_hook(state, _Bucket([emb.weight])).wait()
            assert torch.equal(out.view(30, 2), emb.weight.grad)  # type: ignore[arg-type]
    finally:
        state.close()
    assert state.hints is not None
    return state.hints.stats()

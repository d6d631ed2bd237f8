"""``dirty.ChangeTracker``: for every optimizer it tracks, the rows it lists contain every row of the
parameter and of its state that a run of steps changed (oracle: the bytes before and after, compared
row by row); what changes outside a step, or under a rule it does not know, is not listed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.resilience.dirty import ChangeTracker, row_rule
from zensync.resilience.store import flatten

ROWS, DIM = 40, 16

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "adamw-no-decay": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.0),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.5, centered=True),
}


def _rows_changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, set[int]]:
    return {
        key: set(torch.nonzero((before[key].view(ROWS, -1) != t.view(ROWS, -1)).any(1)).flatten().tolist())
        for key, t in after.items()
        if key in before and t.dim() == 2
    }


def _flat(emb: torch.nn.Parameter, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return flatten({"model": {"emb": emb.detach()}, "optimizer": opt.state_dict()})[0]


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(OPTIMIZERS)),
       runs=st.lists(st.lists(st.sets(st.integers(0, ROWS - 1), max_size=6), min_size=1, max_size=3),
                     min_size=1, max_size=4))  # fmt: skip
def test_listed_rows_contain_every_changed_row(name: str, runs: list[list[set[int]]]) -> None:
    gen = torch.Generator().manual_seed(0)
    emb = torch.nn.Parameter(torch.randn(ROWS, DIM, generator=gen))
    opt = OPTIMIZERS[name]([emb])
    tracker = ChangeTracker()
    tracker.attach({"optimizer": opt})
    tracker.saved()
    for steps in runs:  # a save after each run of steps
        before = {k: v.clone() for k, v in _flat(emb, opt).items()}
        for touched in steps:
            emb.grad = torch.zeros(ROWS, DIM)
            emb.grad[sorted(touched)] = torch.randn(len(touched), DIM, generator=gen)
            opt.step()
        flat = _flat(emb, opt)
        listed = tracker.changes(flat)
        assert "model/emb" in listed  # every optimizer here is tracked
        for key, rows in _rows_changed(before, flat).items():
            assert rows <= set(listed.get(key, np.arange(ROWS)).tolist()), (key, rows)
        tracker.saved()


def test_a_change_outside_a_step_or_an_untracked_rule_is_not_listed() -> None:
    emb = torch.nn.Parameter(torch.zeros(ROWS, DIM))
    opt = torch.optim.SGD([emb], lr=0.1)
    tracker = ChangeTracker()
    tracker.attach({"optimizer": opt})
    tracker.saved()
    assert tracker.changes(_flat(emb, opt)) == {"model/emb": pytest.approx(np.zeros(0))}  # nothing ran
    emb.grad = torch.zeros(ROWS, DIM)
    emb.grad[3] = 1.0
    opt.step()
    assert tracker.changes(_flat(emb, opt))["model/emb"].tolist() == [3]
    with torch.no_grad():
        emb[7] += 1.0  # an edit after the step: its version counter moves
    assert "model/emb" not in tracker.changes(_flat(emb, opt))
    decayed = torch.optim.AdamW([emb], lr=0.1)  # weight decay moves every row
    assert row_rule(decayed, decayed.param_groups[0]) is None


def test_a_sparse_gradients_rows_are_its_indices() -> None:
    table = torch.nn.Embedding(ROWS, DIM, sparse=True)
    opt = torch.optim.SparseAdam(table.parameters(), lr=0.1)
    tracker = ChangeTracker()
    tracker.attach({"optimizer": opt})
    tracker.saved()
    table(torch.tensor([[5, 9, 5]])).sum().backward()
    opt.step()
    assert tracker.changes(_flat(table.weight, opt))["model/emb"].tolist() == [5, 9]

"""``FSDPSyncState.state_dict()`` through torch.distributed.checkpoint on gloo: saved at 4 ranks (FSDP
alone, qsgd with error feedback) and at 2 x 2 (HSDP, PowerSGD over the replicas), loaded at 4 ranks
(resume), at 2 ranks and at 4 x 1 (resharded).

- Resharded, the residual every rank owes is the saved one exactly (its full tensor, equal element
  by element), and the warm-start Qs of PowerSGD are orthonormal bases of the right shape.
- Resumed on the same world with the same data, the run goes on with the same losses and parameters
  as the uninterrupted run that saved.
- A registration that decides otherwise than the checkpoint raises the same ValueError on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zensync
from tests.distributed._launch import launch
from tests.distributed.hooks.test_fsdp import _batch, _Net

SAVE_AT, MORE = 3, 3
"""Steps before the checkpoint, and after it."""
FSDP_SPEC, HSDP_SPEC, PSGD_SPEC = "qsgd:127", "powersgd:2", "powersgd:1"


def _model(mesh: Any, strategy: str, hsdp_mesh: Any = None) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = _Net()
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, zensync.register_fsdp(model, strategy=strategy, mesh=hsdp_mesh)


def _steps(model: nn.Module, rank: int, first: int, count: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # no optimizer state: the checkpoint is the model's and ours
    losses = []
    for step in range(first, first + count):
        opt.zero_grad()
        ids, target = _batch(rank, step)
        loss = nn.functional.cross_entropy(model(ids), target)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _residuals(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {name: t.full_tensor().clone() for name, t in sd["residuals"].items()}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _run_and_save(model: nn.Module, state: Any, rank: int, path: str) -> dict[str, Any]:
    """SAVE_AT steps, a DCP checkpoint, MORE steps: the uninterrupted run."""
    _steps(model, rank, 0, SAVE_AT)
    sd = state.state_dict()
    dcp.save({"model": model.state_dict(), "zensync": sd}, checkpoint_id=path)
    saved = _residuals(sd)
    losses = _steps(model, rank, SAVE_AT, MORE)
    return {"saved": saved, "losses": losses, "params": _params(model)}


def _load(model: nn.Module, state: Any, path: str) -> dict[str, Any]:
    sd = {"model": model.state_dict(), "zensync": state.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    state.load_state_dict(sd["zensync"])
    return sd["zensync"]


def _at_four(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    flat = init_device_mesh("cpu", (world_size,))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    # FSDP alone: uninterrupted, then resumed from its checkpoint; and a run that never saved.
    out["fsdp"] = _run_and_save(*_model(flat, FSDP_SPEC), rank, f"{root}/fsdp")
    out["fsdp_unsaved"] = _steps(_model(flat, FSDP_SPEC)[0], rank, 0, SAVE_AT + MORE)[SAVE_AT:]
    model, state = _model(flat, FSDP_SPEC)
    loaded = _load(model, state, f"{root}/fsdp")
    out["fsdp_resumed"] = {
        "loaded": _residuals(loaded),
        "step": state.next_step,
        "losses": _steps(model, rank, SAVE_AT, MORE),
        "params": _params(model),
    }
    # PowerSGD in the reduce-scatter: each rank's Q per owner's block of rows is saved too.
    out["psgd"] = _run_and_save(*_model(flat, PSGD_SPEC), rank, f"{root}/psgd")
    model, state = _model(flat, PSGD_SPEC)
    _load(model, state, f"{root}/psgd")
    out["psgd_resumed"] = {"losses": _steps(model, rank, SAVE_AT, MORE), "params": _params(model)}
    # HSDP 2 x 2: uninterrupted, resumed, then loaded on a 4 x 1 mesh (4 replicas of one shard).
    out["hsdp"] = _run_and_save(*_model(hsdp["shard"], HSDP_SPEC, hsdp), rank, f"{root}/hsdp")
    model, state = _model(hsdp["shard"], HSDP_SPEC, hsdp)
    _load(model, state, f"{root}/hsdp")
    out["hsdp_resumed"] = {"losses": _steps(model, rank, SAVE_AT, MORE), "params": _params(model)}
    tall = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    model, state = _model(tall["shard"], HSDP_SPEC, tall)
    loaded = _load(model, state, f"{root}/hsdp")
    out["hsdp_4x1"] = {
        "loaded": _residuals(loaded),
        "qs": {n: q.clone() for n, q in state.replicas.sync_for(HSDP_SPEC).compressor.warm_starts().items()},
        "losses": _steps(model, rank, SAVE_AT, 1),
    }
    # Another strategy cannot load the checkpoint's residuals.
    try:
        model, state = _model(flat, "fp16")
        state.load_state_dict(_load_raw(model, _model(flat, FSDP_SPEC)[1], f"{root}/fsdp"))
        out["mismatch"] = "no error"
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def _load_raw(model: nn.Module, template_state: Any, path: str) -> dict[str, Any]:
    """The checkpoint's zensync state, read with a template of the strategy it was saved with."""
    sd = {"zensync": template_state.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    return sd["zensync"]


def _at_two(rank: int, world_size: int, root: str) -> dict[str, Any]:
    flat = init_device_mesh("cpu", (world_size,))
    model, state = _model(flat, FSDP_SPEC)
    loaded = _load(model, state, f"{root}/fsdp")
    owed = {name: state.owed(name) for name in loaded["residuals"]}
    out = {"loaded": _residuals(loaded), "owed": owed, "losses": _steps(model, rank, SAVE_AT, 1)}
    model, state = _model(flat, PSGD_SPEC)  # 4 owners' Qs of 2 rows each, combined for 2 owners of 4
    _load(model, state, f"{root}/psgd")
    out["qs"] = {k: q.clone() for k, q in state.compressor_for(PSGD_SPEC).warm_starts().items()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("dcp")
    four = launch(_at_four, 4, (str(root),), tmp_path_factory.mktemp("four"))
    two = launch(_at_two, 2, (str(root),), tmp_path_factory.mktemp("two"))
    return {"four": four, "two": two}


def test_residuals_reshard_exactly_from_four_ranks_to_two(runs: dict[str, list[dict[str, Any]]]) -> None:
    saved = runs["four"][0]["fsdp"]["saved"]
    assert set(saved) == {"block.1.weight", "block.0.weight", "block.0.bias", "block.1.bias", "head.weight",
                          "head.bias"}  # fmt: skip
    assert any(bool(t.abs().sum() > 0) for t in saved.values())  # qsgd dropped something
    for out in runs["two"]:
        for name, tensor in saved.items():
            torch.testing.assert_close(out["loaded"][name], tensor, rtol=0, atol=0, msg=name)
    # PowerSGD's Qs: one per owner of 4 rows, an orthonormal (8, 1) basis.
    for out in runs["two"]:
        assert {"block.1.weight#0", "block.1.weight#1", "head.weight#0", "head.weight#1"} <= set(out["qs"])
        for key, q in out["qs"].items():
            assert q.shape == (8, 1), key
            torch.testing.assert_close(q.T @ q, torch.eye(1), atol=1e-5, rtol=0)
    # Each of the 2 ranks owes its FSDP shard of the saved residual: together, all of it.
    for name, tensor in saved.items():
        rows = [out["owed"][name] for out in runs["two"]]
        per_owner = rows[0].numel()
        joined = torch.cat(rows)[: tensor.numel()]
        assert per_owner * 2 >= tensor.numel()
        torch.testing.assert_close(joined, tensor.reshape(-1), rtol=0, atol=0, msg=name)


def test_a_resumed_run_goes_on_as_the_uninterrupted_one(runs: dict[str, list[dict[str, Any]]]) -> None:
    for out in runs["four"]:
        for run, resumed in (("fsdp", "fsdp_resumed"), ("psgd", "psgd_resumed"), ("hsdp", "hsdp_resumed")):
            # The same operations on the same values in the same order: equal to the last bit.
            assert out[resumed]["losses"] == out[run]["losses"], run
            for name, param in out[run]["params"].items():
                torch.testing.assert_close(out[resumed]["params"][name], param, rtol=0, atol=0, msg=f"{run} {name}")
        assert out["fsdp_resumed"]["step"] == SAVE_AT
        # Saving moved the residuals to their owners: a run that never saved compresses other splits
        # of the same sums, close to but not bit for bit the same losses.
        assert out["fsdp_unsaved"] == pytest.approx(out["fsdp"]["losses"], rel=1e-3)
        for name, tensor in out["fsdp"]["saved"].items():
            torch.testing.assert_close(out["fsdp_resumed"]["loaded"][name], tensor, rtol=0, atol=0)


def test_hsdp_residuals_and_powersgd_reshard_from_2x2_to_4x1(runs: dict[str, list[dict[str, Any]]]) -> None:
    saved = runs["four"][0]["hsdp"]["saved"]
    assert {"block.1.weight", "head.weight"} <= set(saved)
    for out in runs["four"]:
        for name, tensor in saved.items():
            torch.testing.assert_close(out["hsdp_4x1"]["loaded"][name], tensor, rtol=0, atol=0, msg=name)
        qs = out["hsdp_4x1"]["qs"]
        assert set(qs) >= {"block.1.weight"}, qs.keys()
        for name, q in qs.items():
            width = saved[name].shape[1]
            assert q.shape == (width, 2)
            torch.testing.assert_close(q.T @ q, torch.eye(2), atol=1e-5, rtol=0)
        assert all(loss == loss for loss in out["hsdp_4x1"]["losses"])  # trains on from the resharded state


def test_a_registration_deciding_otherwise_refuses_the_checkpoint(runs: dict[str, list[dict[str, Any]]]) -> None:
    messages = {out["mismatch"] for out in runs["four"]}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "'qsgd:127'" in message and "'fp16'" in message and "head.weight" in message, message

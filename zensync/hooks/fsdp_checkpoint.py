"""``FSDPSyncState``'s checkpoints: a state dict ``torch.distributed.checkpoint`` saves, loads and reshards.

What one step hands the next (the rest is agreed at registration, and registration rebuilds it):

    residuals   error feedback: per compressed parameter, what the gradient is still owed, as a
                DTensor with the parameter's own shape and sharding (below)
    powersgd    the warm-start Q of every PowerSGD-compressed shard (HSDP's replica sync), all of
                them on every rank (small: width x rank per shard)
    zen_seed    the hash seed of Zen over the replicas (HSDP's row-sparse shards); -1: none yet
    decisions   each parameter's paths and compressor, as JSON: a checkpoint is loaded only by a
                registration that decides the same (else ValueError naming the differences)
    step        the step counter (shared-seed compressors draw from it)

FSDP's auto strategy keeps no cost model and no correction: there is none to save.

Residuals. Each rank keeps, per compressed parameter, what its own compression dropped for each
owner's shard; only their sum over the ranks is error feedback's invariant (what was sent plus the
residuals sums to the gradients). ``save`` therefore moves every rank's residual to the owner of its
shard first: one reduce-scatter of all of them over FSDP's group (FSDP alone), or one all-reduce over
the replicas (HSDP, where the reduce-scatter inside a node is lossless and the replica sync
compresses). The owner's part is saved in the units of the gradient FSDP hands the optimizer (the
op's average or divide factor applied), unpadded, as a DTensor sharded like the parameter (FSDP's
``Shard(0)``): DCP saves it once and reshards it like the parameter. Loaded on another world or
mesh (4 ranks -> 2, 2 x 2 -> 4 x 1), each rank takes its shard of the same tensor as what it owes;
the first replica keeps it for HSDP. It becomes the rank's residual at its next compression, in that
world's units (``FSDPSyncState._owed``). The sum is kept exactly, up to the units' rounding.

The run that saved goes on from the moved residuals too (``save`` changes the live state the same
way), so a run resumed from the checkpoint and the uninterrupted one take the same steps.

PowerSGD's Q of a shard spans the column space of its rows. Loaded with the same shards, each
shard's Q is its own again; with other shards, a shard's Q is the best rank-r basis of the old Qs of
the rows it holds, each weighted by the rows it shares with them: a warm start, as Q always is.
"""

from __future__ import annotations

import io
import json
import math
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from zensync.hooks.fsdp import Binding, FSDPSyncState
    from zensync.transport.fsdp import Segment

__all__ = ["STATE_VERSION", "load", "save"]

STATE_VERSION = 1
KEYS = ("version", "step", "strategy", "decisions", "residuals", "powersgd", "zen_seed")


def save(state: FSDPSyncState) -> dict[str, Any]:
    """The state dict (see the module docstring); a collective over every rank of the model's mesh."""
    binding = state.binding
    owed = _move_residuals_to_owners(state)
    residuals = {name: _param_shaped(c, binding.params[name], binding.segments[name]) for name, c in owed.items()}
    seed = state.replicas.zen_seed() if state.replicas is not None else None
    return {
        "version": STATE_VERSION,
        "step": state.next_step,
        "strategy": state.strategy.text,
        "decisions": _decisions(state),
        "residuals": residuals,
        "powersgd": _gather_warm_starts(state),
        "zen_seed": -1 if seed is None else seed,
    }


def load(state: FSDPSyncState, sd: dict[str, Any]) -> None:
    """Restore what ``save`` saved, possibly on another world or mesh: all of it, or (ValueError) nothing.

    ``sd`` is a state dict from ``FSDPSyncState.state_dict()`` that ``dcp.load`` filled in (or one
    ``save`` returned). Call it on every rank, between steps.
    """
    missing = [k for k in KEYS if k not in sd]
    if missing or sd["version"] != STATE_VERSION:
        raise ValueError(
            f"zensync.register_fsdp state: keys {missing} missing or version {sd.get('version')!r} is not "
            f"{STATE_VERSION}: not a state dict of FSDPSyncState.state_dict()"
        )
    saved, current = json.loads(sd["decisions"]), json.loads(_decisions(state))
    if saved != current:
        differ = sorted(n for n in saved.keys() | current.keys() if saved.get(n) != current.get(n))
        raise ValueError(
            f"zensync.register_fsdp state: the checkpoint (strategy {sd['strategy']!r}) syncs parameters "
            f"{differ} otherwise than this registration (strategy {state.strategy.text!r}): "
            f"{ {n: saved.get(n) for n in differ} } against { {n: current.get(n) for n in differ} }; register "
            f"with the checkpoint's strategy and options"
        )
    binding = state.binding
    expected = set(_residual_specs(state))
    if set(sd["residuals"]) != expected:
        raise ValueError(
            f"zensync.register_fsdp state: residuals for {sorted(sd['residuals'])}, and this registration keeps "
            f"them for {sorted(expected)}"
        )
    owed = {}
    for name, tensor in sd["residuals"].items():
        if not isinstance(tensor, DTensor):
            raise ValueError(f"zensync.register_fsdp state: residual {name!r} is {type(tensor).__name__}, not DTensor")
        local = tensor.to_local().reshape(-1)
        chunk = torch.zeros(binding.segments[name].numel, dtype=torch.float32, device=local.device)
        chunk[: local.numel()] = local
        owed[name] = chunk
    warm = torch.load(io.BytesIO(sd["powersgd"]), weights_only=True) if sd["powersgd"] else {}
    # Everything read and checked: now the state changes.
    _drop_residuals(state)
    state.restart(int(sd["step"]), owed)
    if state.replicas is not None:
        seed = int(sd["zen_seed"])
        state.replicas.seed = None if seed < 0 else seed
        _restore_warm_starts(state, warm)


def _decisions(state: FSDPSyncState) -> str:
    plans = {name: state.plan_for(segment) for name, segment in state.binding.segments.items()}
    return json.dumps({name: [p.path.value, p.replica.value, p.spec] for name, p in plans.items()}, sort_keys=True)


def _residual_specs(state: FSDPSyncState) -> dict[str, str]:
    """The parameters that keep an error-feedback residual, with their compressor."""
    from zensync.hooks.fsdp import Path

    specs = {}
    for name, segment in sorted(state.binding.segments.items()):
        plan = state.plan_for(segment)
        if plan.spec is None:
            continue
        if state.replicas is None:
            if plan.path is Path.COMPRESS and state.config.error_feedback:
                specs[name] = plan.spec
        elif plan.replica is Path.COMPRESS and state.replicas.sync_for(plan.spec).error_feedback:
            specs[name] = plan.spec
    return specs


def _move_residuals_to_owners(state: FSDPSyncState) -> dict[str, torch.Tensor]:
    """Each compressed parameter's owed chunk (this rank's shard of the sum of every rank's residual,
    padded, float32, gradient units), which also becomes the live state (``FSDPSyncState._owed``)."""
    specs = _residual_specs(state)
    if not specs:
        return {}
    segments = [state.binding.segments[name] for name in specs]
    replicas = state.replicas
    if replicas is None:
        transport = state.binding.transport
        n = transport.world_size
        raws = [_raw(state.memory.residual(s.name), (n, s.numel), state.binding) for s in segments]
        summed = transport.reduce_scatter(torch.cat(raws, dim=1).reshape(-1))
        units = [state.unit(s.name) for s in segments]
    else:
        memories = [replicas.sync_for(specs[s.name]).worker_memory for s in segments]
        raws = [_raw(m.residual(s.name), (s.numel,), state.binding) for m, s in zip(memories, segments, strict=True)]
        summed = replicas.transport.all_reduce(torch.cat(raws))
        units = [replicas.unit] * len(segments)
    chunks = summed.split([s.numel for s in segments])
    owed = {}
    for segment, chunk, unit in zip(segments, chunks, units, strict=True):
        pending = state.owed(segment.name)  # loaded and not compressed since: gradient units already
        owed[segment.name] = chunk * unit if pending is None else chunk * unit + pending
    _drop_residuals(state)
    state.restart(state.next_step, owed)
    return owed


def _raw(residual: torch.Tensor | None, shape: tuple[int, ...], binding: Binding) -> torch.Tensor:
    if residual is None:
        return torch.zeros(shape, dtype=torch.float32, device=binding.transport.control_device)
    return residual.reshape(shape).float()


def _drop_residuals(state: FSDPSyncState) -> None:
    for name, spec in _residual_specs(state).items():
        memory = state.memory if state.replicas is None else state.replicas.sync_for(spec).worker_memory
        memory.replace(name, None)


def _param_shaped(chunk: torch.Tensor, param: torch.Tensor, segment: Segment) -> DTensor:
    """This rank's padded chunk as its shard of a DTensor shaped and sharded like ``param``."""
    if not isinstance(param, DTensor) or not segment.rows:
        raise ValueError(
            f"zensync.register_fsdp state: {segment.name!r} is not sharded by rows (FSDP's Shard(0)); its "
            f"error-feedback residual cannot be saved sharded like it"
        )
    local = param.to_local()
    return DTensor.from_local(
        chunk[: local.numel()].reshape(local.shape).clone(),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _gather_warm_starts(state: FSDPSyncState) -> bytes:
    """Every shard's PowerSGD Q, gathered over FSDP's group (the replicas hold the same), as bytes."""
    replicas = state.replicas
    if replicas is None:
        return b""
    transport = state.binding.transport
    qs = {}
    for name, spec in _residual_specs(state).items():
        q = replicas.warm_starts(spec).get(name)
        mine = torch.empty(0) if q is None else q.detach().float().reshape(-1)
        width = state.binding.segments[name].width
        gathered = transport.all_gather_v(mine.to(transport.control_device))
        by_shard = [t.cpu().reshape(width, -1) if t.numel() else None for t in gathered]
        if any(t is not None for t in by_shard):
            qs[name] = by_shard
    if not qs:
        return b""
    buffer = io.BytesIO()
    torch.save(qs, buffer)
    return buffer.getvalue()


def _restore_warm_starts(state: FSDPSyncState, qs: dict[str, list[torch.Tensor | None]]) -> None:
    """Each shard's Q from the saved shards' (see the module docstring)."""
    replicas, binding = state.replicas, state.binding
    assert replicas is not None
    specs = _residual_specs(state)
    shard, shards = binding.transport.rank, binding.transport.world_size
    for name, old in qs.items():
        if name not in specs:
            continue
        segment = binding.segments[name]
        total = segment.shape[0]
        lo, hi = min(shard * segment.rows, total), min((shard + 1) * segment.rows, total)
        q = old[shard] if len(old) == shards else _combined(old, lo, hi, total)
        if q is not None:
            replicas.restore_warm_start(specs[name], segment, q)


def _combined(old: list[torch.Tensor | None], lo: int, hi: int, total: int) -> torch.Tensor | None:
    """The rank-r basis best spanning the old shards' Qs over rows [lo, hi), weighted by shared rows."""
    rows = math.ceil(total / len(old))
    parts = []
    for j, q in enumerate(old):
        shared = min(hi, (j + 1) * rows) - max(lo, j * rows)
        if q is not None and shared > 0:
            parts.append(q * math.sqrt(shared))
    if not parts:
        return None
    rank = parts[0].shape[1]
    u, _, _ = torch.linalg.svd(torch.cat(parts, dim=1), full_matrices=False)
    return u[:, :rank].contiguous()

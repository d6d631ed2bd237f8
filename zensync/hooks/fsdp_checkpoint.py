"""``FSDPSyncState``'s checkpoints: a state dict ``torch.distributed.checkpoint`` saves, loads and reshards.

What one step hands the next (the rest is agreed at registration, and registration rebuilds it):

    residuals   error feedback: per compressed parameter, what the gradient is still owed, as a
                DTensor with the parameter's own shape and sharding (below)
    powersgd    every rank's warm-start Qs of PowerSGD (per owner's block of rows in the reduce-scatter;
                per shard in HSDP's replica sync), with the rows each spans (small: width x rank each)
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

PowerSGD's Q of a block of rows spans their column space. Loaded on the same world, each rank's Qs
are its own again; on another, a block's Q is the best rank-r basis of the saved Qs of the rows it
holds (every rank's), each weighted by the rows it shares with them: a warm start, as Q always is.
"""

from __future__ import annotations

import io
import json
import math
from typing import TYPE_CHECKING, Any

import torch

from zensync.compress import Compressor
from zensync.compress.error_feedback import ErrorFeedback
from zensync.compress.powersgd import PowerSGDCompressor
from zensync.hooks.fsdp_replica import matrix_shape
from zensync.transport.fsdp import gather_objects, local_shard, sharded_like

if TYPE_CHECKING:
    from zensync.hooks.fsdp import Binding, FSDPSyncState
    from zensync.transport.fsdp import Segment

__all__ = ["LOCAL_VERSION", "STATE_VERSION", "load", "load_local", "local", "save"]

STATE_VERSION = 1
LOCAL_VERSION = 1
"""Of ``local``'s state (this rank's, for the same world)."""
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
    _check_decisions(state, sd)
    binding = state.binding
    expected = set(_residual_specs(state))
    if set(sd["residuals"]) != expected:
        raise ValueError(
            f"zensync.register_fsdp state: residuals for {sorted(sd['residuals'])}, and this registration keeps "
            f"them for {sorted(expected)}"
        )
    owed = {}
    for name, tensor in sd["residuals"].items():
        try:
            local = local_shard(tensor).reshape(-1)
        except ValueError as exc:
            raise ValueError(f"zensync.register_fsdp state: residual {name!r}: {exc}") from None
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


def local(state: FSDPSyncState) -> dict[str, Any]:
    """This rank's state as it is, for a checkpoint restored on the same world and mesh (zensync's
    in-memory ones): its own residuals, what it owes (``_owed``) and its PowerSGD Qs, as plain
    tensors by name, with the step, Zen's seed and the decisions. No collective, and the live state
    is not changed (``save`` moves the residuals to their owners; this keeps them where they are)."""
    residuals, qs, specs = {}, {}, _residual_specs(state)
    for name, spec in specs.items():
        residual = _memory_of(state, spec).residual(name)
        if residual is not None:
            residuals[name] = residual
        compressor = _compressor_for(state, spec)
        if isinstance(compressor, PowerSGDCompressor):
            kept = compressor.warm_starts()
            qs.update({key: kept[key].detach().clone() for key, _ in _warm_start_keys(state, name) if key in kept})
    transport = state.binding.transport
    seed = state.replicas.seed if state.replicas is not None else None
    owed = {name: t.clone() for name in specs if (t := state.owed(name)) is not None}
    return {"version": LOCAL_VERSION, "world": transport.world_size, "rank": transport.rank, "step": state.next_step,
            "strategy": state.strategy.text, "decisions": _decisions(state), "residuals": residuals, "owed": owed,
            "powersgd": qs, "zen_seed": -1 if seed is None else seed}  # fmt: skip


def load_local(state: FSDPSyncState, sd: dict[str, Any]) -> None:
    """Restore what ``local`` saved, on the same world and rank: all of it, or (ValueError) nothing."""
    transport = state.binding.transport
    if sd.get("version") != LOCAL_VERSION or not {"residuals", "owed", "powersgd"} <= sd.keys():
        raise ValueError(f"zensync.register_fsdp state: version {sd.get('version')!r} is not {LOCAL_VERSION}: not a "
                         f"state of FSDPSyncState.local_state_dict()")  # fmt: skip
    if [sd["world"], sd["rank"]] != [transport.world_size, transport.rank]:
        raise ValueError(
            f"zensync.register_fsdp state: saved by rank {sd['rank']} of {sd['world']}, loaded by rank "
            f"{transport.rank} of {transport.world_size}: a local state is restored by the rank that saved it "
            f"(torch.distributed.checkpoint's state_dict() reshards)"
        )
    _check_decisions(state, sd)
    specs = _residual_specs(state)
    unknown = sorted((sd["residuals"].keys() | sd["owed"].keys()) - specs.keys())
    if unknown:
        raise ValueError(f"zensync.register_fsdp state: residuals for {unknown}, which this registration does not keep")
    _drop_residuals(state)
    for name, residual in sd["residuals"].items():
        _memory_of(state, specs[name]).replace(name, residual.clone())
    state.restart(int(sd["step"]), {name: t.clone() for name, t in sd["owed"].items()})
    if state.replicas is not None:
        seed = int(sd["zen_seed"])
        state.replicas.seed = None if seed < 0 else seed
    for name, spec in specs.items():
        compressor = _compressor_for(state, spec)
        if isinstance(compressor, PowerSGDCompressor):
            shape = torch.Size(matrix_shape(state.binding.segments[name]))
            for key, _ in _warm_start_keys(state, name):
                if key in sd["powersgd"]:
                    compressor.restore_warm_start(key, shape, sd["powersgd"][key].clone())


def _check_decisions(state: FSDPSyncState, sd: dict[str, Any]) -> None:
    saved, current = json.loads(sd["decisions"]), json.loads(_decisions(state))
    if saved != current:
        differ = sorted(n for n in saved.keys() | current.keys() if saved.get(n) != current.get(n))
        raise ValueError(
            f"zensync.register_fsdp state: the checkpoint (strategy {sd['strategy']!r}) syncs parameters "
            f"{differ} otherwise than this registration (strategy {state.strategy.text!r}): "
            f"{ {n: saved.get(n) for n in differ} } against { {n: current.get(n) for n in differ} }; register "
            f"with the checkpoint's strategy and options"
        )


def _memory_of(state: FSDPSyncState, spec: str) -> ErrorFeedback:
    return state.memory if state.replicas is None else state.replicas.sync_for(spec).worker_memory


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
        _memory_of(state, spec).replace(name, None)


def _param_shaped(chunk: torch.Tensor, param: torch.Tensor, segment: Segment) -> torch.Tensor:
    """This rank's padded chunk as its shard of a DTensor shaped and sharded like ``param``."""
    if not segment.rows:
        raise ValueError(
            f"zensync.register_fsdp state: {segment.name!r} is not sharded by rows (FSDP's Shard(0)); its "
            f"error-feedback residual cannot be saved sharded like it"
        )
    return sharded_like(chunk, param)


def _warm_start_keys(state: FSDPSyncState, name: str) -> list[tuple[str, int]]:
    """The Qs one rank keeps for a PowerSGD-compressed parameter: (compressor key, owner of the rows)."""
    n, rank = state.binding.transport.world_size, state.binding.transport.rank
    if state.replicas is not None:
        return [(name, rank)]  # its own shard, synced over the replicas
    return [(f"{name}#{j}", j) for j in range(n)]  # its chunk for every owner, in the reduce-scatter


def _compressor_for(state: FSDPSyncState, spec: str) -> Compressor:
    return state.replicas.sync_for(spec).compressor if state.replicas is not None else state.compressor_for(spec)


def _rows_of(segment: Segment, owner: int) -> tuple[int, int]:
    """The parameter rows of ``owner``'s FSDP shard (unpadded)."""
    total = segment.shape[0]
    return min(owner * segment.rows, total), min((owner + 1) * segment.rows, total)


def _gather_warm_starts(state: FSDPSyncState) -> bytes:
    """Every rank's PowerSGD Qs, each with the rows it spans, gathered over FSDP's group (the
    replicas hold the same), as bytes; empty when there are none."""
    entries = []
    for name, spec in _residual_specs(state).items():
        compressor = _compressor_for(state, spec)
        if not isinstance(compressor, PowerSGDCompressor):
            continue
        kept = compressor.warm_starts()
        for key, owner in _warm_start_keys(state, name):
            if key in kept:
                lo, hi = _rows_of(state.binding.segments[name], owner)
                entries.append((name, key, lo, hi, kept[key].detach().float().cpu()))
    transport = state.binding.transport
    gathered = gather_objects(state.binding.process_group, entries)
    if not any(gathered):
        return b""
    buffer = io.BytesIO()
    torch.save({"world": transport.world_size, "by_rank": gathered}, buffer)
    return buffer.getvalue()


def _restore_warm_starts(state: FSDPSyncState, saved: dict[str, Any]) -> None:
    """Each Q from the saved ones: its own on the same world, else combined (module docstring)."""
    if not saved:
        return
    transport = state.binding.transport
    same = saved["world"] == transport.world_size
    mine = saved["by_rank"][transport.rank] if same else []
    everyone = [entry for entries in saved["by_rank"] for entry in entries]
    for name, spec in _residual_specs(state).items():
        compressor = _compressor_for(state, spec)
        if not isinstance(compressor, PowerSGDCompressor):
            continue
        segment = state.binding.segments[name]
        for key, owner in _warm_start_keys(state, name):
            if same:
                q = next((e[4] for e in mine if e[1] == key), None)
            else:
                q = _combined([e for e in everyone if e[0] == name], *_rows_of(segment, owner))
            if q is not None:
                compressor.restore_warm_start(key, torch.Size(matrix_shape(segment)), q)


def _combined(entries: list[tuple[str, str, int, int, torch.Tensor]], lo: int, hi: int) -> torch.Tensor | None:
    """The rank-r basis best spanning the saved Qs of rows [lo, hi), each weighted by the rows it shares."""
    parts = [
        q * math.sqrt(min(hi, e_hi) - max(lo, e_lo)) for _, _, e_lo, e_hi, q in entries if min(hi, e_hi) > max(lo, e_lo)
    ]
    if not parts:
        return None
    rank = parts[0].shape[1]
    u, _, _ = torch.linalg.svd(torch.cat(parts, dim=1), full_matrices=False)
    return u[:, :rank].contiguous()

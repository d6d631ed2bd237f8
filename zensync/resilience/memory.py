"""One rank's training state, every step, into its host's shared memory, and back after a restart.

``MemoryCheckpoint`` saves named parts (a model, an optimizer, zensync's hook state: anything with
``state_dict()`` / ``load_state_dict()``, or a plain dict of tensors and JSON values) as one
``ShardStore`` shard per step, and restores the newest complete shard that verifies into the same
parts. DTensors (an FSDP2 model's) are kept as this rank's shard and come back on the same mesh
(``state_of``, ``load_parts``). The engine's state travels with the model's, so a run restored
from memory goes on as the uninterrupted one would (tests/distributed/resilience/test_memory.py
checks it on DDP with zensync's hook).

Example::

    ckpt = MemoryCheckpoint("/dev/shm/zensync-job42", rank)
    start = ckpt.restore(model=ddp.module, optimizer=opt, zensync=state)  # None: nothing saved yet
    for step in range(0 if start is None else start + 1, steps):
        ...  # forward, backward, optimizer.step()
        ckpt.save(step, model=ddp.module, optimizer=opt, zensync=state)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zensync.resilience.store import ShardInfo, ShardStore
from zensync.transport.dtensor import from_layout, is_dtensor, layout_of, local_of, meshes_of

__all__ = ["MemoryCheckpoint", "load_parts", "state_of"]

_STEP = "step"


class MemoryCheckpoint:
    """The per-step in-memory checkpoint of rank ``rank`` under ``root`` (a tmpfs directory).

    Args:
        root: The host's store directory (``ShardStore``), shared by its ranks.
        rank: This process's rank (its shards are its own).
        keep: Complete versions kept (>= 1): a save cut off by a crash leaves the previous one.
    """

    def __init__(self, root: str | os.PathLike[str], rank: int, keep: int = 2) -> None:
        self.store, self.rank = ShardStore(root, keep=keep), rank

    def save(self, step: int, **parts: Any) -> ShardInfo:
        """Save every part's state as the version of ``step`` (after that step's optimizer step).

        Raises:
            ValueError: For a part named "step", or a state the store refuses (``store.flatten``).
        """
        if _STEP in parts:
            raise ValueError(f"a part may not be named {_STEP!r}: the checkpoint keeps the step under it")
        state: dict[str, Any] = {name: state_of(part) for name, part in parts.items()}
        state[_STEP] = step
        return self.store.save(self.rank, step, state)

    def restore(self, **parts: Any) -> int | None:
        """Load the newest complete, verified version into ``parts``; returns its step (None: none saved).

        Parts with ``load_state_dict`` get their state through it; a dict part is updated in place.

        Raises:
            KeyError: If a part was not in the checkpoint (named otherwise when it was saved).
            ValueError: If a part cannot take its state (not a dict and no ``load_state_dict``).
        """
        if not self.store.versions(self.rank):
            return None
        state = self.store.load(self.rank)
        load_parts(state, parts)
        return int(state[_STEP])


def state_of(part: Any) -> Any:
    """A part's state: its ``local_state_dict()`` (this rank's own state, restored on the same world:
    ``register_fsdp``'s), else its ``state_dict()``, else the part itself (a dict). A DTensor in it
    (FSDP2's sharded parameters, their optimizer states) becomes this rank's local shard, and its
    layout (``transport.dtensor.layout_of``) a JSON value under ``DTENSORS``: the store keeps plain
    tensors, and ``load_parts`` makes them DTensors again."""
    own = getattr(part, "local_state_dict", None)
    state = own() if own is not None else part.state_dict() if hasattr(part, "state_dict") else part
    if not isinstance(state, dict):
        return state
    layouts: list[Any] = []
    localized = _localized(state, [], layouts)
    if not layouts:
        return state
    if DTENSORS in state:
        raise ValueError(f"a part's state has a key {DTENSORS!r}: the checkpoint keeps its DTensors' layouts under it")
    return {**localized, DTENSORS: layouts}


DTENSORS = "__dtensors__"
"""Where a part's saved state lists its DTensors: [path (its keys), layout] each (``state_of``)."""


def _localized(state: dict[Any, Any], path: list[Any], layouts: list[Any]) -> dict[Any, Any]:
    """``state`` with each DTensor replaced by its local shard (a new dict where one is replaced)."""
    out = state
    for key, value in state.items():
        found: Any = value
        if isinstance(value, dict) and value:
            found = _localized(value, [*path, key], layouts)
        elif is_dtensor(value):
            layouts.append([[*path, key], layout_of(value)])
            found = local_of(value).detach()
        if found is not value:
            out = dict(out) if out is state else out
            out[key] = found
    return out


def _meshes(parts: dict[str, Any]) -> list[Any]:
    """The device meshes of the DTensors the parts hold now (a model's parameters, an optimizer's)."""
    tensors: list[torch.Tensor] = []
    for part in parts.values():
        if isinstance(part, torch.nn.Module):
            tensors += [*part.parameters(), *part.buffers()]
        elif isinstance(part, torch.optim.Optimizer):
            tensors += [p for group in part.param_groups for p in group["params"]]
    return meshes_of(tensors)


def _globalized(name: str, saved: dict[Any, Any], meshes: list[Any]) -> dict[Any, Any]:
    """A part's saved state with its local shards made DTensors again, on the parts' own mesh of the
    saved shape (``state_of``).

    Raises:
        ValueError: When no DTensor of the parts has a mesh of that shape and those dimension names
            (restore on the layout it was saved on; torch.distributed.checkpoint reshards).
    """
    state = {k: v for k, v in saved.items() if k != DTENSORS}
    for path, layout in saved[DTENSORS]:
        node = state
        for key in path[:-1]:
            node[key] = node = dict(node[key])
        node[path[-1]] = from_layout(node[path[-1]], layout, meshes, f"part {name!r}: {'/'.join(map(str, path))}")
    return state


def load_parts(state: dict[str | int, Any], parts: dict[str, Any]) -> None:
    """Load each part's state from a saved ``state`` (``load_state_dict``, or a dict updated in place).
    Saved DTensors (``state_of``) come back as DTensors on the parts' own mesh.

    Raises:
        KeyError: If a part was not in the checkpoint (named otherwise when it was saved).
        ValueError: If a part cannot take its state (not a dict and no ``load_state_dict``), or its
            DTensors were saved on a mesh the parts do not have (``_globalized``).
    """
    missing = sorted(set(parts) - set(state))
    if missing:
        raise KeyError(f"parts {missing} are not in the checkpoint (it has {sorted(map(str, state))})")
    meshes: list[Any] | None = None
    for name, part in parts.items():
        saved = state[name]
        if isinstance(saved, dict) and DTENSORS in saved:
            meshes = _meshes(parts) if meshes is None else meshes
            saved = _globalized(name, saved, meshes)
        if hasattr(part, "load_local_state_dict"):
            part.load_local_state_dict(saved)
        elif hasattr(part, "load_state_dict"):
            part.load_state_dict(saved)
        elif isinstance(part, dict):
            part.clear()
            part.update(saved)
        else:
            raise ValueError(f"part {name!r} is a {type(part).__name__}: give it load_state_dict or pass a dict")

"""One rank's training state, every step, into its host's shared memory, and back after a restart.

``MemoryCheckpoint`` saves named parts (a model, an optimizer, zensync's hook state: anything with
``state_dict()`` / ``load_state_dict()``, or a plain dict of tensors and JSON values) as one
``ShardStore`` shard per step, and restores the newest complete shard that verifies into the same
parts. The engine's state travels with the model's, so a run restored from memory goes on as the
uninterrupted one would (tests/distributed/resilience/test_memory.py checks it on DDP with zensync's hook).

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

from zensync.resilience.store import ShardInfo, ShardStore

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
    """A part's state: its ``state_dict()``, or the part itself (a dict)."""
    return part.state_dict() if hasattr(part, "state_dict") else part


def load_parts(state: dict[str | int, Any], parts: dict[str, Any]) -> None:
    """Load each part's state from a saved ``state`` (``load_state_dict``, or a dict updated in place).

    Raises:
        KeyError: If a part was not in the checkpoint (named otherwise when it was saved).
        ValueError: If a part cannot take its state (not a dict and no ``load_state_dict``).
    """
    missing = sorted(set(parts) - set(state))
    if missing:
        raise KeyError(f"parts {missing} are not in the checkpoint (it has {sorted(map(str, state))})")
    for name, part in parts.items():
        if hasattr(part, "load_state_dict"):
            part.load_state_dict(state[name])
        elif isinstance(part, dict):
            part.clear()
            part.update(state[name])
        else:
            raise ValueError(f"part {name!r} is a {type(part).__name__}: give it load_state_dict or pass a dict")

"""Which rows of a training state changed since the last save, known from the optimizer's steps
instead of a pass over the state (the store then writes, hashes and replicates only those rows).

An optimizer step moves a parameter's row only where the step's gradient row is non-zero, or, for
optimizers with running averages, where it ever was: with no weight decay,

- ``SGD`` without momentum, ``Adagrad`` and ``SparseAdam`` change a row (and its state) only where
  the step's gradient is non-zero (rule "step");
- ``SGD`` with momentum, ``Adam``, ``AdamW`` (weight_decay=0) and ``RMSprop`` change the rows whose
  state is non-zero, a set that only grows by the rows of each gradient (rule "ever");
- anything else (weight decay, another optimizer, a subclass) is not tracked: the store compares the
  tensor's block hashes instead (exact, a read of the tensor).

``ChangeTracker`` hooks each optimizer's step: before it, the non-zero rows of each tracked gradient
(one scan, ``kernels.nonzero_items``; a sparse gradient's indices); after it, each tensor's version
counter. A tensor changed otherwise between a step and the save (its version counter moved: an
in-place edit, ``load_state_dict``) is not listed, and the store hashes it. The store also checks a
few random unlisted rows of each listed tensor against the previous version (``audit_rows``): a
mismatch rewrites the tensor by its hashes and stops tracking it (``disable``), with a warning.

Example::

    tracker = ChangeTracker()
    tracker.attach({"optimizer": opt})
    ...  # opt.step() runs: the hooks record the rows
    rows = tracker.changes(flat_tensors)  # {"model/embedding.weight": rows, ...}
    store.write(rank, step, state, changed=rows, since=previous_step)
    tracker.saved()
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from zensync import kernels
from zensync.resilience.blocks import num_blocks
from zensync.transport.dtensor import local_of

__all__ = ["ChangeTracker", "row_rule"]

logger = logging.getLogger(__name__)


def row_rule(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str | None:
    """The rows one step of ``optimizer`` changes in a parameter of ``group``: "step" (the gradient's
    non-zero rows), "ever" (every row whose gradient was ever non-zero) or None (not known)."""
    kind = type(optimizer)
    if group.get("weight_decay", 0) != 0:
        return None
    if kind is torch.optim.SGD:
        return "step" if group.get("momentum", 0) == 0 else "ever"
    if kind in (torch.optim.Adagrad, torch.optim.SparseAdam):
        return "step"
    if kind in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop):
        return "ever"
    return None


def _place(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """A tensor's memory (its views alike share its version counter)."""
    return t.data_ptr(), tuple(t.shape)


def _rows(grad: torch.Tensor) -> np.ndarray:
    """The non-zero rows of a gradient (a sparse one's indices; a DTensor's: of its shard)."""
    grad = local_of(grad)
    if grad.is_sparse:
        return np.unique(grad.coalesce().indices()[0].cpu().numpy())
    return kernels.nonzero_items(grad.detach().reshape(grad.shape[0], -1)).cpu().numpy()


class ChangeTracker:
    """The rows each tracked tensor changed since ``saved`` (module docstring)."""

    def __init__(self) -> None:
        self._optimizers: list[torch.optim.Optimizer] = []
        self._handles: list[Any] = []
        # per parameter (by id): its rule, the rows changed since the save, the rows ever changed
        self._rule: dict[int, str] = {}
        self._since: dict[int, np.ndarray] = {}
        self._ever: dict[int, np.ndarray] = {}
        # per tensor (by its memory: a DTensor's shard is a new view at each ``to_local``): its version
        # counter after the last step, and at the last save
        self._after_step: dict[tuple[int, tuple[int, ...]], int] = {}
        self._at_save: dict[tuple[int, tuple[int, ...]], int] = {}
        self._steps = 0
        self._disabled: set[str] = set()

    def attach(self, parts: dict[str, Any]) -> None:
        """Hook the steps of the optimizers among ``parts`` (once each)."""
        for part in parts.values():
            if isinstance(part, torch.optim.Optimizer) and all(part is not o for o in self._optimizers):
                self._optimizers.append(part)
                self._handles.append(part.register_step_pre_hook(self._before_step))
                self._handles.append(part.register_step_post_hook(self._after))

    def _before_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        for group in optimizer.param_groups:
            rule = row_rule(optimizer, group)
            for p in group["params"]:
                if rule is None or p.grad is None or num_blocks(tuple(local_of(p).shape), p.element_size()) == 1:
                    self._rule.pop(id(p), None)
                    continue
                rows = _rows(p.grad)
                if rule == "ever" and id(p) not in self._ever:  # rows whose state is not zero yet
                    state = [t for t in optimizer.state.get(p, {}).values() if t.shape == p.shape]
                    self._ever[id(p)] = np.unique(np.concatenate([rows, *map(_rows, state)]))
                self._rule[id(p)] = rule
                since = self._since.get(id(p))
                self._since[id(p)] = rows if since is None else np.union1d(since, rows)
                if rule == "ever":
                    self._ever[id(p)] = np.union1d(self._ever[id(p)], rows)

    def _after(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._steps += 1
        for p, tensor in self._tracked(optimizer):
            if id(p) in self._rule:
                self._after_step[_place(tensor)] = tensor._version

    def _tracked(self, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, tensor) for each parameter and each of its state tensors of its shape (the
        tensor a DTensor's shard: what the checkpoint stores)."""
        out = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                out.append((p, local_of(p)))
                out += [(p, local_of(t)) for t in optimizer.state.get(p, {}).values()
                        if isinstance(t, torch.Tensor) and t.shape == p.shape]  # fmt: skip
        return out

    def changes(self, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """For each tensor of a flattened state (``store.flatten``) whose changed rows are known, its
        rows that may have changed since ``saved`` (sorted); the others are not listed."""
        owners: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}
        for optimizer in self._optimizers:
            for p, tensor in self._tracked(optimizer):
                owners[_place(tensor)] = (p, tensor)
        out = {}
        for key, flat in tensors.items():
            found = owners.get(_place(flat))
            if key in self._disabled or found is None:
                continue
            p, tensor = found
            rule = self._rule.get(id(p))
            expected = (self._after_step if self._steps else self._at_save).get(_place(tensor))
            if expected is None or tensor._version != expected or (self._steps and rule is None):
                continue  # changed outside a tracked step (or never seen): hash it
            empty = np.zeros(0, np.int64)
            out[key] = empty if not self._steps else self._ever[id(p)] if rule == "ever" else self._since[id(p)]
        return out

    def saved(self) -> None:
        """A save took the state: rows are counted from here."""
        self._since.clear()
        self._steps = 0
        self._at_save = {_place(t): t._version for o in self._optimizers for _, t in self._tracked(o)}

    def disable(self, key: str) -> None:
        """Stop listing ``key``'s rows (its listing missed a change: the store's audit)."""
        if key not in self._disabled:
            logger.warning("zensync checkpoint: %r changed outside the rows its optimizer steps touched; its "
                           "checkpoint blocks are compared by hash from now on", key)  # fmt: skip
        self._disabled.add(key)

    def close(self) -> None:
        """Remove the optimizer hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

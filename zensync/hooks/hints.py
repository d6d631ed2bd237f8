"""Row hints: the rows an embedding's lookups touched this step, so detection need not scan its table.

An ``nn.Embedding`` or ``nn.EmbeddingBag`` with dense gradients has non-zero gradient rows only
where its input looked rows up (``padding_idx``, ``max_norm``, ``scale_grad_by_freq``, bag modes and
``per_sample_weights`` all keep the gradient inside those rows; some of them may be exactly zero, as
the padding row is). A forward hook records the unique input rows of every forward since the last
sync (several under ``no_sync``); the DDP hook reads only those rows of the gradient, keeps the non-
zero ones, and feeds them to Zen: a step then makes no pass over the table at all.

A hint is a superset of the non-zero rows only while nothing else writes the weight's gradient, so
a parameter gets no hint when:

* it is shared: another module holds the same Parameter (tied input/output embeddings);
* its gradient was not cleared before the step's first forward (``zero_grad(set_to_none=True)``,
  torch's default): an accumulated gradient keeps earlier steps' rows;
* a tensor hook (``weight.register_hook``) could change its gradient.

The one case these checks cannot see is a functional use of the weight elsewhere (for example
``F.linear(h, emb.weight)`` as a tied decoder). Hints are therefore verified: on the first steps a
parameter uses them and every ``hint_check_every`` steps after, the full scan runs as well, and a
row the scan finds outside the hint turns that parameter's hints off for good (with a warning),
that step taking the scan's rows. ``register(..., row_hints=False)`` turns hints off altogether.

A hint only decides which of a rank's rows are read; collectives and every rank's decisions depend
on the exact non-zero counts, which hint and scan give alike, so ranks need not agree on hints.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

from zensync import kernels

__all__ = ["EMBEDDING_MODULES", "RowHints"]

EMBEDDING_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)
"""Modules whose weight gradient is row-sparse: each step touches the rows its lookups read."""

logger = logging.getLogger(__name__)

_VERIFIED_STEPS = 2
"""A parameter's first steps with a hint are all checked against the full scan."""


class _Slot:
    """One embedding weight's hint state."""

    __slots__ = ("checks", "disabled", "pending", "uses", "valid")

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []
        """Unique rows of each forward since the last take."""
        self.valid = True
        """Whether this window's rows are a superset of the gradient's non-zero rows."""
        self.disabled = False
        """A check found a row outside the hint: this parameter scans from now on."""
        self.uses = 0
        """Steps this parameter's hint was taken."""
        self.checks = 0
        """Of those, steps checked against the scan."""


class RowHints:
    """Forward hooks on a model's embeddings, and the rows they recorded (see the module docstring).

    Args:
        modules: The model's named modules (``module.named_modules()``).
        names: Each parameter's name in the hook (the state's ``param_names``).
        shared: Parameters held by more than one module (they get no hint).
        check_every: Verify a hint against the full scan every this many uses (after the first ones).
    """

    def __init__(
        self,
        modules: Iterable[tuple[str, torch.nn.Module]],
        names: dict[torch.nn.Parameter, str],
        shared: set[torch.nn.Parameter],
        check_every: int,
    ) -> None:
        self.check_every = check_every
        self._slots: dict[str, _Slot] = {}
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        for _, module in modules:
            if not isinstance(module, EMBEDDING_MODULES) or module.sparse:
                continue
            weight = module.weight
            if not isinstance(weight, torch.nn.Parameter) or not weight.requires_grad:
                continue
            if weight in shared or weight not in names:
                continue
            name = names[weight]
            self._slots[name] = _Slot()
            self._handles.append(module.register_forward_hook(self._recorder(name, weight)))

    @property
    def names(self) -> list[str]:
        """Parameters with a hint recorder."""
        return list(self._slots)

    def _recorder(self, name: str, weight: torch.nn.Parameter) -> Any:
        slot = self._slots[name]

        def record(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            del module, output
            if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
                return
            rows = torch.unique(args[0].detach().reshape(-1))
            with self._lock:
                if not slot.pending:  # the window's first forward: is the gradient clear?
                    slot.valid = weight.grad is None and not getattr(weight, "_backward_hooks", None)
                slot.pending.append(rows)

        return record

    def rows(self, name: str, x2d: torch.Tensor) -> torch.Tensor | None:
        """The non-zero rows of ``x2d`` (parameter ``name``'s gradient) from its hint, or None: scan.

        Ends the parameter's window (the next forward starts a new one). Ascending int64, exactly
        what ``kernels.nonzero_items(x2d)`` returns whenever the hint is a superset.
        """
        slot = self._slots.get(name)
        if slot is None:
            return None
        with self._lock:
            pending, slot.pending = slot.pending, []
            usable = slot.valid and not slot.disabled and bool(pending)
        if not usable:
            return None
        hint = pending[0] if len(pending) == 1 else torch.unique(torch.cat(pending))
        hint = hint.to(device=x2d.device, dtype=torch.int64)
        if hint.numel() and (int(hint[0]) < 0 or int(hint[-1]) >= x2d.shape[0]):  # host-device sync
            return None  # out-of-range ids: the forward itself raised; scan rather than index
        found = hint[kernels.nonzero_items(x2d.index_select(0, hint))]
        slot.uses += 1
        if slot.uses <= _VERIFIED_STEPS or slot.uses % self.check_every == 0:
            slot.checks += 1
            scanned = kernels.nonzero_items(x2d)
            if not torch.equal(scanned, found):
                slot.disabled = True
                logger.warning(
                    "zensync: %s has non-zero gradient rows its embedding lookups did not touch (its weight "
                    "is used elsewhere too, e.g. a tied decoder through F.linear); its row hints are off, "
                    "its gradient is scanned",
                    name,
                )
                return scanned
        return found

    def discard(self, names: Iterable[str]) -> None:
        """End these parameters' windows unread (their bucket skipped detection this step)."""
        with self._lock:
            for name in names:
                slot = self._slots.get(name)
                if slot is not None:
                    slot.pending = []

    def stats(self) -> dict[str, dict[str, int | bool]]:
        """Per parameter: steps with a hint, checks run, whether hints were turned off."""
        return {n: {"uses": s.uses, "checks": s.checks, "disabled": s.disabled} for n, s in self._slots.items()}

    def close(self) -> None:
        """Remove the forward hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

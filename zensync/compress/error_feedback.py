"""Error-feedback memory: what compression dropped is added back before the next compression.

For a biased compressor C (top-k, DGC, sign), each step sends C(g + e) and keeps
e <- (g + e) - decompress(C(g + e)), so the sum of what was sent tracks the sum of the gradients
(Karimireddy et al. 2019, EF-SGD; GRACE's Memory: ``compensate`` then ``update``)::

    ef = ErrorFeedback()
    corrected = ef.compensate("fc.weight", grad)
    packed = comp.compress(corrected)
    ef.update("fc.weight", corrected, comp.decompress(packed))

Memories are keyed by a name (the parameter name, plus a stage suffix such as ``"/server/3"`` for
the chunk owner of a two-phase scheme), never by DDP bucket index, so they survive DDP's bucket
rebuild after the first iteration. A name whose shape changes is reset with one warning.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["ErrorFeedback"]

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """Residual memory per name; ``nbytes`` reports its size."""

    __slots__ = ("_residuals", "_warned")

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        self._warned: set[str] = set()

    def compensate(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the residual stored under ``name`` (a new tensor; ``x`` is not modified)."""
        residual = self._residuals.get(name)
        if residual is None:
            return x.clone()
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            if name not in self._warned:
                logger.warning(
                    "error feedback for %s reset: tensor changed from %s %s to %s %s",
                    name,
                    tuple(residual.shape),
                    residual.dtype,
                    tuple(x.shape),
                    x.dtype,
                )
                self._warned.add(name)
            del self._residuals[name]
            return x.clone()
        return x + residual

    def update(self, name: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Store ``compensated - transmitted`` (what compression dropped) under ``name``."""
        if compensated.shape != transmitted.shape:
            raise ValueError(
                f"error feedback {name!r}: transmitted shape {tuple(transmitted.shape)} differs from the "
                f"compensated input's {tuple(compensated.shape)}"
            )
        self._residuals[name] = (compensated - transmitted).detach()

    def residual(self, name: str) -> torch.Tensor | None:
        """The stored residual of ``name`` (None before its first update)."""
        return self._residuals.get(name)

    @property
    def nbytes(self) -> int:
        """Memory held by all residuals, in bytes."""
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def names(self) -> list[str]:
        return sorted(self._residuals)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals by name (for checkpoints)."""
        return {name: r.clone() for name, r in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residuals = {str(name): r.clone() for name, r in state.items()}
        self._warned.clear()

    def clear(self) -> None:
        self._residuals.clear()

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

Non-finite values. A NaN or infinity in one gradient must not stay in a residual (it would be added
back, and sent, at every later step: under GradScaler every later step would be skipped). The rule:

1. The step that sees it behaves as dense allreduce does: its output holds a non-finite value, so
   GradScaler skips that step. Every compressor with error feedback carries a non-finite input to
   its output (``Compressor.carries_nonfinite``; random-k, which might not draw the element, sends
   NaN values then), and a sum with a non-finite term is non-finite.
2. That step leaves the error-feedback state exactly as it was: ``CompressedSync`` brackets each
   step with ``begin_step``/``end_step`` and keeps the step's residual updates (worker and server
   side) and its compressor's state changes (PowerSGD's Q) only if its output is finite. Every rank
   receives the same output, so every rank decides the same way without another collective, and a
   rank whose own gradient was finite drops its updates too.
3. From the next step on, training continues as if that step's updates had not happened: the next
   step compensates with the residuals of the step before. (Step-seeded draws, random-k's indices
   and DGC's sample, still take the next step's index.)

So no residual and no PowerSGD Q holds a NaN or infinity: a finite output means finite inputs on
every rank (1), and a residual is then a difference of finite values, compensated - transmitted. It
cannot overflow where each transmitted element is 0, the input's own value, or a value of its sign
(top-k, DGC, random-k, the sign family, through allgather, alltoall_allgather or gather_broadcast);
the allreduce schemes' compensated - out / n and PowerSGD's could, for values beyond half the
dtype's range (32752 in float16), and that is not checked: the rule costs one ``aminmax`` pass over
each output per step and nothing more. Outside a step (``update`` called alone, one process) the
rule is local: a non-finite new residual is not stored, and the previous one stays.
"""

from __future__ import annotations

import logging
import threading

import torch

from zensync.compress.base import all_finite, call_key

__all__ = ["ErrorFeedback", "Layout"]

Layout = tuple[tuple[str, int], ...]
"""A fused residual's pieces: (parameter name, numel) in the order they are concatenated."""

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """Residual memory per name; ``nbytes`` reports its size.

    Between ``begin_step()`` and ``end_step(keep=...)``, ``update`` only holds its residual back:
    ``end_step`` stores all of them (keep=True) or none (see the module docstring).

    Work buffers: ``compensate`` writes x + residual into a buffer the memory keeps for that name
    (the residual the step before replaced), and a consuming ``update`` turns that buffer into the
    new residual, so a step allocates nothing of the tensor's size after the first two: each name
    holds its residual and one spare of the same size (``workspace_bytes``).

    Overlapping calls (the DDP hook's buckets: one decodes while the next compresses, on two
    threads) hold their steps apart by ``call_key`` and touch the dictionaries under a lock;
    each name belongs to one call at a time.
    """

    __slots__ = ("_layouts", "_lock", "_pending", "_residuals", "_retired", "_spares", "_warned")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._residuals: dict[str, torch.Tensor] = {}
        self._pending: dict[object | None, dict[str, torch.Tensor]] = {}
        """Per open step (``call_key``), its new residuals."""
        self._spares: dict[str, torch.Tensor] = {}
        """Per name, a tensor of the residual's size that no one else holds: ``compensate``'s output."""
        self._layouts: dict[str, Layout] = {}
        """Per fused key, the (parameter name, numel) pieces of its residual, in order (``regroup``);
        keys in the order of their last regroup."""
        self._retired: dict[str, tuple[Layout, torch.Tensor]] = {}
        """Residuals replaced by ``regroup`` whose pieces do not all have a group again yet."""
        self._warned: set[str] = set()

    def regroup(self, key: str, layout: Layout) -> None:
        """Make ``key``'s residual the concatenation of ``layout``'s pieces, wherever they are now.

        A fused group (a DDP bucket's parameters compressed as one) is keyed by its first name; when
        DDP rebuilds its buckets the groups change, and each parameter's part of the residual moves
        to its new group here instead of being lost: pieces come from the groups stored so far and
        from those replaced earlier (a piece no group holds starts at zero); a replaced group is
        kept until every piece of it has moved, and a stored group whose pieces have all moved
        elsewhere is dropped. An unchanged layout costs a comparison. Call it outside a step.
        """
        with self._lock:
            self._regroup(key, layout)

    def _regroup(self, key: str, layout: Layout) -> None:
        known = self._layouts.get(key)
        if known == layout:
            return
        residual = self._residuals.get(key)
        if known is None and residual is not None and residual.numel() == _total(layout):
            self._layouts[key] = layout  # a residual loaded from a checkpoint, before any layout
            return
        sources = [(self._layouts[k], r) for k, r in self._residuals.items() if k in self._layouts and k != key]
        sources += self._retired.values()
        if known is not None and residual is not None:
            self._retired[key] = (known, residual)  # other groups may still take pieces of it
            sources.append((known, residual))
        merged: torch.Tensor | None = None
        taken: set[str] = set()
        for source_layout, source_residual in sources:
            flat, offset = source_residual.reshape(-1), 0
            for name, numel in source_layout:
                target = _offset_of(layout, name, numel)
                if target is not None and name not in taken:
                    if merged is None:
                        merged = source_residual.new_zeros(_total(layout))
                    merged[target : target + numel] = flat[offset : offset + numel]
                    taken.add(name)
                offset += numel
        self._layouts.pop(key, None)
        self._layouts[key] = layout  # last: the most recently regrouped
        self._spares.pop(key, None)
        if merged is None:
            self._residuals.pop(key, None)
        else:
            self._residuals[key] = merged  # flat: compensate views it as the group's tensor
        self._drop_moved()
        logger.debug("error feedback: %s regrouped, %d of %d pieces carried over", key, len(taken), len(layout))

    def _drop_moved(self) -> None:
        """Forget the groups every piece of which now lives in a newer group: a stored group whose
        parameters all belong to groups regrouped after it, a replaced one whose parameters all
        have a group again."""
        keys = list(self._layouts)  # in the order of their last regroup
        names = [{name for name, _ in self._layouts[key]} for key in keys]
        everywhere = set().union(*names)
        for key, (layout, _) in list(self._retired.items()):
            if all(name in everywhere for name, _ in layout):
                del self._retired[key]
        for index, key in enumerate(keys):
            if names[index] <= set().union(*names[index + 1 :]):
                self._residuals.pop(key, None)
                self._spares.pop(key, None)
                del self._layouts[key]

    def begin_step(self) -> None:
        """Hold back every ``update`` of this context's call (``call_key``) until ``end_step``."""
        key = call_key()
        with self._lock:
            assert key not in self._pending, "begin_step called again before end_step"
            self._pending[key] = {}

    def end_step(self, *, keep: bool) -> None:
        """Store the residuals of the step's ``update`` calls (``keep``), or drop them all."""
        with self._lock:
            pending = self._pending.pop(call_key(), None)
            if not pending:
                return
            for name, residual in pending.items():
                if keep:
                    self._store(name, residual)
                else:
                    self._spares[name] = residual  # the dropped residual's memory serves the next step

    def _store(self, name: str, residual: torch.Tensor) -> None:
        """(Caller holds the lock.)"""
        previous = self._residuals.get(name)
        self._residuals[name] = residual
        if previous is not None and previous is not residual:
            self._spares[name] = previous

    def compensate(self, name: str, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """``scale * x`` plus the residual stored under ``name`` (a tensor of its own; ``x`` is not
        modified), in one pass: the DDP hook's division by the world size costs no pass of its own."""
        with self._lock:
            residual, spare = self._take(name, x)
        if residual is None:
            if scale != 1.0:
                return torch.mul(x, scale) if spare is None else torch.mul(x, scale, out=spare)
            return x.clone() if spare is None else spare.copy_(x)
        if spare is None:
            return torch.add(residual, x, alpha=scale)
        return torch.add(residual, x, alpha=scale, out=spare)

    def _take(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``compensate``'s residual and work buffer for ``x`` (caller holds the lock)."""
        residual = self._residuals.get(name)
        if residual is not None and residual.shape != x.shape and residual.numel() == x.numel():
            residual = self._residuals[name] = residual.view(x.shape)  # regroup's flat residual
        spare = self._spares.pop(name, None)
        if spare is not None and not _alike(spare, x):
            spare = None
        if residual is not None and not _alike(residual, x):
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
            residual = None
        return residual, spare

    def update(
        self,
        name: str,
        compensated: torch.Tensor,
        transmitted: torch.Tensor,
        *,
        scale: float = 1.0,
        consume: bool = False,
    ) -> None:
        """Store ``compensated - scale * transmitted`` (what compression dropped) under ``name``.

        Within a step, at ``end_step(keep=True)``. Outside one, now, unless it holds a NaN or
        infinity (then the previous residual stays; a host-device sync). ``consume``: the caller
        gives up ``compensated`` (a tensor of its own, such as ``compensate`` returned), and the
        residual is computed in its memory: one pass, nothing allocated.
        """
        if compensated.shape != transmitted.shape:
            raise ValueError(
                f"error feedback {name!r}: transmitted shape {tuple(transmitted.shape)} differs from the "
                f"compensated input's {tuple(compensated.shape)}"
            )
        if consume:
            residual = compensated.detach().sub_(transmitted, alpha=scale)
        else:
            residual = torch.sub(compensated, transmitted, alpha=scale).detach()
        self.keep_remainder(name, residual)

    def keep_remainder(self, name: str, residual: torch.Tensor) -> None:
        """Store ``residual``, computed by the caller in memory it gives up (``compensate``'s output
        minus what was sent, e.g. ``Compressor.subtract_transmitted``), as ``update`` stores its own."""
        with self._lock:
            pending = self._pending.get(call_key())
            if pending is not None:
                pending[name] = residual
                return
        finite = bool(all_finite(residual))  # host-device sync
        with self._lock:
            if finite:
                self._store(name, residual)
            else:
                logger.debug("error feedback for %s: non-finite residual not stored", name)
                self._spares[name] = residual

    def replace(self, name: str, residual: torch.Tensor | None) -> None:
        """Make ``residual`` (a tensor the memory keeps from now on; None: no residual) ``name``'s
        residual, outside a step (a checkpoint's residual put back, or one moved between ranks)."""
        with self._lock:
            self._spares.pop(name, None)
            if residual is None:
                self._residuals.pop(name, None)
            else:
                self._residuals[name] = residual

    def residual(self, name: str) -> torch.Tensor | None:
        """A copy of the stored residual of ``name`` (None before its first update); the stored
        tensor itself becomes a work buffer at a later step."""
        residual = self._residuals.get(name)
        return None if residual is None else residual.clone()

    @property
    def nbytes(self) -> int:
        """Memory held by all residuals, in bytes."""
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    @property
    def workspace_bytes(self) -> int:
        """Memory held by the work buffers ``compensate`` reuses (at most one residual's size per name)."""
        return sum(r.numel() * r.element_size() for r in self._spares.values())

    def names(self) -> list[str]:
        return sorted(self._residuals)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals by name (for checkpoints)."""
        return {name: r.clone() for name, r in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residuals = {str(name): r.clone() for name, r in state.items()}
        self._spares.clear()
        self._layouts.clear()
        self._retired.clear()
        self._warned.clear()

    def clear(self) -> None:
        self._residuals.clear()
        self._spares.clear()
        self._layouts.clear()
        self._retired.clear()
        self._pending.clear()


def _total(layout: Layout) -> int:
    return sum(numel for _, numel in layout)


def _offset_of(layout: Layout, name: str, numel: int) -> int | None:
    """Where ``name``'s piece starts in ``layout``'s concatenation; None if absent or of another size."""
    offset = 0
    for other, size in layout:
        if other == name:
            return offset if size == numel else None
        offset += size
    return None


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device

"""``CompressedSync``: one compressor, one compressed collective, and the error feedback they need.

Every collective returns, on every rank, the sum over ranks of the gradients as the compressor lets
them through (the DDP hook divides by the world size first, so that sum is the average); the
collectives are the registered ``CompressedCollective``s of this package (``COMPRESSED_SCHEMES``),
flat or two-level (``hierarchy``).

``sync_async`` is a coroutine of the transport's non-blocking collectives: the DDP hook drives it by
completion callbacks (``Task`` on a ``Lane``, which keeps the collectives of successive calls in
the same order on every rank); ``sync`` drives it to completion on the calling thread. Calls on
different names may overlap (each brackets its own state changes, below).

Non-finite values (``zensync.compress.error_feedback`` states the rule): a NaN or infinity in any
rank's compensated input, or in a chunk owner's aggregated input, reaches the output of every rank
as it would under dense allreduce (GradScaler then skips the step), and that step's updates of the
worker residual, the server residuals and the compressor's own state (PowerSGD's Q) are dropped on
every rank. The output is the same on every rank, so one ``aminmax`` pass over it per call decides
for all of them, with no extra collective.

Example::

    sync = CompressedSync("topk:0.01", scheme="allgather")
    out = sync.sync(grad, transport, name="fc.weight", step=3)  # approx. sum over ranks
    out = await sync.sync_async(grad, transport, name="fc.weight", step=4)  # inside a coroutine
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from zensync.compress.base import Compressed, Compressor, Parts, all_finite, build, compressed_call
from zensync.compress.collectives.base import COMPRESSED_SCHEMES, Codec, Own, build_collective
from zensync.compress.collectives.two_level import Hierarchy, two_level
from zensync.compress.error_feedback import ErrorFeedback
from zensync.transport import Transport

__all__ = ["CompressedSync"]


class CompressedSync:
    """One compressor, one scheme, and the error-feedback memories they need.

    Args:
        compressor: A ``Compressor`` or a spec string (``"topk:0.01"``).
        scheme: One of ``COMPRESSED_SCHEMES``, or "auto": allreduce when the compressor allows it,
            else allgather.
        error_feedback: Keep worker-side (and, for divisible schemes, server-side) residuals;
            None follows ``compressor.needs_error_feedback``.

    Raises:
        ValueError: If the scheme is unknown or does not suit the compressor, or error feedback is
            asked of a compressor that cannot carry a non-finite value to its output (``signsgd``).
    """

    __slots__ = ("collective", "compressor", "error_feedback", "scheme", "server_memory", "worker_memory")

    def __init__(
        self, compressor: Compressor | str, scheme: str = "auto", *, error_feedback: bool | None = None
    ) -> None:
        self.compressor = build(compressor) if isinstance(compressor, str) else compressor
        self.scheme: str = _resolve_scheme(self.compressor, scheme)
        self.collective = build_collective(self.scheme)
        self.collective.check(self.compressor)
        self.error_feedback = self.compressor.needs_error_feedback if error_feedback is None else error_feedback
        if self.error_feedback and not self.compressor.carries_nonfinite:
            raise ValueError(
                f"error_feedback=True needs a compressor that carries a NaN or infinity to its output; "
                f"{self.compressor.spec()!r} does not (it would stay in the residual at every later step): "
                f"use efsignsgd or onebit, which send a scale, or error_feedback=False"
            )
        self.worker_memory = ErrorFeedback()
        self.server_memory = ErrorFeedback()

    def state_dict(self) -> dict[str, Any]:
        """The state a later step depends on: both error-feedback memories and the compressor's own
        (PowerSGD's warm-start Qs), for checkpoints (tensors and JSON values)."""
        compressor = self.compressor.state_dict() if hasattr(self.compressor, "state_dict") else {}
        return {
            "worker": self.worker_memory.state_dict(),
            "server": self.server_memory.state_dict(),
            "compressor": compressor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s state (outside a step)."""
        self.worker_memory.load_state_dict(dict(state.get("worker", {})))
        self.server_memory.load_state_dict(dict(state.get("server", {})))
        if hasattr(self.compressor, "load_state_dict"):
            self.compressor.load_state_dict(dict(state.get("compressor", {})))

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the error-feedback residuals (worker and server side)."""
        return self.worker_memory.nbytes + self.server_memory.nbytes

    def sync(
        self,
        x: torch.Tensor,
        transport: Transport,
        *,
        name: str,
        step: int,
        hierarchy: Hierarchy | None = None,
        out: torch.Tensor | None = None,
        scale: float = 1.0,
        parts: Parts | None = None,
    ) -> torch.Tensor:
        """``sync_async`` driven to completion on this thread (the blocking form)."""
        return transport.run(
            self.sync_async(x, transport, name=name, step=step, hierarchy=hierarchy, out=out, scale=scale, parts=parts)
        )

    def fuses(self, *, hierarchical: bool) -> bool:
        """Whether several tensors are synced as one 1-D concatenation (the DDP hook's bucket): the
        compressor's own operation on the longer vector (``Compressor.fuses``), or part by part on
        the flat allreduce (``Compressor.fuses_named_parts``, with ``sync_async(parts=...)``)."""
        if self.compressor.fuses:
            return True
        return self.compressor.fuses_named_parts and self.scheme == "allreduce" and not hierarchical

    def folds_scale(self, *, hierarchical: bool) -> bool:
        """Whether ``sync_async(scale=...)`` applies the scale with no pass of its own over x: error
        feedback's compensation (``scale * x + residual``, one pass it makes anyway), or the flat
        allreduce of a compressor that folds it (PowerSGD)."""
        return self.error_feedback or self._collective_folds(hierarchical=hierarchical)

    def _collective_folds(self, *, hierarchical: bool) -> bool:
        return not hierarchical and self.collective.folds_scale and self.compressor.folds_scale

    async def sync_async(
        self,
        x: torch.Tensor,
        transport: Transport,
        *,
        name: str,
        step: int,
        hierarchy: Hierarchy | None = None,
        out: torch.Tensor | None = None,
        scale: float = 1.0,
        parts: Parts | None = None,
        on_issued: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Sum over ranks of the compressed ``scale * x`` (a new tensor of x's shape and dtype, or ``out``).

        Step 1: add this rank's residual (error feedback). Step 2: run the scheme, flat or two-level.
        Step 3: keep what compression dropped as the new residual. Step 4: commit the step's new
        residuals and compressor state only if the output is finite (module docstring).

        Args:
            x: This rank's tensor.
            transport: The group to sum over (``hierarchy``'s groups must split it).
            name: Key of the residuals and compressor state (the parameter name).
            step: Step index; seeds shared randomness (random-k's indices, DGC's sample).
            hierarchy: Run two-level over these groups; None: flat over ``transport``.
            out: Where to write the sum (x's shape and dtype; it may be ``x`` itself, as the DDP
                hook passes its bucket: fp16's sum is then decoded straight into it, with no new
                tensor of x's size); None: a new tensor.
            scale: Multiply x by this first, where ``folds_scale`` (the DDP hook's division by the
                world size). PowerSGD folds it into its small factor and keeps its residuals in x's
                units; the other error-feedback compressors compensate ``scale * x`` and keep them
                in its units (those of the averaged gradient, as when the caller divides first).
            parts: ``x`` (1-D) concatenates these (name, shape) tensors, which a compressor with
                ``fuses_named_parts`` compresses part by part on the flat allreduce (``fuses``).
            on_issued: Called once the call's last transport collective is issued (``Codec.on_issued``).

        Calls may overlap (the DDP hook's buckets, each in a Task of its own, one decoding while
        the next compresses) as long as they sync different names: each call holds its state
        changes apart (``compressed_call``) and commits or drops them alone.

        Returns:
            The sum (``out`` when given), the same on every rank.
        """
        if scale != 1.0 and not self.folds_scale(hierarchical=hierarchy is not None):
            raise ValueError(
                f"scale={scale}: {self.compressor.spec()!r} over {self.scheme!r}"
                f"{' two-level' if hierarchy is not None else ''} does not fold a scale (see folds_scale)"
            )
        if parts is not None and not self.fuses(hierarchical=hierarchy is not None):
            raise ValueError(
                f"parts: {self.compressor.spec()!r} over {self.scheme!r}"
                f"{' two-level' if hierarchy is not None else ''} does not sync a concatenation part by part "
                f"(see fuses)"
            )
        codec = Codec(self.compressor, self.server_memory if self.error_feedback else None, parts, on_issued)
        if not (self.error_feedback or self.compressor.keeps_state):
            return await self._run(x, transport, codec, name=name, step=step, hierarchy=hierarchy, out=out, scale=scale)
        keep = False
        with compressed_call():
            self._begin_step()
            try:
                summed = await self._run(
                    x, transport, codec, name=name, step=step, hierarchy=hierarchy, out=out, scale=scale
                )
                # Step 4. host-device sync; the same output, so the same decision, on every rank.
                with transport.timed("finite_check"):
                    keep = bool(all_finite(summed))
            finally:
                self._end_step(keep=keep)
        return summed

    async def _run(
        self,
        x: torch.Tensor,
        transport: Transport,
        codec: Codec,
        *,
        name: str,
        step: int,
        hierarchy: Hierarchy | None,
        out: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Steps 1-3 of ``sync_async``."""
        # Step 1: add the residual (to scale * x, unless the collective folds the scale itself).
        if self.error_feedback:
            if not self._collective_folds(hierarchical=hierarchy is not None):
                x_scale, scale = scale, 1.0
            else:
                x_scale = 1.0
            with transport.timed("error_feedback"):
                compensated = self.worker_memory.compensate(name, x, scale=x_scale)
        else:
            compensated = x
        # Step 2: the registered collective, flat or two-level. A collective that can hand this
        # rank's payloads over as it sends them (allgather) gets the residual computed then.
        kept: list[bool] = []
        if hierarchy is None:
            if self.error_feedback:

                def keep_own(own: Compressed) -> None:
                    with transport.timed("error_feedback"):
                        self._keep_sent(name, compensated, own)
                    kept.append(True)

                codec = dataclasses.replace(codec, keep_own=keep_own)
            summed, own = await self.collective.reduce(
                compensated, transport, codec, name=name, step=step, want_own=self.error_feedback, out=out, scale=scale
            )
        else:
            summed = await two_level(self.collective, codec, compensated, hierarchy, name=name, step=step)
            own = None
            if out is not None:
                summed = out.copy_(summed.view(out.shape))
        # Step 3: the new residual (unless the collective had it computed while on the wire).
        if self.error_feedback and not kept:
            with transport.timed("error_feedback"):
                self._keep_residual(name, compensated, summed, own, transport.world_size * scale)
        return summed

    def _keep_residual(
        self, name: str, compensated: torch.Tensor, summed: torch.Tensor, own: Own, n_scale: float
    ) -> None:
        """Step 3 of ``sync_async``: what compression dropped from ``compensated`` becomes the residual.

        compensate made the compensated tensor for this call: the residual is computed in it.
        """
        if isinstance(own, Compressed):
            self._keep_sent(name, compensated, own)
        elif own is not None:
            self.worker_memory.update(name, compensated, own, consume=True)
        else:
            # Linear (allreduce) schemes cannot separate this rank's share of the result: the residual
            # is then the rank's part of the total loss, compensated - out / n, which sums to it
            # exactly. summed is of scale * compensated, so this rank's share is summed / (n scale).
            self.worker_memory.update(name, compensated, summed, scale=1 / n_scale, consume=True)

    def _keep_sent(self, name: str, compensated: torch.Tensor, own: Compressed) -> None:
        """The residual from this rank's own payloads (the allgather's), in one pass in ``compensated``."""
        self.worker_memory.keep_remainder(name, self.compressor.subtract_transmitted(compensated, own))

    def _begin_step(self) -> None:
        """Hold back the residual updates and compressor state changes of this call (Step 4)."""
        self.worker_memory.begin_step()
        self.server_memory.begin_step()
        self.compressor.begin_step()

    def _end_step(self, *, keep: bool) -> None:
        self.worker_memory.end_step(keep=keep)
        self.server_memory.end_step(keep=keep)
        self.compressor.end_step(keep=keep)


def _resolve_scheme(compressor: Compressor, scheme: str) -> str:
    """``scheme``, with "auto" resolved: allreduce when ``compressor`` allows it, else allgather.

    Raises:
        ValueError: If ``scheme`` is neither a compressed collective nor "auto".
    """
    if scheme == "auto":
        return "allreduce" if compressor.allreduce_compatible else "allgather"
    if scheme not in COMPRESSED_SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not one of {', '.join(COMPRESSED_SCHEMES)} or 'auto'")
    return scheme

"""PowerSGD (Vogels et al., NeurIPS 2019): a rank-r approximation by one warm-started power iteration.

A tensor is viewed as the matrix M of shape (n, m) = (shape[0], numel / shape[0]). With a Q of
shape (m, r) kept per tensor name across steps (warm start), one step of the distributed algorithm
is (PyTorch's ``powerSGD_hook`` is the reference behaviour)::

    1. P = allreduce(M Q)            # (n, r): the first allreduce
    2. P = orthogonalize(P)          # reduced QR: orthonormal columns, stable when P is rank-deficient
    3. Q = allreduce(M^T P)          # (m, r): the second allreduce; kept for the next step
    4. approximation = P Q^T         # of the SUM over ranks of M, reshaped to the tensor's shape

Both allreduces are linear in M, so the result approximates the sum of every rank's M, and it is
exact when that sum has rank <= r. ``allreduce_sync`` runs these four steps; ``compress`` is the
same power iteration on this rank's M alone, with payloads (P, Q) and ``decompress`` = P Q^T.
Tensors that are 1-D, empty, or whose factors are not smaller than the matrix ((n + m) r >= n m)
are sent as they are (payload = the tensor; ``allreduce_sync`` all-reduces it).

The initial Q is drawn from a CPU generator seeded by (seed, name) alone, so every rank starts from
the same Q, then orthogonalized (as in ``powerSGD_hook``); it is drawn again when the tensor's
shape (or dtype, or device) changes. Arithmetic is in float32 (float64 for float64 input); P and Q
travel in the input dtype. PowerSGD is biased: it is meant to run with error feedback.

A non-finite value in M makes P, Q and the approximation non-finite (the whole tensor, for that
step). Q is then not kept: between ``begin_step`` and ``end_step(keep=False)`` (``CompressedSync``
drops a step whose output is non-finite) every Q stored is put back as it was, and outside a step a
non-finite Q is not stored, so a warm start never holds a NaN or infinity.

Example::

    comp = build("powersgd:4")
    approx_sum = await comp.allreduce_sync(grad, transport_all_reduce, name="fc.weight", step=3)  # in a coroutine
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from zensync.compress.base import (
    AllReduce,
    Compressed,
    Compressor,
    Parts,
    all_finite,
    call_key,
    compute_dtype,
    format_spec,
    register_compressor,
    shared_generator,
    to_int,
)

__all__ = ["PowerSGDCompressor"]


class _MatrixPart(NamedTuple):
    """One matrix of a concatenation PowerSGD syncs part by part (``allreduce_sync(parts=...)``)."""

    name: str
    shape: torch.Size
    dims: tuple[int, int]
    matrix: torch.Tensor
    """The (n, m) view of the part in the compute dtype."""
    into: torch.Tensor
    """Its stretch of the output."""


def _orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning at least the columns of ``matrix`` (reduced QR's Q; no NaN for zeros)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


@register_compressor
class PowerSGDCompressor(Compressor):
    """``powersgd:rank``: rank-r factors P (n, r) and Q (m, r) of the (shape[0], -1) matrix view.

    Args:
        rank: r, the rank of the approximation, >= 1 (a spec string such as ``"4"`` is accepted).
        seed: Seed of the initial Q; combined with the tensor name.

    Example::

        comp = PowerSGDCompressor(2)
        comp.payload_bytes(64 * 32, torch.float32, shape=(64, 32))  # (64 + 32) * 2 * 4 = 768
        comp.payload_bytes(100, torch.float32)  # a 1-D tensor is sent as is: 400
    """

    name = "powersgd"
    fuses = False  # it factors each matrix: a concatenation has no matrix shape...
    fuses_named_parts = True  # ...but a bucket's matrices share each round (``parts``)
    allreduce_compatible = True
    needs_error_feedback = True
    keeps_state = True
    folds_scale = True

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        """Hyperparameters of PowerSGD."""

        rank: int
        """r, the rank of the approximation (PyTorch's advice: start from 1, then 2, 4, ...)."""
        seed: int = 0
        """Seed of the initial Q; combined with the tensor name, identical on every rank."""

        def __post_init__(self) -> None:
            if self.rank < 1:
                raise ValueError(f"rank={self.rank} must be >= 1: it is the number of columns of P and Q")

        def build(self) -> PowerSGDCompressor:
            return PowerSGDCompressor(self.rank, seed=self.seed)

    def __init__(self, rank: int | str, *, seed: int | str = 0) -> None:
        self.config = PowerSGDCompressor.Config(rank=to_int("rank", rank), seed=to_int("seed", seed))
        # Warm-start Q (m, r) per tensor name, in the compute dtype, with the tensor shape it belongs to.
        self._q_memory: dict[str, tuple[torch.Size, torch.Tensor]] = {}
        # While a step is open: each name's entry before the step's first store (None: it had none).
        self._q_undo: dict[object | None, dict[str, tuple[torch.Size, torch.Tensor] | None]] = {}
        """Per open call (``call_key``), each Q's value before the call's first store of it."""

    def spec(self) -> str:
        return format_spec(self.name, [self.config.rank], {"seed": self.config.seed} if self.config.seed else {})

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the warm-start Qs."""
        return sum(q.numel() * q.element_size() for _, q in self._q_memory.values())

    def warm_starts(self) -> dict[str, torch.Tensor]:
        """The Q (m, r) kept for each name, in the compute dtype (the tensors themselves: read, do not modify)."""
        return {name: q for name, (_, q) in self._q_memory.items()}

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Every warm-start Q with the tensor shape it belongs to (for checkpoints)."""
        return {name: {"shape": list(shape), "q": q.clone()} for name, (shape, q) in self._q_memory.items()}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Replace every warm-start Q by ``state``'s (``state_dict``'s form)."""
        self.clear()
        for name, entry in state.items():
            self.restore_warm_start(name, torch.Size(entry["shape"]), entry["q"].clone())

    def restore_warm_start(self, name: str, shape: torch.Size, q: torch.Tensor) -> None:
        """Keep ``q`` (m, r) as the warm start of ``name``'s tensors of ``shape`` (a checkpoint's), outside a step."""
        self._q_memory[name] = (torch.Size(shape), q)

    def clear(self) -> None:
        """Forget every warm-start Q (the next step draws the initial ones again)."""
        self._q_memory.clear()
        self._q_undo.clear()

    def begin_step(self) -> None:
        """Record each Q's value before the call's first store, for ``end_step(keep=False)``.

        Per open call (``call_key``): overlapping calls (the DDP hook's buckets) undo each their own.
        """
        key = call_key()
        assert key not in self._q_undo, "begin_step called again before end_step"
        self._q_undo[key] = {}

    def end_step(self, *, keep: bool) -> None:
        """Keep the Qs stored since ``begin_step``, or put back the ones from before it."""
        undo = self._q_undo.pop(call_key(), None)
        if keep or not undo:
            return
        for name, before in undo.items():
            if before is None:
                self._q_memory.pop(name, None)
            else:
                self._q_memory[name] = before

    def _keep_q(self, name: str, shape: torch.Size, q: torch.Tensor) -> None:
        """Store ``q`` as ``name``'s warm start: within a step, undoably; outside one, only if finite."""
        undo = self._q_undo.get(call_key())
        if undo is not None:
            undo.setdefault(name, self._q_memory.get(name))
        elif not bool(all_finite(q)):  # host-device sync, on the small (m, r) Q
            return
        self._q_memory[name] = (shape, q)

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int] | None:
        """(n, m) of the matrix view when a tensor of ``shape`` is compressed, None when it is sent as is."""
        numel = math.prod(shape)
        if len(shape) < 2 or numel == 0:
            return None
        n, m = shape[0], numel // shape[0]
        return (n, m) if (n + m) * self.config.rank < n * m else None

    def initial_q(self, name: str, num_cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The orthogonalized random (num_cols, r) Q of ``name``'s first step, the same on every rank."""
        generator = shared_generator(self.config.seed, name, 0, purpose="powersgd")
        q = torch.randn(num_cols, self.config.rank, generator=generator, dtype=torch.float64)
        return _orthogonalize(q).to(dtype)

    def _warm_q(
        self, name: str, shape: torch.Size, device: torch.device, num_cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The Q kept for ``name``, or its initial one when there is none or the tensor changed
        shape, dtype or device."""
        kept_shape, q = self._q_memory.get(name, (None, None))
        if q is None or kept_shape != shape or q.dtype != dtype or q.device != device:
            q = self.initial_q(name, num_cols, dtype).to(device)
        return q

    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> Compressed:
        dims = self.matrix_shape(x.shape)
        if dims is None:
            return Compressed((x.contiguous(),), x.shape)
        matrix = x.reshape(dims).to(compute_dtype(x.dtype)).contiguous()
        q = self._warm_q(name, x.shape, x.device, dims[1], matrix.dtype)
        p = _orthogonalize(matrix @ q)
        q = matrix.T @ p
        self._keep_q(name, x.shape, q)
        return Compressed((p.to(x.dtype), q.to(x.dtype)), x.shape)

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        if len(compressed.payloads) == 1:
            return compressed.payloads[0]
        p, q = compressed.payloads
        compute = compute_dtype(p.dtype)
        return (p.to(compute) @ q.to(compute).T).to(p.dtype).view(compressed.ctx)

    async def allreduce_sync(
        self,
        x: torch.Tensor,
        all_reduce: AllReduce,
        *,
        name: str = "",
        step: int = 0,
        out: torch.Tensor | None = None,
        scale: float = 1.0,
        parts: Parts | None = None,
    ) -> torch.Tensor:
        """Rank-r approximation of the sum over ranks of ``x`` (steps 1-4 of the module docstring).

        One coroutine for both rounds: the Q allreduce is issued only after the P allreduce and the
        orthogonalization, so every rank issues them in the same order (torch's ``powerSGD_hook``,
        which chains them by callbacks per bucket, does not on gloo with several buckets).

        Args:
            x: This rank's tensor.
            all_reduce: Awaitable sum over ranks of a tensor (awaited twice, on (n, r) then (m, r)
                tensors of x's dtype, or once on ``x`` when it is sent as is).
            name: Key of the warm-start Q (and seed of the initial one).
            step: Unused (the warm start carries the state between steps).
            out: Where to write the result (x's shape and dtype; may be ``x``); None: a new tensor.
            scale: Approximate the sum of ``scale * x``: P is orthonormalized, so only the (m, r)
                factor Q carries the scale (no pass over x).
            parts: ``x`` (1-D) concatenates these (name, shape) tensors: each is approximated as
                when synced alone under its name (the same P, Q, warm start), and the rounds are
                shared: one allreduce of the parts sent as they are, one of every P, one of every Q.

        Returns:
            ``out``, or a new tensor of x's shape and dtype; the same on every rank.
        """
        if parts is not None:
            return await self._fused_sync(x, all_reduce, parts, out, scale)
        dims = self.matrix_shape(x.shape)
        if dims is None:
            summed = await all_reduce(x.contiguous() if scale == 1.0 else x * scale, last=True)
            return summed if out is None or summed is out else out.copy_(summed.view(out.shape))
        matrix = x.reshape(dims).to(compute_dtype(x.dtype)).contiguous()
        q = self._warm_q(name, x.shape, x.device, dims[1], matrix.dtype)
        # Step 1: P = sum over ranks of M Q, sent in the input dtype.
        p = (await all_reduce((matrix @ q).to(x.dtype))).to(matrix.dtype)
        # Step 2: orthonormal columns.
        p = _orthogonalize(p)
        # Step 3: Q = sum over ranks of M^T P; the warm start of the next step.
        local_q = matrix.T @ p
        if scale != 1.0:
            local_q.mul_(scale)
        q = (await all_reduce(local_q.to(x.dtype), last=True)).to(matrix.dtype)
        self._keep_q(name, x.shape, q)
        # Step 4: the rank-r approximation of the summed matrix.
        if out is not None and out.dtype == p.dtype and out.is_contiguous():
            torch.matmul(p, q.T, out=out.view(dims))
            return out
        approx = (p @ q.T).to(x.dtype).view(x.shape)
        return approx if out is None else out.copy_(approx)

    async def _fused_sync(
        self, x: torch.Tensor, all_reduce: AllReduce, parts: Parts, out: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """``allreduce_sync`` of a concatenation: steps 1-4 for every matrix at once, three rounds."""
        sizes = [math.prod(shape) for _, shape in parts]
        if x.dim() != 1 or sum(sizes) != x.numel():
            raise ValueError(
                f"powersgd: parts {[tuple(s) for _, s in parts]} do not make up x of shape {tuple(x.shape)}"
            )
        target = torch.empty_like(x) if out is None else out
        compute, rank = compute_dtype(x.dtype), self.config.rank
        matrices: list[_MatrixPart] = []
        plain: list[tuple[torch.Tensor, torch.Tensor]] = []  # (piece, its output): sent as they are
        for (name, shape), piece, into in zip(parts, x.split(sizes), target.view(-1).split(sizes), strict=True):
            dims = self.matrix_shape(shape)
            if dims is None:
                plain.append((piece, into))
            else:
                matrices.append(_MatrixPart(name, shape, dims, piece.reshape(dims).to(compute), into))
        # The parts sent as they are (biases), in one round; scaled here (they are small).
        if plain:
            summed = await all_reduce(torch.cat([piece for piece, _ in plain]) * scale, last=not matrices)
            for (_, into), part in zip(plain, summed.split([p.numel() for p, _ in plain]), strict=True):
                into.copy_(part)
        if not matrices:
            return target
        # Step 1: every P = M Q in one round.
        qs = [self._warm_q(m.name, m.shape, x.device, m.dims[1], compute) for m in matrices]
        local_p = torch.cat([(m.matrix @ q).reshape(-1) for m, q in zip(matrices, qs, strict=True)])
        p_all = (await all_reduce(local_p.to(x.dtype))).to(compute)
        # Step 2: orthonormal columns, matrix by matrix.
        p_parts = p_all.split([m.dims[0] * rank for m in matrices])
        ps = [_orthogonalize(p.view(m.dims[0], rank)) for p, m in zip(p_parts, matrices, strict=True)]
        # Step 3: every Q = M^T P in one round; the warm starts of the next step.
        local_q = torch.cat([(m.matrix.T @ p).reshape(-1) for m, p in zip(matrices, ps, strict=True)])
        if scale != 1.0:
            local_q.mul_(scale)
        q_all = (await all_reduce(local_q.to(x.dtype), last=True)).to(compute)
        # Step 4: each rank-r approximation into its part of the output.
        q_parts = q_all.split([m.dims[1] * rank for m in matrices])
        for m, p, q in zip(matrices, ps, q_parts, strict=True):
            q = q.view(m.dims[1], rank)
            self._keep_q(m.name, m.shape, q)
            if m.into.dtype == p.dtype:
                torch.matmul(p, q.T, out=m.into.view(m.dims))
            else:
                m.into.copy_((p @ q.T).reshape(-1))
        return target

    def shaped_payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        return self.payload_bytes(math.prod(shape), dtype, shape=shape)

    def payload_bytes(
        self, numel: int, dtype: torch.dtype = torch.float32, *, shape: Sequence[int] | None = None
    ) -> int:
        """Bytes of (P, Q), or of the tensor itself when it is sent as is.

        ``numel`` alone does not give the matrix view: without ``shape`` the tensor is priced as 1-D
        (sent as is), which is exact for 1-D tensors only.

        Raises:
            ValueError: If ``shape`` does not have ``numel`` elements.
        """
        if shape is not None and math.prod(shape) != numel:
            raise ValueError(f"shape={tuple(shape)} has {math.prod(shape)} elements, not numel={numel}")
        dims = self.matrix_shape(shape) if shape is not None else None
        if dims is None:
            return numel * dtype.itemsize
        return (dims[0] + dims[1]) * self.config.rank * dtype.itemsize

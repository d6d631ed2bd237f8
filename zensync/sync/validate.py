"""Agreeing on a ``sparse_allreduce`` call before any data moves, with the protocol of ``zensync.sync.agreement``.

1. Every rank checks its own arguments (``LocalRequest``: dtype, layout, dimensions, scheme,
   granularity) without communicating.
2. All ranks exchange a small fixed-size int64 descriptor of their call (``exchange_and_check``): the
   local error code, scheme, granularity, average, dtype, device type, explicit seed, seed proposal,
   non-zero count and shape.
3. Every rank compares the descriptors the same way: on any local error or mismatch every rank raises
   the same ``ValueError``, naming the first problem.

This is the first collective of every call, so a rank with bad input still takes part in exactly the
collectives its peers expect, and no rank hangs waiting for a peer that gave up. The same exchange
agrees on Zen's hash seed (rank 0's proposal wins at first use of a group; an explicit
``SyncOptions.h0_seed`` wins for its call) and, for ``auto``, carries every rank's non-zero count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from zensync.sync.agreement import agree_group_seed, differing_from_rank0, gather_descriptors_async, propose_seed
from zensync.sync.base import default_granularity
from zensync.transport import Transport
from zensync.types import Granularity

__all__ = [
    "MAX_NDIM",
    "SUPPORTED_DTYPES",
    "Agreement",
    "LocalRequest",
    "exchange_and_check",
    "exchange_and_check_async",
]

MAX_NDIM = 8
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_TABLE = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_GRANULARITIES = ("auto", "element", "row")
_MAGIC = 0x5A454E02  # "ZEN" + descriptor version 2
_LAYOUTS = (torch.strided, torch.sparse_coo)

# Descriptor slots (int64 each).
(
    _F_MAGIC,
    _F_SCHEME,
    _F_GRAN,
    _F_AVG,
    _F_DTYPE,
    _F_DEVICE,
    _F_ERROR,
    _F_NNZ,
    _F_SEED,
    _F_PROPOSAL,
    _F_LAYOUT,
    _F_SPARSE_DIM,
    _F_NDIM,
) = range(13)
_F_SHAPE = 13
_F_PUSH_SEED = _F_SHAPE + MAX_NDIM
"""Seed this rank grouped its push records by before the exchange (-1: not grouped); world_size
per-owner record counts follow it."""
_SIZE = _F_PUSH_SEED + 1

_ERR_OK = 0
_ERRORS = {
    1: "dtype {dtype} is not supported (supported: float16, bfloat16, float32, float64)",
    2: "tensor has layout {layout}; pass a dense (strided) or sparse COO tensor, e.g. tensor.to_sparse_coo()",
    3: "tensor has {ndim} dimensions; at most {max_ndim} are supported",
    4: "scheme {scheme!r} is unknown (valid: {valid})",
    5: "granularity {granularity!r} is unknown (valid: 'auto', 'element', 'row')",
    6: "granularity 'row' needs a tensor with at least 2 dimensions, got shape {shape}",
    7: "argument is a {type_name}, not a torch.Tensor",
    8: "out must be a dense (strided) tensor of the input's shape {shape}, dtype {dtype} and device {device}; "
    "got {got}",
    9: "out shares memory with the input without being it; pass the input itself (in place) or separate memory",
    10: "granularity {granularity!r} does not fit a sparse COO tensor with sparse_dim={sparse_dim} of {ndim} "
    "dimensions: its items are the entries of its sparse dimensions (pass granularity='auto')",
    11: "out= is for dense tensors; a sparse COO input returns a new coalesced COO tensor",
}


@dataclasses.dataclass(kw_only=True, slots=True)
class LocalRequest:
    """One rank's view of the call, checked locally."""

    tensor: torch.Tensor | None
    scheme: str
    granularity: str
    average: bool
    h0_seed: int | None
    valid_schemes: tuple[str, ...]
    out: torch.Tensor | None = None
    error: int = _ERR_OK
    message: str = ""

    def __post_init__(self) -> None:
        self.error, self.message = self._check()

    def _check(self) -> tuple[int, str]:
        tensor = self.tensor
        if not isinstance(tensor, torch.Tensor):
            return 7, _ERRORS[7].format(type_name=type(tensor).__name__)
        if tensor.layout not in _LAYOUTS:
            return 2, _ERRORS[2].format(layout=tensor.layout)
        if tensor.dtype not in SUPPORTED_DTYPES:
            return 1, _ERRORS[1].format(dtype=tensor.dtype)
        if tensor.dim() > MAX_NDIM:
            return 3, _ERRORS[3].format(ndim=tensor.dim(), max_ndim=MAX_NDIM)
        if self.scheme not in self.valid_schemes:
            return 4, _ERRORS[4].format(scheme=self.scheme, valid=", ".join(self.valid_schemes))
        if self.granularity not in _GRANULARITIES:
            return 5, _ERRORS[5].format(granularity=self.granularity)
        if self.granularity == "row" and tensor.dim() < 2:
            return 6, _ERRORS[6].format(shape=tuple(tensor.shape))
        if tensor.layout == torch.sparse_coo:
            return self._check_sparse(tensor)
        return self._check_out(tensor)

    def _check_sparse(self, tensor: torch.Tensor) -> tuple[int, str]:
        """A COO tensor's items are the entries of its sparse dims: rows when sparse_dim is 1."""
        sparse_dim, ndim = tensor.sparse_dim(), tensor.dim()
        fits = {"auto": True, "row": sparse_dim == 1 and ndim >= 2, "element": sparse_dim == ndim}
        if not fits[self.granularity]:
            return 10, _ERRORS[10].format(granularity=self.granularity, sparse_dim=sparse_dim, ndim=ndim)
        if self.out is not None:
            return 11, _ERRORS[11]
        return _ERR_OK, ""

    def _check_out(self, tensor: torch.Tensor) -> tuple[int, str]:
        out = self.out
        if out is None:
            return _ERR_OK, ""
        fits = (
            isinstance(out, torch.Tensor)
            and out.layout == torch.strided
            and (out.shape, out.dtype, out.device) == (tensor.shape, tensor.dtype, tensor.device)
        )
        if not fits:
            got = (
                f"shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}, layout {out.layout}"
                if isinstance(out, torch.Tensor)
                else f"a {type(out).__name__}"
            )
            return 8, _ERRORS[8].format(shape=tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device, got=got)
        same = out.data_ptr() == tensor.data_ptr() and out.stride() == tensor.stride()
        if not same and out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            return 9, _ERRORS[9]
        return _ERR_OK, ""

    @property
    def resolved_granularity(self) -> Granularity:
        """'auto' resolved by shape: rows for 2-D tensors (embedding gradients), elements otherwise."""
        if self.granularity == "row":
            return "row"
        if self.granularity == "element":
            return "element"
        assert self.tensor is not None
        if self.tensor.layout == torch.sparse_coo:
            return "row" if self.tensor.sparse_dim() == 1 and self.tensor.dim() >= 2 else "element"
        return default_granularity(self.tensor)

    def descriptor(self, local_nnz: int, world_size: int, push: tuple[int, list[int]] | None = None) -> list[int]:
        """This rank's call as the fixed-size int64 descriptor every rank all-gathers (-1: unset).

        ``push``: (seed, records per owner) of Zen's push, grouped before the exchange.
        """
        desc = [-1] * (_SIZE + world_size)
        if push is not None:
            desc[_F_PUSH_SEED] = push[0]
            desc[_SIZE:] = push[1]
        desc[_F_MAGIC] = _MAGIC
        desc[_F_ERROR] = self.error
        desc[_F_SCHEME] = self.valid_schemes.index(self.scheme) if self.scheme in self.valid_schemes else -1
        desc[_F_GRAN] = _GRANULARITIES.index(self.granularity) if self.granularity in _GRANULARITIES else -1
        desc[_F_AVG] = int(bool(self.average))
        desc[_F_NNZ] = local_nnz
        desc[_F_SEED] = -1 if self.h0_seed is None else self.h0_seed & (2**62 - 1)
        desc[_F_PROPOSAL] = propose_seed()
        tensor = self.tensor
        if isinstance(tensor, torch.Tensor):
            desc[_F_DTYPE] = _DTYPE_TABLE.index(tensor.dtype) if tensor.dtype in _DTYPE_TABLE else -2
            desc[_F_DEVICE] = 0 if tensor.device.type == "cpu" else 1
            desc[_F_LAYOUT] = _LAYOUTS.index(tensor.layout) if tensor.layout in _LAYOUTS else -2
            desc[_F_SPARSE_DIM] = tensor.sparse_dim() if tensor.layout == torch.sparse_coo else 0
            desc[_F_NDIM] = tensor.dim()
            for i, size in enumerate(tensor.shape[:MAX_NDIM]):
                desc[_F_SHAPE + i] = size
        return desc


@dataclasses.dataclass(frozen=True, slots=True)
class Agreement:
    """What all ranks agreed on."""

    h0_seed: int
    nnz_per_rank: list[int] | None
    push_recv_counts: list[int] | None = None
    """Records every rank's push sends this rank, where every rank grouped its records by the agreed
    seed before the exchange (the push then skips its size exchange)."""


def _dtype_name(index: int) -> str:
    return str(_DTYPE_TABLE[index]) if 0 <= index < len(_DTYPE_TABLE) else "an unknown dtype"


def _describe_mismatch(field: str, values: Sequence[object]) -> str:
    return f"{field} differs across ranks: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _remote_error(code: int, desc: list[int], valid_schemes: Sequence[str]) -> str:
    """A description of another rank's local error from its descriptor alone."""
    dtype = _dtype_name(desc[_F_DTYPE])
    shape = tuple(desc[_F_SHAPE : _F_SHAPE + max(0, min(desc[_F_NDIM], MAX_NDIM))])
    summaries = {
        1: f"dtype {dtype} is not supported (supported: float16, bfloat16, float32, float64)",
        2: "tensor is neither dense (strided) nor sparse COO; pass tensor.to_dense()",
        3: f"tensor has {desc[_F_NDIM]} dimensions; at most {MAX_NDIM} are supported",
        4: f"unknown scheme (valid: {', '.join(valid_schemes)})",
        5: "unknown granularity (valid: 'auto', 'element', 'row')",
        6: f"granularity 'row' needs at least 2 dimensions, got shape {shape}",
        7: "argument is not a torch.Tensor",
        8: "out does not match the input (shape, dtype, device or layout)",
        9: "out overlaps the input without being it",
        10: f"granularity does not fit its sparse COO tensor (sparse_dim {desc[_F_SPARSE_DIM]} of {desc[_F_NDIM]})",
        11: "out= given with a sparse COO input",
    }
    return summaries.get(code, f"error code {code}")


def _first_problem(descs: list[list[int]], valid_schemes: Sequence[str]) -> str | None:
    for rank, desc in enumerate(descs):
        if desc[_F_ERROR] != _ERR_OK:
            return f"rank {rank}: {_remote_error(desc[_F_ERROR], desc, valid_schemes)}"
    checks = (
        ("scheme", _F_SCHEME),
        ("granularity", _F_GRAN),
        ("average", _F_AVG),
        ("dtype", _F_DTYPE),
        ("device type", _F_DEVICE),
        ("layout", _F_LAYOUT),
        ("sparse_dim", _F_SPARSE_DIM),
        ("h0_seed", _F_SEED),
    )
    for name, index in checks:
        values = [d[index] for d in descs]
        if differing_from_rank0(values):
            if name == "dtype":
                return _describe_mismatch(name, [_dtype_name(v) for v in values])
            if name == "layout":
                return _describe_mismatch(name, [str(_LAYOUTS[v]) if v >= 0 else "other" for v in values])
            return _describe_mismatch(name, values)
    shapes = [tuple(d[_F_SHAPE : _F_SHAPE + d[_F_NDIM]]) for d in descs]
    if differing_from_rank0(shapes):
        return _describe_mismatch("shape", shapes)
    return None


def exchange_and_check(
    transport: Transport, request: LocalRequest, local_nnz: int, push: tuple[int, list[int]] | None = None
) -> Agreement:
    """All-gather every rank's descriptor and raise the same ``ValueError`` on every rank on any problem.

    Blocking: ``exchange_and_check_async`` run to completion on this thread.

    Args:
        transport: The group.
        request: This rank's checked arguments (a rank with a local error still calls this).
        local_nnz: This rank's non-zero item count, or -1 when not measured.
        push: (seed, records per owner) of this rank's Zen push, grouped before the call.

    Returns:
        The agreed hash seed, when every rank measured them the per-rank non-zero counts, and when
        every rank grouped its push by the agreed seed the records this rank will receive.
    """
    return transport.run(exchange_and_check_async(transport, request, local_nnz, push))


async def exchange_and_check_async(
    transport: Transport, request: LocalRequest, local_nnz: int, push: tuple[int, list[int]] | None = None
) -> Agreement:
    """``exchange_and_check`` as a coroutine of non-blocking collectives (same arguments, result, errors)."""
    tensor = request.tensor
    # Every rank's exchange on the same device type, a rank with a local error included (on NCCL a
    # CPU descriptor would fail on that rank alone and leave the others waiting for it).
    control = transport.control_device
    device = control
    if isinstance(tensor, torch.Tensor) and (request.error == _ERR_OK or tensor.device.type == control.type):
        device = tensor.device
    # Step 2: the descriptor exchange (the first collective of the call).
    desc = request.descriptor(local_nnz, transport.world_size, push)
    descs = await gather_descriptors_async(transport, desc, phase="validate", device=device)
    # Step 3: the same checks, hence the same outcome, on every rank.
    if any(d[_F_MAGIC] != _MAGIC for d in descs):
        raise ValueError(
            "zensync descriptor exchange failed: another rank is running a different zensync version or "
            "a different collective at this point"
        )
    problem = _first_problem(descs, request.valid_schemes)
    if problem is not None:
        own = f" (this rank, {transport.rank}: {request.message})" if request.error != _ERR_OK else ""
        raise ValueError(f"zensync.sparse_allreduce: invalid call: {problem}{own}")
    group_seed = agree_group_seed(transport, descs[0][_F_PROPOSAL])  # kept from the group's first call
    seed = descs[0][_F_SEED] if descs[0][_F_SEED] >= 0 else group_seed
    nnz = [d[_F_NNZ] for d in descs]
    grouped = all(d[_F_PUSH_SEED] == seed for d in descs)  # the same on every rank
    recv = [d[_SIZE + transport.rank] for d in descs] if grouped else None
    return Agreement(h0_seed=seed, nnz_per_rank=nnz if min(nnz) >= 0 else None, push_recv_counts=recv)

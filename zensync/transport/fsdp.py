"""FSDP2's reduce-scatter, handed to zensync: what each call carries, and the comm object FSDP calls.

``fully_shard`` reduce-scatters each module's gradients as one flat tensor (``foreach_reduce``):
every gradient is padded to a multiple of n rows, cut into n row blocks, and the input holds, for
owner j = 0..n-1 in turn, block j of every gradient back to back (``chunk_cat``); rank j receives the
sum of its row ``input.view(n, S)[j]``. ``FSDPModule.set_custom_reduce_scatter`` replaces the
collective by a ``ReduceScatter`` object; this module provides one (``ZenReduceScatter``) that hands
each call to a Python handler with:

- the call's layout (``Segment``: each parameter's fully-qualified name, offset and size in a row of
  S elements, and its rows per owner when FSDP shards it by rows, ``Shard(0)``);
- the transport of FSDP's group (``transport_for_group``: the user's group and timeout);
- the factor the op asks for (``reduce_op_scale``: SUM 1, AVG 1 / n, PREMUL_SUM its factor),
  applied by the handler to the summed output.

Which parameters a call carries: FSDP leaves out a parameter without a gradient unless the module
reduce-scatters unused parameters (zeros), which ``install`` turns on, so every call of a module
carries all its trainable parameters in order and the layout is fixed; a call of another size is
refused (``layout_for``).

FSDP2 exposes neither the layout nor the group's parameters: ``FSDPGroup`` reads them from FSDP's
private state (``_get_fsdp_state()._fsdp_param_groups``, each ``FSDPParam``'s ``_param_fqn``,
``padded_sharded_param_size``, ``fsdp_placement``, ``_orig_size``) of torch 2.13; nothing else here
touches FSDP's internals.

Only this package imports torch.distributed; ``zensync.hooks.fsdp`` decides what each segment takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from zensync.transport.base import Transport
from zensync.transport.torch_dist import transport_for_group

__all__ = [
    "FSDPGroup",
    "ReduceScatterCall",
    "Segment",
    "ZenReduceScatter",
    "broadcast_shards",
    "fsdp_groups",
    "gather_objects",
    "gather_segments",
    "local_shard",
    "reduce_op_scale",
    "replicate_group",
    "scatter_segments",
    "sharded_like",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """One parameter's part of a rank's row of the reduce-scatter input."""

    name: str
    """Fully-qualified parameter name (from the root module)."""
    offset: int
    """First element in the row of S elements."""
    numel: int
    """Elements per owner (the padded shard's)."""
    rows: int
    """Rows per owner when FSDP shards the parameter by rows (``Shard(0)``); 0 otherwise."""
    shape: tuple[int, ...]
    """The parameter's (unsharded, unpadded) shape."""

    @property
    def width(self) -> int:
        """Elements per row (``rows`` > 0)."""
        return self.numel // self.rows if self.rows else 0


@dataclasses.dataclass(frozen=True, slots=True)
class ReduceScatterCall:
    """One reduce-scatter FSDP asked for, as the handler gets it."""

    module: str
    """The FSDP module's fully-qualified name ("" for the root)."""
    segments: tuple[Segment, ...]
    input: torch.Tensor
    """(n, S): row j is this rank's contribution to owner j's shard."""
    output: torch.Tensor
    """(S,): this rank's shard of the sum times ``scale``, to be written by the handler."""
    transport: Transport
    scale: float


Handler = Callable[[ReduceScatterCall], None]


def gather_segments(t: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """``segments``' elements of the last dimension of ``t`` (a row (S,) or the input (n, S)), back to
    back: ``t`` itself (no copy) when they are all of it."""
    if sum(s.numel for s in segments) == t.shape[-1]:
        return t
    return torch.cat([t[..., s.offset : s.offset + s.numel] for s in segments], -1)


def scatter_segments(flat: torch.Tensor, out: torch.Tensor, segments: list[Segment]) -> None:
    """``gather_segments``' inverse on a row: ``flat``'s pieces copied to their segments of ``out`` (S,)."""
    offset = 0
    for s in segments:
        out[s.offset : s.offset + s.numel].copy_(flat[offset : offset + s.numel])
        offset += s.numel


def reduce_op_scale(op: Any, world_size: int) -> float:
    """The factor a reduce op applies to the plain sum: SUM 1, AVG 1 / n, PREMUL_SUM(f) f.

    Raises:
        ValueError: For any other op (MAX, PRODUCT, ...: not a gradient reduction).
    """
    kind = getattr(op, "op", op)  # a ReduceOp object carries its type; RedOpType is the type itself
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.AVG:
        return 1.0 / world_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        return float(op.factor)
    raise ValueError(f"zensync's FSDP reduce-scatter sums gradients; FSDP asked for op {op!r} (SUM, AVG, PREMUL_SUM)")


class FSDPGroup:
    """One FSDP module's parameter group: its layout and the group it reduce-scatters over."""

    def __init__(self, name: str, module: FSDPModule, names: dict[int, str] | None = None) -> None:
        self.name, self.module = name, module
        self._names = names or {}
        """Parameter object id -> fully-qualified name from the root (FSDP's own is set at its lazy init)."""
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) != 1:
            raise ValueError(
                f"FSDP module {name or '<root>'!r} has {len(groups)} parameter groups (a per-parameter mesh from "
                f"shard_placement_fn); FSDP takes a custom reduce-scatter only with one"
            )
        self._group = groups[0]

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group FSDP reduce-scatters over (the shard dimension of the mesh)."""
        mesh_info: Any = self._group.mesh_info  # FSDPMeshInfo: a module that shards holds one
        return mesh_info.shard_process_group

    @property
    def native_replicas(self) -> bool:
        """Whether FSDP itself all-reduces over replicas (``fully_shard`` on a 2-D mesh: native HSDP)."""
        return hasattr(self._group.mesh_info, "replicate_process_group")

    @property
    def divide_factor(self) -> float | None:
        """The user's ``set_gradient_divide_factor`` (None: FSDP averages over its group)."""
        return self._group.gradient_divide_factor

    def layout(self) -> tuple[Segment, ...]:
        """The trainable parameters' segments, in FSDP's order, named from the root."""
        segments, offset = [], 0
        for param in self._group.fsdp_params:
            if not param.sharded_param.requires_grad:
                continue
            numel = param.padded_sharded_param_size.numel()
            by_rows = param.fsdp_placement.dim == 0 and len(param.padded_sharded_param_size) >= 1
            rows = param.padded_sharded_param_size[0] if by_rows and numel else 0
            name = self._names.get(id(param.sharded_param)) or param._param_fqn or param._module_info.param_name
            segments.append(Segment(name, offset, numel, rows, tuple(param._orig_size)))
            offset += numel
        return tuple(segments)

    def install(self, handler: Handler) -> None:
        """Route this module's reduce-scatters to ``handler``; every trainable parameter in every call."""
        self.module.set_reduce_scatter_unused_params(True, recurse=False)
        self.module.set_custom_reduce_scatter(ZenReduceScatter(self, handler))


def replicate_group(mesh: Any, shard_group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """The replicate group of a 2-D (replicate, shard) mesh whose shard dimension is FSDP's group;
    None for a 1-D mesh that is FSDP's group (no replicas), or for no mesh.

    Raises:
        ValueError: If the mesh has more than 2 dimensions, or its shard dimension (the last, or the
            one named "shard") is not the group the model was sharded over.
    """
    if mesh is None:
        return None
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim not in (1, 2):
        raise ValueError(f"mesh has {mesh.ndim} dimensions; zensync.register_fsdp takes (shard,) or (replicate, shard)")
    shard_dim = names.index("shard") if "shard" in names else mesh.ndim - 1
    shard_ranks = dist.get_process_group_ranks(mesh.get_group(shard_dim))
    if shard_ranks != dist.get_process_group_ranks(shard_group):
        raise ValueError(
            f"mesh's shard dimension holds ranks {shard_ranks}, and the model was sharded over "
            f"{dist.get_process_group_ranks(shard_group)}: fully_shard the model on mesh['shard'] (a 1-D mesh) "
            f"and pass the 2-D mesh to zensync.register_fsdp, which syncs the replicas"
        )
    return None if mesh.ndim == 1 else mesh.get_group(1 - shard_dim)


def broadcast_shards(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Every replica's parameter shards set to those of the group's first rank (replicas start equal)."""
    transport = transport_for_group(group)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(transport.broadcast(local.contiguous(), 0))


def sharded_like(chunk: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``chunk``'s first elements as this rank's shard of a DTensor shaped and sharded like ``param``
    (an FSDP parameter, ``Shard(0)``: its local rows back to back, the padding after them)."""
    if not isinstance(param, DTensor):
        raise ValueError(f"expected an FSDP parameter (a DTensor), got {type(param).__name__}")
    local = param.to_local()
    return DTensor.from_local(
        chunk[: local.numel()].reshape(local.shape).clone(),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def local_shard(tensor: Any) -> torch.Tensor:
    """This rank's part of a DTensor (what ``sharded_like`` made, after DCP filled it in).

    Raises:
        ValueError: If ``tensor`` is not a DTensor.
    """
    if not isinstance(tensor, DTensor):
        raise ValueError(f"expected a DTensor, got {type(tensor).__name__}")
    return tensor.to_local()


def gather_objects(group: dist.ProcessGroup, obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (checkpoints' small metadata)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def fsdp_groups(model: torch.nn.Module) -> list[FSDPGroup]:
    """Every FSDP module of ``model`` (itself included) that holds parameters, with its name."""
    found = []
    names = {id(p): n for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_groups:
            found.append(FSDPGroup(name, module, names))
    return found


class ZenReduceScatter(ReduceScatter):
    """The ``ReduceScatter`` FSDP calls: checks the call against the module's layout, then runs ``handler``."""

    def __init__(self, group: FSDPGroup, handler: Handler) -> None:
        self._group, self._handler = group, handler
        self._layout: tuple[Segment, ...] | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def layout_for(self, numel: int, world_size: int) -> tuple[Segment, ...]:
        """The layout of a call of ``numel`` input elements (fixed after the first call).

        Raises:
            ValueError: If the call carries another number of elements than the layout's.
        """
        if self._layout is None:
            self._layout = self._group.layout()
        expected = world_size * sum(s.numel for s in self._layout)
        if numel != expected:
            raise ValueError(
                f"FSDP module {self._group.name or '<root>'!r} reduce-scatters {numel} elements, and its "
                f"trainable parameters {[s.name for s in self._layout]} make {expected}: zensync needs every "
                f"trainable parameter in every call (set_reduce_scatter_unused_params(True), set by "
                f"zensync.register_fsdp; did requires_grad change after registration?)"
            )
        return self._layout

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        transport = transport_for_group(group)
        n = transport.world_size
        segments = self.layout_for(input_tensor.numel(), n)
        call = ReduceScatterCall(
            module=self._group.name,
            segments=segments,
            input=input_tensor.view(n, -1),
            output=output_tensor,
            transport=transport,
            scale=reduce_op_scale(op, n),
        )
        self._handler(call)
        return None  # done: FSDP waits on nothing (async_op is not used by FSDP's caller)

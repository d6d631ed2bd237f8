"""A DTensor (FSDP2's sharded parameters, their optimizer states) as this rank's plain shard and a JSON
layout, and back on the same mesh: what zensync's in-memory checkpoints store (``resilience.memory``)
and how their change tracker follows a shard (``resilience.dirty``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["from_layout", "is_dtensor", "layout_of", "local_of", "meshes_of"]


def is_dtensor(t: Any) -> bool:
    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a new view at each call, on the same memory), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def layout_of(t: torch.Tensor) -> dict[str, Any]:
    """A DTensor's layout as JSON: placements, global shape and stride, its mesh's shape and dimension names.

    Raises:
        ValueError: For a placement other than Shard and Replicate (a partial sum has no value of its own).
    """
    assert isinstance(t, DTensor)
    placements: list[list[Any]] = []
    for p in t.placements:
        if isinstance(p, Shard):
            placements.append(["shard", p.dim])
        elif isinstance(p, Replicate):
            placements.append(["replicate"])
        else:
            raise ValueError(f"a DTensor of placements {t.placements} is not stored (only Shard and Replicate)")
    return {"placements": placements, "shape": list(t.shape), "stride": list(t.stride()),
            "mesh": list(t.device_mesh.shape), "dims": list(t.device_mesh.mesh_dim_names or ())}  # fmt: skip


def meshes_of(tensors: Iterable[torch.Tensor]) -> list[Any]:
    """The distinct device meshes of the DTensors among ``tensors``, in order."""
    found: list[Any] = []
    for t in tensors:
        if isinstance(t, DTensor) and all(t.device_mesh is not m for m in found):
            found.append(t.device_mesh)
    return found


def from_layout(local: torch.Tensor, layout: dict[str, Any], meshes: list[Any], where: str) -> torch.Tensor:
    """The DTensor of ``local`` (this rank's shard) with ``layout`` (``layout_of``'s), on the mesh of
    ``meshes`` with its shape and dimension names.

    Raises:
        ValueError: Naming ``where``, when no mesh of ``meshes`` has that shape and those names.
    """
    wanted = [layout["mesh"], layout["dims"]]
    mesh = next((m for m in meshes if [list(m.shape), list(m.mesh_dim_names or ())] == wanted), None)
    if mesh is None:
        raise ValueError(
            f"{where} was saved as a DTensor on a mesh of shape {layout['mesh']} (dims {layout['dims']}), and no "
            f"DTensor here lies on one ({[list(m.shape) for m in meshes]}): in-memory checkpoints restore on "
            f"the layout they were saved on"
        )
    placements = [Shard(p[1]) if p[0] == "shard" else Replicate() for p in layout["placements"]]
    shape, stride = torch.Size(layout["shape"]), tuple(layout["stride"])
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

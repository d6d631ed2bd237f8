"""Flat per-rank tensor states through torch.distributed.checkpoint (the disk fallback of
``zensync.resilience``): each rank saves and loads its own keys, ``"rank<r>/..."``, collectively.

A load needs no template: each rank's keys, shapes and dtypes come from the checkpoint's metadata.
"""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zensync.transport.torch_dist import TorchTransport

__all__ = ["METADATA", "dcp_load_rank", "dcp_rank_files", "dcp_save_rank", "dcp_steps"]

METADATA = ".metadata"
_METADATA = METADATA


def _group(transport: TorchTransport) -> dist.ProcessGroup | None:
    return transport.group


def dcp_save_rank(path: str | pathlib.Path, tensors: dict[str, torch.Tensor], transport: TorchTransport) -> None:
    """Save this rank's ``tensors`` under ``rank<r>/`` at ``path`` (a collective of ``transport``'s ranks).

    The checkpoint is complete once its ``.metadata`` exists (DCP writes it last, on the coordinator).
    """
    prefix = f"rank{transport.rank}/"
    dcp.save({prefix + key: t.detach().cpu().contiguous() for key, t in tensors.items()},
             checkpoint_id=str(path), process_group=_group(transport))  # fmt: skip


def dcp_load_rank(
    path: str | pathlib.Path, transport: TorchTransport | None, rank: int | None = None
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors (default: ``transport``'s rank) of a checkpoint ``dcp_save_rank`` wrote:
    a collective of ``transport``'s ranks, or, with ``transport`` None, one process alone (DCP's
    ``no_dist``: the rank's files copied from remote storage, say).

    Raises:
        FileNotFoundError: If ``path`` holds no complete checkpoint, or none of the rank's keys.
    """
    if not (pathlib.Path(path) / _METADATA).is_file():
        raise FileNotFoundError(f"{path} holds no complete torch.distributed.checkpoint (no {_METADATA})")
    rank = transport.rank if transport is not None else rank
    if rank is None:
        raise ValueError("dcp_load_rank without a transport needs rank=")
    prefix = f"rank{rank}/"
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    template = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not template:
        raise FileNotFoundError(f"{path} has no tensors of rank {rank} (a checkpoint of another world?)")
    if transport is None:
        dcp.load(template, checkpoint_id=str(path), no_dist=True)
    else:
        dcp.load(template, checkpoint_id=str(path), process_group=_group(transport))
    return {key.removeprefix(prefix): t for key, t in template.items()}


def dcp_rank_files(path: str | pathlib.Path, rank: int) -> list[str]:
    """The data files (relative to ``path``) holding rank ``rank``'s tensors, besides ``.metadata``."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefix = f"rank{rank}/"
    return sorted({info.relative_path for index, info in (metadata.storage_data or {}).items()
                   if index.fqn.startswith(prefix)})  # fmt: skip


def dcp_steps(directory: str | pathlib.Path) -> list[int]:
    """The steps of the complete checkpoints ``step<k>`` under ``directory``, oldest first."""
    base = pathlib.Path(directory)
    if not base.is_dir():
        return []
    return sorted(int(p.name[4:]) for p in base.glob("step*") if p.name[4:].isdigit() and (p / _METADATA).is_file())

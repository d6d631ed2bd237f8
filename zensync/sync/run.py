"""Running one scheme on arguments every rank already agreed on (no descriptor exchange).

``zensync.sparse_allreduce`` validates first and then calls ``run_agreed``. Callers that have
established agreement another way (the DDP hook checks the model and options once at registration
and all-gathers the densities every step) call it directly and save a collective per tensor.
"""

from __future__ import annotations

import torch

from zensync.sync.base import ItemView, SyncContext, SyncOptions, scheme_registry
from zensync.transport import TrafficLog, Transport
from zensync.types import SyncStats

__all__ = ["run_agreed"]


def run_agreed(
    view: ItemView,
    transport: Transport,
    *,
    scheme: str,
    options: SyncOptions,
    h0_seed: int,
    stats: SyncStats,
    nnz_per_rank: list[int] | None = None,
) -> torch.Tensor:
    """The sum over ranks of ``view`` with ``scheme``, as a (num_items, item_numel) tensor.

    Every rank must pass the same scheme, shapes, dtype, options and seed: nothing is checked here.
    Traffic already recorded in ``stats.phases`` (e.g. a validation exchange) is kept.
    """
    stats.requested_scheme = scheme
    stats.scheme = scheme
    stats.rank = transport.rank
    stats.world_size = transport.world_size
    stats.numel = view.x2d.numel()
    stats.granularity = view.granularity
    stats.num_items = view.num_items
    stats.item_numel = view.item_numel
    log = TrafficLog()
    log.phases = stats.phases
    with transport.recording(log), torch.no_grad():
        if view.x2d.numel() == 0:
            result = view.x2d.clone()
        else:
            ctx = SyncContext(
                transport=transport,
                view=view,
                stats=stats,
                options=options,
                h0_seed=h0_seed,
                nnz_per_rank=nnz_per_rank,
            )
            result = scheme_registry()[scheme]().run(ctx)
    stats.density = stats.local_nnz / stats.num_items if stats.num_items else 0.0
    return result

"""Running one scheme on arguments every rank already agreed on (no descriptor exchange).

``zensync.sparse_allreduce`` validates first and then calls ``run_agreed``. Callers that have
established agreement another way (the DDP hook checks the model and options once at registration
and all-gathers the densities every step) call it directly and save a collective per tensor; the
hook awaits ``run_agreed_async`` in the coroutine it runs on its ``Lane``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zensync.sync.base import ItemView, SyncContext, SyncOptions, for_scheme, get_scheme
from zensync.transport import TrafficLog, Transport
from zensync.types import SyncStats

if TYPE_CHECKING:
    from zensync.sync.zen import PreparedPush

__all__ = ["run_agreed", "run_agreed_async"]


def run_agreed(
    view: ItemView,
    transport: Transport,
    *,
    scheme: str,
    options: SyncOptions,
    h0_seed: int,
    stats: SyncStats,
    nnz_per_rank: list[int] | None = None,
    out: torch.Tensor | None = None,
    items: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    sparse_out: bool = False,
    divisor: int = 1,
    push: PreparedPush | None = None,
) -> torch.Tensor:
    """The sum over ranks of ``view`` with ``scheme``, as a (num_items, item_numel) tensor (blocking).

    ``run_agreed_async`` driven to completion on this thread; see it for the contract.
    """
    coro = run_agreed_async(
        view,
        transport,
        scheme=scheme,
        options=options,
        h0_seed=h0_seed,
        stats=stats,
        nnz_per_rank=nnz_per_rank,
        out=out,
        items=items,
        values=values,
        sparse_out=sparse_out,
        divisor=divisor,
        push=push,
    )
    with torch.no_grad():
        return transport.run(coro)


async def run_agreed_async(
    view: ItemView,
    transport: Transport,
    *,
    scheme: str,
    options: SyncOptions,
    h0_seed: int,
    stats: SyncStats,
    nnz_per_rank: list[int] | None = None,
    out: torch.Tensor | None = None,
    items: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    sparse_out: bool = False,
    divisor: int = 1,
    push: PreparedPush | None = None,
) -> torch.Tensor:
    """The sum over ranks of ``view`` with ``scheme``, as a (num_items, item_numel) tensor.

    A coroutine of the transport's non-blocking collectives: await it, drive it with
    ``transport.run`` (what ``run_agreed`` does) or with a ``Task`` on a ``Lane``. Every rank must
    pass the same scheme, shapes, dtype, options and seed: nothing is checked here. Traffic already
    recorded in ``stats.phases`` (e.g. a validation exchange) is kept.

    The input is detached rather than run under ``torch.no_grad()``: grad mode is per thread, and
    the coroutine's segments may run on different threads.

    Args:
        view: This rank's tensor as items (``zensync.sync.base.item_view``).
        transport: The group.
        scheme: A registered scheme name (``zensync.sync.SCHEMES``).
        options: Scheme tunables, identical on every rank.
        h0_seed: Zen's agreed hash seed (``zensync.sync.agreement``).
        stats: Filled with what the call observed and moved.
        nnz_per_rank: Every rank's non-zero item count, when measured before (``auto`` needs it).
        out: Where the sum goes: a contiguous tensor of ``view.x2d``'s shape, dtype and device,
            either ``view.x2d``'s own memory (in place: Zen and AGsparse then write only the
            union's items, no pass over the whole tensor) or memory that does not overlap it.
        items: Ascending unique int64 ids of a superset of this rank's non-zero items, known
            without a scan (``SyncContext.items``); schemes that scan ignore it.
        values: The rows of ``items`` when ``view.x2d`` holds no data (a COO input: ``view.x2d``
            is then a stride-0 zero view of the right shape, never read).
        sparse_out: Return a coalesced sparse COO tensor (sparse_dim 1) instead of a dense one
            (``out`` must be None).
        push: Zen's push grouped before the call's agreement, with the counts it carried
            (``zensync.sync.zen.PreparedPush``); used when its seed and partition match.
        divisor: Divide each rank's values by this before summing (DDP's averaging, as DDP's
            own ``x / n``): Zen divides its records alone; other schemes get a divided dense copy.

    Returns:
        The sum (of the divided values) in the input dtype, identical on every rank: ``out``
        when given, a sparse COO tensor with ``sparse_out``, else a new tensor.

    Raises:
        ValueError: ``out`` does not fit ``view`` (shape, dtype, device, contiguity, overlap).
    """
    out_is_input = _check_out(out, view.x2d)
    _record_call(stats, view, transport, scheme)
    if view.x2d.requires_grad:
        view = ItemView(x2d=view.x2d.detach(), granularity=view.granularity)
    log = TrafficLog()
    log.phases = stats.phases
    with transport.recording(log):
        if view.x2d.numel() == 0:
            result = view.x2d.clone() if out is None else out
            if sparse_out:
                result = result.to_sparse(1).coalesce()
        else:
            ctx = SyncContext(
                transport=transport,
                view=view,
                stats=stats,
                options=options,
                h0_seed=h0_seed,
                nnz_per_rank=nnz_per_rank,
                out=out,
                out_is_input=out_is_input,
                items=items,
                values=values,
                sparse_out=sparse_out,
                divisor=divisor,
                push=push,
            )
            runner = get_scheme(scheme)
            result = await runner.run(for_scheme(ctx, runner))
            if sparse_out and not result.is_sparse:
                result = result.to_sparse(1).coalesce()
            if out is not None and result is not out:  # a scheme that builds its sum apart
                out.copy_(result)
                result = out
    stats.density = stats.local_nnz / stats.num_items if stats.num_items else 0.0
    return result


def _check_out(out: torch.Tensor | None, x2d: torch.Tensor) -> bool:
    """Whether ``out`` is ``x2d``'s own memory; ValueError when it does not fit (see ``run_agreed_async``)."""
    if out is None:
        return False
    if out.shape != x2d.shape or out.dtype != x2d.dtype or out.device != x2d.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous tensor of shape {tuple(x2d.shape)}, dtype {x2d.dtype} and device "
            f"{x2d.device}; got shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}"
            f"{'' if out.is_contiguous() else ', not contiguous'}"
        )
    if out.data_ptr() == x2d.data_ptr():
        return True
    if _shares_memory(out, x2d):
        raise ValueError("out overlaps the input without being it: pass the input itself or separate memory")
    return False


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of two contiguous tensors intersect."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end, b_end = a_start + a.numel() * a.element_size(), b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end and a.numel() > 0 and b.numel() > 0


def _record_call(stats: SyncStats, view: ItemView, transport: Transport, scheme: str) -> None:
    """What the call is, into ``stats`` (before the scheme adds what it observes)."""
    stats.requested_scheme = scheme
    stats.scheme = scheme
    stats.rank = transport.rank
    stats.world_size = transport.world_size
    stats.numel = view.x2d.numel()
    stats.granularity = view.granularity
    stats.num_items = view.num_items
    stats.item_numel = view.item_numel

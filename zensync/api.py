"""``sparse_allreduce``: the user-facing entry point of the sparse sync engine."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Literal

import torch

from zensync import kernels
from zensync.sync import SCHEMES, SyncOptions
from zensync.sync.agreement import group_seed
from zensync.sync.base import ItemView, item_view
from zensync.sync.coo import CooItems
from zensync.sync.partition import make_partition
from zensync.sync.run import run_agreed
from zensync.sync.validate import LocalRequest, exchange_and_check
from zensync.sync.zen import PreparedPush, bucket_records
from zensync.transport import TrafficLog, Transport, resolve
from zensync.types import SyncStats

__all__ = ["sparse_allreduce"]


_SEED_MASK = 2**62 - 1
"""Seeds travel masked to 62 bits in the call descriptor (``zensync.sync.validate``)."""


def _early_push(
    view: ItemView, coo: CooItems | None, scheme: str, options: SyncOptions, transport: Transport, stats: SyncStats
) -> PreparedPush | None:
    """Zen's Step 1.1 before the agreement, where the hash seed is known already (given, or the
    group's from its first call): the exchange then carries the per-owner counts and the push skips
    its size exchange, one collective fewer. None otherwise (the push exchanges sizes)."""
    if scheme not in ("zen", "sparse_ps"):
        return None
    seed = options.h0_seed if options.h0_seed is not None else group_seed(transport)
    if seed is None:
        return None
    seed &= _SEED_MASK
    start = time.perf_counter()
    hashed = scheme == "zen"
    part = make_partition(view.num_items, transport.world_size, seed=seed, hashed=hashed)
    items, values = (None, None) if coo is None else (coo.items, coo.values)
    push = bucket_records(view.x2d, part, items, values, 1, seed=seed, hashed=hashed)
    stats.phase_time_s["push"] = time.perf_counter() - start
    return push


def sparse_allreduce(
    tensor: torch.Tensor,
    group: Any = None,
    *,
    scheme: str = "zen",
    average: bool = False,
    granularity: Literal["auto", "element", "row"] = "auto",
    stats: SyncStats | None = None,
    options: SyncOptions | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all ranks of ``group``, moving only its non-zeros.

    Lossless for every scheme: the result equals ``torch.distributed.all_reduce`` of the dense tensor
    up to floating-point summation order, is identical on every rank, and NaN/Inf propagate as in
    all_reduce (NaN counts as non-zero, -0.0 as zero). The input is not modified, unless it is ``out``.

    Args:
        tensor: A float16/bfloat16/float32/float64 tensor, the same shape, dtype and layout on
            every rank: dense (non-contiguous tensors are copied) or sparse COO (coalesced or not,
            e.g. the gradient of ``nn.Embedding(sparse=True)``; its items are the entries of its
            sparse dims, rows when ``sparse_dim()`` is 1, and no scan runs: the indices are its
            non-zero items). Other sparse layouts are rejected.
        group: A torch.distributed ProcessGroup (None: the default group), or a zensync
            ``Transport`` such as a ``SimulatedWorld`` rank.
        scheme: "zen" (balanced parallelism, hash-bitmap pull), "dense", "agsparse", "sparcml",
            "sparse_ps", "omnireduce", or "auto" (lowest predicted time).
        average: Divide the sum by the group size.
        granularity: "row" treats dim-0 slices as items (embedding gradients), "element" single
            elements; "auto" picks rows for 2-D tensors.
        stats: A ``SyncStats`` to fill with what the call observed and moved.
        options: Scheme tunables (``SyncOptions``); identical on every rank.
        out: Where to write the result (same shape, dtype and device as ``tensor``), or None for a
            new tensor. It may be ``tensor`` itself: a contiguous input is then summed in place,
            and "zen" and "agsparse" write only the items some rank has non-zero (the others are
            zero already), with no pass over the whole tensor; the other schemes copy their sum in.
            A separate ``out`` is zero-filled first. Memory shared with the input in any other way
            is refused.

    Returns:
        ``out`` when given, else a new tensor with the shape, dtype and device of ``tensor``. For
        a sparse COO input: a new coalesced COO tensor with the input's shape and sparse dims,
        holding the union of the ranks' non-zero entries (exactly-zero entries of an input are
        dropped; a sum that cancels to zero is kept), identical on every rank.

    Raises:
        ValueError: On every rank, when any rank passes an unsupported or mismatched argument
            (dtype, shape, layout, scheme, granularity, average, seed, an ``out`` that does not
            fit); raised locally when this process is not a member of ``group``.

    Example::

        out = zensync.sparse_allreduce(embedding.weight.grad, scheme="zen", average=True)
    """
    transport = resolve(group)
    options = options if options is not None else SyncOptions()
    stats = stats if stats is not None else SyncStats()
    stats.phases, stats.phase_time_s = {}, {}
    log = TrafficLog()
    log.phases = stats.phases
    with transport.recording(log), torch.no_grad():
        request = LocalRequest(
            tensor=tensor,
            scheme=scheme,
            granularity=granularity,
            average=average,
            h0_seed=options.h0_seed,
            valid_schemes=SCHEMES,
            out=out,
        )
        coo = CooItems.of(tensor) if request.error == 0 and tensor.layout == torch.sparse_coo else None
        view = None
        if coo is not None:
            view = coo.view
        elif request.error == 0:
            view = item_view(tensor.detach(), request.resolved_granularity)
        local_nnz = -1
        if view is not None and scheme == "auto":
            local_nnz = kernels.nonzero_items(view.x2d if coo is None else coo.values).numel()
        push = _early_push(view, coo, scheme, options, transport, stats) if view is not None else None
        agreement = exchange_and_check(
            transport, request, local_nnz, None if push is None else (push.seed, push.counts)
        )
    assert view is not None  # a local error raised in exchange_and_check on every rank
    if push is not None and agreement.push_recv_counts is not None:
        push = dataclasses.replace(push, recv_counts=agreement.push_recv_counts)
    agreed = functools.partial(
        run_agreed,
        view,
        transport,
        scheme=scheme,
        options=options,
        h0_seed=agreement.h0_seed,
        stats=stats,
        nnz_per_rank=agreement.nnz_per_rank,
        push=push,
    )
    if coo is not None:
        with torch.no_grad():
            summed = agreed(items=coo.items, values=coo.values, sparse_out=True)
            return coo.restore(summed, transport.world_size if average else 1)
    # A contiguous out takes the sum directly (in place when it is the input); another is copied into.
    target = out.detach().view(view.x2d.shape) if out is not None and out.is_contiguous() else None
    with torch.no_grad():
        result = agreed(out=target).view(tensor.shape)
        if out is None:
            return result / transport.world_size if average else result
        if target is None:
            out.copy_(result)
        if average:
            out.div_(transport.world_size)
    return out

"""One bucket's path from DDP's buffer to the wire: the step jobs the hook puts on its lane.

For each bucket (``bucket_job``):

1. split the buffer into its parameters' views (DDP lays them out contiguously, in the order of
   ``bucket.parameters()``);
2. detect: find each parameter's non-zero items (rows of 2-D parameters, elements otherwise) and
   all-gather their counts with last step's measured times (one small collective per bucket), so
   every rank decides on the same numbers; buckets the decider finds clearly dense skip this;
3. decide: one ``Decision`` per parameter (``hooks.decider``), then divide by the world size, as
   DDP does without a hook (Zen divides a sparse parameter's non-zero records instead; PowerSGD
   folds the division into its small factor);
4. execute: the fused dense allreduce, the sparse schemes, the compressed groups (``hooks.executor``),
   every result back into the bucket buffer: a sparse parameter's step allocates, fills and copies
   nothing of its size (its non-zero items from Step 2 feed its scheme, which writes the union).

A parameter with sparse gradients (``nn.Embedding(sparse=True)``) has a bucket of its own whose
buffer is the COO gradient: ``sparse_gradient_job`` syncs it from its indices.

Every job is a coroutine on the state's lane: it starts when the job before it has finished and
its segments run on the backend threads that complete its collectives, so the work overlaps the
rest of backward, and collectives leave every rank in the same order. Buckets that need neither
detection nor compression go straight to an async allreduce on DDP's own group (``async_dense``),
as torch's allreduce hook does.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import torch

from zensync.cost import CostModel, TensorShape
from zensync.hooks.decider import choose_scheme
from zensync.hooks.executor import BucketWork, param_item_view
from zensync.hooks.state import ZenSyncState
from zensync.sync import SCHEMES
from zensync.sync.base import ItemView
from zensync.sync.coo import CooItems
from zensync.sync.partition import make_partition
from zensync.sync.run import run_agreed_async
from zensync.sync.zen import PreparedPush, bucket_records
from zensync.transport import Handle, Task, TrafficLog
from zensync.types import SyncStats, index_dtype

__all__ = [
    "SPARSE_GRADIENT_CANDIDATES",
    "async_dense",
    "bucket_job",
    "check_step_job",
    "param_views",
    "sparse_gradient_job",
    "sparse_gradient_scheme",
]


def param_views(buffer: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """The parameters' views of a bucket buffer (Step 1)."""
    numels = [math.prod(shape) for shape in shapes]
    if sum(numels) != buffer.numel():
        raise RuntimeError(
            f"DDP bucket layout unexpected: parameters hold {sum(numels)} elements, the buffer {buffer.numel()}"
        )
    return [part.view(shape) for part, shape in zip(buffer.split(numels), shapes, strict=True)]


async def check_step_job(state: ZenSyncState) -> torch.Tensor:
    """A step's agreement check (``check_agreement``; ``ZenSyncState.begin_check`` issues it at DDP's
    forward, or ``open_step`` at the first bucket); its failure is noted for the step's jobs.

    Its gather is issued under a log of its own, which is uninstalled before the wait: the buckets'
    jobs run meanwhile, and their traffic is theirs.
    """
    log = TrafficLog()
    with state.runtime.transport.recording(log):
        check = Task(state.check_agreement()).start()  # runs to its gather's wait: issued now
    try:
        await check
    except BaseException as exc:
        state.note_failure(exc)
        raise
    finally:
        with state.lock:
            state.log.note_phases(log)
    return torch.empty(0)


async def bucket_job(
    state: ZenSyncState,
    buffer: torch.Tensor,
    shapes: Sequence[torch.Size],
    names: Sequence[str],
    dense_only: bool,
    submitted_s: float,
) -> torch.Tensor:
    """One bucket's sync (the module docstring's steps); the averaged bucket.

    ``submitted_s``: ``time.perf_counter()`` when the hook put the job on the lane (the wait for
    the lane is the step log's ``queued`` phase).

    After a job of this step failed on this rank, the step's later buckets skip their collectives
    and fail with the same exception (their peers fail in the group's timeout).
    """
    if state.step_error is not None:
        raise state.step_error
    try:
        return await _sync_bucket(state, buffer, shapes, names, dense_only, submitted_s)
    except BaseException as exc:
        state.note_failure(exc)
        raise


async def _sync_bucket(
    state: ZenSyncState,
    buffer: torch.Tensor,
    shapes: Sequence[torch.Size],
    names: Sequence[str],
    dense_only: bool,
    submitted_s: float,
) -> torch.Tensor:
    start = time.perf_counter()
    runtime, step = state.runtime, state.step
    transport = runtime.transport
    n = transport.world_size
    views = param_views(buffer, shapes)
    log = TrafficLog()
    log.work_s["queued"] = start - submitted_s
    with transport.recording(log):
        items: list[torch.Tensor | None]
        if dense_only:
            state.skip_hints(names)
            with state.lock:
                decisions = state.decider.decide(step, names, None, [], [], n, None)
            items = [None] * len(views)
            pushes: list[PreparedPush | None] = [None] * len(views)
        else:
            with transport.timed("detect"):
                decisions, items, pushes = await _detect_and_decide(state, names, views)
        # Step 1: average first, as DDP does (no fp16 overflow): the whole buffer when every
        # parameter goes dense, else each parameter's view, except where the sync divides itself:
        # Zen divides the non-zero records alone (no pass over a sparse parameter), and PowerSGD
        # folds the division into its small (m, r) factor.
        divided = [state.executor.divides_itself(d) for d in decisions]
        with transport.timed("divide"):
            if not any(divided):
                buffer.div_(n)
            else:
                for view, skip in zip(views, divided, strict=True):
                    if not skip:
                        view.div_(n)
        # Every result goes back into the bucket buffer, which DDP reads the gradients from: in
        # place for the dense allreduce and for the sparse schemes (which write only the union's
        # items: the others are zero already), copied in for the compressed groups.
        work = BucketWork(buffer, views, decisions, names, step, items=items, pushes=pushes)
        await state.executor.run(work)
    with state.lock:
        state.log.note_traffic(time.perf_counter() - start, log)
    return buffer


_MAX_FOLDED_COUNTS = 4096
"""At most this many per-owner counts (parameters x ranks) ride on a bucket's detection gather."""


async def _detect_and_decide(
    state: ZenSyncState, names: Sequence[str], views: Sequence[torch.Tensor]
) -> tuple[list, list[torch.Tensor | None], list[PreparedPush | None]]:
    """Steps 2 and 3: gathered non-zero counts -> one decision per parameter, identical on all ranks.

    Also returns each parameter's non-zero items, which its sparse scheme then starts from (no
    second scan), and, where Zen may run, its push grouped by owner: the gather carries the
    per-owner counts too, so Zen's push needs no size exchange (one collective fewer per parameter).
    """
    runtime = state.runtime
    transport = runtime.transport
    n = transport.world_size
    # One small all-gather carries this step's non-zero counts and the last step's measured sync
    # times (microseconds), so every rank decides on the same numbers.
    item_views = [param_item_view(v) for v in views]
    items: list[torch.Tensor | None] = [
        state.nonzero_rows(name, v.x2d) for name, v in zip(names, item_views, strict=True)
    ]
    counts = [0 if i is None else i.numel() for i in items]
    measured_us = [round(state.record(name).measured_s * 1e6) for name in names]
    pushes = _early_pushes(state, names, item_views, items)
    folded = [c for push in pushes if push is not None for c in push.counts]
    local = torch.tensor(counts + measured_us + folded, dtype=torch.int64, device=views[0].device)
    with transport.phase("detect"):
        gathered = await transport.all_gather_async(local)
    stacked = torch.stack(gathered)
    summed = stacked[:, : 2 * len(views)].sum(0).tolist()  # host-device sync
    if folded:
        mine = stacked[:, 2 * len(views) + transport.rank :: n].tolist()  # [rank j][pushed param k]
        k = 0
        for i, push in enumerate(pushes):
            if push is not None:
                pushes[i] = dataclasses.replace(push, recv_counts=[mine[j][k] for j in range(n)])
                k += 1
    model = await runtime.ensure_cost_model(state.config)
    with state.lock:
        decisions = state.decider.decide(
            state.step,
            names,
            item_views,
            summed[: len(views)],
            summed[len(views) :],
            n,
            model,
        )
    return decisions, items, pushes


def _early_pushes(
    state: ZenSyncState,
    names: Sequence[str],
    item_views: Sequence[ItemView],
    items: Sequence[torch.Tensor | None],
) -> list[PreparedPush | None]:
    """Zen's grouped push, divided by n as Zen does, of each parameter Zen synced last step.

    Those are likely to take Zen again, and every rank folds the same ones (the records agree), so
    the gathered rows align; a parameter that goes another way this step wastes only the grouping
    of its non-zero rows.
    """
    runtime = state.runtime
    n = runtime.transport.world_size
    pushes: list[PreparedPush | None] = [None] * len(item_views)
    if "zen" not in state.strategy.candidates or n == 1:
        return pushes
    budget = _MAX_FOLDED_COUNTS
    for i, (name, view, found) in enumerate(zip(names, item_views, items, strict=True)):
        if found is None or view.granularity != "row" or budget < n or state.record(name).scheme != "zen":
            continue
        budget -= n
        part = make_partition(view.num_items, n, seed=runtime.h0_seed, hashed=True)
        pushes[i] = bucket_records(view.x2d, part, found, None, n, seed=runtime.h0_seed, hashed=True)
    return pushes


SPARSE_GRADIENT_CANDIDATES = ("zen", "agsparse")
"""What "auto" chooses from for a sparse-gradient parameter: the schemes that work from its indices."""


def sparse_gradient_scheme(state: ZenSyncState, name: str, view: ItemView, model: CostModel | None) -> str:
    """The scheme of a sparse-gradient bucket.

    A named sparse scheme when the strategy names one. Under "auto", the cost model's choice
    (rounds and bytes) between Zen and AGsparse at the density and densification the parameter's
    last sync measured, which every rank holds alike (AGsparse's one all-gather wins at few ranks
    and small tables, Zen's balanced push and pull at many ranks); Zen on the first step. Every
    other strategy ("dense", compressor specs) takes Zen: compressing indices and values would be
    lossy for no gain, and DDP itself syncs such a gradient with a sparse allreduce whatever else
    the model does.
    """
    strategy = state.strategy
    if strategy.kind == "sparse" and strategy.text in SCHEMES and strategy.text != "auto":
        return strategy.text
    record = state.record(name)
    if strategy.text != "auto" or model is None or record.steps == 0:
        return "zen"
    shape = TensorShape(
        world_size=state.runtime.transport.world_size,
        num_items=view.num_items,
        item_bytes=view.item_bytes,
        index_bytes=index_dtype(view.num_items).itemsize,
        nnz=record.mean_density * view.num_items,
    )
    choice, predicted = choose_scheme(shape, SPARSE_GRADIENT_CANDIDATES, model, record, state.config.switch_margin)
    record.predicted_s = predicted
    return choice


async def sparse_gradient_job(state: ZenSyncState, grad: torch.Tensor, name: str) -> torch.Tensor:
    """A sparse-gradient bucket (``nn.Embedding(sparse=True)``): the averaged coalesced COO gradient.

    DDP gives such a parameter a bucket of its own whose buffer is the gradient itself, a COO tensor
    with one entry per lookup, and takes the returned tensor as the gradient. Its entries are
    coalesced (duplicates summed) and synced from the indices alone: no detection pass, no dense
    tensor. DDP's averaging divides each rank's values by n before the sum, as DDP divides before
    its allreduce.
    """
    if state.step_error is not None:
        raise state.step_error
    try:
        return await _sync_sparse_gradient(state, grad, name)
    except BaseException as exc:
        state.note_failure(exc)
        raise


async def _sync_sparse_gradient(state: ZenSyncState, grad: torch.Tensor, name: str) -> torch.Tensor:
    start = time.perf_counter()
    transport = state.runtime.transport
    coo = CooItems.of(grad)
    model = await state.runtime.ensure_cost_model(state.config) if state.strategy.text == "auto" else None
    with state.lock:
        scheme = sparse_gradient_scheme(state, name, coo.view, model)
    stats = SyncStats()
    log = TrafficLog()
    with transport.recording(log):
        summed = await run_agreed_async(
            coo.view,
            transport,
            scheme=scheme,
            options=state.config.sync_options,
            h0_seed=state.runtime.h0_seed,
            stats=stats,
            items=coo.items,
            values=coo.values,
            sparse_out=True,
            divisor=transport.world_size,
        )
    result = coo.restore(summed, 1)
    with state.lock:
        record = state.record(name)
        record.scheme = scheme
        record.mean_density = stats.mean_density  # from every rank's counts: the same on every rank
        state.executor.note_sparse(name, scheme, stats)
        state.log.note_traffic(time.perf_counter() - start, log)
    return result


def async_dense(
    state: ZenSyncState, buffer: torch.Tensor, numels: Sequence[int], names: Sequence[str]
) -> Handle[torch.Tensor]:
    """A bucket that needs no detection: one async allreduce on DDP's group, as torch's allreduce hook.

    No lane and no split: the cheapest path, taken by every bucket of a dense model between
    re-checks, the last one included. The step's close (``finish_step``) waits for these.
    """
    transport = state.runtime.dense_transport
    state.skip_hints(names)
    buffer.div_(transport.world_size)
    log = TrafficLog()
    start = time.perf_counter()
    with transport.recording(log), transport.phase("dense"):
        handle = transport.all_reduce_async(buffer, inplace=True)

    def done(out: torch.Tensor) -> torch.Tensor:
        elapsed = time.perf_counter() - start
        with state.lock:
            state.executor.note_dense(names, numels, elapsed)
            state.log.note_traffic(elapsed, log)
        return out

    chained = handle.then(done)
    chained.add_done_callback(lambda h: state.note_failure(h.error) if h.error is not None else None)
    state.add_pending(chained)
    return chained

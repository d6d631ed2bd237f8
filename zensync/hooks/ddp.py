"""The DDP comm hook: per-parameter sparsity detection, scheme choice, and one Future per bucket.

``zensync.register(ddp_model, strategy="auto")`` is all a user writes. For each bucket the hook

1. splits the bucket into its parameters' views (DDP lays them out contiguously, in the order of
   ``bucket.parameters()``), and divides by the world size first, as DDP does without a hook;
2. counts each parameter's non-zero items (rows of 2-D parameters, elements otherwise) and
   all-gathers the counts (one small collective per bucket), so every rank sees the same densities;
3. chooses per parameter, with the alpha-beta cost model, the measured density and the previous
   step's gamma, between dense and the strategy's sparse scheme(s) (``hooks.decide``);
4. syncs the dense parameters in one fused allreduce and each sparse parameter with
   ``run_agreed`` (sparse_allreduce without its per-call validation), and returns the averaged bucket.

Everything after step 1 runs on the state's communication thread, so it overlaps the rest of
backward; DDP waits for the futures at the end of backward. The thread's first job of each step is
``ZenSyncState.check_agreement`` (the ranks' engine states must match). The last bucket's hook waits
for the step, so a failure reaches ``backward()`` with its own type and message; a bucket that
fails makes the step's remaining buckets on that rank skip their collectives.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from zensync import kernels
from zensync.hooks.compressed import COMPRESSED_PREFIX, compression_for, sync_compressed
from zensync.hooks.config import HookConfig
from zensync.hooks.decide import DENSE_DENSITY, blend_prior, choose_scheme
from zensync.hooks.state import ZenSyncState
from zensync.sync.base import ItemView, default_granularity, index_dtype, item_view
from zensync.sync.compressed import hierarchy
from zensync.sync.cost import TensorShape, predict_time
from zensync.sync.run import run_agreed
from zensync.transport import GradBucket, TrafficLog
from zensync.types import SyncStats

__all__ = ["register", "zensync_hook"]

_CLEARLY_DENSE_FACTOR = 2.0
"""A bucket skips detection while every sparse candidate was predicted at least this much slower,
or while its dense parameters are at least ``DENSE_DENSITY`` dense."""


T = TypeVar("T")

_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()
"""DDP models zensync's hook is registered on (a second ``register`` is refused)."""


class GradBucketLike(Protocol):
    """What the hook uses of ``torch.distributed.GradBucket``."""

    def buffer(self) -> torch.Tensor: ...

    def parameters(self) -> list[torch.Tensor]: ...

    def is_last(self) -> bool: ...


def register(ddp_model: Any, strategy: str = "auto", **options: Any) -> ZenSyncState:
    """Register zensync's comm hook on a DistributedDataParallel model; returns the hook state.

    Args:
        ddp_model: A ``torch.nn.parallel.DistributedDataParallel`` model.
        strategy: "auto" (cost model per parameter), "dense", a sparse scheme name ("zen",
            "agsparse", "sparcml", "sparse_ps", "omnireduce") used for every parameter the
            detector finds sparse (below ``DENSE_DENSITY``), a compressor spec ("fp16", "topk:0.01", "powersgd:4";
            naturally sparse parameters may still take Zen), or a plan file from ``zensync plan``
            ("plan.json"; parameters missing from it are synced densely).
        **options: ``HookConfig`` fields (warmup_steps, latency_s, bandwidth_bytes_per_s,
            switch_margin, history_size, jsonl_path, sync_options, compressed_scheme,
            ranks_per_node, timeout, ...; ``help(zensync.HookConfig)``).

    Returns:
        The ``ZenSyncState``: per-step statistics (``history``, ``last_step()``), checkpoints
        (``state_dict()`` / ``load_state_dict()``).

    Raises:
        ValueError: On every rank, when any rank's local checks fail (options, plan file, devices,
            dtypes, compressor specs) or ranks differ in options or model (``hooks.agree``).
        RuntimeError: On this rank, before any collective, when the model already has the hook.

    Example::

        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = zensync.register(ddp, strategy="auto")
    """
    # Step 1: local checks, before any collective. A second register on the same model is refused
    # here (DDP allows one comm hook); the rest is carried to every rank by the state's agreement.
    if ddp_model in _REGISTERED:
        raise RuntimeError(
            "zensync.register was already called on this DDP model (DDP takes one comm hook per model); "
            "keep the state the first call returned, or wrap a new DistributedDataParallel"
        )
    failure: BaseException | None = None
    config = HookConfig()
    module = getattr(ddp_model, "module", None)
    try:
        if module is None or not hasattr(ddp_model, "register_comm_hook"):
            raise TypeError(f"zensync.register expects a DistributedDataParallel model, got {type(ddp_model).__name__}")
        config = HookConfig.from_options(strategy, options)
    except Exception as exc:  # noqa: BLE001 - carried to every rank and re-raised by the agreement
        failure = exc
    named = module.named_parameters() if isinstance(module, torch.nn.Module) else iter(())
    # Step 2: the agreement collective (ZenSyncState construction), then the hook's own setup.
    state = ZenSyncState(getattr(ddp_model, "process_group", None), named, config, failure=failure)
    device = next(iter(state.param_names)).device
    if state.strategy.kind != "dense":
        state.ensure_cost_model(device)
    ranks_per_node = state.two_level_ranks_per_node()
    if ranks_per_node:
        state.hierarchy = hierarchy(state.transport, ranks_per_node)
    ddp_model.register_comm_hook(state, zensync_hook)
    _REGISTERED.add(ddp_model)
    return state


def zensync_hook(state: ZenSyncState, bucket: GradBucketLike) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``ddp_model.register_comm_hook(state, zensync_hook)``; see the module docstring."""
    if not state.step_open:
        # The step's first bucket: the ranks compare their engine state (a checkpoint loaded on one
        # rank only fails every rank at this step instead of hanging later). The check is the comm
        # thread's first job of the step, so it overlaps backward and precedes every collective of
        # the step on zensync's group; a failure fails the step's remaining buckets on every rank.
        state.step_open = True
        state.worker.submit(lambda: _check_step(state))
    buffer = bucket.buffer()
    params = list(bucket.parameters())
    names = [state.name_of(p) for p in params]
    is_last = bucket.is_last()
    dense_only = _dense_without_detection(state, names)
    plain = state.in_warmup or state.strategy.kind in ("dense", "sparse")  # no compression this step
    if dense_only and plain and not is_last and state.dense_transport is not state.transport:
        return _async_dense(state, buffer, params, names)
    job = state.worker.submit(lambda: _step_work(state, buffer, params, names, is_last, dense_only))
    if not is_last:
        return job.future
    # The last bucket: DDP has queued every other bucket of the step before it, and backward has no
    # gradient left to compute, so waiting here costs no overlap. Waiting on this thread lets a
    # failure reach the user with its own type and message (a Future's error cannot carry them).
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(job.result())
    return done


# DDP.register_comm_hook compares the annotations with the real GradBucket and Future types, and this
# module's annotations are strings (``from __future__ import annotations``): give it the objects.
zensync_hook.__annotations__ = {
    "state": ZenSyncState,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _param_views(buffer: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    numels = [math.prod(shape) for shape in shapes]
    if sum(numels) != buffer.numel():
        raise RuntimeError(
            f"DDP bucket layout unexpected: parameters hold {sum(numels)} elements, the buffer {buffer.numel()}"
        )
    return [part.view(shape) for part, shape in zip(buffer.split(numels), shapes, strict=True)]


def _item_view(view: torch.Tensor) -> ItemView:
    """A parameter as the sparse schemes see it: rows of a 2-D parameter, elements otherwise."""
    return item_view(view, default_granularity(view))


def _async_dense(
    state: ZenSyncState, buffer: torch.Tensor, params: list[torch.Tensor], names: list[str]
) -> torch.futures.Future[torch.Tensor]:
    """A bucket that needs no detection: one async allreduce on DDP's group, as torch's allreduce hook.

    No thread hop and no split: the cheapest path, taken by every bucket of a dense model between
    re-checks. The last bucket of a step always goes through the comm thread, which closes the step
    after the async buckets complete.
    """
    transport = state.dense_transport
    buffer.div_(transport.world_size)
    log = TrafficLog()
    start = time.perf_counter()
    with transport.recording(log), transport.phase("dense"):
        future = transport.all_reduce_async(buffer, on_error=state.note_failure)
    numels = [p.numel() for p in params]

    def done(finished: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        out = finished.value()  # a failed allreduce raises here; note_failure kept its original
        elapsed = time.perf_counter() - start
        with state.lock:
            _note_dense(state, names, numels, elapsed)
            _note_traffic(state, log, elapsed)
        return out

    chained = future.then(done)
    state.add_pending(chained)
    return chained


def _noting_failure(state: ZenSyncState, work: Callable[[], T]) -> T:
    """``work()``, its exception first noted as the step's failure (``note_failure``), then re-raised."""
    try:
        return work()
    except BaseException as exc:
        state.note_failure(exc)
        raise


def _check_step(state: ZenSyncState) -> torch.Tensor:
    """The comm thread's first job of a step: ``check_agreement``, its failure noted for the step."""
    _noting_failure(state, state.check_agreement)
    return torch.empty(0)


def _step_work(
    state: ZenSyncState,
    buffer: torch.Tensor,
    params: list[torch.Tensor],
    names: list[str],
    is_last: bool,
    dense_only: bool,
) -> torch.Tensor:
    """One bucket's work on the comm thread, and the step's close after its last bucket.

    After a bucket of this step failed on this rank, the rest of the step's buckets skip their
    collectives and fail with the same exception (their peers fail in the group's timeout), and the
    last bucket re-raises the first failure. The step counter advances either way, so a caught
    failure leaves no rank behind in its step count.
    """
    try:
        if state.step_error is not None:
            raise state.step_error
        return _noting_failure(state, lambda: _sync_bucket(state, buffer, params, names, dense_only))
    finally:
        if is_last:
            failure = state.finish_step()
            if failure is not None:
                raise failure


def _sync_bucket(
    state: ZenSyncState,
    buffer: torch.Tensor,
    params: list[torch.Tensor],
    names: list[str],
    dense_only: bool,
) -> torch.Tensor:
    start = time.perf_counter()
    transport = state.transport
    shapes = [p.shape for p in params]
    views = _param_views(buffer, shapes)
    buffer.div_(transport.world_size)  # Step 1: average first, as DDP does (no fp16 overflow)
    log = TrafficLog()
    with transport.recording(log):
        schemes = ["dense"] * len(views) if dense_only else _decide(state, names, views)
        if state.strategy.kind in ("compress", "plan") and not state.in_warmup:
            schemes = [compression_for(state, n) if s == "dense" else s for s, n in zip(schemes, names, strict=True)]
        # All dense: the allreduce runs in place on the bucket. Otherwise results go to a new buffer.
        out = buffer if all(s == "dense" for s in schemes) else torch.empty_like(buffer)
        out_views = views if out is buffer else _param_views(out, shapes)
        _sync_dense(state, buffer, views, out_views, schemes, names)
        _sync_sparse(state, out_views, views, schemes, names)
        if any(s.startswith(COMPRESSED_PREFIX) for s in schemes):
            sync_compressed(state, out_views, views, schemes, names)
    with state.lock:
        _note_traffic(state, log, time.perf_counter() - start)
    return out


def _note_traffic(state: ZenSyncState, log: TrafficLog, elapsed: float) -> None:
    """Add one bucket's sync time and bytes to the step record (caller holds ``state.lock``)."""
    current = state.current
    current["comm_time_s"] += elapsed
    current["bytes_sent"] += log.total_sent
    current["bytes_recv"] += log.total_recv


def _note_dense(state: ZenSyncState, names: list[str], numels: list[int], elapsed: float) -> None:
    """Records of parameters synced by one fused dense allreduce taking ``elapsed`` (caller holds the lock)."""
    total = sum(numels) or 1
    for name, numel in zip(names, numels, strict=True):
        record = state.record(name)
        record.scheme = "dense"
        record.measured_s = elapsed * numel / total
        record.steps += 1
        state.current["params"][name] = {"scheme": "dense", "density": record.mean_density}


def _dense_without_detection(state: ZenSyncState, names: list[str]) -> bool:
    """Whether a bucket is synced densely this step without counting its non-zeros (same on every rank)."""
    return state.in_warmup or state.strategy.kind == "dense" or _clearly_dense(state, names)


def _clearly_dense(state: ZenSyncState, names: list[str]) -> bool:
    """Skip detection for a bucket whose parameters all went dense by a wide margin last time.

    Such buckets (the layers of a dense model) are re-checked every ``recheck_every`` steps instead of
    paying a count pass and a small collective each step. The step counter and the records are the
    same on every rank, so every rank skips the same buckets.
    """
    if state.step % state.config.recheck_every == 0:
        return False
    for name in names:
        record = state.records.get(name)
        if record is None or record.scheme != "dense" or "dense" not in record.predicted_s:
            return False
        if record.mean_density >= DENSE_DENSITY:
            continue
        fastest_sparse = min((t for s, t in record.predicted_s.items() if s != "dense"), default=float("inf"))
        if fastest_sparse < _CLEARLY_DENSE_FACTOR * record.predicted_s["dense"]:
            return False
    return True


def _decide(state: ZenSyncState, names: list[str], views: list[torch.Tensor]) -> list[str]:
    """Steps 2 and 3: gathered non-zero counts -> one scheme per parameter, identical on all ranks."""
    transport = state.transport
    # One small all-gather carries this step's non-zero counts and the last step's measured sync
    # times (microseconds), so every rank decides on the same numbers.
    item_views = [_item_view(v) for v in views]
    counts = [kernels.nonzero_items(v.x2d).numel() for v in item_views]
    measured_us = [round(state.record(name).measured_s * 1e6) for name in names]
    local = torch.tensor(counts + measured_us, dtype=torch.int64, device=views[0].device)
    with transport.phase("detect"):
        gathered = transport.all_gather(local)
    summed = torch.stack(gathered).sum(0).tolist()  # host-device sync
    totals, measured_sum = summed[: len(views)], summed[len(views) :]
    adapt = state.config.adapt
    if adapt:
        for name, total_us in zip(names, measured_sum, strict=True):
            record = state.record(name)
            record.learn(total_us / transport.world_size * 1e-6)
            if record.scheme in record.correction:
                blend_prior(state.scheme_correction, record.scheme, record.correction[record.scheme])
    model = state.ensure_cost_model(views[0].device)
    candidates = state.strategy.candidates
    # A named sparse scheme ("zen") runs for every parameter the detector finds sparse; "auto" measures.
    insist = state.strategy.text if state.strategy.kind == "sparse" and state.strategy.text != "auto" else None
    refresh = adapt and state.step > 0 and state.step % state.config.explore_every == 0
    # Dense parameters share one fused allreduce: a parameter's dense cost is its share (by size)
    # of the bucket's allreduce, latency included, as its measured dense time is (``_note_dense``).
    bucket_numel = sum(v.numel() for v in views)
    bucket = TensorShape(
        world_size=transport.world_size,
        num_items=bucket_numel,
        item_bytes=views[0].element_size(),
        index_bytes=index_dtype(bucket_numel).itemsize,
        nnz=float(bucket_numel),
    )
    bucket_dense_s = predict_time("dense", bucket, lambda m: float(bucket_numel), model)
    schemes = []
    for name, view, total, param in zip(names, item_views, totals, views, strict=True):
        shape = TensorShape(
            world_size=transport.world_size,
            num_items=view.num_items,
            item_bytes=view.item_bytes,
            index_bytes=index_dtype(view.num_items).itemsize,
            nnz=total / transport.world_size,
        )
        record = state.record(name)
        record.mean_density = shape.nnz / shape.num_items if shape.num_items else 0.0
        scheme, predicted = choose_scheme(
            shape,
            candidates,
            model,
            record,
            state.config.switch_margin,
            explore=adapt,
            refresh=refresh,
            prior=state.scheme_correction,
            dense_s=bucket_dense_s * param.numel() / max(1, bucket_numel),
            insist=insist,
        )
        record.scheme, record.predicted_s = scheme, predicted
        schemes.append(scheme)
    return schemes


def _sync_dense(
    state: ZenSyncState,
    buffer: torch.Tensor,
    views: list[torch.Tensor],
    out_views: list[torch.Tensor],
    schemes: list[str],
    names: list[str],
) -> None:
    """Step 4a: one fused allreduce for every dense parameter, written into ``out_views``.

    When every parameter is dense, ``out_views`` are ``views`` and the allreduce runs in place.
    """
    transport = state.transport
    dense = [i for i, s in enumerate(schemes) if s == "dense"]
    start = time.perf_counter()
    with transport.phase("dense"):
        if len(dense) == len(views):
            transport.all_reduce(buffer, inplace=True)
        elif dense:
            summed = transport.all_reduce(torch.cat([views[i].reshape(-1) for i in dense]), inplace=True)
            for i, part in zip(dense, summed.split([views[i].numel() for i in dense]), strict=True):
                out_views[i].view(-1).copy_(part)
    elapsed = time.perf_counter() - start
    with state.lock:
        _note_dense(state, [names[i] for i in dense], [views[i].numel() for i in dense], elapsed)


def _sync_sparse(
    state: ZenSyncState,
    out_views: list[torch.Tensor],
    views: list[torch.Tensor],
    schemes: list[str],
    names: list[str],
) -> None:
    """Step 4b: each sparse parameter through its sparse scheme (``run_agreed``), written into ``out_views``."""
    for i, scheme in enumerate(schemes):
        if scheme == "dense" or scheme.startswith(COMPRESSED_PREFIX):
            continue
        stats = SyncStats()
        view = _item_view(views[i])
        # Agreement is established (register's check + this step's density exchange): no validation.
        result = run_agreed(
            view,
            state.transport,
            scheme=scheme,
            options=state.config.sync_options,
            h0_seed=state.h0_seed,
            stats=stats,
        )
        out_views[i].copy_(result.view(views[i].shape))
        with state.lock:
            _note_sparse(state, names[i], scheme, stats)


def _note_sparse(state: ZenSyncState, name: str, scheme: str, stats: SyncStats) -> None:
    """Record of a parameter synced by a sparse scheme (caller holds ``state.lock``)."""
    record = state.record(name)
    if stats.densification is not None:
        record.gamma = stats.densification
    record.measured_s = stats.total_time_s
    record.bytes_sent, record.bytes_recv = stats.bytes_sent, stats.bytes_recv
    record.steps += 1
    state.current["params"][name] = {
        "scheme": scheme,
        "density": record.mean_density,
        "gamma": record.gamma,
        "bytes_sent": stats.bytes_sent,
        "bytes_recv": stats.bytes_recv,
        "predicted_s": record.predicted_s.get(scheme),
        "measured_s": stats.total_time_s,
    }

"""The DDP comm hook: ``zensync.register(ddp_model)``, and ``zensync_hook``, which DDP calls per bucket.

The hook turns each bucket into a step job (``hooks.pipeline``: views, detection, decision,
execution) on the state's lane and returns its future; DDP waits for the futures at the end of
backward. The ranks compare their engine states (``check_agreement``) at the first step and every
``check_every`` steps in one small all-gather issued at DDP's forward (a forward pre-hook,
``begin_check``), whose round overlaps the forward and backward and gates the buckets'
collectives (``open_step``). The last
bucket's hook waits for the step, so a failure reaches ``backward()`` with its own type and
message; a bucket that fails makes the step's remaining buckets on that rank skip their collectives.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from typing import Any, Protocol

import torch

from zensync.hooks.config import HookConfig
from zensync.hooks.pipeline import async_dense, bucket_job, check_step_job, param_views, sparse_gradient_job
from zensync.hooks.state import ZenSyncState
from zensync.transport import GradBucket, Handle

__all__ = ["register", "zensync_hook"]

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
            dtypes, compressor specs) or ranks differ in options or model (``zensync.sync.registration``).
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
    state.setup()
    if isinstance(module, torch.nn.Module):
        state.attach_hints(module)
    ddp_model.register_comm_hook(state, zensync_hook)
    state.forward_hook = ddp_model.register_forward_pre_hook(functools.partial(_begin_check, state))
    if state.warmup is not None:
        state.forward_end_hook = ddp_model.register_forward_hook(functools.partial(_forward_end, state))
    _REGISTERED.add(ddp_model)
    return state


def _syncs(module: Any) -> bool:
    """Whether the forward running now has a backward that syncs."""
    return torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True)


def _begin_check(state: ZenSyncState, module: Any, _inputs: object) -> None:
    """DDP's forward pre-hook (DDP holds the state anyway, as its comm hook's): a forward whose
    backward will sync issues the step's agreement check (and is marked for a warm-up profile)."""
    if _syncs(module):
        if state.warmup is not None:
            state.warmup.forward_start(state.step)
        state.begin_check(check_step_job)


def _forward_end(state: ZenSyncState, module: Any, _inputs: object, _output: object) -> None:
    """DDP's forward hook, with ``profile="warmup"``: the forward's end, for the warm-up profile."""
    if state.warmup is not None and _syncs(module):
        state.warmup.forward_end(state.step)


def zensync_hook(state: ZenSyncState, bucket: GradBucketLike) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``ddp_model.register_comm_hook(state, zensync_hook)``; see the module docstring."""
    if not state.step_open:
        # The step's first bucket: on the steps that compare (check_due), the ranks compare their
        # engine state (a checkpoint loaded on one rank only fails every rank at such a step, before
        # it changed what any rank syncs, instead of hanging later). The check's gather is
        # the step's first collective on zensync's group, issued at the forward (``_begin_check``):
        # its round overlaps the forward and backward, and the buckets' collectives wait for it and
        # fail with its exception on every rank.
        state.open_step(check_step_job)
        if state.warmup is not None and state.warmup.due(state.step):
            state.measure_warmup_profile()  # auto's choice, before the step's first bucket syncs
        elif state.verify_due:
            state.verify_auto_choice()  # auto's choice against its measured steps, before this step syncs
    buffer = bucket.buffer()
    params = list(bucket.parameters())
    names = [state.name_of(p) for p in params]
    is_last = bucket.is_last()
    step, runtime = state.step, state.runtime
    groups = state.replay_groups(names, is_last) if buffer.layout != torch.sparse_coo else None
    replayed: list[tuple[list[str], Handle[torch.Tensor]]] = []
    if groups is None:
        job = _start_bucket(state, buffer, [p.shape for p in params], names)
    else:  # the first step after a checkpoint load, synced as the saved step's buckets (is_last)
        replayed = _start_replayed(state, buffer, params, names, groups)
        job = replayed[-1][1]
    if not is_last:
        return job.to_torch_future()
    # The last bucket: DDP has queued every other bucket of the step before it, and backward has no
    # gradient left to compute, so waiting here costs no overlap. Waiting on this thread lets a
    # failure reach the user with its own type and message (a Future's error cannot carry them).
    runtime.lane.drain()  # the step's jobs: its check, and every bucket sent through the lane
    # Then the buckets on DDP's group, this one included, unless the step failed (see finish_step).
    failure = state.finish_step()
    if state.warmup is not None:
        state.warmup.step_end(step)  # after the step's collectives: the rest of the step starts here
    if failure is not None:
        raise failure
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(_gather_replayed(buffer, params, names, replayed) if replayed else job.outcome())
    return done


def _start_bucket(
    state: ZenSyncState, buffer: torch.Tensor, shapes: list[torch.Size], names: list[str]
) -> Handle[torch.Tensor]:
    """Start one bucket's sync (its path by the decider: a sparse gradient, DDP's own all-reduce
    on the dense transport, or a step job on the lane); the handle of the synced buffer."""
    state.note_bucket(names)
    if state.warmup is not None:
        state.warmup.bucket(state.step, names)
    decider, runtime = state.decider, state.runtime
    dense_only = decider.skips_detection(state.step, names)
    plain = not decider.compresses(state.step)
    if buffer.layout == torch.sparse_coo:  # a sparse-gradient parameter, alone in its bucket
        return state.submit(sparse_gradient_job(state, buffer, names[0]))
    if dense_only and plain and runtime.dense_transport is not runtime.transport:
        return async_dense(state, buffer, [math.prod(shape) for shape in shapes], names)
    submitted_s = time.perf_counter()
    return state.submit(bucket_job(state, buffer, shapes, names, dense_only, submitted_s))


def _start_replayed(state: ZenSyncState, buffer: torch.Tensor, params: list[torch.Tensor], names: list[str],
                    groups: list[list[str]]) -> list[tuple[list[str], Handle[torch.Tensor]]]:  # fmt: skip
    """Sync ``buffer`` as the saved layout's buckets (``ZenSyncState.replay_groups``), each gathered
    into a buffer of its own, in the saved order; (names, handle) per bucket."""
    views = dict(zip(names, param_views(buffer, [p.shape for p in params]), strict=True))
    started = []
    for group in groups:
        gathered = torch.cat([views[n].reshape(-1) for n in group])
        started.append((group, _start_bucket(state, gathered, [views[n].shape for n in group], group)))
    return started


def _gather_replayed(buffer: torch.Tensor, params: list[torch.Tensor], names: list[str],
                     replayed: list[tuple[list[str], Handle[torch.Tensor]]]) -> torch.Tensor:  # fmt: skip
    """The replayed buckets' synced buffers written back into DDP's bucket (all done: the step drained)."""
    views = dict(zip(names, param_views(buffer, [p.shape for p in params]), strict=True))
    for group, job in replayed:
        synced = job.outcome()
        offset = 0
        for name in group:
            view = views[name]
            view.copy_(synced[offset : offset + view.numel()].view_as(view))
            offset += view.numel()
    return buffer


# DDP.register_comm_hook compares the annotations with the real GradBucket and Future types, and this
# module's annotations are strings (``from __future__ import annotations``): give it the objects.
zensync_hook.__annotations__ = {
    "state": ZenSyncState,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}

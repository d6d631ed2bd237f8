"""Running one bucket's decisions: the fused dense allreduce, the sparse schemes, the compressed groups.

Every path is a coroutine of non-blocking collectives on the hook's own group, awaited in the same
order on every rank (dense, then sparse parameters in bucket order, then compressed groups in order
of first appearance). Every sum goes back into its parameter's view of the bucket buffer; what
each parameter's sync did goes to the
step log (``ParamStep``) and to its record (``ParamRecord``), under the state's lock.

Overlap across buckets: right after issuing the bucket's last collective (its last compressed
group's, or the fused dense allreduce when nothing follows it) the job hands the lane on
(``zensync.transport.hand_on``), so the next bucket compresses and issues while this one's
collective is on the wire and its result is decoded. Both still leave every rank in submission
order; a bucket's decode and the next bucket's compression run on two threads, each in its own
Task context (its own traffic log and phase, its own error-feedback step: ``compressed_call``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zensync.hooks.decision import Decision, DecisionKind
from zensync.hooks.memory import ParamMemory
from zensync.hooks.runtime import Runtime
from zensync.hooks.steplog import ParamStep, StepLog
from zensync.sync import SyncOptions
from zensync.sync.base import ItemView, default_granularity, get_scheme, item_view
from zensync.sync.run import run_agreed_async
from zensync.sync.zen import PreparedPush
from zensync.transport import TrafficLog, hand_on
from zensync.types import SyncStats

__all__ = ["BucketExecutor", "BucketWork", "divides_records", "param_item_view"]


@dataclass(frozen=True, slots=True)
class BucketWork:
    """One bucket's parameters and their decisions (index i: one parameter).

    Every sum goes back into ``views`` (DDP reads the gradients from the bucket): the allreduce runs
    in place on ``buffer`` when every decision is dense, and a sparse scheme sums its view in place.
    """

    buffer: torch.Tensor
    views: Sequence[torch.Tensor]
    decisions: Sequence[Decision]
    names: Sequence[str]
    step: int
    items: Sequence[torch.Tensor | None] = ()
    """Each parameter's non-zero items where detection found them (its sparse scheme starts there)."""
    pushes: Sequence[PreparedPush | None] = ()
    """Zen's push of a parameter grouped during detection, with the counts the detection gather carried."""


def divides_records(decision: Decision) -> bool:
    """Whether the decision's scheme divides its non-zero records by the world size itself (Zen,
    AGsparse): the parameter's view is then not divided beforehand (no pass over it)."""
    return decision.kind is DecisionKind.SPARSE and get_scheme(decision.scheme).divides


def contiguous_span(views: Sequence[torch.Tensor], *, any_order: bool) -> torch.Tensor | None:
    """One 1-D view of the memory ``views`` cover when they lie back to back in one storage, in
    their order (or in any order when ``any_order``), as a bucket lays out its parameters; else None."""
    if not views or any(not v.is_contiguous() for v in views):
        return None
    ordered = sorted(views, key=lambda v: v.storage_offset()) if any_order else list(views)
    first = ordered[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for v in ordered:
        if v.untyped_storage().data_ptr() != storage or v.storage_offset() != offset or v.dtype != first.dtype:
            return None
        offset += v.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def param_item_view(view: torch.Tensor) -> ItemView:
    """A parameter as the sparse schemes see it: rows of a 2-D parameter, elements otherwise."""
    return item_view(view, default_granularity(view))


class BucketExecutor:
    """Runs decisions on the runtime's transport and writes what they did to memory and the log."""

    __slots__ = ("lock", "log", "memory", "overlap", "runtime", "sync_options")

    def __init__(
        self,
        runtime: Runtime,
        memory: ParamMemory,
        log: StepLog,
        sync_options: SyncOptions,
        lock: threading.Lock,
        *,
        overlap: bool = True,
    ) -> None:
        self.runtime = runtime
        self.memory = memory
        self.log = log
        self.sync_options = sync_options
        self.lock = lock
        self.overlap = overlap
        """Hand the lane on after the bucket's last collective (``HookConfig.overlap_buckets``)."""

    def divides_itself(self, decision: Decision) -> bool:
        """Whether the decision's sync divides by the world size itself, so the pipeline leaves the
        parameter's view undivided: Zen and AGsparse divide the non-zero records alone, PowerSGD
        folds the division into its small factor (``CompressedSync.folds_scale``)."""
        if decision.kind is DecisionKind.COMPRESSED and decision.compressor is not None:
            sync = self.memory.compressed_sync(decision.compressor, decision.scheme)
            return sync.folds_scale(hierarchical=decision.level == "hier")
        return divides_records(decision)

    async def run(self, work: BucketWork) -> None:
        """Sync every parameter of a bucket by its decision, in place in ``work.views``; hands the
        lane on after the bucket's last collective (module docstring)."""
        follows = any(d.kind is not DecisionKind.DENSE for d in work.decisions)
        await self._dense(work, last=self.overlap and not follows)
        await self._sparse(work)
        await self._compressed(work)

    # -- Step 4a: one fused allreduce ------------------------------------------------------------------
    async def _dense(self, work: BucketWork, *, last: bool) -> None:
        transport = self.runtime.transport
        views, names = work.views, work.names
        dense = [i for i, d in enumerate(work.decisions) if d.kind is DecisionKind.DENSE]
        start = time.perf_counter()
        with transport.phase("dense"):
            if dense:
                whole = len(dense) == len(views)  # in place on the bucket; else a fused copy
                fused = work.buffer if whole else torch.cat([views[i].reshape(-1) for i in dense])
                pending = transport.all_reduce_async(fused, inplace=True)
                if last:
                    hand_on()
                summed = await pending
                if not whole:
                    for i, part in zip(dense, summed.split([views[i].numel() for i in dense]), strict=True):
                        views[i].view(-1).copy_(part)
        elapsed = time.perf_counter() - start
        with self.lock:
            self.note_dense([names[i] for i in dense], [views[i].numel() for i in dense], elapsed)

    def note_dense(self, names: Sequence[str], numels: Sequence[int], elapsed: float) -> None:
        """Records of parameters synced by one fused dense allreduce taking ``elapsed`` (caller holds the lock)."""
        total = sum(numels) or 1
        for name, numel in zip(names, numels, strict=True):
            record = self.memory.record(name)
            record.scheme = "dense"
            record.measured_s = elapsed * numel / total
            record.steps += 1
            self.log.note(name, ParamStep(scheme="dense", density=record.mean_density))

    # -- Step 4b: each sparse parameter through its scheme ---------------------------------------------
    async def _sparse(self, work: BucketWork) -> None:
        views = work.views
        n = self.runtime.transport.world_size
        for i, decision in enumerate(work.decisions):
            if decision.kind is not DecisionKind.SPARSE:
                continue
            stats = SyncStats()
            view = param_item_view(views[i])
            # Agreement is established (register's check + this step's density exchange): no validation.
            await run_agreed_async(  # the sum lands in view.x2d: the bucket's own memory
                view,
                self.runtime.transport,
                scheme=decision.scheme,
                options=self.sync_options,
                h0_seed=self.runtime.h0_seed,
                stats=stats,
                out=view.x2d,
                items=work.items[i] if work.items else None,
                divisor=n if divides_records(decision) else 1,
                push=work.pushes[i] if work.pushes and divides_records(decision) else None,
            )
            with self.lock:
                self.note_sparse(work.names[i], decision.scheme, stats)

    def note_sparse(self, name: str, scheme: str, stats: SyncStats) -> None:
        """Record and step-log entry of a parameter a sparse scheme synced (caller holds the lock)."""
        record = self.memory.record(name)
        if stats.densification is not None:
            record.gamma = stats.densification
        record.measured_s = stats.total_time_s
        record.bytes_sent, record.bytes_recv = stats.bytes_sent, stats.bytes_recv
        record.steps += 1
        self.log.note(
            name,
            ParamStep(
                scheme=scheme,
                density=record.mean_density,
                gamma=record.gamma,
                bytes_sent=stats.bytes_sent,
                bytes_recv=stats.bytes_recv,
                predicted_s=record.predicted_s.get(scheme),
                measured_s=stats.total_time_s,
                collectives=stats.collectives,
                observes_all=True,
            ),
        )

    # -- Step 4c: compressed fusion groups -----------------------------------------------------------
    async def _compressed(self, work: BucketWork) -> None:
        """One compressed collective per (decision, fusion group), in order of first appearance.

        A group is compressed in the bucket's own order, so its parameters usually lie back to back
        and the sum is written straight into the bucket. Its error-feedback memory is keyed by its
        alphabetically first parameter's name and regrouped by parameter name
        (``ErrorFeedback.regroup``) when the group's layout changes (DDP's bucket rebuild), so each
        residual stays on its own elements.
        """
        views, decisions, names = work.views, work.decisions, work.names
        groups: dict[tuple[str, str | None], list[int]] = {}
        for i, decision in enumerate(decisions):
            if decision.kind is DecisionKind.COMPRESSED:
                groups.setdefault(decision.group_key, []).append(i)
        for index, members in enumerate(groups.values()):
            first = min(names[i] for i in members)
            ef_name = first if len(members) == 1 else "fused:" + first
            await self._compressed_group(
                decisions[members[0]],
                [names[i] for i in members],
                [views[i] for i in members],
                ef_name,
                work.step,
                last=self.overlap and index == len(groups) - 1,
            )

    async def _compressed_group(
        self,
        decision: Decision,
        names: list[str],
        views: list[torch.Tensor],
        ef_name: str,
        step: int,
        *,
        last: bool,
    ) -> None:
        assert decision.compressor is not None
        sync = self.memory.compressed_sync(decision.compressor, decision.scheme)
        transport = self.runtime.transport
        levels = self.runtime.hierarchy if decision.level == "hier" else None
        scale = 1 / transport.world_size if self.divides_itself(decision) else 1.0
        log = TrafficLog()
        start = time.perf_counter()
        # The group's own stretch of the bucket where its views lie back to back in bucket order
        # (or in any order, for a compressor whose result does not depend on the order: no error
        # feedback, no state): the sum is then written straight into it. Otherwise a copy.
        # A single parameter keeps its shape (PowerSGD sees the matrix).
        if len(views) == 1:
            span = views[0] if views[0].is_contiguous() else None
            flat = views[0]
        else:
            order_free = not (sync.error_feedback or sync.compressor.keeps_state)
            span = contiguous_span(views, any_order=order_free)
            flat = span if span is not None else torch.cat([v.reshape(-1) for v in views])
        if sync.error_feedback:
            sync.worker_memory.regroup(ef_name, tuple((n, v.numel()) for n, v in zip(names, views, strict=True)))
        # A compressor that works part by part (PowerSGD on the flat allreduce) learns each part's
        # name and shape; elsewhere (a plan's two-level group) it sees the concatenation, as before.
        parts = None
        if len(views) > 1 and not sync.compressor.fuses and sync.fuses(hierarchical=levels is not None):
            parts = tuple((n, v.shape) for n, v in zip(names, views, strict=True))
        with transport.recording(log), transport.phase("compressed"):
            summed = await sync.sync_async(
                flat,
                transport,
                name=ef_name,
                step=step,
                hierarchy=levels,
                out=span,
                scale=scale,
                parts=parts,
                on_issued=hand_on if last else None,
            )
        if span is None:
            for out, part in zip(views, summed.reshape(-1).split([v.numel() for v in views]), strict=True):
                out.copy_(part.view(out.shape))
        elapsed = time.perf_counter() - start
        sent = log.total_sent
        total = sum(v.numel() for v in views) or 1
        with self.lock:
            for name, view in zip(names, views, strict=True):
                share = view.numel() / total
                self.log.note(
                    name,
                    ParamStep(
                        scheme=decision.label,
                        density=self.memory.record(name).mean_density,
                        bytes_sent=round(sent * share),
                        measured_s=elapsed * share,
                    ),
                )

"""Measuring a step's inputs inside the group that trains: every rank at once, on its own links.

``profile_group`` is collective (every rank calls it, with the same arguments) and returns the same
``zensync.planner.StepProfile`` on every rank. Every time in it is the slowest rank's (the elementwise
maximum over ranks): a collective completes when its last rank arrives, so that is what a step
pays. Ready times, offsets inside the backward, are the mean over ranks. The fits are rank 0's,
broadcast (a least-squares solve is not bit-reproducible across processes). It is the calibration
run of ``zensync.planner.predict_step``; run it apart from the steps it predicts.

Steps:

1. compute: a copy of the DDP model with the same buckets and a hook that communicates nothing
   runs ``iterations`` steps on every rank at once (after ``warmup``); forward, backward (with the
   per-parameter ready times and DDP's bucket copies) and the rest of the step (zeroing the
   gradients, the optimizer) are timed, and DDP's buckets recorded;
2. the links: allreduces up to the largest bucket (float32, and float16 for the casts) and
   allgathers of compressed-payload sizes, each
   size timed ``repeats`` times after a barrier; alpha-beta fitted per collective; one small
   all-gather (the hook's agreement round) timed alone;
3. each compressor's local work at each bucket's size (and a small size, for the fixed part), every
   rank at once: ``compress`` is error feedback's compensation and the encode, ``decompress`` the
   decode of every rank's payload into the bucket, the new residual and the finite check (what the
   hook's ``CompressedSync`` does around its collective); PowerSGD, whose work and payload follow
   the matrix shapes, on each bucket's own tensors instead (``BucketCost``: the work before its
   first collective, the rest, and the bytes of each of its rounds).
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from zensync.compress import Compressor, ErrorFeedback, all_finite, build
from zensync.cost import compressor_model, fit_affine, shape_priced
from zensync.planner import AUTO_COMPRESSORS, BucketCost, LinkFit, ModelProfile, StepProfile, TensorProfile
from zensync.profiling.costs import clamped_fit
from zensync.transport import GradBucket, TorchTransport, Transport

__all__ = ["agreed_compute", "profile_group", "profile_links", "slowest_over_ranks"]

_SMALL_NUMEL = 2**16
"""The small size each compressor is also timed at, for the fixed part of its cost."""
_ALLREDUCE_BYTES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024)
_ALLGATHER_BYTES = (4 * 1024, 256 * 1024, 2 * 1024 * 1024)
_ROUND_ELEMENTS = 3
"""int64 per rank of the hook's agreement all-gather."""

Batch = tuple[torch.Tensor, torch.Tensor]


def profile_group(
    ddp: nn.parallel.DistributedDataParallel,
    make_batch: Callable[[], Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    specs: Sequence[str] = AUTO_COMPRESSORS,
    iterations: int = 6,
    warmup: int = 2,
    repeats: int = 5,
    name: str = "model",
    transport: Transport | None = None,
) -> StepProfile:
    """Measure the step's compute, links and compressor costs in this group (module docstring).

    Args:
        ddp: The model as it will train (its module is copied; ``ddp`` itself is not run or changed).
        make_batch: Returns this rank's (inputs, targets) for one step.
        loss_fn: (output, targets) -> scalar loss.
        optimizer: Builds the step's optimizer from parameters (its step is part of ``other_s``).
        specs: Compressor specs to time (default: the ones "auto" may choose).
        iterations: Timed steps of step 1 (after ``warmup`` untimed ones).
        warmup: Untimed steps first (DDP rebuilds its buckets after the first).
        repeats: Timed calls per collective size and per compressor operation.
        name: Model name recorded in the profile.
        transport: The group (default: ``ddp``'s process group).

    Returns:
        The ``StepProfile``, the same on every rank.

    Raises:
        ValueError: If ``iterations`` or ``repeats`` < 1, or a spec is invalid.
    """
    if iterations < 1 or repeats < 1 or warmup < 1:
        raise ValueError(
            f"iterations={iterations} and repeats={repeats} must be >= 1 and warmup={warmup} >= 1 "
            f"(DDP settles its buckets in the first step)"
        )
    transport = transport or TorchTransport(ddp.process_group)
    for spec in specs:  # a bad spec fails here, on every rank, before minutes of measuring
        try:
            build(spec)
        except ValueError as exc:
            raise ValueError(f"specs: {spec!r}: {exc}") from None
    # Step 1: compute, and DDP's buckets.
    profile, other_s, buckets = _compute(ddp, make_batch, loss_fn, optimizer, iterations, warmup, name, transport)
    return profile_links(transport, profile, other_s, buckets, specs, repeats)


def profile_links(
    transport: Transport,
    profile: ModelProfile,
    other_s: float,
    buckets: tuple[tuple[str, ...], ...],
    specs: Sequence[str],
    repeats: int = 5,
) -> StepProfile:
    """Steps 2 and 3 of the module docstring around a measured compute ``profile``: the links and the
    compressors at the buckets' sizes; the ``StepProfile``, rank 0's on every rank (collective).

    ``profile_group`` calls it after its own compute run; the DDP hook after its warm-up steps
    (``HookConfig.profile="warmup"``), whose compute it measured itself (``agreed_compute``).
    """
    largest_bytes = max(_numel(profile, b) for b in buckets) * profile.dtype_bytes
    n = transport.world_size
    allreduce = _fit_link(transport, "allreduce", (*_ALLREDUCE_BYTES, largest_bytes), repeats, 2 * (n - 1) / n)
    half_sizes = (*_ALLREDUCE_BYTES, largest_bytes // 2)
    allreduce_half = _fit_link(transport, "allreduce", half_sizes, repeats, 2 * (n - 1) / n, torch.float16)
    allgather = _fit_link(transport, "allgather", _ALLGATHER_BYTES, repeats, float(n - 1))
    round_s = _median_s(transport, lambda: transport.all_gather(_round_payload()), repeats)
    # Step 3: the compressors at the buckets' sizes; shape-priced ones on the buckets' tensors.
    sizes = sorted({_SMALL_NUMEL, *(_numel(profile, b) for b in buckets)})
    shaped = {spec: shape_priced(spec) for spec in specs}
    costs = {_key(spec): _compressor_costs(transport, spec, sizes, repeats) for spec in specs if not shaped[spec]}
    bucket_costs = {
        key: _bucket_costs(transport, key, profile, buckets, repeats) for key in dict.fromkeys(shaped.values()) if key
    }
    return _as_rank0(
        transport,
        StepProfile(
            profile=profile,
            world_size=n,
            other_s=other_s,
            buckets=buckets,
            allreduce=allreduce,
            allreduce_half=allreduce_half,
            allgather=allgather,
            round_s=round_s,
            compressor_costs=costs,
            bucket_costs=bucket_costs,
        ),
    )


def _as_rank0(transport: Transport, step: StepProfile) -> StepProfile:
    """Rank 0's profile on every rank, bit for bit: the inputs of the fits are identical on every rank,
    but a least-squares solve is not bit-reproducible across processes (buffer alignment), and ranks
    whose predictions differ by an ulp could choose differently at a tie."""
    if transport.world_size == 1:
        return step
    return StepProfile.from_json(transport.broadcast_text(step.to_json()))


def _numel(profile: ModelProfile, bucket: Sequence[str]) -> int:
    sizes = {t.name: t.numel for t in profile.tensors}
    return sum(sizes[n] for n in bucket)


def _key(spec: str) -> str:
    return compressor_model(spec).spec


def _round_payload() -> torch.Tensor:
    return torch.zeros(_ROUND_ELEMENTS, dtype=torch.int64)


# -- Step 1 ---------------------------------------------------------------------------------------------
def _compute(
    ddp: nn.parallel.DistributedDataParallel,
    make_batch: Callable[[], Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None,
    iterations: int,
    warmup: int,
    name: str,
    transport: Transport,
) -> tuple[ModelProfile, float, tuple[tuple[str, ...], ...]]:
    """Step 1: (profile, other_s, buckets), agreed over ranks."""
    buckets: list[tuple[str, ...]] = []
    replica, params = _silent_replica(ddp, buckets)
    marks: dict[str, float] = {}
    handles = [p.register_post_accumulate_grad_hook(_marker(marks, n)) for n, p in params]
    opt = optimizer(replica.parameters()) if optimizer is not None else None
    ready: dict[str, list[float]] = {n: [] for n, _ in params}
    forward, backward, other = [], [], []
    try:
        for it in range(warmup + iterations):
            inputs, targets = make_batch()
            buckets.clear()
            transport.barrier()  # every rank computes at once, as in training
            start = time.perf_counter()
            replica.zero_grad(set_to_none=False)
            zeroed = time.perf_counter()
            loss = loss_fn(replica(inputs), targets)
            backward_start = time.perf_counter()
            marks.clear()
            loss.backward()
            backward_end = time.perf_counter()
            if opt is not None:
                opt.step()
            end = time.perf_counter()
            if it < warmup:
                continue
            forward.append(backward_start - zeroed)
            backward.append(backward_end - backward_start)
            other.append(end - backward_end + zeroed - start)
            for n, t in marks.items():
                ready[n].append(t - backward_start)
    finally:
        for handle in handles:
            handle.remove()
    shapes = {n: tuple(p.shape) for n, p in params}
    device = f"measured:{params[0][1].device.type} x{transport.world_size} at once"
    profile, other_s = agreed_compute(
        transport, forward, backward, other, ready, shapes, tuple(buckets), params[0][1].element_size(), name, device
    )
    return profile, other_s, tuple(buckets)


def agreed_compute(
    transport: Transport,
    forward: Sequence[float],
    backward: Sequence[float],
    other: Sequence[float],
    ready: dict[str, list[float]],
    shapes: dict[str, tuple[int, ...]],
    buckets: tuple[tuple[str, ...], ...],
    dtype_bytes: int,
    name: str,
    device: str,
    *,
    other_waits: bool = False,
) -> tuple[ModelProfile, float]:
    """(compute profile, other_s) from per-step times measured on this rank, agreed over ranks
    (collective; every rank passes as many steps and the same names): durations are the slowest
    rank's per step, then the mean over steps; ready times (seconds after the start of backward,
    per parameter) the mean over ranks of each rank's mean. Only the bucketed parameters count.

    ``other_waits``: ``other`` spans the caller's code between steps, which may wait for the other
    ranks (a barrier, a loss allreduce) after the step's collectives let them go at different
    times; the step's own work there is then the least rank's time, per step (the rank that
    arrives last at such a collective waits the least), not the slowest rank's, which would count
    the others' wait as work.
    """
    # Ready times: the mean over ranks; durations: the slowest rank's, per step.
    ordered = sorted(ready)
    mean_ready = _mean(transport, [statistics.fmean(ready[n]) if ready[n] else 0.0 for n in ordered])
    forward_s, backward_s = (statistics.fmean(slowest_over_ranks(transport, times)) for times in (forward, backward))
    other_s = statistics.fmean(_least(transport, other) if other_waits else slowest_over_ranks(transport, other))
    bucketed = {n for b in buckets for n in b}
    measured = sorted((t, n) for n, t in zip(ordered, mean_ready, strict=True) if n in bucketed)
    tensors = tuple(TensorProfile(name=n, shape=shapes[n], ready_s=t) for t, n in measured)
    profile = ModelProfile(
        model=name,
        tensors=tensors,
        forward_s=forward_s,
        backward_s=max(backward_s, tensors[-1].ready_s),
        dtype_bytes=dtype_bytes,
        device=device,
    )
    return profile, other_s


def _silent_replica(
    ddp: nn.parallel.DistributedDataParallel, buckets: list[tuple[str, ...]]
) -> tuple[nn.parallel.DistributedDataParallel, list[tuple[str, nn.Parameter]]]:
    """A DDP copy of ``ddp``'s module with its bucket size and a hook that sends nothing and appends
    each bucket's parameter names to ``buckets``; with its trainable (name, parameter) pairs."""
    module = copy.deepcopy(ddp.module)
    replica = nn.parallel.DistributedDataParallel(
        module,
        bucket_cap_mb=ddp.bucket_bytes_cap / 2**20,
        process_group=ddp.process_group,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        find_unused_parameters=ddp.find_unused_parameters,
    )
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in params}

    def no_comm(_state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buckets.append(tuple(names[id(p)] for p in bucket.parameters()))
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    # DDP compares the hook's annotations with the real types (this module's are strings).
    no_comm.__annotations__ = {"_state": object, "bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}
    replica.register_comm_hook(None, no_comm)
    return replica, params


def _marker(marks: dict[str, float], name: str) -> Callable[[torch.Tensor], None]:
    def mark(_param: torch.Tensor) -> None:
        marks[name] = time.perf_counter()

    return mark


# -- Step 2 ---------------------------------------------------------------------------------------------
def _fit_link(
    transport: Transport,
    op: str,
    sizes: Sequence[int],
    repeats: int,
    volume: float,
    dtype: torch.dtype = torch.float32,
) -> LinkFit:
    """alpha-beta of ``op`` from its median time at each size (bytes per rank) of ``dtype`` payloads
    (a backend sums half precision at another speed than float32: gloo's fp16 sum is software)."""
    sizes = sorted(set(sizes))
    seconds = []
    for nbytes in sizes:
        payload = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype)
        call = functools.partial(transport.all_reduce if op == "allreduce" else transport.all_gather, payload)
        seconds.append(_median_s(transport, call, repeats))
    intercept, slope = fit_affine([volume * s for s in sizes], seconds)
    return LinkFit(
        latency_s=max(0.0, intercept),
        bandwidth_bytes_per_s=1.0 / max(slope, 1e-15),
        sizes=tuple(sizes),
        seconds=tuple(seconds),
    )


def _median_s(transport: Transport, call: Callable[[], object], repeats: int) -> float:
    """Median over ``repeats`` calls (each after a barrier, one warm-up first) of the slowest rank's time."""
    call()
    times = []
    for _ in range(repeats):
        transport.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(slowest_over_ranks(transport, times))


def slowest_over_ranks(transport: Transport, values: Sequence[float]) -> list[float]:
    """Elementwise maximum over ranks of ``values`` (exact: the same on every rank; a NaN wins).

    A collective completes when its slowest rank has arrived, so what a step pays for a section that
    every rank runs before one is its slowest rank's time, not the mean.
    """
    return _over_ranks(transport, values).amax(dim=0).tolist()


def _least(transport: Transport, values: Sequence[float]) -> list[float]:
    """Elementwise minimum over ranks of ``values`` (exact: the same on every rank)."""
    return _over_ranks(transport, values).amin(dim=0).tolist()


def _over_ranks(transport: Transport, values: Sequence[float]) -> torch.Tensor:
    """Every rank's ``values``, one row per rank (float64)."""
    return torch.stack(transport.all_gather(torch.tensor(list(values), dtype=torch.float64)))


def _mean(transport: Transport, values: Sequence[float]) -> list[float]:
    """The mean over ranks of ``values`` (equal on every rank up to the sum's order: ``_as_rank0``
    makes the profile identical)."""
    return (transport.all_reduce(torch.tensor(list(values), dtype=torch.float64)) / transport.world_size).tolist()


# -- Step 3 ---------------------------------------------------------------------------------------------
def _compressor_costs(
    transport: Transport, spec: str, sizes: Sequence[int], repeats: int
) -> dict[str, dict[str, float]]:
    """``gpu_compress`` (per element) and ``gpu_decompress`` (per element of decode work) of ``spec``."""
    comp = build(spec)
    n = transport.world_size
    model = compressor_model(spec)
    allreduce = comp.allreduce_compatible
    feedback = comp.needs_error_feedback
    scale = 1.0 / n
    gen = torch.Generator().manual_seed(transport.rank)
    enc, dec, work = [], [], []
    for numel in sizes:
        x = torch.randn(numel, generator=gen)
        out = torch.empty_like(x)
        memory = ErrorFeedback()
        memory.keep_remainder("b", torch.zeros_like(x))  # a residual exists from the second step on
        state: dict[str, Any] = {}

        def encode(x: torch.Tensor = x, memory: ErrorFeedback = memory, state: dict[str, Any] = state) -> None:
            if feedback:
                state["compensated"] = memory.compensate("b", x, scale=scale)
                state["payload"] = comp.compress(state["compensated"], name="b")
            else:
                state["payload"] = comp.compress_scaled(x, scale, name="b")

        def decode(out: torch.Tensor = out, memory: ErrorFeedback = memory, state: dict[str, Any] = state) -> None:
            payload = state["payload"]
            if allreduce:
                comp.decompress_into(payload, out)
            else:
                comp.decompress_sum([payload] * n, out)
            if feedback:
                memory.keep_remainder("b", comp.subtract_transmitted(state["compensated"], payload))
            if feedback or comp.keeps_state:
                bool(all_finite(out))  # host-device sync

        enc.append(_median_s(transport, encode, repeats))
        decode()  # a payload exists for the decode's warm-up
        dec.append(_median_s(transport, decode, repeats))
        work.append(float(model.aggregate_elements(np.array([float(numel)]), 1 if allreduce else n)[0]))
    return {"gpu_compress": _affine(sizes, enc), "gpu_decompress": _affine(work, dec)}


def _bucket_costs(
    transport: Transport, spec: str, profile: ModelProfile, buckets: Sequence[Sequence[str]], repeats: int
) -> tuple[BucketCost, ...]:
    """``BucketCost`` of a shape-priced compressor (PowerSGD) on each bucket's tensors, every rank at once.

    The hook's fused call (``CompressedSync.sync_async(parts=...)`` on the flat allreduce, with error
    feedback) runs with a collective that returns its input at once: the time up to its first call
    is ``before_s``, the rest ``after_s``, and each call's bytes are a round.
    """
    comp = build(spec)
    scale = 1.0 / transport.world_size
    shapes = {t.name: torch.Size(t.shape) for t in profile.tensors}
    gen = torch.Generator().manual_seed(transport.rank)
    costs = []
    for bucket in buckets:
        parts = tuple((name, shapes[name]) for name in bucket)
        x = torch.randn(sum(shape.numel() for _, shape in parts), generator=gen)
        out = torch.empty_like(x)
        memory = ErrorFeedback()
        memory.keep_remainder("b", torch.zeros_like(x))  # a residual exists from the second step on
        _time_fused_call(comp, x, out, memory, parts, scale)  # warm-up: the initial Qs, the allocations
        before, after = [], []
        for _ in range(repeats):
            transport.barrier()
            b, a, rounds = _time_fused_call(comp, x, out, memory, parts, scale)
            before.append(b)
            after.append(a)
        slowest = slowest_over_ranks(transport, [statistics.median(before), statistics.median(after)])
        costs.append(BucketCost(before_s=slowest[0], after_s=slowest[1], rounds=rounds))
    return tuple(costs)


def _time_fused_call(
    comp: Compressor,
    x: torch.Tensor,
    out: torch.Tensor,
    memory: ErrorFeedback,
    parts: tuple[tuple[str, torch.Size], ...],
    scale: float,
) -> tuple[float, float, tuple[tuple[str, int], ...]]:
    """(seconds to the first collective, seconds after it, the rounds) of one fused call with error
    feedback, its collectives returning their input at once."""
    rounds: list[tuple[str, int]] = []
    marks: list[float] = []

    async def local(tensor: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        marks.append(time.perf_counter())
        rounds.append(("allreduce", tensor.numel() * tensor.element_size()))
        return tensor

    start = time.perf_counter()
    compensated = memory.compensate("b", x)
    call = comp.allreduce_sync(compensated, local, name="b", parts=parts, scale=scale, out=out)
    try:
        call.send(None)
    except StopIteration as stop:
        summed = stop.value
    else:  # pragma: no cover - the local collective never suspends
        call.close()
        raise RuntimeError(f"{comp.spec()}: allreduce_sync suspended on a collective that returns at once")
    memory.update("b", compensated, summed, scale=1.0, consume=True)
    bool(all_finite(summed))
    end = time.perf_counter()
    first = marks[0] if marks else end
    return first - start, end - first, tuple(rounds)


def _affine(x: Sequence[float], seconds: Sequence[float]) -> dict[str, float]:
    """``AffineCost`` fields of the clamped least-squares line (``clamped_fit``)."""
    fit = clamped_fit(x, seconds)
    return {"fixed_s": fit.fixed_s, "per_element_s": fit.per_element_s, "knee_elements": 0}

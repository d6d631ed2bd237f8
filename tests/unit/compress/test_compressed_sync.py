"""Compressed collective schemes on the simulated world equal their single-process definitions.

Every scheme is checked for world sizes 1..8 against the definition written out here with the same
compressor (flat), and for several (world size, ranks per node) pairs two-level. Data are small
integers, so sparsifiers and casts keep exact values and every summation order gives the same sum;
quantizers (whose values are products of norms and levels) are compared with a float tolerance.
Error feedback is checked by its conservation law: what was delivered plus every residual left
equals what the ranks put in.
"""

from __future__ import annotations

import pytest
import torch

from zensync.compress import COMPRESSED_SCHEMES, CompressedSync, build, hierarchy
from zensync.transport import SimulatedWorld, TrafficLog

SHAPE = (37, 5)
"""Neither dimension divides by the world sizes used, so chunks and shards are uneven."""
QUANTIZER_RTOL = 1e-5
"""Quantized values are norm * level / s in float32: sums in another order differ by a few ulps."""
EXACT = ("none", "fp16", "topk:0.2", "dgc:0.2", "randomk:0.3")
QUANTIZED = ("qsgd:16", "terngrad", "efsignsgd", "onebit")


def _data(rank: int, step: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-4, 5, SHAPE, generator=gen).float()


def _roundtrip(spec: str, x: torch.Tensor, name: str, step: int = 0) -> torch.Tensor:
    comp = build(spec)
    return comp.decompress(comp.compress(x, name=name, step=step))


def _definition(spec: str, scheme: str, inputs: list[torch.Tensor], name: str, step: int = 0) -> torch.Tensor:
    """What ``scheme`` must deliver for these per-rank inputs (no error feedback)."""
    n = len(inputs)
    if scheme in ("allreduce", "allgather") or n == 1:
        return sum((_roundtrip(spec, x, name, step) for x in inputs), torch.zeros(SHAPE))
    if scheme == "gather_broadcast":
        summed = sum((_roundtrip(spec, x, name, step) for x in inputs), torch.zeros(SHAPE))
        return _roundtrip(spec, summed, f"{name}#root#server", step)
    chunks = [x.reshape(-1).tensor_split(n) for x in inputs]
    out = []
    for j in range(n):
        summed = sum(_roundtrip(spec, c[j], f"{name}#{j}", step) for c in chunks)
        out.append(_roundtrip(spec, summed, f"{name}#{j}#server", step))
    return torch.cat(out).view(SHAPE)


def _schemes(spec: str) -> list[str]:
    allreduce_ok = build(spec).allreduce_compatible
    return [s for s in COMPRESSED_SCHEMES if s != "allreduce" or allreduce_ok]


def _run_flat(spec: str, scheme: str, n: int) -> list[torch.Tensor]:
    def body(t):  # type: ignore[no-untyped-def]
        sync = CompressedSync(spec, scheme, error_feedback=False)
        return sync.sync(_data(t.rank), t, name="w", step=0)

    return SimulatedWorld(n).run(body)


CASES = [(spec, scheme) for spec in EXACT + QUANTIZED for scheme in _schemes(spec)]


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize(("spec", "scheme"), CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_flat_scheme_equals_definition(spec: str, scheme: str, n: int) -> None:
    results = _run_flat(spec, scheme, n)
    expected = _definition(spec, scheme, [_data(r) for r in range(n)], "w")
    rtol = QUANTIZER_RTOL if spec in QUANTIZED else 0.0
    for rank, out in enumerate(results):
        assert out.shape == SHAPE and out.dtype == torch.float32
        torch.testing.assert_close(out, expected, rtol=rtol, atol=rtol, msg=lambda m, r=rank: f"rank {r}: {m}")


OUT_CASES = [*CASES, ("powersgd:2", "allreduce"), ("bf16", "allreduce")]


@pytest.mark.parametrize("error_feedback", [False, True])
@pytest.mark.parametrize(("spec", "scheme"), OUT_CASES, ids=[f"{s}-{c}" for s, c in OUT_CASES])
def test_out_the_input_itself_gives_the_new_tensor_result(spec: str, scheme: str, error_feedback: bool) -> None:
    """``out=x`` (the DDP hook passes its bucket) returns ``out`` holding exactly what the call without
    ``out`` returns, step after step, so the residuals and PowerSGD's warm start evolve alike."""
    if error_feedback and not build(spec).carries_nonfinite:
        pytest.skip(f"{spec} takes no error feedback")

    def body(t):  # type: ignore[no-untyped-def]
        fresh = CompressedSync(spec, scheme, error_feedback=error_feedback)
        inplace = CompressedSync(spec, scheme, error_feedback=error_feedback)
        pairs = []
        for step in range(3):
            x = _data(t.rank, step)
            given = x.clone()
            expected = fresh.sync(given, t, name="w", step=step)
            buf = x.clone()
            got = inplace.sync(buf, t, name="w", step=step, out=buf)
            pairs.append((expected, got, got is buf, torch.equal(given, x)))
        return pairs

    for rank, pairs in enumerate(SimulatedWorld(3).run(body)):
        for step, (expected, got, same, input_kept) in enumerate(pairs):
            assert same, f"rank {rank} step {step}: out was not returned"
            assert input_kept, f"rank {rank} step {step}: the call without out modified its input"
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m, r=rank, s=step: f"{r}/{s}: {m}")


@pytest.mark.parametrize("scale", [0.25, 1 / 3])
@pytest.mark.parametrize("spec", ["powersgd:2", "powersgd:1", "fp16", "bf16"])
def test_folded_scale_equals_scaling_first(spec: str, scale: float) -> None:
    """``sync(x, scale=s)`` (the hook's division folded into PowerSGD's factor, or into the cast) delivers
    what ``sync(s * x)`` does, step after step with PowerSGD's error feedback and warm start; the
    residual stays in x's units (1/s times the other's)."""

    def body(t):  # type: ignore[no-untyped-def]
        folded, first = CompressedSync(spec, "allreduce"), CompressedSync(spec, "allreduce")
        assert folded.folds_scale(hierarchical=False)
        out = []
        for step in range(3):
            x = _data(t.rank, step)
            buf = x.clone()
            got = folded.sync(buf, t, name="w", step=step, out=buf, scale=scale)
            out.append((got, first.sync(x * scale, t, name="w", step=step)))
        residuals = (folded.worker_memory.residual("w"), first.worker_memory.residual("w"))
        return out, residuals

    tol = 1e-5
    for pairs, (folded_res, first_res) in SimulatedWorld(3).run(body):
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        if first_res is not None:
            torch.testing.assert_close(folded_res * scale, first_res, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [0.25, 1 / 3])
@pytest.mark.parametrize(
    ("spec", "scheme", "two_level"),
    [
        ("topk:0.2", "allgather", False),
        ("dgc:0.2", "allgather", False),
        ("efsignsgd", "allgather", False),
        ("onebit", "alltoall_allgather", False),
        ("topk:0.2", "allgather", True),
        ("powersgd:2", "allreduce", True),
    ],
)
def test_error_feedback_folds_the_scale_into_its_compensation(
    spec: str, scheme: str, two_level: bool, scale: float
) -> None:
    """With error feedback, ``sync(x, scale=s)`` compensates ``s * x`` in the pass that adds the
    residual, and delivers what ``sync(s * x)`` does, step after step, with the same residual
    (in the units of ``s * x``); two-level too, where no collective folds a scale."""

    def body(t):  # type: ignore[no-untyped-def]
        levels = hierarchy(t, 2) if two_level else None
        folded, first = CompressedSync(spec, scheme), CompressedSync(spec, scheme)
        assert folded.folds_scale(hierarchical=two_level)
        out = []
        for step in range(3):
            # Distinct magnitudes (integer data has ties, which an ulp of rounding may reorder).
            x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + t.rank))
            buf = x.clone()
            got = folded.sync(buf, t, name="w", step=step, hierarchy=levels, out=buf, scale=scale)
            out.append((got.clone(), first.sync(x * scale, t, name="w", step=step, hierarchy=levels)))
        return out, folded.worker_memory.residual("w"), first.worker_memory.residual("w")

    # s * x + r and r + s * x (torch.add's alpha, perhaps fused) may round apart by an ulp: the
    # compressors see the same tensor up to that, and select the same of these distinct magnitudes.
    tol = 1e-5
    for pairs, folded_res, first_res in SimulatedWorld(4).run(body):
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        torch.testing.assert_close(folded_res, first_res, rtol=tol, atol=tol)


def test_scale_is_refused_where_it_cannot_be_folded() -> None:
    def body(t):  # type: ignore[no-untyped-def]
        errors = []
        cases = [  # no error feedback, so no compensation pass to fold the scale into
            ("topk:0.2", "allgather", None),
            ("fp16", "allgather", None),
            ("randomk:0.3", "allreduce", None),
            ("powersgd:2", "allreduce", hierarchy(t, 2)),
        ]
        for spec, scheme, levels in cases:
            sync = CompressedSync(spec, scheme, error_feedback=False)
            assert not sync.folds_scale(hierarchical=levels is not None)
            with pytest.raises(ValueError, match="does not fold a scale"):
                sync.sync(_data(t.rank), t, name="w", step=0, hierarchy=levels, scale=0.5)
            errors.append(True)
        return errors

    assert SimulatedWorld(4).run(body) == [[True] * 4] * 4


def test_powersgd_allreduce_is_exact_on_a_shared_low_rank_sum() -> None:
    """Each rank holds a_r * u v^T: the sum has rank 1, so one power iteration recovers it exactly."""
    n = 4
    gen = torch.Generator().manual_seed(3)
    u, v = torch.randn(SHAPE[0], 1, generator=gen), torch.randn(1, SHAPE[1], generator=gen)
    scales = [1.0, -2.0, 0.5, 3.0]

    def body(t):  # type: ignore[no-untyped-def]
        sync = CompressedSync("powersgd:1", "allreduce", error_feedback=False)
        return sync.sync(scales[t.rank] * (u @ v), t, name="w", step=0)

    results = SimulatedWorld(n).run(body)
    expected = sum(scales) * (u @ v)
    for out in results:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out, results[0], rtol=0, atol=0)


HIERARCHIES = [(4, 2), (6, 3), (6, 2), (8, 4)]


@pytest.mark.parametrize(("n", "k"), HIERARCHIES)
@pytest.mark.parametrize("scheme", ["allgather", "alltoall_allgather", "gather_broadcast"])
def test_two_level_equals_definition(n: int, k: int, scheme: str) -> None:
    spec = "topk:0.3"

    def body(t):  # type: ignore[no-untyped-def]
        levels = hierarchy(t, k)
        return CompressedSync(spec, scheme, error_feedback=False).sync(
            _data(t.rank), t, name="w", step=0, hierarchy=levels
        )

    results = SimulatedWorld(n).run(body)
    nodes = n // k
    inputs = [_data(r).reshape(-1) for r in range(n)]
    shards = []
    for local in range(k):
        # Shard ``local`` of each node's sum, then the flat scheme across the nodes.
        node_sums = [sum(inputs[m * k + i].tensor_split(k)[local] for i in range(k)) for m in range(nodes)]
        shards.append(_definition_1d(spec, scheme, node_sums, f"w@{local}"))
    expected = torch.cat(shards).view(SHAPE)
    for out in results:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _definition_1d(spec: str, scheme: str, inputs: list[torch.Tensor], name: str) -> torch.Tensor:
    n = len(inputs)
    zero = torch.zeros_like(inputs[0])
    if scheme == "allgather" or n == 1:
        return sum((_roundtrip(spec, x, name) for x in inputs), zero)
    if scheme == "gather_broadcast":
        return _roundtrip(spec, sum((_roundtrip(spec, x, name) for x in inputs), zero), f"{name}#root#server")
    chunks = [x.tensor_split(n) for x in inputs]
    out = []
    for j in range(n):
        summed = sum(_roundtrip(spec, c[j], f"{name}#{j}") for c in chunks)
        out.append(_roundtrip(spec, summed, f"{name}#{j}#server"))
    return torch.cat(out)


@pytest.mark.parametrize(
    ("spec", "scheme"),
    [
        ("topk:0.1", "allgather"),
        ("topk:0.1", "alltoall_allgather"),
        ("efsignsgd", "gather_broadcast"),
        ("efsignsgd", "allgather"),  # the residual computed as the payload is sent (Codec.keep_own)
        ("onebit", "allgather"),
        ("randomk:0.2", "allreduce"),
        ("powersgd:1", "allreduce"),
    ],
)
def test_error_feedback_conserves_the_sum(spec: str, scheme: str) -> None:
    """sum_t out_t + sum_i worker residual_i + server residuals == sum_t sum_i x_it (float64)."""
    n, steps = 3, 12

    def body(t):  # type: ignore[no-untyped-def]
        sync = CompressedSync(spec, scheme, error_feedback=True)
        delivered = torch.zeros(SHAPE, dtype=torch.float64)
        for step in range(steps):
            delivered += sync.sync(_data(t.rank, step).double(), t, name="w", step=step)
        server = {key: sync.server_memory.residual(key) for key in sync.server_memory.names()}
        return delivered, sync.worker_memory.residual("w"), server

    results = SimulatedWorld(n).run(body)
    put_in = sum(_data(r, s).double() for r in range(n) for s in range(steps))
    delivered = results[0][0]
    worker = sum(res[1] for res in results)
    if scheme == "alltoall_allgather":  # rank r owns chunk r's server residual
        server = torch.cat([results[r][2][f"w#{r}"].reshape(-1) for r in range(n)]).view(SHAPE)
    elif scheme == "gather_broadcast":  # the root owns the whole tensor's
        server = results[0][2]["w#root"]
    else:
        assert all(not res[2] for res in results)
        server = torch.zeros_like(put_in)
    torch.testing.assert_close(delivered + worker + server, put_in, rtol=1e-9, atol=1e-9)
    for res in results[1:]:
        torch.testing.assert_close(res[0], delivered, rtol=0, atol=0)


def test_bad_configuration_errors() -> None:
    with pytest.raises(ValueError, match="allreduce-compatible"):
        CompressedSync("topk:0.1", "allreduce")
    with pytest.raises(ValueError, match="scheme="):
        CompressedSync("fp16", "ring")
    world = SimulatedWorld(4)
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        world.run(lambda t: hierarchy(t, 3))


def test_auto_scheme_and_memory_report() -> None:
    assert CompressedSync("fp16").scheme == "allreduce"
    assert CompressedSync("topk:0.1").scheme == "allgather"

    def body(t):  # type: ignore[no-untyped-def]
        sync = CompressedSync("topk:0.1", "alltoall_allgather")
        sync.sync(_data(t.rank), t, name="w", step=0)
        return sync.memory_bytes

    n = 4
    per_rank = SimulatedWorld(n).run(body)
    numel = SHAPE[0] * SHAPE[1]
    chunks = torch.zeros(numel).tensor_split(n)
    for rank, nbytes in enumerate(per_rank):
        assert nbytes == 4 * (numel + chunks[rank].numel())  # worker residual + its chunk's server residual


_PARTS = (("a.weight", torch.Size([8, 6])), ("a.bias", torch.Size([6])), ("b.weight", torch.Size([5, 7])))


@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_powersgd_over_a_concatenation_equals_each_part_alone(scale: float) -> None:
    """PowerSGD given a bucket's concatenation and its parts approximates each part as when synced
    alone under its name (same P, Q, warm start, residual), bit for bit, step after step; three
    rounds in all (the bias, every P, every Q) instead of one per tensor and factor."""

    def body(t):  # type: ignore[no-untyped-def]
        fused = CompressedSync("powersgd:2", "allreduce")
        alone = {name: CompressedSync("powersgd:2", "allreduce") for name, _ in _PARTS}
        assert fused.fuses(hierarchical=False) and not fused.fuses(hierarchical=True)
        results = []
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + t.rank)
            tensors = [torch.randn(shape, generator=gen) for _, shape in _PARTS]
            flat = torch.cat([x.reshape(-1) for x in tensors])
            log = TrafficLog()
            with t.recording(log):
                got = fused.sync(flat, t, name="fused:a.bias", step=step, scale=scale, parts=_PARTS)
            rounds = sum(phase.collectives for phase in log.phases.values())
            expected = [
                alone[name].sync(x, t, name=name, step=step, scale=scale).reshape(-1)
                for (name, _), x in zip(_PARTS, tensors, strict=True)
            ]
            results.append((got, torch.cat(expected), rounds))
        residual = fused.worker_memory.residual("fused:a.bias")
        residuals = torch.cat([alone[name].worker_memory.residual(name).reshape(-1) for name, _ in _PARTS])
        return results, residual, residuals

    for results, residual, residuals in SimulatedWorld(3).run(body):
        for got, expected, rounds in results:
            assert torch.equal(got, expected)
            assert rounds == 3
        assert torch.equal(residual, residuals)


def test_parts_are_refused_where_nothing_syncs_them_part_by_part() -> None:
    def body(t):  # type: ignore[no-untyped-def]
        flat = torch.zeros(sum(s.numel() for _, s in _PARTS))
        for scheme, levels in (("allreduce", hierarchy(t, 2)), ("allgather", None)):
            with pytest.raises(ValueError, match="does not sync a concatenation part by part"):
                CompressedSync("powersgd:2", scheme).sync(flat, t, name="w", step=0, hierarchy=levels, parts=_PARTS)
        return True

    assert SimulatedWorld(4).run(body) == [True] * 4


@pytest.mark.parametrize(
    ("spec", "scheme"),
    [
        ("topk:0.2", "allgather"),
        ("efsignsgd", "allgather"),
        ("powersgd:2", "allreduce"),
        ("dgc:0.2", "alltoall_allgather"),
    ],
)
@pytest.mark.parametrize("seed", range(2))
def test_overlapping_calls_keep_their_own_step(spec: str, scheme: str, seed: int) -> None:
    """Two calls of one CompressedSync overlap on a lane (the first hands on after its last
    collective, as the DDP hook's buckets do): the first's input holds a NaN on one rank, so its
    step is dropped everywhere; the second's is kept, and its output, residuals and compressor
    state equal those of the same call made alone."""
    import random

    from zensync.transport import Lane, hand_on

    generators = [random.Random(seed * 7 + r) for r in range(3)]
    delays = SimulatedWorld(3, timeout_s=30, delay_s=lambda r: generators[r].random() * 0.004)
    clean = _data(0, step=5)

    def inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        poisoned = _data(rank, step=3)
        if rank == 1:
            poisoned[2, 1] = float("nan")
        return poisoned, _data(rank, step=4) + clean

    def overlapped(t):  # type: ignore[no-untyped-def]
        sync = CompressedSync(spec, scheme, error_feedback=build(spec).needs_error_feedback)
        poisoned, fine = inputs(t.rank)
        lane = Lane()
        first = lane.submit(sync.sync_async(poisoned, t, name="a", step=1, on_issued=hand_on))
        second = lane.submit(sync.sync_async(fine, t, name="b", step=1, on_issued=hand_on))
        assert lane.drain(timeout=20)
        return first.outcome(), second.outcome(), sync

    def alone(t):  # type: ignore[no-untyped-def]
        sync = CompressedSync(spec, scheme, error_feedback=build(spec).needs_error_feedback)
        return sync.sync(inputs(t.rank)[1], t, name="b", step=1), sync

    for (a, b, sync), (b_alone, sync_alone) in zip(delays.run(overlapped), SimulatedWorld(3).run(alone), strict=True):
        assert not torch.isfinite(a).all()
        assert torch.equal(b, b_alone)
        assert sync.worker_memory.residual("a") is None  # the poisoned step left nothing
        pairs = ((sync.worker_memory, sync_alone.worker_memory), (sync.server_memory, sync_alone.server_memory))
        for memory, reference in pairs:
            assert memory.names() == reference.names()
            for name in reference.names():
                assert torch.equal(memory.residual(name), reference.residual(name)), name
        if spec.startswith("powersgd"):
            kept, expected = sync.compressor.warm_starts(), sync_alone.compressor.warm_starts()
            assert set(kept) == set(expected) == {"b"}
            assert torch.equal(kept["b"], expected["b"])

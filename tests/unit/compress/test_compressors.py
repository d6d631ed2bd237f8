"""Every compressor against an independent float64 reference, plus sizes, specs, errors and EF.

References are written here from the algorithm definitions (zensync/compress/*.py docstrings), not by
calling the implementation: top-k ranks |x| in float64 with Python's stable ``sorted`` (ties at the
k-th magnitude go to the lowest positions); QSGD and TernGrad replay the documented shared-seed
draws (``shared_generator(seed, name, step, purpose=...)``); PowerSGD's power iteration and
orthogonalization are spelled out with an explicit two-round sum over simulated ranks.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from zensync import kernels
from zensync.compress import Compressed, ErrorFeedback, build, cast, compressor_names
from zensync.compress.base import shared_generator
from zensync.transport.handle import run_sync

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SIZES = (0, 1, 7, 128, 1000, 4097)
SPECS = (
    "none",
    "fp16",
    "bf16",
    "randomk:0.1",
    "randomk:0.3,scale=true,seed=5",
    "topk:0.05",
    "dgc:0.01",
    "dgc:0.2,sample_fraction=0.05,seed=2",
    "qsgd",
    "qsgd:4,16,seed=1",
    "terngrad",
    "terngrad:seed=9",
    "signsgd",
    "efsignsgd",
    "onebit",
    "powersgd:2",
    "powersgd:1,seed=4",
)
NAME, STEP = "layer.weight", 3
FP32_REL = 2e-6
"""Relative tolerance of a float32 result against float64 (a few ulps of float32 rounding)."""
EF_ATOL = 1e-10
"""Error feedback's sum identity in float64: 50 steps of O(10) sums round at ~1e-14, far below this."""


def rel_tol(dtype):
    """float32 arithmetic, then a cast to ``dtype``: the cast may round the other way than from float64 (1 ulp)."""
    return max(FP32_REL, torch.finfo(dtype).eps)


def randn(shape, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def roundtrip(comp, x, name=NAME, step=STEP):
    return comp.decompress(comp.compress(x, name=name, step=step))


def reference_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Dense float64 tensor keeping the k largest |x|; ties at the k-th magnitude keep the lowest positions."""
    flat = x.double().reshape(-1).tolist()
    keep = sorted(range(len(flat)), key=lambda i: -abs(flat[i]))[:k]  # stable: equal |x| keep index order
    out = [0.0] * len(flat)
    for i in keep:
        out[i] = flat[i]
    return torch.tensor(out, dtype=torch.float64).view(x.shape)


def k_of(ratio: float, numel: int) -> int:
    return 0 if numel == 0 else min(numel, max(1, math.ceil(round(ratio * numel, 6))))


# -- registry, specs, errors -------------------------------------------------------------------------------------------
def test_every_algorithm_is_registered():
    expected = {"none", "fp16", "bf16", "randomk", "topk", "dgc", "qsgd", "terngrad", "signsgd", "efsignsgd", "onebit"}
    assert expected | {"powersgd"} == set(compressor_names())


@pytest.mark.parametrize(
    ("ratio", "numel", "k"), [(0.07, 100, 7), (0.29, 100, 29), (0.01, 1, 1), (0.5, 3, 2), (1, 5, 5)]
)
def test_k_is_ceil_of_ratio_times_numel(ratio, numel, k):
    # 0.07 * 100 is 7.000000000000001 in floating point: k must still be 7.
    for spec in (f"topk:{ratio}", f"dgc:{ratio}", f"randomk:{ratio}"):
        assert build(spec).compress(randn(numel)).payloads[0].numel() == k, spec
    assert k_of(ratio, numel) == k


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trip(spec):
    comp = build(spec)
    rebuilt = build(comp.spec())
    assert rebuilt == comp and hash(rebuilt) == hash(comp) and rebuilt.spec() == comp.spec()
    config = getattr(comp, "config", None)  # compressors without options have no Config
    assert config is None or config.build() == comp


def test_equality_follows_hyperparameters():
    assert build("topk:0.010") == build("topk:0.01") != build("topk:0.02")
    assert build("randomk:0.1") != build("randomk:0.1,seed=1") != build("randomk:0.1,seed=1,scale=true")
    assert build("randomk:0.1", seed=1) == build("randomk:0.1,seed=1")
    assert build("qsgd") == build("qsgd:127,128") != build("qsgd:127,64")


@pytest.mark.parametrize(
    ("spec", "options", "param"),
    [
        ("topk:0", {}, "ratio"),
        ("topk:1.5", {}, "ratio"),
        ("topk:nan", {}, "ratio"),
        ("topk:abc", {}, "ratio"),
        ("randomk:-0.1", {}, "ratio"),
        ("randomk:0.1,scale=maybe", {}, "scale"),
        ("randomk:0.1,seed=x", {}, "seed"),
        ("dgc:2", {}, "ratio"),
        ("dgc:0.1,sample_fraction=0", {}, "sample_fraction"),
        ("qsgd:0", {}, "levels"),
        ("qsgd:128", {}, "levels"),
        ("qsgd:2.5", {}, "levels"),
        ("qsgd:4,0", {}, "bucket"),
        ("powersgd:0", {}, "rank"),
        ("powersgd:1.5", {}, "rank"),
        ("powersgd", {}, "rank"),
        ("terngrad:seed=1.5", {}, "seed"),
        ("topk:0.1,bogus=1", {}, "bogus"),
        ("topk:0.1,ratio=0.2", {}, "ratio"),
        ("randomk:0.1,seed=1", {"seed": 2}, "seed"),
        ("nosuch:1", {}, "unknown compressor 'nosuch'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_parameter(spec, options, param):
    with pytest.raises(ValueError, match=param):
        build(spec, **options)


# -- sizes, shapes, dtypes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_payload_bytes_match_payloads(spec):
    comp = build(spec)
    for dtype in DTYPES:
        for numel in SIZES:
            packed = comp.compress(randn(numel, dtype, seed=numel), name=NAME, step=STEP)
            assert comp.payload_bytes(numel, dtype) == packed.nbytes, (dtype, numel)
            out = comp.decompress(packed)
            assert out.shape == (numel,) and out.dtype == dtype


@pytest.mark.parametrize("shape", [(40, 25), (64, 64), (4, 3), (1, 50), (3, 4, 5), (0, 7), (7, 0)])
def test_powersgd_payload_bytes_with_shape(shape):
    comp = build("powersgd:2")
    numel = math.prod(shape)
    for dtype in DTYPES:
        packed = comp.compress(randn(shape, dtype), name=NAME)
        assert comp.payload_bytes(numel, dtype, shape=shape) == packed.nbytes, dtype
    with pytest.raises(ValueError, match="shape"):
        comp.payload_bytes(numel + 1, shape=shape)


@pytest.mark.parametrize("spec", SPECS)
def test_shape_dtype_and_non_contiguous_input(spec):
    for dtype in DTYPES:
        base = randn((30, 40), dtype, seed=1)
        for x in (base.T, base[:, ::3], base[::2]):
            assert not x.is_contiguous()
            out = roundtrip(build(spec), x)  # fresh instances: PowerSGD's warm start is state
            assert out.shape == x.shape and out.dtype == x.dtype
            assert torch.equal(out, roundtrip(build(spec), x.contiguous()))


# -- each algorithm against its reference ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_casts(dtype):
    x = randn(1000, dtype) * 100
    assert torch.equal(roundtrip(build("none"), x), x)
    for spec, wire, mantissa_bits in (("fp16", torch.float16, 10), ("bf16", torch.bfloat16, 7)):
        out = roundtrip(build(spec), x)
        assert build(spec).compress(x).payloads[0].dtype == wire
        # Round to nearest: relative error at most half an ulp of the wire format.
        assert ((out.double() - x.double()).abs() <= x.double().abs() * 2.0 ** -(mantissa_bits + 1)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", ["fp16", "bf16"])
def test_cast_folds_a_scale_into_its_pass(spec, dtype):
    """compress_scaled(x, s) is compress(x * s), bit for bit: over several scratch chunks (the last
    one partial), on a non-contiguous x, and where casting first would overflow fp16 (the division
    brings 1e5 back in range)."""
    base = randn(2 * (1 << 17) + 125, dtype, seed=5) * 100  # a multiple of 3
    if torch.finfo(dtype).max > 1e5:  # an fp16 input cannot hold it
        base[7] = 1e5
    comp = build(spec)
    for x, scale in ((base, 0.25), (base, 1 / 3), (base.view(-1, 3)[:, 1], 0.5), (base[:10], 1.0)):
        payload = comp.compress_scaled(x, scale).payloads[0]
        expected = comp.compress(x * scale).payloads[0]
        assert payload.shape == x.shape and payload.dtype == comp.wire_dtype
        assert torch.equal(payload, expected), (spec, scale)
    assert bool(torch.isfinite(comp.compress_scaled(base, 0.25).payloads[0]).all())


@pytest.mark.parametrize("spec", ["fp16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
@pytest.mark.parametrize("into", ["new", "x", "strided"])
def test_cast_pipeline_issues_every_piece_before_its_first_wait(spec, scale, into, monkeypatch):
    """On CPU a cast of two pieces or more is summed piece by piece: every piece is issued
    (``AllReduce`` called) before the first is awaited, the last piece alone says last, and the
    result is the definition: each rank's ``scale * x`` cast to the wire, summed in rank order in
    the wire dtype, cast back (into x itself with ``out=x``, into a strided ``out``). Pieces of 2^16 here (each over the
    scale-and-cast's scratch chunk), 2^21 in use."""
    monkeypatch.setattr(cast, "_PIPELINE_PIECE", 1 << 16)
    numel, n = 3 * (1 << 16) + 1000, 3
    piece = -(-numel // 3)
    inputs = [randn(numel, torch.float32, seed=40 + r) * 10 for r in range(n)]
    comp = build(spec)
    wires = [(x * scale).to(comp.wire_dtype) for x in inputs]
    expected = (wires[0] + wires[1] + wires[2]).float()
    barrier, slots = threading.Barrier(n, timeout=20), [[] for _ in range(n)]
    events: list[tuple] = []

    def all_reduce_of(rank):
        def all_reduce(t, *, last=False):
            index = len(slots[rank])
            slots[rank].append(t.clone())
            if rank == 0:
                events.append(("issue", t.numel(), last))

            async def wait():
                if rank == 0:
                    events.append(("wait", index))
                barrier.wait()
                total = slots[0][index] + slots[1][index] + slots[2][index]
                barrier.wait()
                return total

            return wait()

        return all_reduce

    def rank_body(r):
        x = inputs[r].clone()
        out = {"new": None, "x": x, "strided": torch.empty(2 * numel)[::2]}[into]
        result = run_sync(comp.allreduce_sync(x, all_reduce_of(r), name=NAME, step=STEP, scale=scale, out=out))
        assert result is out if out is not None else result.shape == x.shape
        return result

    with ThreadPoolExecutor(max_workers=n) as pool:
        results = [f.result() for f in [pool.submit(rank_body, r) for r in range(n)]]
    for result in results:
        assert result.dtype == torch.float32 and torch.equal(result, expected), spec
    assert events == [
        ("issue", piece, False),
        ("issue", piece, False),
        ("issue", numel - 2 * piece, True),
        ("wait", 0),
        ("wait", 1),
        ("wait", 2),
    ]


def test_cast_pipeline_piece_count_is_bounded(monkeypatch):
    """numel // piece pieces of even sizes (ceil(numel / count), the last one shorter), at most 64;
    under two pieces, one round of the whole. (Pieces of 1024 here, 2^21 in use.)"""
    monkeypatch.setattr(cast, "_PIPELINE_PIECE", 1024)
    comp = build("fp16")
    for numel, count in ((65 * 1024 + 7, 64), (2047, 1), (2048, 2), (3 * 1024 + 1023, 3), (0, 1)):
        seen: list[int] = []

        async def all_reduce(t, *, last=False, seen=seen):
            seen.append(t.numel())
            return t

        x = torch.arange(numel, dtype=torch.float32)
        out = run_sync(comp.allreduce_sync(x, all_reduce, name=NAME, step=STEP))
        piece = -(-numel // count)
        assert len(seen) == count and seen[:-1] == [piece] * (count - 1) and sum(seen) == numel
        assert torch.equal(out, x.half().float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_and_dgc_match_reference_topk(dtype):
    for numel, ratio in ((1, 0.5), (7, 0.3), (1000, 0.01), (40_000, 0.01), (70_001, 0.003)):
        x = randn(numel, dtype, seed=numel)
        expected = reference_topk(x, k_of(ratio, numel))
        for spec in (f"topk:{ratio}", f"dgc:{ratio}"):
            assert torch.equal(roundtrip(build(spec), x).double(), expected), (spec, numel)


def test_topk_index_dtype_and_tie_rule():
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0])
    values, indices = build("topk:0.5").compress(x).payloads
    assert indices.dtype == torch.int32 and indices.tolist() == [1, 2, 3]  # |2.0| at 2 beats the ties at 4, 5
    assert values.tolist() == [-3.0, 2.0, 3.0]


ADVERSARIAL = {
    "all_equal": lambda n: torch.full((n,), 0.5),
    "many_ties": lambda n: torch.arange(n).remainder(3).float() - 1.0,
    "single_spike": lambda n: torch.zeros(n).index_fill_(0, torch.tensor([n // 3]), 1e6) + 1e-3,
    "all_zeros": lambda n: torch.zeros(n),
    # 1 % of the elements at 1e6: the sampled threshold stays among the spikes for all relaxations,
    # so a 2 % selection takes the exact fallback.
    "dense_spikes": lambda n: torch.where(torch.arange(n) % 100 == 7, 1e6, randn(n, torch.float32).abs()),
    "negative_ramp": lambda n: -torch.linspace(0, 1, n),
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
@pytest.mark.parametrize("ratio", [0.001, 0.02, 0.5])
def test_dgc_sends_exactly_k_for_adversarial_inputs(case, ratio):
    numel = 50_000
    x = ADVERSARIAL[case](numel)
    comp = build(f"dgc:{ratio}")
    for step in range(3):
        values, indices = comp.compress(x, name=NAME, step=step).payloads
        assert values.numel() == indices.numel() == indices.unique().numel() == k_of(ratio, numel)
        assert torch.equal(roundtrip(comp, x, step=step).double(), reference_topk(x, k_of(ratio, numel)))


def test_randomk_indices_are_shared_by_ranks_and_vary_by_step():
    x = randn(5000)
    rank0, rank1 = build("randomk:0.01,seed=7"), build("randomk:0.01,seed=7")
    kept0 = roundtrip(rank0, x, step=4).nonzero().squeeze(1)
    kept1 = roundtrip(rank1, randn(5000, seed=1), step=4).nonzero().squeeze(1)
    assert kept0.numel() == 50 and torch.equal(kept0, kept1)
    assert not torch.equal(kept0, roundtrip(rank0, x, step=5).nonzero().squeeze(1))
    assert not torch.equal(kept0, roundtrip(rank0, x, name="other", step=4).nonzero().squeeze(1))
    assert not torch.equal(kept0, roundtrip(build("randomk:0.01,seed=8"), x, step=4).nonzero().squeeze(1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_randomk_values(dtype):
    x = randn(1000, dtype) + 10.0  # no zeros, so the support is visible
    for spec, factor in (("randomk:0.1", 1.0), ("randomk:0.1,scale=true", 10.0)):
        out = roundtrip(build(spec), x)
        kept = out != 0
        assert int(kept.sum()) == 100
        assert torch.equal(out[kept], (x[kept].double() * factor).to(dtype))


def replay_draws(purpose, numel, dtype, seed=0):
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.rand(numel, generator=shared_generator(seed, NAME, STEP, purpose=purpose), dtype=compute).double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("levels", "bucket"), [(127, 128), (4, 16), (1, 5)])
def test_qsgd_matches_replayed_reference(dtype, levels, bucket):
    numel = 1000
    x = randn(numel, dtype, seed=levels)
    x[bucket : 2 * bucket] = 0  # one all-zero bucket
    comp = build(f"qsgd:{levels},{bucket}")
    signed, norms = comp.compress(x, name=NAME, step=STEP).payloads
    x64 = x.double()
    padded = torch.cat([x64, x64.new_zeros(-numel % bucket)]).view(-1, bucket)
    ref_norms = padded.pow(2).sum(1).sqrt()
    assert torch.allclose(norms.double(), ref_norms, rtol=FP32_REL, atol=0)
    norm = norms.double().repeat_interleave(bucket)[:numel]  # the fp32 wire norm, as the definition says
    ratio = torch.where(norm > 0, x64.abs() / norm * levels, 0.0)
    dithered = ratio + replay_draws("qsgd", numel, dtype)
    level = dithered.floor().clamp(0, levels)
    # float32 arithmetic may floor the other way where the dithered value is within rounding of an integer.
    ambiguous = (dithered - dithered.round()).abs() < 1e-4
    got = signed.double().abs()
    assert ((got == level) | (ambiguous & ((got - level).abs() <= 1))).all()
    assert int(ambiguous.sum()) < numel // 50  # the exemption is rare, so the check has teeth
    assert torch.equal(signed.double().sign() * (got > 0), x64.sign() * (got > 0))
    expected = norm * signed.double() / levels
    out = comp.decompress(Compressed((signed, norms), (x.shape, dtype)))
    assert torch.allclose(out.double(), expected.to(dtype).double(), rtol=rel_tol(dtype), atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_terngrad_matches_replayed_reference(dtype):
    x = randn(2000, dtype)
    packed, scale = build("terngrad").compress(x, name=NAME, step=STEP).payloads
    assert packed.dtype == torch.uint8 and packed.numel() == x.numel() // 4  # 2-bit codes, four per byte
    ternary = kernels.unpack_bits(packed, 2, x.numel()).to(torch.int8) - 1
    x64 = x.double()
    # The scale is the smallest float32 >= max |x|, so every probability |x| / scale is <= 1.
    below = torch.nextafter(scale, torch.zeros(1))
    assert scale.dtype == torch.float32 and below.item() < x64.abs().max().item() <= scale.item()
    draws, probability = replay_draws("terngrad", x.numel(), dtype), x64.abs() / scale.double()
    # float32 arithmetic may decide the other way where the draw is within rounding of the probability.
    decided = (draws - probability).abs() > 1e-6
    assert torch.equal(
        (ternary.double() - x64.sign() * (draws < probability))[decided], torch.zeros(int(decided.sum()))
    )
    assert int(decided.sum()) > x.numel() - 5
    out = roundtrip(build("terngrad"), x)
    assert torch.equal(out, (scale.double() * ternary.double()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_family(dtype):
    x = randn(1001, dtype)
    x[:3] = torch.tensor([0.0, -0.0, -1.0], dtype=dtype)
    x64 = x.double()
    sign = torch.where(x64 >= 0, 1.0, -1.0)  # 0 and -0.0 count as +1
    assert torch.equal(roundtrip(build("signsgd"), x), sign.to(dtype))
    mean_magnitude = x64.abs().mean()
    ef_out = roundtrip(build("efsignsgd"), x).double()
    assert torch.allclose(ef_out, (sign * mean_magnitude).to(dtype).double(), rtol=rel_tol(dtype), atol=0)
    means = torch.where(x64 >= 0, x64[x64 >= 0].mean(), x64[x64 < 0].mean())
    onebit_out = roundtrip(build("onebit"), x).double()
    assert torch.allclose(onebit_out, means.to(dtype).double(), rtol=rel_tol(dtype), atol=0)


def test_sign_bits_are_little_endian_packed():
    x = torch.tensor([1.0, -1, -1, 1, -1, -1, -1, -1, 1, 1, -1])  # non-negative at 0, 3, 8, 9
    (packed,) = build("signsgd").compress(x).payloads
    assert packed.dtype == torch.uint8 and packed.tolist() == [0b1001, 0b11]


def test_onebit_with_one_empty_group():
    x = torch.tensor([1.0, 2.0, 4.0])
    _, scales = build("onebit").compress(x).payloads
    assert scales.tolist() == pytest.approx([7 / 3, 0.0])


# -- PowerSGD ----------------------------------------------------------------------------------------------------------
def run_ranks(comps, inputs, name=NAME, lasts=None):
    """allreduce_sync on len(comps) threads sharing a fake all_reduce: sum over ranks in rank order.

    Each thread drives its rank's coroutine to completion (``run_sync``); the fake ``all_reduce`` is
    a coroutine that meets the other ranks at a barrier. A failing rank leaves the others at the
    barrier until its timeout, then every error surfaces. ``lasts``: a list that receives rank 0's
    ``last`` flag of each round.
    """
    n = len(comps)
    barrier, slots = threading.Barrier(n, timeout=10), [None] * n

    def all_reduce_of(rank):
        async def all_reduce(t, *, last=False):
            if rank == 0 and lasts is not None:
                lasts.append(last)
            slots[rank] = t.clone()
            barrier.wait()
            total = sum(slots[1:], slots[0].clone())
            barrier.wait()
            return total

        return all_reduce

    def rank_body(r):
        return run_sync(comps[r].allreduce_sync(inputs[r], all_reduce_of(r), name=name, step=STEP))

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(rank_body, r) for r in range(n)]
        return [f.result() for f in futures]


def test_powersgd_allreduce_sync_is_the_two_round_algorithm():
    shape, rank, num_ranks = (24, 3, 5), 2, 3
    comps = [build(f"powersgd:{rank},seed=1") for _ in range(num_ranks)]
    q = comps[0].initial_q(NAME, 15, torch.float64)
    assert torch.allclose(q.T @ q, torch.eye(rank, dtype=torch.float64), atol=1e-12)
    for step in range(3):  # warm start: each step continues from the previous summed Q
        inputs = [randn(shape, seed=10 * step + r) for r in range(num_ranks)]
        matrices = [x.reshape(24, 15) for x in inputs]
        p = torch.linalg.qr(sum(m @ q for m in matrices), mode="reduced").Q
        q = sum(m.T @ p for m in matrices)
        expected = (p @ q.T).reshape(shape)
        lasts: list[bool] = []
        for out in run_ranks(comps, inputs, lasts=lasts):
            assert torch.allclose(out, expected, rtol=0, atol=1e-12), step
        assert lasts == [False, True]  # the Q round is the last: the hook may hand its lane on there


def test_allreduce_sync_marks_only_its_final_round_last(monkeypatch):
    """Every allreduce compressor's last round, and only it, says so (``AllReduce``'s ``last``);
    the casts' pipeline too, with an ``all_reduce`` that issues at the await."""
    monkeypatch.setattr(cast, "_PIPELINE_PIECE", 1 << 10)
    x = randn((24, 15), seed=4)
    vector = randn((30,), seed=5)
    parts = (("a", torch.Size([24, 15])), ("b", torch.Size([30])))
    cases = [(spec, x, None) for spec in ("fp16", "bf16", "none", "randomk:0.1", "powersgd:2")]
    cases.append(("powersgd:2", vector, None))
    cases.append(("powersgd:2", torch.cat([x.reshape(-1), vector]), parts))
    cases += [(spec, randn((3 << 10) + 5, seed=6), None) for spec in ("fp16", "bf16")]
    for spec, tensor, fused in cases:
        lasts: list[bool] = []
        comp = build(spec)

        async def all_reduce(t, *, last=False, lasts=lasts):
            lasts.append(last)
            return t.clone()

        out = run_sync(comp.allreduce_sync(tensor, all_reduce, name=NAME, step=STEP, parts=fused))
        assert lasts and lasts[-1] and not any(lasts[:-1]), (spec, lasts)
        if tensor.numel() > 3 << 10:
            assert len(lasts) == 3 and torch.equal(out, comp.decompress(comp.compress(tensor))), spec


def test_powersgd_exact_when_the_sum_has_rank_at_most_r():
    rank = 3
    u, v = randn((40, rank), seed=1), randn((30, rank), seed=2)
    low_rank = u @ v.T
    noise = randn((40, 30), seed=3)  # full rank on each rank, cancels in the sum
    inputs = [low_rank + noise, -noise, torch.zeros(40, 30, dtype=torch.float64)]
    outs = run_ranks([build(f"powersgd:{rank}") for _ in inputs], inputs)
    for out in outs:
        assert torch.allclose(out, low_rank, rtol=0, atol=1e-10)
    comp = build(f"powersgd:{rank}")
    assert torch.allclose(roundtrip(comp, low_rank), low_rank, rtol=0, atol=1e-10)


def test_powersgd_standalone_is_one_power_iteration():
    comp = build("powersgd:2")
    m = randn((50, 20))
    q0 = comp.initial_q(NAME, 20, torch.float64)
    p, q = comp.compress(m, name=NAME).payloads
    assert p.shape == (50, 2) and q.shape == (20, 2)
    # P spans M Q0, and P Q^T is the projection of M onto that span (basis-independent).
    basis = torch.linalg.svd(m @ q0, full_matrices=False).U
    assert torch.allclose(comp.decompress(Compressed((p, q), m.shape)), basis @ basis.T @ m, atol=1e-12)


def test_powersgd_warm_start_is_per_name_and_resets_on_shape_change():
    comp, fresh = build("powersgd:2"), build("powersgd:2")
    first, second = randn((20, 10), seed=1), randn((30, 10), seed=2)
    roundtrip(comp, first)
    assert comp.memory_bytes == 10 * 2 * 8
    assert not torch.equal(roundtrip(comp, first), roundtrip(fresh, first, name="other"))  # warm vs initial Q
    assert torch.equal(roundtrip(comp, second), roundtrip(build("powersgd:2"), second))  # new shape: initial Q
    comp.clear()
    assert comp.memory_bytes == 0


@pytest.mark.parametrize("shape", [(100,), (4, 3), (2, 2, 1), (1, 1), (0, 5), (3,)])
def test_powersgd_passthrough_for_1d_and_small(shape):
    comp = build("powersgd:2")
    inputs = [randn(shape, seed=r) for r in range(3)]
    assert comp.matrix_shape(shape) is None
    (payload,) = comp.compress(inputs[0]).payloads
    assert torch.equal(payload, inputs[0])
    for out in run_ranks([build("powersgd:2") for _ in inputs], inputs):
        assert torch.equal(out, inputs[0] + inputs[1] + inputs[2])


# -- error feedback ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk:0.05", "dgc:0.01", "efsignsgd", "onebit"])
def test_error_feedback_conserves_the_sum(spec):
    comp, memory = build(spec), ErrorFeedback()
    sent = torch.zeros(20_000, dtype=torch.float64)
    total = torch.zeros_like(sent)
    for step in range(50):
        grad = randn(20_000, seed=step)
        total += grad
        corrected = memory.compensate(NAME, grad)
        transmitted = roundtrip(comp, corrected, step=step)
        memory.update(NAME, corrected, transmitted)
        sent += transmitted
    residual = memory.residual(NAME)
    assert residual is not None and residual.abs().max() > 0  # compression really dropped something
    assert torch.allclose(sent + residual, total, rtol=0, atol=EF_ATOL)


@pytest.mark.parametrize("spec", ["topk:0.01", "dgc:0.01"])
@pytest.mark.parametrize("numel", [1000, 40_000])
def test_nan_gradients_are_sent_not_dropped(spec: str, numel: int) -> None:
    """A NaN ranks above every number (as torch.topk), so it reaches every rank and shows up there."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    x[numel // 3] = float("nan")
    comp = build(spec)
    out = comp.decompress(comp.compress(x, name="w", step=0))
    assert torch.isnan(out[numel // 3]) and int(torch.isnan(out).sum()) == 1

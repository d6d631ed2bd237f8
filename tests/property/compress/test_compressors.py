"""Properties every compressor must have, on Hypothesis-drawn shapes, dtypes and values.

1. decompress(compress(x)) has x's shape and dtype, and ``payload_bytes`` is the payloads' size.
2. The payload layout (shapes, dtypes) depends only on x's shape and dtype, not its values, so a rank
   can unpack another rank's payloads with its own layout (``zensync.compress.collectives``).
3. Compression is deterministic given (x, name, step, seed).
4. random-k with ``scale=True``, QSGD and TernGrad are unbiased: the mean of ``NUM_DRAWS``
   decompressions (one per step, so each has fresh shared-seed draws) is within Bernstein's bound of
   x, at a false-alarm probability (``FALSE_ALARM``) small enough for every element of a 20x run.

The statistical test also runs with ``derandomize=True``: Hypothesis draws the same examples on every
run, so it either always passes or always fails (for a given example count).
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, example, given, settings

from tests.strategies import DENSE_DTYPES, assert_identical, examples
from zensync.compress import build
from zensync.compress.base import fp32_round_up
from zensync.compress.collectives.base import sum_in_rank_order

SPECS = (
    "none",
    "fp16",
    "bf16",
    "randomk:0.2",
    "randomk:0.5,scale=true",
    "topk:0.1",
    "dgc:0.05",
    "qsgd:127,128",
    "qsgd:3,5",
    "terngrad",
    "signsgd",
    "efsignsgd",
    "onebit",
    "powersgd:1",
    "powersgd:3",
)
UNBIASED_SPECS = ("randomk:0.25,scale=true", "qsgd:4,8", "terngrad")
NUM_DRAWS = 2000
FALSE_ALARM = 1e-9
"""Allowed probability that one element of one unbiased example lands outside its tolerance. A 20x run
(ZENSYNC_HYPOTHESIS_SCALE=20: 160 examples of at most 48 elements) checks under 8e3 elements, so an
unbiased compressor fails it with probability below 1e-5."""
_LOG_TERM = math.log(2 / FALSE_ALARM)
SIGMAS = math.sqrt(2 * _LOG_TERM)
"""Bernstein's inequality for the mean of N independent draws with per-draw std sigma and
|draw - mean| <= b: P(|mean - x| >= t) <= 2 exp(-N t^2 / (2 sigma^2 + 2 b t / 3)), so at
t = SIGMAS sigma / sqrt(N) + RARE_EVENT_JUMPS b / N it is at most FALSE_ALARM (6.5 standard errors).
The second term matters when a Bernoulli probability p is tiny: the count of successes is
Poisson-like and its tail is heavier than the normal one."""
RARE_EVENT_JUMPS = 2 * _LOG_TERM / 3
"""The jump term's factor (14.3 single-draw jumps / NUM_DRAWS); b comes from ``_std_and_jump``."""
ROUNDING_SLACK = 1e-12
"""Relative to max |x|: float64 arithmetic. Each draw is at most 4 max |x| (random-k's numel / k scale)
and carries a few roundings of 2^-53; their mean over NUM_DRAWS adds at most NUM_DRAWS roundings of
the running sum, 2000 * 2^-53 * 4 < 1e-12 (norms and scales are rounded up to fp32, which keeps them
exact)."""

FAST = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=examples(8), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(
    draw: st.DrawFn, min_dims: int = 0, max_dims: int = 3, min_side: int = 0, max_side: int = 40, dtypes=DENSE_DTYPES
) -> torch.Tensor:
    """Generates: 0-3 dims (0-sized included), a dtype, N(0, 1) values at scale 1e-3..1e3, some exact zeros."""
    shape = tuple(draw(st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims)))
    dtype = draw(st.sampled_from(dtypes))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    x[torch.rand(shape, generator=generator) < draw(st.sampled_from([0.0, 0.3]))] = 0.0
    return x.to(dtype)


def _payload_bytes(comp, x: torch.Tensor) -> int:
    if comp.name == "powersgd":
        return comp.payload_bytes(x.numel(), x.dtype, shape=tuple(x.shape))
    return comp.payload_bytes(x.numel(), x.dtype)


def _layout(packed) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(p.shape), p.dtype) for p in packed.payloads]


@FAST
@given(spec=st.sampled_from(SPECS), x=tensors(), step=st.integers(0, 10**6))
def test_shape_dtype_size_layout_and_determinism(spec, x, step):
    comp = build(spec)
    packed = comp.compress(x, name="p", step=step)
    out = comp.decompress(packed)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert _payload_bytes(comp, x) == packed.nbytes
    generator = torch.Generator().manual_seed(step)
    different = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(x.dtype)
    other = build(spec).compress(different, name="p", step=step)
    assert _layout(other) == _layout(packed)
    again = build(spec).compress(x, name="p", step=step)
    assert all(torch.equal(a, b) for a, b in zip(again.payloads, packed.payloads, strict=True))


def _std_and_jump(spec: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Analytic per-element std of one decompression, and the largest single-draw deviation (Bernstein's b)."""
    x = x.reshape(-1)
    magnitude = x.abs()
    if spec.startswith("randomk"):
        numel, k = x.numel(), math.ceil(0.25 * x.numel())
        # kept with probability p = k / n, then scaled by 1 / p: variance x^2 (1 / p - 1).
        return magnitude * math.sqrt(numel / k - 1), magnitude * numel / k
    if spec.startswith("qsgd"):
        levels, bucket = 4, 8
        padded = torch.cat([x, x.new_zeros(-x.numel() % bucket)]).view(-1, bucket)
        norm = fp32_round_up(padded.norm(dim=1)).double().repeat_interleave(bucket)[: x.numel()]
        scaled = torch.where(norm > 0, magnitude / norm * levels, 0.0)
        fraction = scaled - scaled.floor()
        step = norm / levels  # one level
        return step * (fraction * (1 - fraction)).sqrt(), step
    scale = fp32_round_up(magnitude.max()).double()
    probability = torch.where(scale > 0, magnitude / scale, 0.0)  # all zeros: nothing is kept, std 0
    return scale * (probability * (1 - probability)).sqrt(), scale.expand_as(x)


@SLOW
@given(
    spec=st.sampled_from(UNBIASED_SPECS),
    x=tensors(min_dims=1, max_dims=1, min_side=1, max_side=48, dtypes=(torch.float64,)),
)
@example(spec="terngrad", x=torch.zeros(1, dtype=torch.float64))  # the 20x run: 0 / 0 made the std NaN
def test_unbiased_estimators(spec, x):
    comp = build(spec)
    draws = torch.stack([comp.decompress(comp.compress(x, name="u", step=t)) for t in range(NUM_DRAWS)])
    std, jump = _std_and_jump(spec, x)
    tolerance = SIGMAS * std / math.sqrt(NUM_DRAWS) + RARE_EVENT_JUMPS * jump / NUM_DRAWS
    slack = ROUNDING_SLACK * float(x.abs().max())
    deviation = (draws.mean(0) - x).abs().reshape(-1)
    assert (deviation <= tolerance + slack).all(), (deviation - tolerance).max()


@FAST
@given(
    spec=st.sampled_from(SPECS),
    x=tensors(),
    senders=st.integers(1, 5),
    step=st.integers(0, 10**6),
    special=st.sampled_from([None, math.nan, math.inf, -0.0]),
)
def test_decompress_sum_and_subtract_transmitted_equal_their_definitions(spec, x, senders, step, special):
    """The one-pass sum of several senders (``decompress_sum``) is bit for bit ``sum_in_rank_order`` of
    the decompressions, and ``subtract_transmitted`` is x - decompress(compress(x)) wherever x is
    finite (a non-finite x makes the step's output non-finite, and its residual is dropped), up to the
    sign of a zero."""
    comp = build(spec)
    inputs = [x * (r + 1) for r in range(senders)]
    if special is not None and x.numel():
        inputs[0].view(-1)[0] = special
    parts = [comp.compress(t, name="p", step=step) for t in inputs]
    expected = sum_in_rank_order([comp.decompress(p) for p in parts], x)
    out = torch.full_like(x, math.nan)
    assert comp.decompress_sum(parts, out) is out
    assert_identical(out, expected)
    residual = inputs[0].clone()
    assert comp.subtract_transmitted(residual, parts[0]) is residual
    definition = inputs[0] - comp.decompress(parts[0])
    finite = inputs[0].isfinite()
    # Equal values (top-k's zeroed positions may be +0.0 where the subtraction gives -0.0).
    torch.testing.assert_close(residual[finite], definition[finite], rtol=0, atol=0, equal_nan=True)

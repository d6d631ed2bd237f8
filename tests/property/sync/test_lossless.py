"""Lossless sparse sync == dense allreduce, for every scheme, on the simulated world (sizes 1..8).

Inputs are integer-valued, so every summation order gives the same float result and the comparison
with the float64 reference sum is bit-exact for every dtype (|sums| <= 32 fit float16 and bfloat16).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import zensync
from tests.strategies import examples
from zensync.kernels import reference
from zensync.sync.partition import make_partition

SEED = 99
OPTIONS = zensync.SyncOptions(h0_seed=SEED)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PATTERNS = ("zero", "full", "random", "skew", "single", "one_element", "collide")
PROPERTY_SETTINGS = settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def sync_cases(draw: st.DrawFn) -> dict:
    """Generates: world size, scheme, shape, dtype, per-rank integer-valued inputs, specials."""
    n = draw(st.integers(1, 8))
    pattern = draw(st.sampled_from(PATTERNS))
    if pattern == "one_element":
        shape: tuple[int, ...] = (1,)
    elif draw(st.booleans()):
        shape = (draw(st.integers(1, 3000)),)
    else:
        shape = (draw(st.integers(1, 200)), draw(st.integers(1, 9)))
    return {
        "n": n,
        "scheme": draw(st.sampled_from(zensync.SCHEMES)),
        "shape": shape,
        "dtype": draw(st.sampled_from(DTYPES)),
        "pattern": pattern,
        "density": draw(st.floats(0.0, 1.0)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "special": draw(st.sampled_from(("none", "nan", "inf", "neg_zero", "cancel"))),
        "average": draw(st.booleans()),
        "granularity": draw(st.sampled_from(("auto", "auto", "element"))),
    }


def _mask(case: dict, gen: torch.Generator, rank: int) -> torch.Tensor:
    shape, pattern = case["shape"], case["pattern"]
    numel = int(torch.tensor(shape).prod())
    if pattern in ("zero", "full", "one_element"):
        return torch.full(shape, pattern != "zero", dtype=torch.bool)
    if pattern == "single":
        mask = torch.zeros(numel, dtype=torch.bool)
        if rank == 0:
            mask[int(torch.randint(numel, (1,), generator=gen))] = True
        return mask.view(shape)
    if pattern == "skew":  # every non-zero in the first 1/16 of the items
        mask = torch.rand(shape, generator=gen) < case["density"]
        mask[max(1, shape[0] // 16) :] = False
        return mask
    if pattern == "collide":  # every non-zero item maps to owner 0 under Zen's h0
        rows = case["granularity"] != "element" and len(shape) == 2
        num_items = shape[0] if rows else numel
        part = make_partition(num_items, case["n"], seed=SEED)
        positions = torch.arange(part.owner_range(0)[1])
        items = reference.unpermute(positions, part)
        mask = torch.zeros(num_items, dtype=torch.bool)
        mask[items] = torch.rand(items.numel(), generator=gen) < max(case["density"], 0.5)
        return mask.view(shape[0], 1).expand(shape).clone() if rows else mask.view(shape)
    return torch.rand(shape, generator=gen) < case["density"]


def _inputs(case: dict) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(case["seed"])
    xs = []
    for rank in range(case["n"]):
        values = torch.randint(-4, 5, case["shape"], generator=gen).to(torch.float64)
        values[values == 0] = 1.0
        x = values * _mask(case, gen, rank)
        special = case["special"]
        if special == "neg_zero":
            x[x == 0] = -0.0
        elif special == "cancel" and rank == 1:  # rank 1 cancels rank 0 exactly: non-zero inputs, zero sum
            x = -xs[0]
        elif special in ("nan", "inf") and rank == case["n"] - 1:
            x.view(-1)[0] = float("nan") if special == "nan" else float("inf")
        xs.append(x.to(case["dtype"]))
    return xs


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    equal = (a == b) | (a.isnan() & b.isnan())
    return bool(equal.all())


def _expected(case: dict, xs: list[torch.Tensor]) -> torch.Tensor:
    """The float64 sum (or average) in the case's dtype."""
    expected = torch.stack([x.to(torch.float64) for x in xs]).sum(0).to(case["dtype"])
    return expected / case["n"] if case["average"] else expected


def _run_case(case: dict, xs: list[torch.Tensor], outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every rank's ``sparse_allreduce`` of its input with the case's arguments (and its ``out``)."""

    def body(t: zensync.Transport) -> torch.Tensor:
        return zensync.sparse_allreduce(
            xs[t.rank],
            group=t,
            scheme=case["scheme"],
            average=case["average"],
            granularity=case["granularity"],
            options=OPTIONS,
            out=None if outs is None else outs[t.rank],
        )

    return zensync.SimulatedWorld(case["n"], timeout_s=60).run(body)


@given(sync_cases())
@PROPERTY_SETTINGS
def test_every_scheme_equals_dense_sum(case: dict) -> None:
    xs = _inputs(case)
    originals = [x.clone() for x in xs]
    expected = _expected(case, xs)
    results = _run_case(case, xs)
    for rank, result in enumerate(results):
        assert result.shape == expected.shape and result.dtype == expected.dtype
        assert _same_bits(result, expected), (
            f"rank {rank}: max diff {(result.double() - expected.double()).abs().max()}"
        )
        assert result.data_ptr() != xs[rank].data_ptr()
        assert torch.equal(xs[rank].view(torch.uint8), originals[rank].view(torch.uint8)), "input modified"
        assert torch.equal(result.view(torch.uint8), results[0].view(torch.uint8)) or _same_bits(result, results[0])


@given(n=st.integers(1, 8), seed=st.integers(0, 2**31 - 1), scheme=st.sampled_from(zensync.SCHEMES))
@settings(max_examples=examples(20), deadline=None)
def test_non_contiguous_input(n: int, seed: int, scheme: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    bases = [
        (torch.randint(-3, 4, (7, 40), generator=gen) * (torch.rand(7, 40, generator=gen) < 0.2)).float()
        for _ in range(n)
    ]
    views = [b.t() for b in bases]  # (40, 7), non-contiguous
    expected = torch.stack(views).sum(0)
    results = zensync.SimulatedWorld(n, timeout_s=60).run(
        lambda t: zensync.sparse_allreduce(views[t.rank], group=t, scheme=scheme, options=OPTIONS)
    )
    for result in results:
        assert torch.equal(result, expected)


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("scheme", zensync.SCHEMES)
def test_every_world_size_and_scheme(n: int, scheme: str) -> None:
    """Deterministic coverage of each (world size, scheme) pair, 1-D and 2-D, all float dtypes."""
    for dtype in DTYPES:
        for shape in ((997,), (61, 5)):
            case = {
                "n": n,
                "shape": shape,
                "dtype": dtype,
                "pattern": "random",
                "density": 0.1,
                "seed": n * 100 + len(shape),
                "special": "none",
                "average": False,
                "granularity": "auto",
            }
            xs = _inputs(case)
            expected = torch.stack([x.to(torch.float64) for x in xs]).sum(0).to(dtype)
            results = zensync.SimulatedWorld(n, timeout_s=60).run(
                lambda t, xs=xs: zensync.sparse_allreduce(xs[t.rank], group=t, scheme=scheme, options=OPTIONS)
            )
            for result in results:
                assert torch.equal(result, expected), (dtype, shape)


@given(sync_cases(), st.sampled_from(("input", "separate")))
@PROPERTY_SETTINGS
def test_out_equals_the_dense_sum_in_place_or_apart(case: dict, where: str) -> None:
    xs = _inputs(case)
    originals = [x.clone() for x in xs]
    expected = _expected(case, xs)
    # A separate out starts as garbage (NaN): whatever the scheme does not write must still be zero.
    outs = [x if where == "input" else torch.full_like(x, float("nan")) for x in xs]
    results = _run_case(case, xs, outs)
    for rank, result in enumerate(results):
        assert result is outs[rank]
        diff = (result.double() - expected.double()).abs().max()
        assert _same_bits(result, expected), f"rank {rank}: max diff {diff}"
        if where == "separate":
            assert torch.equal(xs[rank].view(torch.uint8), originals[rank].view(torch.uint8)), "input modified"


@pytest.mark.parametrize("scheme", ["zen", "agsparse"])
@pytest.mark.parametrize("shape", [(4000,), (500, 3)])
def test_in_place_zen_and_agsparse_write_only_the_union(scheme: str, shape: tuple[int, ...]) -> None:
    """Items no rank has non-zero keep their exact bits (-0.0 here): nothing writes over them."""
    n = 4
    gen = torch.Generator().manual_seed(7)
    xs = []
    for _ in range(n):
        x = torch.randint(1, 5, shape, generator=gen).float() * (torch.rand(shape, generator=gen) < 0.02)
        x[x == 0] = -0.0
        xs.append(x)
    expected = torch.stack(xs).sum(0)
    nonzero = torch.stack([x != 0 for x in xs]).any(0)
    if len(shape) == 2:  # rows are the items: a row with any non-zero element is in the union, all of it
        nonzero = nonzero.any(1, keepdim=True).expand(shape)
    untouched = ~nonzero

    def body(t: zensync.Transport) -> torch.Tensor:
        stats = zensync.SyncStats()
        out = zensync.sparse_allreduce(xs[t.rank], group=t, scheme=scheme, options=OPTIONS, out=xs[t.rank], stats=stats)
        assert scheme != "zen" or stats.pull_encodings["dense"] == 0  # a dense pull writes whole ranges
        return out

    for result in zensync.SimulatedWorld(n, timeout_s=60).run(body):
        assert torch.equal(result, expected)
        assert bool(torch.signbit(result[untouched]).all()), "an item outside the union was written"


def _coo(dense: torch.Tensor, sparse_dim: int, gen: torch.Generator, duplicate: bool) -> torch.Tensor:
    """``dense`` as a COO tensor with ``sparse_dim`` sparse dims, uncoalesced (split entries) when asked."""
    coo = dense.to_sparse(sparse_dim).coalesce()
    if not duplicate or coo._nnz() == 0:
        return coo
    # Every entry split into two halves listed apart (as nn.Embedding(sparse=True) lists one row per lookup).
    indices, values = coo.indices(), coo.values()
    half = torch.randint(-2, 3, values.shape, generator=gen).to(values.dtype)
    order = torch.randperm(2 * indices.shape[1], generator=gen)
    return torch.sparse_coo_tensor(
        torch.cat([indices, indices], 1)[:, order], torch.cat([values - half, half])[order], coo.shape
    )


@given(sync_cases(), st.booleans())
@PROPERTY_SETTINGS
def test_sparse_coo_input_gives_the_coalesced_sum(case: dict, duplicate: bool) -> None:
    """A COO input: the coalesced COO sum, identical on every rank, its dense form the dense sum."""
    dense_inputs = _inputs({**case, "special": "none"})  # integer values: every order sums alike
    shape = case["shape"]
    sparse_dim = 1 if len(shape) == 2 and case["granularity"] == "auto" else len(shape)
    gen = torch.Generator().manual_seed(case["seed"])
    xs = [_coo(x.double(), sparse_dim, gen, duplicate).to(case["dtype"]) for x in dense_inputs]
    expected = _expected(case, dense_inputs)
    results = _run_case({**case, "granularity": "auto"}, xs)
    for rank, result in enumerate(results):
        assert result.layout == torch.sparse_coo and result.is_coalesced()
        assert (result.shape, result.dtype, result.sparse_dim()) == (expected.shape, expected.dtype, sparse_dim)
        assert _same_bits(result.to_dense(), expected), f"rank {rank}"
        assert torch.equal(result.indices(), results[0].indices())
        assert torch.equal(result.values().view(torch.uint8), results[0].values().view(torch.uint8))
        # Kept: every item whose sum is non-zero, and only items of the union (one whose sum
        # cancels to zero may be kept or not, depending on the pull encoding).
        union = torch.stack([x != 0 for x in dense_inputs]).any(0)
        nonzero_sum = expected != 0
        if sparse_dim < len(shape):  # rows
            union, nonzero_sum = union.any(1), nonzero_sum.any(1)
        kept = torch.zeros(union.shape, dtype=torch.bool)
        kept[tuple(result.indices())] = True
        assert bool((kept <= union).all()) and bool((nonzero_sum <= kept).all())

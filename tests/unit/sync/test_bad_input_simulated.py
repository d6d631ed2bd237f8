"""Bad input raises the same clear ValueError on every rank (simulated world; gloo in tests/distributed)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import zensync

WORLD = 3


def _outcomes(make_input: Callable[[int], object], **kwargs: object) -> list[object]:
    def body(t: zensync.Transport) -> torch.Tensor:
        per_rank = {k: (v(t.rank) if callable(v) else v) for k, v in kwargs.items()}
        return zensync.sparse_allreduce(make_input(t.rank), group=t, **per_rank)  # type: ignore[arg-type]

    return zensync.SimulatedWorld(WORLD, timeout_s=20).run(body, return_exceptions=True)


def _assert_all_raise(outcomes: list[object], *fragments: str) -> None:
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, ValueError), f"rank {rank} returned {outcome!r}"
        for fragment in fragments:
            assert fragment in str(outcome), f"rank {rank}: {fragment!r} not in {outcome}"


def test_shape_mismatch() -> None:
    _assert_all_raise(_outcomes(lambda r: torch.zeros(10 + (r == 2))), "shape differs", "rank 2: (11,)")


def test_dtype_mismatch() -> None:
    _assert_all_raise(
        _outcomes(lambda r: torch.zeros(10, dtype=torch.float64 if r else torch.float32)), "dtype differs"
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_unsupported_dtype_on_one_rank(dtype: torch.dtype) -> None:
    outcomes = _outcomes(lambda r: torch.zeros(4, dtype=dtype if r == 1 else torch.float32))
    _assert_all_raise(outcomes, "rank 1", "not supported", str(dtype))


def test_sparse_coo_on_one_rank_only() -> None:
    outcomes = _outcomes(lambda r: torch.zeros(4).to_sparse() if r == 0 else torch.zeros(4))
    _assert_all_raise(outcomes, "layout differs", "rank 0: torch.sparse_coo", "rank 1: torch.strided")


def test_sparse_dim_differs() -> None:
    outcomes = _outcomes(lambda r: torch.ones(4, 3).to_sparse(1 + (r == 1)))
    _assert_all_raise(outcomes, "sparse_dim differs", "rank 1: 2")


def test_csr_layout() -> None:
    outcomes = _outcomes(lambda r: torch.eye(4).to_sparse_csr() if r == 0 else torch.eye(4))
    _assert_all_raise(outcomes, "rank 0", "neither dense (strided) nor sparse COO")
    assert "to_sparse_coo" in str(outcomes[0])


def test_sparse_coo_with_out_or_a_granularity_it_cannot_have() -> None:
    coo = torch.eye(4).to_sparse(1)
    _assert_all_raise(_outcomes(lambda r: coo, out=lambda r: torch.zeros(4, 4) if r == 2 else None), "rank 2", "out=")
    _assert_all_raise(_outcomes(lambda r: coo, granularity="element"), "rank 0", "granularity does not fit")


def test_not_a_tensor() -> None:
    _assert_all_raise(_outcomes(lambda r: [1.0, 2.0] if r == 2 else torch.zeros(2)), "rank 2", "not a torch.Tensor")


def test_unknown_scheme_and_granularity() -> None:
    _assert_all_raise(_outcomes(lambda r: torch.zeros(4), scheme=lambda r: "zenn" if r == 1 else "zen"), "rank 1")
    outcomes = _outcomes(lambda r: torch.zeros(4), granularity="rows")
    _assert_all_raise(outcomes, "unknown granularity")


def test_row_granularity_needs_two_dims() -> None:
    _assert_all_raise(_outcomes(lambda r: torch.zeros(4), granularity="row"), "at least 2 dimensions")


def test_options_mismatch() -> None:
    _assert_all_raise(_outcomes(lambda r: torch.zeros(4), average=lambda r: r == 0), "average differs")
    seeds = lambda r: zensync.SyncOptions(h0_seed=r)  # noqa: E731
    _assert_all_raise(_outcomes(lambda r: torch.zeros(4), options=seeds), "h0_seed differs")


def test_too_many_dims() -> None:
    _assert_all_raise(_outcomes(lambda r: torch.zeros((1,) * 9)), "9 dimensions")


def test_group_usable_after_error() -> None:
    def body(t: zensync.Transport) -> torch.Tensor:
        with pytest.raises(ValueError, match="shape differs"):
            zensync.sparse_allreduce(torch.zeros(3 + t.rank), group=t)
        return zensync.sparse_allreduce(torch.full((5,), float(t.rank + 1)), group=t)

    for result in zensync.SimulatedWorld(WORLD, timeout_s=20).run(body):
        assert torch.equal(result, torch.full((5,), 6.0))


def test_empty_tensor() -> None:
    for scheme in zensync.SCHEMES:
        results = zensync.SimulatedWorld(2).run(
            lambda t, s=scheme: zensync.sparse_allreduce(torch.zeros(0, 4), group=t, scheme=s)
        )
        assert all(r.shape == (0, 4) for r in results)


def test_options_validation() -> None:
    with pytest.raises(ValueError, match="sparcml_dense_ratio"):
        zensync.SyncOptions(sparcml_dense_ratio=0.0)
    with pytest.raises(ValueError, match="omnireduce_block"):
        zensync.SyncOptions(omnireduce_block=0)


@pytest.mark.parametrize(
    ("bad_out", "fragment"),
    [
        (lambda x: torch.zeros(11), "out does not match the input"),
        (lambda x: torch.zeros(10, dtype=torch.float64), "out does not match the input"),
        (lambda x: torch.zeros(10).to_sparse(), "out does not match the input"),
        (lambda x: [0.0] * 10, "out does not match the input"),
        (lambda x: torch.cat([x, x])[5:15], None),  # separate memory (a view into another tensor): fine
    ],
)
def test_an_out_that_does_not_fit_on_one_rank_fails_every_rank(bad_out, fragment) -> None:
    inputs = [torch.zeros(10) for _ in range(WORLD)]

    def body(t: zensync.Transport):
        out = bad_out(inputs[t.rank]) if t.rank == 1 else None
        return zensync.sparse_allreduce(inputs[t.rank], group=t, out=out)

    outcomes = zensync.SimulatedWorld(WORLD, timeout_s=20).run(body, return_exceptions=True)
    if fragment is None:
        assert all(isinstance(o, torch.Tensor) for o in outcomes), outcomes
        return
    _assert_all_raise(outcomes, "rank 1", fragment)
    assert "got shape" in str(outcomes[1]) or "got a list" in str(outcomes[1])  # the rank's own, detailed


def test_an_out_overlapping_the_input_is_refused_on_every_rank() -> None:
    bases = [torch.zeros(12) for _ in range(WORLD)]

    def body(t: zensync.Transport):
        x = bases[t.rank][:10]
        out = bases[t.rank][2:] if t.rank == 0 else None  # shifted by two elements: neither it nor apart
        return zensync.sparse_allreduce(x, group=t, out=out)

    outcomes = zensync.SimulatedWorld(WORLD, timeout_s=20).run(body, return_exceptions=True)
    _assert_all_raise(outcomes, "rank 0", "out overlaps the input")

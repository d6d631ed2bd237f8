"""The agreement protocol (``zensync.sync.agreement``) on the simulated world: seeds, comparisons, register.

Zen's seed of a group is agreed at the group's first use: rank 0's proposal wins and is kept for the
group's later calls; an explicit ``SyncOptions.h0_seed`` wins for its own call. ``agree`` (register's
check) returns rank 0's proposal or raises the same ValueError on every rank.
"""

from __future__ import annotations

import threading

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import zensync
from tests.strategies import examples
from zensync.sync import agreement, validate, zen
from zensync.sync.agreement import (
    MAX_MESSAGE_BYTES,
    agree_group_seed,
    compare_with_rank0,
    compare_with_rank0_async,
    differing_from_rank0,
    group_seed,
)
from zensync.sync.base import get_scheme
from zensync.sync.registration import agree, agree_async
from zensync.transport import SimulatedWorld, TrafficLog, Transport
from zensync.transport.handle import Lane

PROPOSAL_BASE = 1000
"""Rank r proposes PROPOSAL_BASE * call + r, so every proposal says whose it was."""


def _rank_of_thread() -> int:
    """The simulated rank running on this thread (rank threads are named sim-rank-<r>)."""
    return int(threading.current_thread().name.rsplit("-", 1)[1])


def _patch_proposals(patch: pytest.MonkeyPatch) -> None:
    """Makes each rank's seed proposal of its c-th call (c = 1, 2, ...) PROPOSAL_BASE * c + rank."""
    calls: dict[int, int] = {}

    def propose() -> int:
        rank = _rank_of_thread()
        calls[rank] = calls.get(rank, 0) + 1
        return PROPOSAL_BASE * calls[rank] + rank

    patch.setattr(validate, "propose_seed", propose)


def _record_seeds(patch: pytest.MonkeyPatch) -> dict[int, list[int]]:
    """Records, per rank, the seed of every partition Zen builds (filled while ``patch`` is active)."""
    used: dict[int, list[int]] = {}
    lock = threading.Lock()
    original = zen.make_partition

    def recording(num_items: int, num_owners: int, *, seed: int, hashed: bool = True):
        with lock:
            used.setdefault(_rank_of_thread(), []).append(seed)
        return original(num_items, num_owners, seed=seed, hashed=hashed)

    patch.setattr(zen, "make_partition", recording)
    return used


def _sum(t: Transport, options: zensync.SyncOptions | None = None) -> torch.Tensor:
    x = torch.zeros(64)
    x[t.rank :: 7] = float(t.rank + 1)
    return zensync.sparse_allreduce(x, group=t, scheme="zen", options=options)


@given(n=st.integers(1, 5))
@settings(max_examples=examples(5), deadline=None)
def test_first_use_of_a_group_agrees_on_rank0s_proposal(n: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        _patch_proposals(patch)
        used = _record_seeds(patch)

        def body(t: Transport) -> tuple[int | None, int | None]:
            before = group_seed(t)
            _sum(t)  # first use: every rank proposes, rank 0's proposal (PROPOSAL_BASE) wins
            _sum(t)  # later use: new proposals (2 * PROPOSAL_BASE + r) are ignored
            return before, group_seed(t)

        outcomes = SimulatedWorld(n, timeout_s=30).run(body)
    assert outcomes == [(None, PROPOSAL_BASE)] * n
    assert used == {rank: [PROPOSAL_BASE, PROPOSAL_BASE] for rank in range(n)}


@given(n=st.integers(1, 5), explicit=st.integers(0, 2**62 - 1))
@settings(max_examples=examples(8), deadline=None)
def test_an_explicit_seed_wins_for_its_call(n: int, explicit: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        _patch_proposals(patch)
        used = _record_seeds(patch)

        def body(t: Transport) -> int | None:
            _sum(t, zensync.SyncOptions(h0_seed=explicit))  # the group's seed is still agreed here
            _sum(t)  # no explicit seed: the group's
            return group_seed(t)

        outcomes = SimulatedWorld(n, timeout_s=30).run(body)
    assert outcomes == [PROPOSAL_BASE] * n
    assert used == {rank: [explicit, PROPOSAL_BASE] for rank in range(n)}


def test_explicit_seeds_that_differ_raise_on_every_rank() -> None:
    outcomes = SimulatedWorld(3, timeout_s=30).run(
        lambda t: _sum(t, zensync.SyncOptions(h0_seed=t.rank)), return_exceptions=True
    )
    for outcome in outcomes:
        assert isinstance(outcome, ValueError) and "h0_seed differs across ranks" in str(outcome)


def test_group_seed_is_per_transport_and_kept() -> None:
    def body(t: Transport) -> tuple[int, int, int | None]:
        first = agree_group_seed(t, 11)
        again = agree_group_seed(t, 22)
        split = t.split(0)
        return first, again, group_seed(split)

    assert SimulatedWorld(2, timeout_s=30).run(body) == [(11, 11, None)] * 2


def test_the_group_seed_is_not_on_the_transport() -> None:
    def body(t: Transport) -> bool:
        _sum(t)
        return hasattr(t, "h0_seed")

    assert SimulatedWorld(2, timeout_s=30).run(body) == [False, False]


# -- comparisons ------------------------------------------------------------------------------------------------------
def test_differing_from_rank0() -> None:
    assert differing_from_rank0([7, 7, 8, 7, 9]) == [2, 4]
    assert differing_from_rank0([[1, 2], [1, 2]]) == []
    assert differing_from_rank0([]) == []


@pytest.mark.parametrize("on_lane", [False, True])
def test_compare_with_rank0_compares_only_the_leading_values(on_lane: bool) -> None:
    """The hook's per-step check: (digest, mark) compared, the step carried along for the message."""

    def body(t: Transport) -> agreement.Comparison:
        values = [5, 1 if t.rank != 2 else 9, 100 + t.rank]
        if on_lane:
            return Lane().submit(compare_with_rank0_async(t, values, compared=2)).wait(30)
        return compare_with_rank0(t, values, compared=2)

    for comparison in SimulatedWorld(4, timeout_s=30, delay_s=lambda r: 0.001 * r).run(body):
        assert comparison.differing == [2]
        assert comparison.rows == [[5, 1, 100], [5, 1, 101], [5, 9, 102], [5, 1, 103]]


def test_compare_with_rank0_all_values_by_default() -> None:
    comparisons = SimulatedWorld(3, timeout_s=30).run(lambda t: compare_with_rank0(t, [1, t.rank]))
    assert all(c.differing == [1, 2] for c in comparisons)


# -- register's agreement ----------------------------------------------------------------------------------------------
def test_agree_returns_rank0s_proposal_or_the_explicit_seed() -> None:
    seeds = SimulatedWorld(3, timeout_s=30).run(lambda t: agree(t, "same model", None, None))
    assert len(set(seeds)) == 1 and 0 <= seeds[0] < 2**62
    assert SimulatedWorld(3, timeout_s=30).run(lambda t: agree(t, "same model", None, 42)) == [42] * 3


def test_agree_quotes_every_failing_rank_on_every_rank() -> None:
    def body(t: Transport) -> int:
        failure = {1: KeyError("plan.json"), 2: RuntimeError("x" * (2 * MAX_MESSAGE_BYTES))}.get(t.rank)
        return agree(t, "same model", failure, None)

    outcomes = SimulatedWorld(3, timeout_s=30).run(body, return_exceptions=True)
    messages = {str(o) for o in outcomes}
    assert len(messages) == 1 and all(isinstance(o, ValueError) for o in outcomes)
    message = messages.pop()
    cut = "RuntimeError: " + "x" * (MAX_MESSAGE_BYTES - len("RuntimeError: "))
    assert message == f"zensync.register failed on rank(s) [1, 2]: rank 1: KeyError: 'plan.json'; rank 2: {cut}"
    assert isinstance(outcomes[1].__cause__, KeyError) and outcomes[0].__cause__ is None  # type: ignore[union-attr]


def test_agree_names_ranks_that_differ_from_rank0() -> None:
    def body(t: Transport) -> int:
        return Lane().submit(agree_async(t, "model B" if t.rank == 1 else "model A", None, None)).wait(30)

    outcomes = SimulatedWorld(3, timeout_s=30, delay_s=lambda r: 0.001 * r).run(body, return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, ValueError)
        assert str(outcome) == (
            "zensync.register: ranks [1] differ from rank 0 in their hook options or in their model's parameters "
            "(names, shapes, dtypes); every rank must register the same model with the same options"
        )


def test_agree_traffic_is_setup() -> None:
    def body(t: Transport) -> dict[str, int]:
        log = TrafficLog()
        with t.recording(log):
            agree(t, "m", None, None)
        return {name: p.num_calls for name, p in log.phases.items()}

    assert SimulatedWorld(2, timeout_s=30).run(body) == [{"setup": 1}] * 2


# -- the scheme registry ----------------------------------------------------------------------------------------------
def test_each_scheme_is_built_once() -> None:
    for name in zensync.SCHEMES:
        assert get_scheme(name) is get_scheme(name)
        assert get_scheme(name).name == name
    with pytest.raises(ValueError, match=r"sync scheme 'zenn' is unknown \(valid: .*zen"):
        get_scheme("zenn")


def test_a_scheme_or_compressor_with_a_plain_function_is_refused_at_registration() -> None:
    from zensync.compress.base import Compressor, compressor_names, register_compressor
    from zensync.sync.base import SyncScheme, register_scheme, scheme_registry

    class Blocking(SyncScheme):
        name = "blocking-test-scheme"

        def run(self, ctx):  # type: ignore[override]  # not a coroutine: the mistake under test
            return ctx.view.x2d.clone()

    with pytest.raises(TypeError, match="run must be a coroutine"):
        register_scheme(Blocking)
    assert "blocking-test-scheme" not in scheme_registry()

    class BlockingCompressor(Compressor):  # registration only: never built
        name = "blocking-test-compressor"

        def allreduce_sync(self, x, all_reduce, *, name="", step=0):  # type: ignore[override]
            return x

    with pytest.raises(TypeError, match="allreduce_sync must be a coroutine"):
        register_compressor(BlockingCompressor)
    assert "blocking-test-compressor" not in compressor_names()

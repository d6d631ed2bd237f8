"""A NaN or infinity in one rank's gradient under error feedback (issue 11, item 5).

The rule (``zensync/compress/error_feedback.py``): the step that sees the non-finite value delivers a
non-finite output, as dense allreduce would (so GradScaler skips it), and leaves every residual and
PowerSGD's warm-start Q exactly as they were, on every rank; later steps run as if it had not happened.

Each case runs ``STEPS`` steps on a simulated world with integer-valued data; at ``BAD_STEP`` one
element of one rank's gradient is NaN, +inf or -inf. Checked on every rank:

1. the output of ``BAD_STEP`` holds a non-finite value;
2. the worker residuals, server residuals and PowerSGD Qs after it equal those after the step before;
3. no residual or Q ever holds a non-finite value;
4. the outputs and state of every later step equal those of a reference run that skips the call of
   ``BAD_STEP`` altogether. Both runs pass the same step indices: random-k's indices and DGC's sample
   are drawn from the step index, so "as if the update had not happened" means the state of the step
   before, used at the next step's index, and that holds exactly, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from zensync.compress import (
    COMPRESSED_SCHEMES,
    CompressedSync,
    ErrorFeedback,
    PowerSGDCompressor,
    build,
    compressor_names,
    hierarchy,
)
from zensync.compress.base import all_finite
from zensync.transport import SimulatedWorld
from zensync.transport.handle import run_sync

SHAPE = (37, 5)
"""Neither dimension divides by the world sizes used, so chunks are uneven; PowerSGD compresses it
((37 + 5) * 1 < 185)."""
DGC_SAMPLED_SHAPE = (160, 128)
"""20480 elements: above DGC's EXACT_BELOW_NUMEL, so its sampled-threshold path runs."""
STEPS, BAD_STEP = 5, 2
EF_SPECS = {
    "topk": "topk:0.2",
    "dgc": "dgc:0.2",
    "randomk": "randomk:0.3",
    "efsignsgd": "efsignsgd",
    "onebit": "onebit",
    "powersgd": "powersgd:1",
}
"""A spec for every registered compressor with error feedback (``test_every_error_feedback_compressor_is_covered``)."""
SPEC_ARGS = {"topk": "0.2", "dgc": "0.2", "randomk": "0.3", "powersgd": "1", "qsgd": "16"}
"""The argument of each registered compressor that needs one."""


@dataclasses.dataclass(frozen=True)
class Bad:
    """Where the non-finite value goes: ``value`` at flat ``index`` of ``rank``'s gradient at ``step``."""

    value: float
    rank: int
    index: int = 3  # in the first chunk: its owner (rank 0) is not the bad rank when rank > 0
    step: int = BAD_STEP


def _data(rank: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-4, 5, shape, generator=gen).float()


def _state(sync: CompressedSync) -> dict[str, torch.Tensor]:
    """Every residual and warm-start Q of ``sync``, copied."""
    state = {f"worker/{n}": sync.worker_memory.residual(n) for n in sync.worker_memory.names()}
    state |= {f"server/{n}": sync.server_memory.residual(n) for n in sync.server_memory.names()}
    if isinstance(sync.compressor, PowerSGDCompressor):
        state |= {f"q/{n}": q for n, q in sync.compressor.warm_starts().items()}
    return {key: value.clone() for key, value in state.items() if value is not None}


def _run(
    spec: str,
    scheme: str,
    n: int,
    bad: Bad | None,
    *,
    skip: int = BAD_STEP,
    ranks_per_node: int = 0,
    shape: tuple[int, ...] = SHAPE,
    error_feedback: bool | None = None,
) -> list[tuple[dict[int, torch.Tensor], dict[int, dict[str, torch.Tensor]]]]:
    """Per rank: (output of each step, state after each step). ``bad`` None: ``skip`` is not run."""

    def body(t):  # type: ignore[no-untyped-def]
        levels = hierarchy(t, ranks_per_node) if ranks_per_node else None
        sync = CompressedSync(spec, scheme, error_feedback=error_feedback)
        outs, states = {}, {}
        for step in range(STEPS):
            if bad is None and step == skip:
                continue
            x = _data(t.rank, step, shape)
            if bad is not None and step == bad.step and t.rank == bad.rank:
                x.view(-1)[bad.index] = bad.value
            outs[step] = sync.sync(x, t, name="w", step=step, hierarchy=levels)
            states[step] = _state(sync)
        return outs, states

    return SimulatedWorld(n).run(body)


def _check(
    spec: str,
    scheme: str,
    n: int,
    bad: Bad,
    *,
    ranks_per_node: int = 0,
    shape: tuple[int, ...] = SHAPE,
    error_feedback: bool | None = None,
) -> None:
    options: dict[str, Any] = {"ranks_per_node": ranks_per_node, "shape": shape, "error_feedback": error_feedback}
    faulty = _run(spec, scheme, n, bad, **options)
    reference = _run(spec, scheme, n, None, skip=bad.step, **options)
    for rank, ((outs, states), (ref_outs, ref_states)) in enumerate(zip(faulty, reference, strict=True)):
        where = f"rank {rank}"
        # 1. The bad step delivers a non-finite value, as dense allreduce would.
        assert not torch.isfinite(outs[bad.step]).all(), f"{where}: step {bad.step} output is finite"
        # 2. Its state is the state of the step before (none before step 0), exactly; there is some
        # after the step before (the check is not vacuous).
        before = states[bad.step - 1] if bad.step > 0 else {}
        assert bad.step == 0 or before, f"{where}: no error-feedback state to check"
        _assert_same_state(states[bad.step], before, f"{where}, after step {bad.step}")
        # 3. Never a non-finite value in a residual or a Q.
        for step, state in states.items():
            for key, value in state.items():
                assert torch.isfinite(value).all(), f"{where}: {key} non-finite after step {step}"
        # 4. Every other step as in the run without the bad step.
        for step in ref_outs:
            assert torch.equal(outs[step], ref_outs[step]), f"{where}: step {step} output differs from the reference"
            _assert_same_state(states[step], ref_states[step], f"{where}, reference after step {step}")


def _assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(got) == sorted(expected), where
    for key, value in got.items():
        assert value.dtype == expected[key].dtype and torch.equal(value, expected[key]), f"{where}: {key} differs"


def _schemes(spec: str) -> list[str]:
    allreduce_ok = build(spec).allreduce_compatible
    return [s for s in COMPRESSED_SCHEMES if s != "allreduce" or allreduce_ok]


BADS = {
    "nan-last": lambda n: Bad(math.nan, n - 1),
    "inf-first": lambda n: Bad(math.inf, 0),
    "neginf-last": lambda n: Bad(-math.inf, n - 1),
}
FLAT_CASES = [(spec, scheme) for spec in EF_SPECS.values() for scheme in _schemes(spec)]


def test_every_error_feedback_compressor_is_covered() -> None:
    def spec_of(name: str) -> str:
        return f"{name}:{SPEC_ARGS[name]}" if name in SPEC_ARGS else name

    with_feedback = {name for name in compressor_names() if build(spec_of(name)).needs_error_feedback}
    assert with_feedback == set(EF_SPECS)


@pytest.mark.parametrize("bad", BADS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(("spec", "scheme"), FLAT_CASES, ids=[f"{s}-{c}" for s, c in FLAT_CASES])
def test_flat_step_with_nonfinite_value_is_dropped_from_state(spec: str, scheme: str, n: int, bad: str) -> None:
    _check(spec, scheme, n, BADS[bad](n))


@pytest.mark.parametrize(("spec", "scheme"), FLAT_CASES, ids=[f"{s}-{c}" for s, c in FLAT_CASES])
def test_two_level_step_with_nonfinite_value_is_dropped_from_state(spec: str, scheme: str) -> None:
    """4 ranks in nodes of 2: the NaN reaches one local rank's shard only; every rank still skips the step."""
    _check(spec, scheme, 4, Bad(math.nan, 3), ranks_per_node=2)


@pytest.mark.parametrize(("spec", "scheme"), FLAT_CASES, ids=[f"{s}-{c}" for s, c in FLAT_CASES])
def test_nonfinite_value_at_the_first_step_leaves_no_state(spec: str, scheme: str) -> None:
    """Before the first update there is no residual (and no Q): the bad first step must not create one."""
    _check(spec, scheme, 2, Bad(math.nan, 1, step=0))


@pytest.mark.parametrize("bad", BADS)
@pytest.mark.parametrize("scheme", ["allgather", "alltoall_allgather"])
def test_dgc_sampled_threshold_path(scheme: str, bad: str) -> None:
    _check("dgc:0.01", scheme, 2, BADS[bad](2), shape=DGC_SAMPLED_SHAPE)


@pytest.mark.parametrize("scheme", ["allreduce", "allgather"])
def test_powersgd_without_error_feedback_keeps_its_q(scheme: str) -> None:
    """PowerSGD's warm-start Q is state of its own: it follows the rule without error feedback too."""
    _check("powersgd:1", scheme, 2, Bad(math.nan, 1), error_feedback=False)


# -- the compressors' part: a non-finite input reaches the output -----------------------------------------------------
PROPAGATING = [f"{name}:{SPEC_ARGS[name]}" if name in SPEC_ARGS else name for name in compressor_names()]
PROPAGATING.remove("signsgd")  # signs alone cannot carry a NaN: test_signsgd_rejects_error_feedback


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("shape", [(1,), (37, 5), (20480,)])
@pytest.mark.parametrize("spec", PROPAGATING)
def test_compressors_carry_a_nonfinite_input_to_the_output(spec: str, shape: tuple[int, ...], value: float) -> None:
    """Wherever the value is, decompress(compress(x)) (and allreduce_sync, where allowed) is non-finite."""
    numel = math.prod(shape)
    for index in sorted({0, numel // 2, numel - 1}):
        x = _data(0, 0, shape)
        x.view(-1)[index] = value
        comp = build(spec)
        out = comp.decompress(comp.compress(x, name="w", step=1))
        assert not torch.isfinite(out).all(), index
        if comp.allreduce_compatible:
            out = run_sync(build(spec).allreduce_sync(x, _one_rank_all_reduce, name="w", step=1))
            assert not torch.isfinite(out).all(), index


async def _one_rank_all_reduce(t: torch.Tensor, *, last: bool = False) -> torch.Tensor:
    """The sum over a world of one rank: a copy."""
    return t.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 7, 4097])
def test_all_finite_equals_isfinite_all(numel: int, dtype: torch.dtype) -> None:
    base = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    assert bool(all_finite(base)) and bool(all_finite(torch.arange(numel)))
    for index in sorted({0, numel // 2, numel - 1} if numel else set()):
        for value in (math.nan, math.inf, -math.inf):
            x = base.clone()
            x[index] = value
            assert bool(all_finite(x)) == bool(torch.isfinite(x).all()) is False, (index, value)


def test_signsgd_rejects_error_feedback() -> None:
    with pytest.raises(ValueError, match="signsgd"):
        CompressedSync("signsgd", "allgather", error_feedback=True)


# -- ErrorFeedback on its own ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_standalone_update_keeps_the_previous_residual(value: float) -> None:
    """Without a step (one process), a non-finite residual is never stored: the previous one stays."""
    comp, memory = build("topk:0.2"), ErrorFeedback()
    for step in range(3):
        grad = _data(0, step, SHAPE)
        if step == 1:
            grad[0, 0] = value
        corrected = memory.compensate("w", grad)
        memory.update("w", corrected, comp.decompress(comp.compress(corrected)))
        if step == 0:
            first = memory.residual("w").clone()
        if step == 1:
            assert torch.equal(memory.residual("w"), first)
    assert torch.isfinite(memory.residual("w")).all()


def test_step_commits_all_updates_or_none() -> None:
    memory = ErrorFeedback()
    x = torch.ones(4)
    memory.begin_step()
    memory.update("a", x, torch.zeros(4))
    assert memory.residual("a") is None  # held back until the step ends
    memory.end_step(keep=True)
    assert torch.equal(memory.residual("a"), x)
    memory.begin_step()
    memory.update("a", 3 * x, torch.zeros(4))
    memory.update("b", x, torch.zeros(4))
    memory.end_step(keep=False)
    assert torch.equal(memory.residual("a"), x) and memory.residual("b") is None


def test_compensate_reuses_the_replaced_residual_and_stays_exact() -> None:
    """From the third step on, compensate writes into the residual the step before replaced (no new
    tensor of the parameter's size), a dropped step's buffer is reused too, and every step's value
    equals x + residual computed afresh."""
    comp, memory = build("topk:0.2"), ErrorFeedback()
    buffers, expected = [], None
    for step in range(6):
        grad = _data(0, step, SHAPE)
        memory.begin_step()
        corrected = memory.compensate("w", grad)
        reference = grad + (expected if expected is not None else torch.zeros_like(grad))
        assert torch.equal(corrected, reference)
        buffers.append(corrected.data_ptr())
        held = memory.residual("w")
        memory.keep_remainder("w", comp.subtract_transmitted(corrected, comp.compress(corrected)))
        keep = step != 3  # step 3 is dropped: its residual buffer becomes the spare
        memory.end_step(keep=keep)
        if keep:
            expected = reference - comp.decompress(comp.compress(reference))
        assert torch.equal(memory.residual("w"), expected)
        if held is not None:
            assert held.data_ptr() not in buffers  # residual() hands out a copy
    assert len(set(buffers)) == 2, buffers  # two buffers alternate: residual and spare
    assert memory.nbytes == memory.workspace_bytes == expected.numel() * expected.element_size()


def test_regroup_carries_each_parameters_residual_to_its_new_group() -> None:
    """DDP's rebuild turns groups {a, b} and {c} into {a} and {b, c}: each piece keeps its values,
    a new parameter starts at zero, and the old groups are dropped once all their pieces moved."""
    memory = ErrorFeedback()
    memory.regroup("fused:a", (("a", 2), ("b", 3)))
    memory.regroup("c", (("c", 4),))
    memory.update("fused:a", torch.arange(5.0), torch.zeros(5))
    memory.update("c", torch.arange(10.0, 14.0), torch.zeros(4))
    memory.regroup("a", (("a", 2),))
    memory.regroup("fused:b", (("b", 3), ("c", 4), ("d", 1)))
    assert torch.equal(memory.residual("a"), torch.tensor([0.0, 1.0]))
    assert torch.equal(memory.residual("fused:b"), torch.tensor([2.0, 3.0, 4.0, 10.0, 11.0, 12.0, 13.0, 0.0]))
    assert memory.names() == ["a", "fused:b"]
    assert torch.equal(memory.compensate("a", torch.ones(1, 2)), torch.tensor([[1.0, 2.0]]))  # viewed as the tensor
    memory.regroup("a", (("a", 2),))  # unchanged: nothing moves
    assert memory.names() == ["a", "fused:b"]


def test_regroup_in_the_other_order_and_a_changed_size() -> None:
    """The replaced group regroups first: its other pieces wait for their new group; a piece of
    another size starts at zero."""
    memory = ErrorFeedback()
    memory.regroup("fused:a", (("a", 2), ("b", 3)))
    memory.update("fused:a", torch.arange(5.0), torch.zeros(5))
    memory.regroup("fused:a", (("a", 2), ("x", 1)))
    memory.regroup("b", (("b", 3),))
    assert torch.equal(memory.residual("fused:a"), torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(memory.residual("b"), torch.tensor([2.0, 3.0, 4.0]))
    memory.regroup("fused:a", (("a", 5),))
    assert memory.residual("fused:a") is None  # nothing of that size anywhere

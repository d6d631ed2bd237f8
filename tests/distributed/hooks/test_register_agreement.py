"""``zensync.register`` when one rank's local setup fails: every rank raises the same ValueError, promptly.

Before the agreement collective carried local failures, the failing rank raised alone (RecursionError
for a deeply nested plan, NotImplementedError for a meta-device model) while its peers waited in the
next collective until the group's timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import zensync
from tests.distributed._launch import launch

GLOO_TIMEOUT_S = 30.0
PROMPT_S = 15.0
"""Every rank must raise well inside the group's timeout: the failure travels by the agreement."""


def _model(meta: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 4), torch.nn.Flatten(), torch.nn.Linear(8, 2))
    return model.to("meta") if meta else model


class _MetaDDP(torch.nn.Module):
    """What a DDP model offers register(), around a meta-device module (DDP itself refuses meta)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.process_group = None

    def register_comm_hook(self, state: object, hook: object) -> None:
        raise AssertionError("register must fail before registering the hook")


def _case(rank: int, world_size: int, case: str, tmp: str) -> dict[str, object]:
    faulty = rank == world_size - 1
    strategy, options = "zen", {}
    model = _model()
    ddp: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    if faulty and case == "nested_plan":
        path = Path(tmp) / "nested.json"
        path.write_text("[" * 200_000 + "]" * 200_000)
        strategy = str(path)
    elif faulty and case == "meta_device":
        ddp = _MetaDDP(_model(meta=True))
    elif faulty and case == "unknown_option":
        options = {"warmup_stepz": 3}
    elif faulty and case == "bad_timeout":
        options = {"timeout": -1}
    elif faulty and case == "bad_spec":
        strategy = "topk:-0.5"
    start = time.monotonic()
    try:
        zensync.register(ddp, strategy=strategy, **options)
        outcome = "registered"
    except Exception as exc:  # noqa: BLE001 - the test inspects what the user sees
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome, "elapsed_s": time.monotonic() - start}


CASES = {
    "nested_plan": "nest",
    "meta_device": "meta",
    "unknown_option": "warmup_stepz",
    "bad_timeout": "timeout=-1",
    "bad_spec": "topk:-0.5",
}


def _all_cases(rank: int, world_size: int, tmp: str) -> dict[str, dict[str, object]]:
    # One launch runs every case in turn: a failed agreement leaves the group usable.
    return {case: _case(rank, world_size, case, tmp) for case in sorted(CASES)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, object]]]:
    tmp = tmp_path_factory.mktemp("agreement")
    return launch(_all_cases, 2, (str(tmp),), tmp, gloo_timeout_s=GLOO_TIMEOUT_S)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_rank_failing_fails_every_rank(case: str, outcomes: list[dict[str, dict[str, object]]]) -> None:
    results = [per_rank[case] for per_rank in outcomes]
    texts = [str(r["outcome"]) for r in results]
    assert texts[0] == texts[1], texts  # the same error on every rank
    assert texts[0].startswith("ValueError: zensync.register failed on rank(s) [1]: "), texts[0]
    assert CASES[case] in texts[0]
    assert all(float(r["elapsed_s"]) < PROMPT_S for r in results), results  # type: ignore[arg-type]


def _twice(rank: int, world_size: int) -> str:
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    zensync.register(ddp, strategy="zen")
    try:
        zensync.register(ddp, strategy="zen")
    except RuntimeError as exc:
        return str(exc)
    return "registered twice"


def test_register_twice_is_refused(tmp_path: Path) -> None:
    for message in launch(_twice, 2, (), tmp_path):
        assert "already called on this DDP model" in message


def _load_worker(rank: int, world_size: int, who: str, check_every: int) -> dict[str, object]:
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    state = zensync.register(ddp, strategy="zen", latency_s=1e-5, bandwidth_bytes_per_s=1e9, check_every=check_every)

    def step(i: int) -> None:
        ddp(torch.arange(4).view(2, 2) * (rank + 1) + i).sum().backward()

    step(0)
    saved = state.state_dict()
    step(1)
    if who == "all" or rank == world_size - 1:
        state.load_state_dict(saved)  # back to step 1 (on every rank, or on one only)
    pending, steps = state.load_pending, []
    start = time.monotonic()
    try:
        for i in range(2, 4):
            step(i)
            steps.append(state.step)
        outcome = f"step {state.step}"
    except ValueError as exc:
        outcome = f"ValueError: {exc}"
    return {"outcome": outcome, "elapsed_s": time.monotonic() - start, "pending": pending, "steps": steps}


def test_checkpoint_loaded_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    """check_every=1: the load takes effect at once and the next step compares."""
    results = launch(_load_worker, 2, ("one", 1), tmp_path, gloo_timeout_s=GLOO_TIMEOUT_S)
    for result in results:
        assert "ranks [1] hold another engine state than rank 0 (step counters by rank: [2, 1])" in str(
            result["outcome"]
        ), results
        assert result["elapsed_s"] < PROMPT_S
        assert not result["pending"] and result["steps"] == []
    results = launch(_load_worker, 2, ("all", 1), tmp_path, gloo_timeout_s=GLOO_TIMEOUT_S)
    assert [r["outcome"] for r in results] == ["step 3", "step 3"]


def test_checkpoint_loaded_between_comparisons_waits_for_the_next_one(tmp_path: Path) -> None:
    """check_every=3: steps 0 and 3 compare. Loaded after step 1 on one rank, the checkpoint changes
    nothing at step 2 (both ranks sync as before), takes effect as step 3's comparison is issued,
    and fails every rank there; loaded on every rank, it takes effect there on every rank."""
    results = launch(_load_worker, 2, ("one", 3), tmp_path, gloo_timeout_s=GLOO_TIMEOUT_S)
    for result in results:
        assert "ranks [1] hold another engine state than rank 0 (step counters by rank: [3, 1])" in str(
            result["outcome"]
        ), results
        assert result["steps"] == [3] and result["elapsed_s"] < PROMPT_S
    assert [r["pending"] for r in results] == [False, True]
    results = launch(_load_worker, 2, ("all", 3), tmp_path, gloo_timeout_s=GLOO_TIMEOUT_S)
    assert [r["steps"] for r in results] == [[3, 2], [3, 2]]  # step 2 ran unloaded; step 3 from step 1
    assert all(r["pending"] for r in results)


def _load_dense_worker(rank: int, world_size: int) -> dict[str, object]:
    # A dense model under auto: a clearly dense bucket goes straight to DDP's group on the steps
    # between re-checks (odd steps here) and through zensync's lane on the others. Rank 1 loads a
    # step-1 checkpoint when rank 0 is at step 2: its (last) bucket goes to DDP's group and rank
    # 0's to the lane. The check fails both; rank 1 must not wait for its unmatched allreduce.
    side = torch.distributed.new_group(backend="gloo")  # keeps rank 0 alive until rank 1 is done
    # DDP syncs on a group of its own: rank 1's unmatched allreduce stays there, and the launcher's
    # closing barrier on the default group does not pair with it and wait out the group's timeout.
    ddp_group = torch.distributed.new_group(backend="gloo")
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4), process_group=ddp_group)
    state = zensync.register(
        ddp, strategy="auto", recheck_every=2, check_every=1, latency_s=1e-5, bandwidth_bytes_per_s=1e9
    )

    def step() -> None:
        ddp(torch.randn(3, 8)).sum().backward()

    step()  # step 0: detection (lane)
    saved = state.state_dict()
    step()  # step 1: clearly dense (DDP's group)
    if rank == 1:
        state.load_state_dict(saved)
    start = time.monotonic()
    try:
        step()
        outcome = f"step {state.step}"
    except ValueError as exc:
        outcome = f"ValueError: {exc}"
    elapsed = time.monotonic() - start
    torch.distributed.barrier(group=side)
    return {"outcome": outcome, "elapsed_s": elapsed}


@pytest.mark.slow  # the README's run keeps test_checkpoint_loaded_on_one_rank_fails_every_rank
def test_checkpoint_loaded_on_one_rank_fails_every_rank_when_buckets_go_different_ways(tmp_path: Path) -> None:
    for result in launch(_load_dense_worker, 2, (), tmp_path, gloo_timeout_s=GLOO_TIMEOUT_S):
        assert "ranks [1] hold another engine state than rank 0 (step counters by rank: [2, 1])" in str(
            result["outcome"]
        ), result
        assert result["elapsed_s"] < PROMPT_S, result


def _calibrated(rank: int, world_size: int) -> list[str]:
    models = []
    for _ in range(3):
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        models.append(repr(zensync.register(ddp, strategy="auto").cost_model))
    return models


def test_calibrated_cost_model_is_bit_identical_on_every_rank(tmp_path: Path) -> None:
    # Ranks decide alone from the cost model: an ulp of difference can flip a choice at a crossover
    # (and fails the per-step agreement). Allreduce sums and LAPACK fits are not bit-reproducible
    # across processes; the model must be rank 0's, broadcast.
    results = launch(_calibrated, 3, (), tmp_path)
    assert results[1] == results[0] and results[2] == results[0], results


def _load_mid_step_worker(rank: int, world_size: int) -> dict[str, object]:
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    state = zensync.register(ddp, strategy="zen", latency_s=1e-5, bandwidth_bytes_per_s=1e9, check_every=1)
    x = torch.arange(4).view(2, 2) * (rank + 1)
    ddp(x).sum().backward()
    saved = state.state_dict()
    with torch.no_grad():
        ddp(x)  # an evaluation forward issues no check: loading stays allowed
    state.load_state_dict(saved)
    loss = ddp(x).sum()  # this forward issued the step's check
    try:
        state.load_state_dict(saved)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    loss.backward()  # the step runs on the state that was checked
    state.load_state_dict(saved)  # between steps again
    ddp(x).sum().backward()
    return {"refused": refused, "step": state.step}


def test_load_state_dict_between_forward_and_backward_is_refused(tmp_path: Path) -> None:
    for result in launch(_load_mid_step_worker, 2, (), tmp_path, gloo_timeout_s=GLOO_TIMEOUT_S):
        assert "load_state_dict during a step" in str(result["refused"]), result
        assert result["step"] == 2  # loaded step 1, then one step

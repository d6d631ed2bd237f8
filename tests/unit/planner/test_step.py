"""``predict_step`` against the step written out by hand from the measured inputs, and ``StepProfile``'s checks."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from zensync.cost import allgather_s, allreduce_s, compressor_model
from zensync.planner import (
    BucketCost,
    LinkFit,
    ModelProfile,
    StepProfile,
    TensorProfile,
    choose_compression,
    predict_step,
)
from zensync.planner.step import _bucket_order

FORWARD_S, BACKWARD_S, OTHER_S, ROUND_S = 0.02, 0.05, 0.01, 2e-4
ALLREDUCE = LinkFit(latency_s=2e-3, bandwidth_bytes_per_s=1e8)
ALLGATHER = LinkFit(latency_s=1e-3, bandwidth_bytes_per_s=5e7)
TOPK = compressor_model("topk:0.01").spec
COSTS = {
    TOPK: {
        "gpu_compress": {"fixed_s": 1e-4, "per_element_s": 2e-9, "knee_elements": 0},
        "gpu_decompress": {"fixed_s": 2e-4, "per_element_s": 3e-9, "knee_elements": 0},
    },
    "fp16": {
        "gpu_compress": {"fixed_s": 0.0, "per_element_s": 1e-9, "knee_elements": 0},
        "gpu_decompress": {"fixed_s": 0.0, "per_element_s": 1e-9, "knee_elements": 0},
    },
}


Buckets = tuple[tuple[str, ...], ...]


def _step(*, ready: tuple[float, ...] = (0.03, 0.05), buckets: Buckets | None = None) -> StepProfile:
    tensors = tuple(TensorProfile(name=f"w{i}", shape=(1000, 100), ready_s=t) for i, t in enumerate(sorted(ready)))
    profile = ModelProfile(model="m", tensors=tensors, forward_s=FORWARD_S, backward_s=BACKWARD_S)
    return StepProfile(
        profile=profile,
        world_size=4,
        other_s=OTHER_S,
        buckets=buckets or (tuple(t.name for t in tensors),),
        allreduce=ALLREDUCE,
        allgather=ALLGATHER,
        round_s=ROUND_S,
        compressor_costs=COSTS,
    )


def test_fp32_one_bucket_is_forward_backward_allreduce_and_the_rest() -> None:
    step = _step()
    comm = allreduce_s(2 * 100_000 * 4.0, 4, ALLREDUCE.bandwidth_bytes_per_s, ALLREDUCE.latency_s)
    expected = FORWARD_S + BACKWARD_S + comm + OTHER_S  # one bucket: ready at the end of backward
    assert predict_step(step, "fp32", hooked=False).step_s == pytest.approx(expected, rel=1e-12)


def test_hook_round_goes_ahead_of_the_bucket_on_the_comm_stream() -> None:
    step = _step()
    numel = 200_000
    model = compressor_model("topk:0.01")
    encode = 1e-4 + 2e-9 * numel
    payload = model.payload_bytes(numel)
    work = float(model.aggregate_elements(np.array([float(numel)]), 4)[0])
    decode = 2e-4 + 3e-9 * work
    comm = allgather_s(float(payload), 4, ALLGATHER.bandwidth_bytes_per_s, ALLGATHER.latency_s)
    ready = FORWARD_S + BACKWARD_S
    # The encode runs on the compute stream at the ready time (the backward has ended there); the
    # round, from the start of the backward, has long finished, so the allgather starts after the
    # encode; the decode follows it.
    assert BACKWARD_S > ROUND_S
    expected = ready + encode + comm + decode + OTHER_S
    assert predict_step(step, "topk:0.01").step_s == pytest.approx(expected, rel=1e-12)
    # Without the hook (no round) the same here: the round was hidden behind the encode.
    assert predict_step(step, "topk:0.01", hooked=False).step_s == pytest.approx(expected, rel=1e-12)


def test_hook_round_delays_a_collective_only_by_what_the_backward_does_not_hide() -> None:
    slow_round = dataclasses.replace(_step(), round_s=0.5)
    hooked = predict_step(slow_round, "fp32").step_s
    plain = predict_step(slow_round, "fp32", hooked=False).step_s
    # The round runs from the start of the backward; the bucket is ready BACKWARD_S later.
    assert hooked == pytest.approx(plain + 0.5 - BACKWARD_S, rel=1e-12)


def test_two_buckets_overlap_the_first_with_backward() -> None:
    step = _step(ready=(0.01, 0.05), buckets=(("w0",), ("w1",)))
    comm = allreduce_s(100_000 * 4.0, 4, ALLREDUCE.bandwidth_bytes_per_s, ALLREDUCE.latency_s)
    # w0 is ready at 0.01 and its allreduce (~6 ms) ends before w1 is ready at 0.05.
    assert FORWARD_S + 0.01 + comm < FORWARD_S + 0.05
    expected = FORWARD_S + 0.05 + comm + OTHER_S
    assert predict_step(step, "fp32", hooked=False).step_s == pytest.approx(expected, rel=1e-12)


def test_bucket_order_makes_buckets_contiguous_and_ready_times_monotone() -> None:
    step = _step(ready=(0.01, 0.02, 0.03), buckets=(("w0", "w2"), ("w1",)))
    profile, groups = _bucket_order(step.profile, step.buckets)
    assert [t.name for t in profile.tensors] == ["w1", "w0", "w2"]
    assert groups == (0, 1, 1)
    assert [t.ready_s for t in profile.tensors] == [0.02, 0.02, 0.03]


def test_json_round_trip() -> None:
    step = _step()
    again = StepProfile.from_json(step.to_json())
    assert again.to_json() == step.to_json()
    assert predict_step(again, "topk:0.01").step_s == predict_step(step, "topk:0.01").step_s


def test_unmeasured_compressor_names_the_measured_ones() -> None:
    with pytest.raises(ValueError, match=r"no measured costs for 'dgc:0.01'.*fp16"):
        predict_step(_step(), "dgc:0.01")


def test_buckets_must_cover_the_profile() -> None:
    with pytest.raises(ValueError, match="every profiled tensor must be in exactly one bucket"):
        _step(buckets=(("w0",),))


def test_auto_chooses_the_fastest_predicted_compressor() -> None:
    step = _step()
    choice = choose_compression(step, ["fp16", "topk:0.01"])
    assert set(choice.predicted_s) == {"fp32", "fp16", "topk:0.01"}
    assert choice.spec == min(choice.predicted_s, key=choice.predicted_s.__getitem__) == "topk:0.01"
    assert choice.step_s == predict_step(step, "topk:0.01").step_s


def test_auto_stays_dense_where_compression_does_not_pay() -> None:
    fast = LinkFit(latency_s=1e-5, bandwidth_bytes_per_s=1e12)
    step = dataclasses.replace(_step(), allreduce=fast, allgather=fast)
    choice = choose_compression(step, ["fp16", "topk:0.01"])
    assert choice.spec == "fp32"
    assert min(choice.predicted_s["fp16"], choice.predicted_s["topk:0.01"]) > choice.predicted_s["fp32"]


def test_auto_margin_keeps_dense_when_the_gain_is_smaller() -> None:
    step = _step()
    choice = choose_compression(step, ["topk:0.01"])
    gain = choice.predicted_s["fp32"] / choice.predicted_s["topk:0.01"] - 1.0
    assert choose_compression(step, ["topk:0.01"], margin=gain * 0.99).spec == "topk:0.01"
    assert choose_compression(step, ["topk:0.01"], margin=gain * 1.01).spec == "fp32"
    with pytest.raises(ValueError, match=r"margin=-0\.1 must be >= 0"):
        choose_compression(step, ["topk:0.01"], margin=-0.1)


def test_from_json_checks_the_costs_as_every_profile_reader() -> None:
    data = json.loads(_step().to_json())
    data["compressor_costs"][TOPK]["gpu_compress"]["fixed_s"] = -1.0
    with pytest.raises(ValueError, match="fixed_s"):
        StepProfile.from_json(json.dumps(data))


def test_the_casts_take_the_half_precision_allreduce_where_it_was_measured() -> None:
    half = LinkFit(latency_s=ALLREDUCE.latency_s, bandwidth_bytes_per_s=ALLREDUCE.bandwidth_bytes_per_s / 2)
    step = _step()
    slow_half = dataclasses.replace(step, allreduce_half=half)
    comm = allreduce_s(2 * 100_000 * 2.0, 4, ALLREDUCE.bandwidth_bytes_per_s, ALLREDUCE.latency_s)
    # Half the bandwidth for the same fp16 bytes: the allreduce takes its byte term twice.
    extra = comm - ALLREDUCE.latency_s
    assert predict_step(slow_half, "fp16").step_s == pytest.approx(predict_step(step, "fp16").step_s + extra)
    assert predict_step(slow_half, "fp32").step_s == predict_step(step, "fp32").step_s
    assert StepProfile.from_json(slow_half.to_json()) == slow_half


POWERSGD = BucketCost(
    before_s=3e-3, after_s=7e-3, rounds=(("allreduce", 400), ("allreduce", 8800), ("allreduce", 1600))
)


def _powersgd_step(**kwargs: object) -> StepProfile:
    return dataclasses.replace(_step(**kwargs), bucket_costs={"powersgd:4": (POWERSGD,)})  # type: ignore[arg-type]


def test_powersgd_is_priced_from_its_measured_bucket() -> None:
    """before_s on the compute stream at the ready time, then its three allreduces and after_s."""
    step = _powersgd_step()
    comm = sum(
        allreduce_s(float(nbytes), 4, ALLREDUCE.bandwidth_bytes_per_s, ALLREDUCE.latency_s)
        for _, nbytes in POWERSGD.rounds
    )
    expected = FORWARD_S + BACKWARD_S + POWERSGD.before_s + comm + POWERSGD.after_s + OTHER_S
    assert predict_step(step, "powersgd:4").step_s == pytest.approx(expected, rel=1e-12)
    assert step.measured("powersgd:4") and step.measured("topk:0.01") and not step.measured("powersgd:2")


def test_powersgd_buckets_are_placed_by_their_ready_times() -> None:
    """Two buckets, the later one listed first: each takes its own cost at its own ready time."""
    fast = BucketCost(before_s=1e-3, after_s=1e-3, rounds=(("allreduce", 400),))
    slow = BucketCost(before_s=2e-3, after_s=30e-3, rounds=(("allreduce", 400),))
    step = dataclasses.replace(
        _step(ready=(0.01, 0.05), buckets=(("w1",), ("w0",))), bucket_costs={"powersgd:4": (slow, fast)}
    )
    comm = allreduce_s(400.0, 4, ALLREDUCE.bandwidth_bytes_per_s, ALLREDUCE.latency_s)
    # w0 (fast, ready at 0.01) is done long before w1 (slow, ready at 0.05 after w0's 1 ms delay).
    expected = FORWARD_S + 0.05 + fast.before_s + slow.before_s + comm + slow.after_s + OTHER_S
    assert predict_step(step, "powersgd:4", hooked=False).step_s == pytest.approx(expected, rel=1e-12)


def test_auto_may_choose_powersgd_and_it_round_trips() -> None:
    step = _powersgd_step()
    choice = choose_compression(step, ["fp16", "topk:0.01", "powersgd:4"])
    assert choice.predicted_s["powersgd:4"] == predict_step(step, "powersgd:4").step_s
    assert choice.spec == min(choice.predicted_s, key=choice.predicted_s.__getitem__)
    again = StepProfile.from_json(step.to_json())
    assert again == step
    assert predict_step(again, "powersgd:4").step_s == predict_step(step, "powersgd:4").step_s


def test_unmeasured_powersgd_names_what_to_measure() -> None:
    with pytest.raises(ValueError, match=r"no measured bucket costs for 'powersgd:4'.*profile_group"):
        predict_step(_step(), "powersgd:4")


def test_bucket_costs_need_one_entry_per_bucket() -> None:
    with pytest.raises(ValueError, match=r"bucket_costs\['powersgd:4'\] has 2 entries for 1 buckets"):
        dataclasses.replace(_step(), bucket_costs={"powersgd:4": (POWERSGD, POWERSGD)})
    with pytest.raises(ValueError, match="before_s=-1"):
        BucketCost(before_s=-1.0, after_s=0.0, rounds=())

"""Planner cost models: bandwidth parsing, the cluster spec, collective formulas, compressor models and
per-option pipeline costs, each against numbers worked out by hand in the comments."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zensync.cost import (
    FP16_MODEL,
    AffineCost,
    CompressorModel,
    allgather_s,
    allreduce_s,
    alltoall_s,
    broadcast_s,
    compressor_model,
    gather_s,
    reduce_scatter_s,
)
from zensync.planner.cluster import ClusterSpec, parse_bandwidth
from zensync.planner.options import TensorOption, candidate_options, option_costs

REL = 1e-12
"""Relative tolerance: every expected value below is a short float expression (rounding only)."""


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("25Gbit", 25e9 / 8),
        ("100gbit", 100e9 / 8),
        ("12.5GB/s", 12.5e9),
        ("10 Gb/s", 10e9 / 8),
        ("25Gbps", 25e9 / 8),
        ("100Mbit", 100e6 / 8),
        ("1GiB/s", 2.0**30),
        ("2 GBytes/s", 2e9),
        ("nvlink", 50e9),  # Espresso: 0.02 us per KB
        ("PCIe", 2.5e9),  # Espresso: 0.4 us per KB
    ],
)
def test_parse_bandwidth(text: str, bytes_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s, rel=REL)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("25", "expected <number><prefix><unit>"),
        ("fast", "expected <number><prefix><unit>"),
        ("", "expected <number><prefix><unit>"),
        ("25Gx", "unknown unit 'x'"),
        ("25 GBx", "unknown unit 'Bx'"),
        ("0Gbit", "positive"),
        (25, "expected a string"),
    ],
)
def test_parse_bandwidth_errors(text: object, fragment: str) -> None:
    with pytest.raises(ValueError, match="bandwidth=") as info:
        parse_bandwidth(text)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_cluster_spec_validates_and_round_trips() -> None:
    cluster = ClusterSpec.from_strings(nodes=8, gpus_per_node=8, inter="25Gbit", intra="pcie", cpu_workers=2)
    assert cluster.world_size == 64 and cluster.hierarchical
    assert cluster.inter_latency_s == 150e-6 and cluster.intra_bandwidth_bytes_per_s == 2.5e9
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster
    assert not ClusterSpec.from_strings(nodes=1, gpus_per_node=8, inter="25Gbit").hierarchical
    with pytest.raises(ValueError, match=r"ClusterSpec.nodes=0 must be an int >= 1"):
        ClusterSpec.from_strings(nodes=0, gpus_per_node=8, inter="25Gbit")
    with pytest.raises(ValueError, match=r"ClusterSpec.inter_latency_s=-1"):
        ClusterSpec.from_strings(nodes=2, gpus_per_node=8, inter="25Gbit", inter_latency_s=-1)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['speed'\]"):
        ClusterSpec.from_dict({**cluster.to_dict(), "speed": 1})
    with pytest.raises(ValueError, match=r"cluster is missing field\(s\) \[.gpus_per_node."):
        ClusterSpec.from_dict({"nodes": 2})


def test_collective_formulas_by_hand() -> None:
    # k = 8 ranks, B = 1 GB/s, alpha = 100 us.
    args = (8, 1e9, 1e-4)
    assert allreduce_s(8e6, *args) == pytest.approx(1e-4 + 2 * 7 / 8 * 8e6 / 1e9, rel=REL)  # 14.1 ms
    assert reduce_scatter_s(8e6, *args) == pytest.approx(1e-4 + 7 / 8 * 8e6 / 1e9, rel=REL)  # 7.1 ms
    assert allgather_s(1e6, *args) == pytest.approx(1e-4 + 7 * 1e6 / 1e9, rel=REL)  # 7.1 ms: 7 peers' 1 MB
    assert alltoall_s(8e6, *args) == pytest.approx(1e-4 + 7 / 8 * 8e6 / 1e9, rel=REL)  # 7.1 ms
    assert gather_s(1e6, *args) == pytest.approx(1e-4 + 7e6 / 1e9, rel=REL)  # root receives 7 MB
    assert broadcast_s(1e6, *args) == pytest.approx(1e-4 + 1e6 / 1e9, rel=REL)  # pipelined: 1.1 ms
    for collective in (allreduce_s, reduce_scatter_s, allgather_s, alltoall_s, gather_s, broadcast_s):
        assert collective(1e6, 1, 1e9, 1e-4) == 0.0  # one rank: nothing to send
    np.testing.assert_allclose(allreduce_s(np.array([0.0, 8e6]), *args), [1e-4, 0.0141], rtol=REL)


def test_affine_cost_shapes() -> None:
    espresso = AffineCost.espresso_gpu(390e-6)  # DGC one-level total, Espresso 1.6
    assert espresso(1000.0) == 390e-6 and espresso(2.0**20) == 390e-6  # constant up to 2**20
    assert espresso(2.0**21) == pytest.approx(780e-6, rel=REL)  # linear above
    affine = AffineCost(fixed_s=1e-5, per_element_s=1e-9)
    assert affine(1e6) == pytest.approx(1e-5 + 1e-3, rel=REL)
    with pytest.raises(ValueError, match=r"AffineCost.fixed_s=-1"):
        AffineCost(fixed_s=-1)


def test_compressor_model_defaults_and_payload() -> None:
    dgc = CompressorModel.family("dgc", bits_per_element=0.64, allreduce_compatible=False)
    # 2**20 * 0.64 / 8 = 83886.08 -> 83887 bytes (values + indices of 1 %).
    assert dgc.payload_bytes(2**20) == 83887 and dgc.sparse and dgc.divisible
    assert dgc.compress_s("gpu", 2.0**20) == pytest.approx(356e-6, rel=REL)  # 390 total - 34 decode
    assert dgc.decompress_s("gpu", 2.0**20) == pytest.approx(34e-6, rel=REL)
    # CPU: 15 us + 4 bytes * 8 / 20 Gbit/s per element.
    assert dgc.compress_s("cpu", 1e6) == pytest.approx(15e-6 + 1e6 * 32 / 20e9, rel=REL)
    np.testing.assert_allclose(dgc.payload_array(np.array([2.0**20, 10.0])), [83887, 1])
    # Sparse decode: the first payload densely, each further one by its payload fraction (0.08 / 4 = 0.02).
    assert dgc.aggregate_elements(np.array([1e6]), 8)[0] == pytest.approx(1e6 + 7 * 1e6 * 0.02, rel=1e-9)
    sign = CompressorModel.family("efsignsgd", bits_per_element=1.0, allreduce_compatible=False)
    # quantizers: one fused pass writes the output once and reads each further 1-bit payload once
    fraction = sign.payload_bytes(1_000_000) / 4e6
    assert sign.aggregate_elements(np.array([1e6]), 8)[0] == pytest.approx(1e6 * (1 + 7 * fraction), rel=1e-9)
    exact = CompressorModel.family("topk", bits_per_element=1.0, allreduce_compatible=False, payload_fn=lambda n: 7)
    assert exact.payload_bytes(123) == 7
    assert CompressorModel.family("powersgd", bits_per_element=4.0, allreduce_compatible=True).divisible is False
    with pytest.raises(ValueError, match="has no default costs; valid: bf16"):
        CompressorModel.family("zip", bits_per_element=1.0, allreduce_compatible=False)
    with pytest.raises(ValueError, match=r"bits_per_element=0"):
        CompressorModel.family("dgc", bits_per_element=0.0, allreduce_compatible=False)


def test_compressor_model_factory_reads_the_compressor() -> None:
    pytest.importorskip("zensync.compress.dgc", reason="the dgc compressor module is not there yet")
    from zensync.compress import build

    model = compressor_model("dgc:0.01")
    comp = build("dgc:0.01")
    assert model.spec == comp.spec() and model.allreduce_compatible == comp.allreduce_compatible
    assert model.payload_bytes(1_000_000) == comp.payload_bytes(1_000_000)
    assert model.gpu_compress == AffineCost.espresso_gpu(356e-6)
    slow = compressor_model("dgc:0.01", overrides={"gpu_compress": AffineCost(fixed_s=1.0)})
    assert slow.gpu_compress.fixed_s == 1.0
    with pytest.raises(ValueError, match=r"overrides \['speed'\] are not fields"):
        compressor_model("dgc:0.01", overrides={"speed": 1})


# A 2 x 2 cluster with round numbers: intra 10 GB/s, 10 us; inter 1 GB/s, 100 us; PCIe 4 GB/s.
CLUSTER = ClusterSpec(
    nodes=2,
    gpus_per_node=2,
    intra_bandwidth_bytes_per_s=10e9,
    intra_latency_s=1e-5,
    inter_bandwidth_bytes_per_s=1e9,
    inter_latency_s=1e-4,
    pcie_bandwidth_bytes_per_s=4e9,
)
# 2 bits per element (payload = numel / 4 bytes), fixed kernel costs: encode 100 us, decode 20 us on
# the GPU, 500 us / 300 us on the CPU. Dense decode (not sparse).
MODEL = CompressorModel(
    spec="test",
    bits_per_element=2.0,
    allreduce_compatible=False,
    gpu_compress=AffineCost(fixed_s=1e-4),
    gpu_decompress=AffineCost(fixed_s=2e-5),
    cpu_compress=AffineCost(fixed_s=5e-4),
    cpu_decompress=AffineCost(fixed_s=3e-4),
)
NUMEL = np.array([1e6])  # 4 MB of float32; the 1/2 shard is 2 MB


def _costs(code: str, upper_bound: bool = False) -> tuple[float, list[tuple[str, float]]]:
    costs = option_costs(TensorOption.from_code(code), NUMEL, CLUSTER, MODEL, upper_bound=upper_bound)
    return float(costs.compute_s[0]), [(resource, float(seconds[0])) for resource, seconds in costs.stages]


def _assert_stages(got: list[tuple[str, float]], expected: list[tuple[str, float]]) -> None:
    assert [r for r, _ in got] == [r for r, _ in expected]
    for (_, seconds), (_, want) in zip(got, expected, strict=True):
        assert seconds == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_fp32_option_costs_by_hand() -> None:
    # Flat ring over 4 ranks at min(10, 1) GB/s: 100 us + 2 * 3/4 * 4 MB / 1 GB/s = 6.1 ms.
    compute, stages = _costs("fp32-ar-gpu-flat")
    assert compute == 0.0
    _assert_stages(stages, [("wait", 0.0), ("comm", 6.1e-3)])
    # Two-level: intra RS 10 us + 1/2 * 4 MB / 10 GB/s = 0.21 ms; inter AR of the 2 MB shard over 2 nodes
    # with the NIC shared by 2 GPUs (0.5 GB/s): 100 us + 2 * 1/2 * 2 MB / 0.5 GB/s = 4.1 ms; intra AG
    # 10 us + 2 MB / 10 GB/s = 0.21 ms. Total 4.52 ms.
    _assert_stages(_costs("fp32-ar-gpu-hier")[1], [("wait", 0.0), ("comm", 4.52e-3)])


def test_compressed_option_costs_by_hand() -> None:
    # Flat allgather: encode 100 us (compute stream and wait), AG of 250 kB over 4 ranks at 1 GB/s
    # = 100 us + 3 * 0.25 ms = 0.85 ms, decode of 4 payloads 20 us (fixed cost) -> comm 0.87 ms.
    compute, stages = _costs("comp-ag-gpu-flat")
    assert compute == pytest.approx(1e-4, rel=REL)
    _assert_stages(stages, [("wait", 1e-4), ("comm", 0.87e-3)])
    # Two-level allgather: RS 0.21 ms, encode of the shard 100 us (charged to compute too, as Espresso
    # does, but not a wait), inter AG of 125 kB at 0.5 GB/s = 100 us + 0.25 ms, decode 20 us, intra AG
    # of the fp32 shard 0.21 ms -> 0.89 ms.
    compute, stages = _costs("comp-ag-gpu-hier")
    assert compute == pytest.approx(1e-4, rel=REL)
    _assert_stages(stages, [("wait", 0.0), ("comm", 0.89e-3)])
    # CPU flat allgather: D2H 4 MB / 4 GB/s = 1 ms + encode 0.5 ms; AG 0.85 ms; decode 0.3 ms + H2D 1 ms.
    compute, stages = _costs("comp-ag-cpu-flat")
    assert compute == 0.0
    _assert_stages(stages, [("cpu", 1.5e-3), ("comm", 0.85e-3), ("cpu", 1.3e-3)])
    # Upper bound: the same collectives, no kernels, no copies, no compute charge.
    compute, stages = _costs("comp-ag-gpu-flat", upper_bound=True)
    assert compute == 0.0
    _assert_stages(stages, [("wait", 0.0), ("comm", 0.85e-3)])


def test_alltoall_and_gather_broadcast_by_hand() -> None:
    # Flat alltoall+allgather over 4 ranks; alltoall traffic shares the NIC: min(10, 1/2) = 0.5 GB/s.
    # A2A of 250 kB: 100 us + 3/4 * 250 kB / 0.5 GB/s = 0.475 ms; decode 20 us; re-encode of the 250k
    # chunk 100 us; AG of its 62.5 kB at 1 GB/s: 100 us + 3 * 62.5 us = 0.2875 ms; decode 20 us.
    _assert_stages(_costs("comp-a2a-gpu-flat")[1], [("wait", 1e-4), ("comm", 0.9025e-3)])
    # Gather 100 us + 3 * 0.25 ms; decode 20 us; re-encode 100 us; broadcast 100 us + 0.25 ms; decode 20 us.
    _assert_stages(_costs("comp-gb-gpu-flat")[1], [("wait", 1e-4), ("comm", 1.34e-3)])


def test_fp16_option_uses_the_fp16_model() -> None:
    compute, stages = _costs("fp16-ar-gpu-flat")
    assert compute == pytest.approx(float(FP16_MODEL.compress_s("gpu", 1e6)), rel=REL)
    # 2 MB allreduced over 4 ranks at 1 GB/s: 100 us + 3 ms, plus the fp16 decode.
    _assert_stages(stages, [("wait", compute), ("comm", 3.1e-3 + float(FP16_MODEL.decompress_s("gpu", 1e6)))])


def test_candidate_options_respect_compatibility() -> None:
    codes = {o.code for o in candidate_options(CLUSTER, MODEL)}
    assert "comp-ar-gpu-flat" not in codes  # MODEL is not allreduce-compatible
    assert {"fp32-ar-gpu-flat", "fp32-ar-gpu-hier", "comp-a2a-gpu-hier", "comp-gb-gpu-flat"} <= codes
    assert not any(code.endswith("hier2") for code in codes)
    two_level = {o.code for o in candidate_options(CLUSTER, MODEL, devices=("gpu", "cpu"), two_level=True)}
    assert {"comp-ag-gpu-hier2", "comp-a2a-cpu-hier2"} <= two_level
    single_node = ClusterSpec.from_strings(nodes=1, gpus_per_node=8, inter="25Gbit")
    assert all(o.level == "flat" for o in candidate_options(single_node, MODEL, two_level=True))
    powersgd = CompressorModel.family("powersgd", bits_per_element=1.0, allreduce_compatible=True)
    schemes = {o.scheme for o in candidate_options(CLUSTER, powersgd, two_level=True) if o.kind == "comp"}
    assert schemes == {"ar", "ag", "gb"}  # indivisible: no alltoall


def test_tensor_option_codes() -> None:
    options = candidate_options(CLUSTER, MODEL, devices=("gpu", "cpu"), two_level=True)
    assert all(TensorOption.from_code(o.code) == o for o in options)
    assert len({o.code for o in options}) == len(options)
    assert TensorOption.from_code("comp-a2a-gpu-hier").espresso_code == 3
    assert TensorOption.from_code("comp-ag-gpu-flat").espresso_code == 10
    assert TensorOption.from_code("fp16-ar-gpu-hier").espresso_code == 1
    assert TensorOption.from_code("comp-ag-cpu-hier").espresso_code == 5
    with pytest.raises(ValueError, match="expected kind-scheme-device-level"):
        TensorOption.from_code("comp-ag")
    with pytest.raises(ValueError, match=r"option code 'zip-ag-gpu-flat' is invalid: TensorOption.kind='zip'"):
        TensorOption.from_code("zip-ag-gpu-flat")
    with pytest.raises(ValueError, match="runs as a GPU allreduce"):
        TensorOption(kind="fp32", device="cpu")
    with pytest.raises(ValueError, match="no compressed intra phase"):
        TensorOption(kind="comp", scheme="ar", level="hier2")


@given(counts=st.lists(st.integers(0, 2**24), min_size=0, max_size=40), spec=st.sampled_from(["dgc:0.01", "qsgd:8"]))
@settings(max_examples=60, deadline=None)
def test_payload_array_is_payload_bytes_per_element(counts: list[int], spec: str) -> None:
    """The vectorised payload (one call per distinct count, shared cache) equals payload_bytes of
    each element, in the array's shape, repeated counts included."""
    model = compressor_model(spec)
    numel = np.array(counts + counts[:3], dtype=np.float64)
    cache: dict[int, int] = {}
    expected = [model.payload_bytes(int(c)) for c in numel]
    np.testing.assert_array_equal(model.payload_array(numel, cache), expected)
    if len(numel) % 2 == 0:
        np.testing.assert_array_equal(model.payload_array(numel.reshape(2, -1), cache), np.reshape(expected, (2, -1)))

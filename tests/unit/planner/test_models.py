"""Unit tests of ``zensync.planner.models`` (built-in roofline profiles) and ``zensync.planner.gpus``."""

from __future__ import annotations

import math
import time

import pytest

from zensync.planner import ModelProfile, builtin_gpus, builtin_models, builtin_profile, gpu_spec, models

MODELS = ("resnet50", "resnet101", "vgg16", "bert-base", "gpt2", "lstm", "deepfm")

BUILD_BUDGET_S = 1.0
"""Each profile must build in well under a second, module construction included (the brief's bound)."""


# ---------------------------------------------------------------------------------------------------------------------
# Closed-form parameter counts, written independently of the module definitions
# ---------------------------------------------------------------------------------------------------------------------


def _resnet_params(blocks: tuple[int, ...]) -> int:
    total = 3 * 64 * 7 * 7 + 2 * 64  # conv1 + bn1
    c_in = 64
    for count, width in zip(blocks, (64, 128, 256, 512), strict=True):
        for i in range(count):
            total += c_in * width + 9 * width * width + width * 4 * width  # 1x1, 3x3, 1x1 convs
            total += 2 * (width + width + 4 * width)  # three BNs (weight + bias)
            if i == 0:
                total += c_in * 4 * width + 2 * 4 * width  # downsample conv + BN
            c_in = 4 * width
    return total + 2048 * 1000 + 1000


def _vgg16_params() -> int:
    widths = (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512)
    convs = sum(c_in * c_out * 9 + c_out for c_in, c_out in zip((3, *widths[:-1]), widths, strict=True))
    return convs + (25088 * 4096 + 4096) + (4096 * 4096 + 4096) + (4096 * 1000 + 1000)


def _bert_base_params(vocab: int = 30522, positions: int = 512, d: int = 768, ff: int = 3072, layers: int = 12) -> int:
    embeddings = (vocab + positions + 2) * d + 2 * d
    layer = 4 * (d * d + d) + (d * ff + ff) + (ff * d + d) + 2 * (2 * d)
    return embeddings + layers * layer + (d * d + d)  # + pooler


def _gpt2_params(vocab: int = 50257, positions: int = 1024, d: int = 768, layers: int = 12) -> int:
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return (vocab + positions) * d + layers * block + 2 * d  # tied lm_head adds nothing


def _lstm_params(vocab: int = 33278, h: int = 1500, layers: int = 2) -> int:
    return vocab * h + layers * (2 * 4 * h * h + 2 * 4 * h) + vocab  # tied decoder: only its bias is new


# Criteo Kaggle cardinalities, hashed to at most 10^6 buckets per field.
DEEPFM_ROWS = 5_569_296


def _deepfm_params(rows: int = DEEPFM_ROWS, fields: int = 26, dim: int = 16, dense: int = 13) -> int:
    mlp_in = fields * dim + dense
    mlp = (mlp_in * 400 + 400) + 2 * (400 * 400 + 400) + (400 + 1)
    return rows * (1 + dim) + (dense + 1) + mlp


EXPECTED = {
    # model: (tensors, parameters); torchvision and Hugging Face report the literal totals.
    "resnet50": (161, 25_557_032),
    "resnet101": (314, 44_549_160),
    "vgg16": (32, 138_357_544),
    "bert-base": (5 + 12 * 16 + 2, 109_482_240),
    "gpt2": (2 + 12 * 12 + 2, 124_439_808),
    "lstm": (1 + 2 * 4 + 1, 85_974_278),
    "deepfm": (26 + 2 + 26 + 8, 95_171_247),
}
CLOSED_FORM = {
    "resnet50": _resnet_params((3, 4, 6, 3)),
    "resnet101": _resnet_params((3, 4, 23, 3)),
    "vgg16": _vgg16_params(),
    "bert-base": _bert_base_params(),
    "gpt2": _gpt2_params(),
    "lstm": _lstm_params(),
    "deepfm": _deepfm_params(),
}
# Espresso Table 4 sizes are MiB of FP32 gradients (reference/espresso.md 1.7).
ESPRESSO_MIB = {"resnet101": 170, "vgg16": 528, "bert-base": 420, "gpt2": 475, "lstm": 328}
# Espresso Table 5 tensor counts that our definitions match (its BERT-base, 207, has a different head).
ESPRESSO_TENSORS = {"vgg16": 32, "resnet101": 314, "gpt2": 148, "lstm": 10}


def _step_s(profile: ModelProfile) -> float:
    return profile.forward_s + profile.backward_s


# ---------------------------------------------------------------------------------------------------------------------
# Shapes and counts
# ---------------------------------------------------------------------------------------------------------------------


def test_builtin_models_lists_the_seven() -> None:
    assert builtin_models() == MODELS


@pytest.mark.parametrize("model", MODELS)
def test_tensor_counts_and_parameter_totals(model: str) -> None:
    profile = builtin_profile(model)
    tensors, params = EXPECTED[model]
    assert len(profile.tensors) == tensors
    assert profile.num_params == params == CLOSED_FORM[model]
    assert profile.gradient_bytes == 4 * params and profile.dtype_bytes == 4


@pytest.mark.parametrize("model", sorted(ESPRESSO_MIB))
def test_sizes_match_espresso_table_4(model: str) -> None:
    mib = builtin_profile(model).gradient_bytes / 2**20
    assert abs(mib - ESPRESSO_MIB[model]) < 3.0, mib


@pytest.mark.parametrize("model", sorted(ESPRESSO_TENSORS))
def test_tensor_counts_match_espresso_table_5(model: str) -> None:
    assert len(builtin_profile(model).tensors) == ESPRESSO_TENSORS[model]


def test_deepfm_tables_are_capped_criteo_fields() -> None:
    shapes = {t.name: t.shape for t in builtin_profile("deepfm").tensors}
    first = [shapes[f"first_order.{i}.weight"] for i in range(26)]
    second = [shapes[f"embedding.{i}.weight"] for i in range(26)]
    assert sum(s[0] for s in first) == sum(s[0] for s in second) == DEEPFM_ROWS
    assert {s[1] for s in first} == {1} and {s[1] for s in second} == {16}
    assert max(s[0] for s in second) == 1_000_000
    assert shapes["mlp.0.weight"] == (400, 26 * 16 + 13)


def test_gpt2_uses_conv1d_layout_and_tied_head() -> None:
    shapes = {t.name: t.shape for t in builtin_profile("gpt2").tensors}
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (768, 2304)  # Conv1D: (in, out)
    assert shapes["transformer.wte.weight"] == (50257, 768)
    assert not any(name.startswith("lm_head") for name in shapes)


# ---------------------------------------------------------------------------------------------------------------------
# Timing structure
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gpu", ["V100", "H200"])
def test_ready_times_are_ordered_and_within_backward(model: str, gpu: str) -> None:
    profile = builtin_profile(model, gpu=gpu)
    ready = [t.ready_s for t in profile.tensors]
    assert ready == sorted(ready)
    assert ready[0] > 0
    assert ready[-1] <= profile.backward_s
    # The first forward op of every built-in holds parameters, so the last gradient ends the backward.
    assert ready[-1] == pytest.approx(profile.backward_s, rel=1e-12)
    assert profile.forward_s > 0
    assert profile.device == f"roofline:{gpu}"


def test_resnet_backward_order() -> None:
    names = [t.name for t in builtin_profile("resnet101").tensors]
    assert names[:2] == ["fc.bias", "fc.weight"]
    assert names[-3:] == ["bn1.bias", "bn1.weight", "conv1.weight"]
    assert names.index("layer4.2.bn3.bias") < names.index("layer3.22.conv1.weight") < names.index("layer1.0.bn1.bias")
    # The shortcut runs after bn3 in the forward, so its gradients come before bn3's.
    block = names[names.index("layer2.0.downsample.1.bias") :][:6]
    assert block == [
        "layer2.0.downsample.1.bias",
        "layer2.0.downsample.1.weight",
        "layer2.0.downsample.0.weight",
        "layer2.0.bn3.bias",
        "layer2.0.bn3.weight",
        "layer2.0.conv3.weight",
    ]


def test_transformer_and_lstm_backward_order() -> None:
    bert = [t.name for t in builtin_profile("bert-base").tensors]
    assert bert[:2] == ["pooler.dense.bias", "pooler.dense.weight"]
    assert bert[-1] == "embeddings.word_embeddings.weight"
    p = "encoder.layer.0.attention.self"
    assert bert.index(f"{p}.value.weight") < bert.index(f"{p}.key.weight") < bert.index(f"{p}.query.weight")
    gpt2 = [t.name for t in builtin_profile("gpt2").tensors]
    assert gpt2[0] == "transformer.ln_f.bias"
    assert gpt2[-2:] == ["transformer.wpe.weight", "transformer.wte.weight"]  # tied wte: ready after its lookup
    lstm = [t.name for t in builtin_profile("lstm").tensors]
    layer = ["rnn.bias_hh_l{}", "rnn.bias_ih_l{}", "rnn.weight_hh_l{}", "rnn.weight_ih_l{}"]
    assert lstm == ["decoder.bias", *(n.format(1) for n in layer), *(n.format(0) for n in layer), "encoder.weight"]
    vgg = [t.name for t in builtin_profile("vgg16").tensors]
    assert vgg[0] == "classifier.6.bias" and vgg[-1] == "features.0.weight"
    deepfm = [t.name for t in builtin_profile("deepfm").tensors]
    assert deepfm[0] == "mlp.6.bias" and deepfm[-1] == "first_order.0.weight"


@pytest.mark.parametrize("model", MODELS)
def test_faster_gpu_gives_shorter_backward(model: str) -> None:
    v100, a100, h100, h200 = (builtin_profile(model, gpu=g).backward_s for g in ("V100", "A100", "H100", "H200"))
    assert v100 > a100 > h100 >= h200


@pytest.mark.parametrize("model", MODELS)
def test_amp_is_faster_than_fp32(model: str) -> None:
    amp, fp32 = builtin_profile(model, precision="amp"), builtin_profile(model, precision="fp32")
    assert amp.backward_s < fp32.backward_s and amp.forward_s < fp32.forward_s


@pytest.mark.parametrize("model", ["resnet50", "resnet101", "vgg16"])
def test_doubling_the_batch_doubles_compute_bound_time(model: str) -> None:
    # Convolutions dominate and weights are small next to activations, so time is near-linear in batch.
    single, double = builtin_profile(model, batch=32), builtin_profile(model, batch=64)
    assert 1.9 < double.backward_s / single.backward_s <= 2.0 + 1e-9
    assert 1.9 < double.forward_s / single.forward_s <= 2.0 + 1e-9


def test_small_batches_are_weight_bound() -> None:
    # GPT-2 at 80 tokens streams its 124M weights: doubling the tokens costs far less than 2x.
    single, double = builtin_profile("gpt2", batch=1), builtin_profile("gpt2", batch=2)
    assert 1.0 < double.backward_s / single.backward_s < 1.6


# ---------------------------------------------------------------------------------------------------------------------
# Plausibility against published numbers (generous bands: a roofline ignores launch overhead and
# framework time, and the published runs use larger batches)
# ---------------------------------------------------------------------------------------------------------------------

# NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md (pytorch-21.03 NGC),
# 1 GPU training throughput: DGX-1 32GB (V100) 1156 img/s AMP and 356 img/s FP32; DGX A100 80GB 2470 img/s AMP.
RESNET50_PUBLISHED_IMG_S = {("V100", "amp"): 1156.0, ("V100", "fp32"): 356.0, ("A100", "amp"): 2470.0}
PLAUSIBLE_FACTOR = 2.0
"""The roofline step must be within 2x of the published step time for the same 32 images."""


@pytest.mark.parametrize(("gpu", "precision"), sorted(RESNET50_PUBLISHED_IMG_S))
def test_resnet50_step_is_near_published_throughput(gpu: str, precision: str) -> None:
    published_s = 32 / RESNET50_PUBLISHED_IMG_S[(gpu, precision)]
    step_s = _step_s(builtin_profile("resnet50", gpu=gpu, precision=precision, batch=32))
    assert published_s / PLAUSIBLE_FACTOR < step_s < published_s * PLAUSIBLE_FACTOR, (step_s, published_s)


def test_resnet50_v100_amp_step_is_tens_of_ms() -> None:
    step_s = _step_s(builtin_profile("resnet50"))
    assert 0.010 < step_s < 0.100
    # Never faster than the tensor-core peak allows: 3 passes x 2 x 4.09 GMAC (torchvision's count) x 32 images.
    assert step_s > 3 * 2 * 4.09e9 * 32 / (gpu_spec("V100").tensor_tflops * 1e12)


@pytest.mark.parametrize(
    ("model", "matmul_params", "tokens"), [("bert-base", 12 * 12 * 768**2, 1024), ("gpt2", 12 * 12 * 768**2, 80)]
)
def test_transformer_steps_respect_the_6nd_bound(model: str, matmul_params: int, tokens: int) -> None:
    # Training costs at least 6 x (block weight-matrix parameters, 12 d^2 per layer) x tokens FLOPs (Kaplan et al.).
    step_s = _step_s(builtin_profile(model))
    assert step_s > 6 * matmul_params * tokens / (gpu_spec("V100").tensor_tflops * 1e12)
    assert step_s < 0.1


# ---------------------------------------------------------------------------------------------------------------------
# Errors, round trip, speed; the GPU table
# ---------------------------------------------------------------------------------------------------------------------


def test_unknown_names_and_bad_batches_raise() -> None:
    with pytest.raises(ValueError, match=r"model='resnet18'.*resnet50"):
        builtin_profile("resnet18")
    with pytest.raises(ValueError, match=r"gpu='P100'.*H100"):
        builtin_profile("resnet50", gpu="P100")
    with pytest.raises(ValueError, match=r"precision='bf16'.*amp"):
        builtin_profile("resnet50", precision="bf16")
    for batch in (0, -3):
        with pytest.raises(ValueError, match=rf"batch={batch} must be >= 1"):
            builtin_profile("gpt2", batch=batch)


@pytest.mark.parametrize("model", ["resnet101", "gpt2", "lstm"])
def test_json_round_trip(model: str) -> None:
    profile = builtin_profile(model, gpu="h100", batch=3)
    assert ModelProfile.from_json(profile.to_json()) == profile
    assert profile.batch.startswith("3 ") and profile.batch.endswith(", amp")


@pytest.mark.parametrize("model", MODELS)
def test_each_builtin_builds_quickly(model: str) -> None:
    models._module.cache_clear()  # time the meta-device module construction too, not just the trace
    start = time.perf_counter()
    builtin_profile(model, gpu="A100", batch=7, precision="fp32")
    assert time.perf_counter() - start < BUILD_BUDGET_S


@pytest.mark.parametrize("alias", ["h100", "H100", "H100-SXM", "nvidia h100_sxm5", " H100 "])
def test_gpu_aliases(alias: str) -> None:
    assert gpu_spec(alias).name == "H100"


def test_gpu_table_values() -> None:
    assert builtin_gpus() == ("V100", "A100", "H100", "H200")
    specs = {name: gpu_spec(name) for name in builtin_gpus()}
    table = {name: (s.fp32_tflops, s.tensor_tflops, s.hbm_gbps) for name, s in specs.items()}
    assert table == {
        "V100": (15.7, 125.0, 900.0),
        "A100": (19.5, 312.0, 2039.0),
        "H100": (67.0, 989.0, 3350.0),
        "H200": (67.0, 989.0, 4800.0),
    }
    # roofline_s: 75 TFLOP at 60 % of V100's 125 TFLOP/s is 1 s; 630 GB at 70 % of 900 GB/s is 1 s.
    assert math.isclose(gpu_spec("V100").roofline_s(75e12, 0.0, tensor_cores=True), 1.0)
    assert math.isclose(gpu_spec("V100").roofline_s(0.0, 630e9, tensor_cores=False), 1.0)


def test_unknown_gpu_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"\['V100', 'A100', 'H100', 'H200'\]"):
        gpu_spec("mi300x")

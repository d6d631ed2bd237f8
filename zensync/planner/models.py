"""Built-in model profiles: Espresso's workloads (reference/espresso.md 1.7, Table 4) plus DeepFM, by roofline.

Each architecture is a tree of ``torch.nn`` modules on the meta device (no memory; parameter containers,
no ``forward``), so names and shapes are what ``named_parameters()`` gives. A per-model trace lists the
forward ops in execution order with FLOPs and HBM traffic at the batch, from the modules' own sizes
(conv: 2*Cin*Cout*k*k*Hout*Wout*N/groups; linear: 2*in*out*rows; attention: 4*B*T^2*d for the score
and value matmuls; LSTM: 2*4*h*(in+h) per token and layer; embedding: a memory-bound gather). Each op
takes ``GpuSpec.roofline_s`` (peak x COMPUTE_EFFICIENCY 0.6, HBM x MEMORY_EFFICIENCY 0.7): matmul-class
ops use the FP16 tensor-core peak under "amp" and the FP32 peak under "fp32"; bytes are activations in
and out plus weights, 2 bytes per element under "amp", 4 under "fp32". A backward costs 2x the forward
FLOPs with parameters (input + weight grad; 1x without) and 2x its bytes. It runs the ops in reverse
forward order (autograd's ready queue, by sequence number, on one device); a gradient is ready when the
last op using it finishes (a tied embedding: after its lookup, i.e. last). Within one op, tensors are in
reverse registration order (bias before weight), as DDP's reversed-parameter buckets assume.

| model | tensors | params | MiB (fp32) | default batch (Espresso Table 4) |
|---|---|---|---|---|
| resnet50 | 161 | 25,557,032 | 97.5 | 32 images 224x224 |
| resnet101 | 314 | 44,549,160 | 169.9 | 32 images (Table 4: 170 MB) |
| vgg16 | 32 | 138,357,544 | 527.8 | 32 images (528 MB) |
| bert-base | 199 (Table 5: 207) | 109,482,240 | 417.6 | 8 x 128 = 1024 tokens (420 MB) |
| gpt2 | 148 | 124,439,808 | 474.7 | 1 x 80 = 80 tokens (475 MB) |
| lstm | 10 | 85,974,278 | 328.0 | 4 x 20 (bptt) = 80 tokens (328 MB) |
| deepfm | 62 | 95,171,247 | 363.0 | 1024 rows (not in Espresso) |

Example::

    profile = builtin_profile("resnet101", gpu="H100", batch=64)
    profile.tensors[0].name, profile.backward_s  # ("fc.bias", ...)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from torch import nn

from zensync.planner._architectures import (
    BERT_SEQ,
    CRITEO_DENSE,
    DEEPFM_DIM,
    GPT2_SEQ,
    IMAGE_SIZE,
    LSTM_BPTT,
    bert_base,
    deepfm,
    gpt2,
    lstm_lm,
    resnet,
    vgg16,
)
from zensync.planner.gpus import GpuSpec, gpu_spec
from zensync.planner.profile import ModelProfile, TensorProfile

__all__ = ["builtin_models", "builtin_profile"]

_ELEMENT_BYTES = {"amp": 2, "fp32": 4}
"""Bytes per activation/weight element moved; AMP keeps FP32 gradients, so profiles keep dtype_bytes=4."""
# ---------------------------------------------------------------------------------------------------------------------
# Forward ops and their costs
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Op:
    params: tuple[str, ...]
    """Canonical names of the parameters whose gradients this op's backward produces."""
    flops: float
    act_elems: float
    """Activation elements the forward reads and writes."""
    weight_elems: float = 0.0
    """Weight elements the forward streams (an LSTM re-reads W_hh every step); for a gather, the table."""
    matmul: bool = False
    gather: bool = False


class _Trace:
    """Collects a model's forward ops in execution order; each method is one op kind."""

    __slots__ = ("_canonical", "model", "ops")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.ops: list[_Op] = []
        # A tied parameter is listed once by named_parameters(), under its first name.
        self._canonical = {id(p): name for name, p in model.named_parameters()}

    def params(self, prefix: str, suffix: str = "") -> tuple[str, ...]:
        named = self.model.get_submodule(prefix).named_parameters(recurse=False, remove_duplicate=False)
        return tuple(self._canonical[id(p)] for name, p in named if name.endswith(suffix))

    def _numel(self, params: tuple[str, ...]) -> int:
        return sum(self.model.get_parameter(p).numel() for p in params)

    def memory(self, act_elems: float, flops: float = 0.0) -> None:
        self.ops.append(_Op(params=(), flops=flops, act_elems=act_elems))

    def norm(self, prefix: str, elems: float) -> None:
        """BatchNorm/LayerNorm (a residual add folded in): read, write, ~8 FLOPs per element."""
        params = self.params(prefix)
        self.ops.append(_Op(params=params, flops=8.0 * elems, act_elems=2.0 * elems, weight_elems=self._numel(params)))

    def linear(self, params: tuple[str, ...], n_in: int, n_out: int, rows: float) -> None:
        flops, act, weight = 2.0 * n_in * n_out * rows, (n_in + n_out) * rows, self._numel(params)
        self.ops.append(_Op(params=params, flops=flops, act_elems=act, weight_elems=weight, matmul=True))

    def dense(self, prefix: str, rows: float) -> None:
        """nn.Linear, or a GPT-2 Conv1D (ParameterDict with an (in, out) weight)."""
        module = self.model.get_submodule(prefix)
        if isinstance(module, nn.Linear):
            n_in, n_out = module.in_features, module.out_features
        else:
            n_in, n_out = module.get_parameter("weight").shape
        self.linear(self.params(prefix), n_in, n_out, rows)

    def conv(self, prefix: str, n: int, h: int, w: int) -> tuple[int, int, int]:
        """A Conv2d on n x Cin x h x w; returns (output elements, Hout, Wout)."""
        conv = self.model.get_submodule(prefix)
        assert isinstance(conv, nn.Conv2d) and not isinstance(conv.padding, str), prefix
        (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
        h_out, w_out = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        out = n * conv.out_channels * h_out * w_out
        flops = 2.0 * (conv.in_channels // conv.groups) * kh * kw * out
        act, weight = n * conv.in_channels * h * w + out, conv.weight.numel()
        self.ops.append(_Op(params=self.params(prefix), flops=flops, act_elems=act, weight_elems=weight, matmul=True))
        return out, h_out, w_out

    def gather(self, prefix: str, rows: float) -> None:
        """Embedding lookup: reads ``rows`` rows, writes them; the backward writes a dense table gradient."""
        table = self.model.get_submodule(prefix).get_parameter("weight")
        act, params = 2.0 * rows * table.shape[1], self.params(prefix)
        self.ops.append(_Op(params=params, flops=0.0, act_elems=act, weight_elems=table.numel(), gather=True))

    def attention(self, batch: int, seq: int, d: int, heads: int) -> None:
        """Scores Q K^T and probabilities x V (4*B*T^2*d FLOPs); q, k, v, out and B*heads*T^2 scores (x4)."""
        act = batch * (4.0 * seq * d + 4.0 * heads * seq * seq)
        self.ops.append(_Op(params=(), flops=4.0 * batch * seq * seq * d, act_elems=act, matmul=True))

    def lstm(self, prefix: str, layer: int, tokens: int, steps: int) -> None:
        """One layer of an nn.LSTM: W_ih once over all tokens, W_hh re-read at every time step."""
        rnn = self.model.get_submodule(prefix)
        assert isinstance(rnn, nn.LSTM), prefix
        h = rnn.hidden_size
        n_in = rnn.input_size if layer == 0 else h
        weight = 4 * h * n_in + 8 * h + 4 * h * h * steps
        act = tokens * (n_in + h + 8.0 * h)  # input, output, 4h gates written then read
        flops, params = 2.0 * 4 * h * (n_in + h) * tokens, self.params(prefix, suffix=f"_l{layer}")
        self.ops.append(_Op(params=params, flops=flops, act_elems=act, weight_elems=weight, matmul=True))

    def sequential(self, prefix: str, rows: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Walk an nn.Sequential of Conv2d/ReLU/MaxPool2d/Dropout/Linear; ``shape`` excludes the batch."""
        seq = self.model.get_submodule(prefix)
        assert isinstance(seq, nn.Sequential), prefix
        for i, layer in enumerate(seq):
            name, elems = f"{prefix}.{i}", rows * math.prod(shape)
            if isinstance(layer, nn.Conv2d):
                _, h, w = self.conv(name, rows, shape[1], shape[2])
                shape = (layer.out_channels, h, w)
            elif isinstance(layer, nn.Linear):
                self.dense(name, rows)
                shape = (layer.out_features,)
            elif isinstance(layer, nn.MaxPool2d):
                shape = (shape[0], shape[1] // 2, shape[2] // 2)
                self.memory(elems + rows * math.prod(shape), flops=elems)
            else:  # ReLU, Dropout: one read, one write
                self.memory(2.0 * elems, flops=elems)
        return shape

    def count(self, prefix: str) -> int:
        blocks = self.model.get_submodule(prefix)
        assert isinstance(blocks, nn.ModuleList), prefix
        return len(blocks)


# ---------------------------------------------------------------------------------------------------------------------
# Per-model forward traces (execution order)
# ---------------------------------------------------------------------------------------------------------------------


def _trace_resnet(t: _Trace, n: int) -> None:
    out, h, w = t.conv("conv1", n, IMAGE_SIZE, IMAGE_SIZE)
    t.norm("bn1", out)
    t.memory(2.0 * out, flops=out)  # ReLU
    h, w = (h - 1) // 2 + 1, (w - 1) // 2 + 1  # max-pool 3x3, stride 2, padding 1
    t.memory(1.25 * out, flops=2.25 * out)
    for stage in range(1, 5):
        for i in range(t.count(f"layer{stage}")):
            h, w = _trace_bottleneck(t, f"layer{stage}.{i}", n, h, w)
    channels = t.model.get_parameter("fc.weight").shape[1]
    t.memory(n * channels * (h * w + 1.0), flops=n * channels * h * w)  # global average pool
    t.dense("fc", n)


def _trace_bottleneck(t: _Trace, p: str, n: int, h: int, w: int) -> tuple[int, int]:
    h_in, w_in = h, w
    for j in (1, 2, 3):
        out, h, w = t.conv(f"{p}.conv{j}", n, h, w)
        t.norm(f"{p}.bn{j}", out)
        if j < 3:
            t.memory(2.0 * out, flops=out)  # ReLU
    if hasattr(t.model.get_submodule(p), "downsample"):  # runs after bn3 in torchvision's forward
        shortcut, _, _ = t.conv(f"{p}.downsample.0", n, h_in, w_in)
        t.norm(f"{p}.downsample.1", shortcut)
    t.memory(3.0 * out, flops=2.0 * out)  # residual add + ReLU
    return h, w


def _trace_vgg(t: _Trace, n: int) -> None:
    shape = t.sequential("features", n, (3, IMAGE_SIZE, IMAGE_SIZE))
    # The adaptive average pool to 7x7 is the identity on 224x224 inputs (7x7 after five pools).
    t.sequential("classifier", n, (math.prod(shape),))


def _trace_bert(t: _Trace, batch: int) -> None:
    d, tokens = t.model.get_parameter("pooler.dense.weight").shape[0], batch * BERT_SEQ
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        t.gather(f"embeddings.{name}", tokens)
    t.norm("embeddings.LayerNorm", tokens * d)  # the sum of the three embeddings folded in
    for i in range(t.count("encoder.layer")):
        p = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            t.dense(f"{p}.attention.self.{name}", tokens)
        t.attention(batch, BERT_SEQ, d, heads=12)
        t.dense(f"{p}.attention.output.dense", tokens)
        t.norm(f"{p}.attention.output.LayerNorm", tokens * d)
        t.dense(f"{p}.intermediate.dense", tokens)
        t.memory(2.0 * tokens * 4 * d, flops=8.0 * tokens * 4 * d)  # GELU
        t.dense(f"{p}.output.dense", tokens)
        t.norm(f"{p}.output.LayerNorm", tokens * d)
    t.dense("pooler.dense", batch)  # on the first token of each sequence
    t.memory(2.0 * batch * d, flops=batch * d)  # tanh


def _trace_gpt2(t: _Trace, batch: int) -> None:
    (vocab, d), tokens = t.model.get_parameter("transformer.wte.weight").shape, batch * GPT2_SEQ
    t.gather("transformer.wte", tokens)
    t.gather("transformer.wpe", tokens)
    for i in range(t.count("transformer.h")):
        p = f"transformer.h.{i}"
        t.norm(f"{p}.ln_1", tokens * d)
        t.dense(f"{p}.attn.c_attn", tokens)
        t.attention(batch, GPT2_SEQ, d, heads=12)  # the causal mask still computes all T x T scores
        t.dense(f"{p}.attn.c_proj", tokens)
        t.norm(f"{p}.ln_2", tokens * d)
        t.dense(f"{p}.mlp.c_fc", tokens)
        t.memory(2.0 * tokens * 4 * d, flops=8.0 * tokens * 4 * d)  # GELU
        t.dense(f"{p}.mlp.c_proj", tokens)
    t.norm("transformer.ln_f", tokens * d)
    t.linear(("transformer.wte.weight",), d, vocab, tokens)  # lm_head, tied to wte
    t.memory(3.0 * tokens * vocab, flops=5.0 * tokens * vocab)  # softmax cross-entropy over the logits


def _trace_lstm(t: _Trace, batch: int) -> None:
    (vocab, d), tokens = t.model.get_parameter("encoder.weight").shape, batch * LSTM_BPTT
    t.gather("encoder", tokens)
    t.memory(2.0 * tokens * d, flops=tokens * d)  # dropout
    for layer in range(2):
        t.lstm("rnn", layer, tokens, steps=LSTM_BPTT)
    t.memory(2.0 * tokens * d, flops=tokens * d)  # dropout
    t.dense("decoder", tokens)
    t.memory(3.0 * tokens * vocab, flops=5.0 * tokens * vocab)  # log-softmax + NLL


def _trace_deepfm(t: _Trace, rows: int) -> None:
    fields = t.count("embedding")
    for i in range(fields):
        t.gather(f"first_order.{i}", rows)
    t.dense("dense_linear", rows)
    for i in range(fields):
        t.gather(f"embedding.{i}", rows)
    pairs = rows * fields * DEEPFM_DIM
    t.memory(2.0 * pairs, flops=3.0 * pairs)  # FM term: ((sum v)^2 - sum v^2) / 2
    t.sequential("mlp", rows, (fields * DEEPFM_DIM + CRITEO_DENSE,))
    t.memory(4.0 * rows, flops=8.0 * rows)  # sum of the three terms, sigmoid, BCE


# ---------------------------------------------------------------------------------------------------------------------
# Registry and public API
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Spec:
    build: Callable[[], nn.Module]
    trace: Callable[[_Trace, int], None]
    default_batch: int
    """Per-GPU batch of Espresso's Table 4 (DeepFM: 1024 rows, a common CTR batch)."""
    unit: str
    """What ``batch`` counts."""


_IMAGES = f"images of {IMAGE_SIZE}x{IMAGE_SIZE}"
_MODELS: dict[str, _Spec] = {
    "resnet50": _Spec(build=lambda: resnet((3, 4, 6, 3)), trace=_trace_resnet, default_batch=32, unit=_IMAGES),
    "resnet101": _Spec(build=lambda: resnet((3, 4, 23, 3)), trace=_trace_resnet, default_batch=32, unit=_IMAGES),
    "vgg16": _Spec(build=vgg16, trace=_trace_vgg, default_batch=32, unit=_IMAGES),
    "bert-base": _Spec(build=bert_base, trace=_trace_bert, default_batch=8, unit=f"x {BERT_SEQ} tokens"),
    "gpt2": _Spec(build=gpt2, trace=_trace_gpt2, default_batch=1, unit=f"x {GPT2_SEQ} tokens"),
    "lstm": _Spec(build=lstm_lm, trace=_trace_lstm, default_batch=4, unit=f"x {LSTM_BPTT} tokens (bptt)"),
    "deepfm": _Spec(build=deepfm, trace=_trace_deepfm, default_batch=1024, unit="rows (13 dense + 26 categorical)"),
}


def builtin_models() -> tuple[str, ...]:
    """Names accepted by :func:`builtin_profile`.

    Returns:
        ``("resnet50", "resnet101", "vgg16", "bert-base", "gpt2", "lstm", "deepfm")``.

    Example::

        profiles = [builtin_profile(name) for name in builtin_models()]
    """
    return tuple(_MODELS)


@functools.cache
def _module(model: str) -> nn.Module:
    with torch.device("meta"):
        return _MODELS[model].build()


def _op_times(op: _Op, gpu: GpuSpec, precision: str) -> tuple[float, float]:
    """(forward, backward) seconds of one op."""
    tensor_cores, element = op.matmul and precision == "amp", _ELEMENT_BYTES[precision]
    forward_bytes = element * (op.act_elems + (0.0 if op.gather else op.weight_elems))
    backward_bytes = element * (2.0 * op.act_elems + (1.0 if op.gather else 2.0) * op.weight_elems)
    backward_flops = op.flops * (2.0 if op.params else 1.0)
    forward_s = gpu.roofline_s(op.flops, forward_bytes, tensor_cores=tensor_cores)
    return forward_s, gpu.roofline_s(backward_flops, backward_bytes, tensor_cores=tensor_cores)


def builtin_profile(model: str, *, gpu: str = "V100", batch: int | None = None, precision: str = "amp") -> ModelProfile:
    """A built-in model's gradient tensors in backward order, timed by a roofline on a named GPU.

    Steps: 1. resolve the model, GPU, precision and batch; 2. trace the forward ops at that batch;
    3. time each op; 4. run the ops backwards, stamping each gradient when its last user finishes.

    Args:
        model: One of :func:`builtin_models` (case-insensitive).
        gpu: A GPU name or alias accepted by :func:`zensync.planner.gpus.gpu_spec`.
        batch: Per-GPU batch in the model's unit (images, sequences or rows); None for Table 4's.
        precision: "amp" (FP16 tensor cores, 2-byte activations) or "fp32".

    Returns:
        The profile; ``device`` is "roofline:<GPU>" and ``batch`` names the batch and precision.

    Raises:
        ValueError: For an unknown model, GPU or precision, or a batch below 1.

    Example::

        profile = builtin_profile("resnet50", gpu="h100", batch=64)
        assert profile.tensors[0].name == "fc.bias" and profile.tensors[-1].name == "conv1.weight"
    """
    # Step 1: resolve.
    key = model.strip().lower()
    if key not in _MODELS:
        raise ValueError(f"model={model!r} is not a built-in profile: valid names are {list(_MODELS)}")
    if precision not in _ELEMENT_BYTES:
        raise ValueError(f"precision={precision!r} must be one of {list(_ELEMENT_BYTES)}")
    spec, device = _MODELS[key], gpu_spec(gpu)
    n = spec.default_batch if batch is None else batch
    if n < 1:
        raise ValueError(f"batch={batch} must be >= 1: it counts {spec.unit} per GPU")
    # Step 2: trace the forward.
    net = _module(key)
    trace = _Trace(net)
    spec.trace(trace, n)
    # Steps 3 and 4: time the ops, then walk them backwards.
    times = [_op_times(op, device, precision) for op in trace.ops]
    ready: dict[str, float] = {}
    clock = 0.0
    for op, (_, backward_s) in zip(reversed(trace.ops), reversed(times), strict=True):
        clock += backward_s
        ready.update(dict.fromkeys(op.params, clock))  # a later user (in backward) overwrites an earlier one
    named = list(net.named_parameters())
    assert set(ready) == {name for name, _ in named}, f"{key}: the trace and the parameters disagree"
    rank = {name: i for i, (name, _) in enumerate(reversed(named))}
    order = sorted(named, key=lambda item: (ready[item[0]], rank[item[0]]))
    tensors = tuple(TensorProfile(name=name, shape=tuple(p.shape), ready_s=ready[name]) for name, p in order)
    return ModelProfile(
        model=key,
        tensors=tensors,
        forward_s=sum(forward_s for forward_s, _ in times),
        backward_s=clock,
        dtype_bytes=4,
        device=f"roofline:{device.name}",
        batch=f"{n} {spec.unit}, {precision}",
    )

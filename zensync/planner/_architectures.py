"""The built-in models' architectures as parameter containers on the meta device (no ``forward``).

Names and shapes follow torchvision (ResNet, VGG), Hugging Face (BERT ``BertModel``, GPT-2
``transformer.*`` with Conv1D's (in, out) layout), PyTorch's word_language_model (tied LSTM) and a
DeepFM on Criteo; ``zensync.planner.models`` traces their forward ops for the roofline.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "BERT_SEQ",
    "CRITEO_DENSE",
    "DEEPFM_DIM",
    "GPT2_SEQ",
    "IMAGE_SIZE",
    "LSTM_BPTT",
    "bert_base",
    "deepfm",
    "gpt2",
    "lstm_lm",
    "resnet",
    "vgg16",
]

IMAGE_SIZE, BERT_SEQ, GPT2_SEQ, LSTM_BPTT = 224, 128, 80, 20

# Criteo Kaggle (Display Advertising Challenge) categorical cardinalities C1..C26, as in DLRM's Kaggle
# preprocessing (33,762,577 in all); DeepFM hashes each field into at most _DEEPFM_BUCKETS buckets,
# which leaves 5,569,296 rows and keeps the model at 363 MiB instead of 2.1 GiB.
_CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
_DEEPFM_BUCKETS = 1_000_000
DEEPFM_DIM = 16
CRITEO_DENSE = 13


def _tree(**children: nn.Module) -> nn.ModuleDict:
    return nn.ModuleDict(children)


def _embedding(rows: int, dim: int) -> nn.Embedding:
    # from_pretrained skips the normal_ init, which on the meta device imports torch._dynamo (seconds).
    return nn.Embedding.from_pretrained(torch.empty(rows, dim), freeze=False)


# ---------------------------------------------------------------------------------------------------------------------
# Architectures (built on the meta device by _module)
# ---------------------------------------------------------------------------------------------------------------------


def resnet(blocks: tuple[int, int, int, int]) -> nn.Module:
    """torchvision ResNet v1.5: bottlenecks with the stride on the 3x3 conv, BN after every conv, fc to 1000."""

    def conv(c_in: int, c_out: int, k: int, stride: int = 1) -> nn.Conv2d:
        return nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=False)

    root: dict[str, nn.Module] = {"conv1": conv(3, 64, 7, 2), "bn1": nn.BatchNorm2d(64)}
    c_in = 64
    for stage, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512), strict=True), start=1):
        layer = []
        for i in range(count):
            stride = 2 if stage > 1 and i == 0 else 1
            block: dict[str, nn.Module] = {
                "conv1": conv(c_in, width, 1), "bn1": nn.BatchNorm2d(width),
                "conv2": conv(width, width, 3, stride), "bn2": nn.BatchNorm2d(width),
                "conv3": conv(width, 4 * width, 1), "bn3": nn.BatchNorm2d(4 * width),
            }  # fmt: skip
            if i == 0:
                block["downsample"] = nn.Sequential(conv(c_in, 4 * width, 1, stride), nn.BatchNorm2d(4 * width))
            layer.append(nn.ModuleDict(block))
            c_in = 4 * width
        root[f"layer{stage}"] = nn.ModuleList(layer)
    root["fc"] = nn.Linear(c_in, 1000)
    return nn.ModuleDict(root)


def vgg16() -> nn.Module:
    """torchvision VGG-16 (configuration D, no BN) with its 3-layer classifier."""
    layers: list[nn.Module] = []
    c_in = 3
    for v in (64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0):  # 0: max-pool
        layers += [nn.MaxPool2d(2, 2)] if v == 0 else [nn.Conv2d(c_in, v, 3, padding=1), nn.ReLU(inplace=True)]
        c_in = v or c_in
    classifier = nn.Sequential(
        nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(),
        nn.Linear(4096, 1000),
    )  # fmt: skip
    return _tree(features=nn.Sequential(*layers), avgpool=nn.AdaptiveAvgPool2d(7), classifier=classifier)


def bert_base() -> nn.Module:
    """Hugging Face ``BertModel`` (bert-base-uncased: vocab 30522, 12 layers, hidden 768, 512 positions, pooler)."""
    d, ff = 768, 3072

    def layer() -> nn.Module:
        attention = _tree(
            self=_tree(query=nn.Linear(d, d), key=nn.Linear(d, d), value=nn.Linear(d, d)),
            output=_tree(dense=nn.Linear(d, d), LayerNorm=nn.LayerNorm(d)),
        )
        output = _tree(dense=nn.Linear(ff, d), LayerNorm=nn.LayerNorm(d))
        return _tree(attention=attention, intermediate=_tree(dense=nn.Linear(d, ff)), output=output)

    embeddings = _tree(
        word_embeddings=_embedding(30522, d), position_embeddings=_embedding(512, d),
        token_type_embeddings=_embedding(2, d), LayerNorm=nn.LayerNorm(d),
    )  # fmt: skip
    encoder = _tree(layer=nn.ModuleList(layer() for _ in range(12)))
    return _tree(embeddings=embeddings, encoder=encoder, pooler=_tree(dense=nn.Linear(d, d)))


def gpt2() -> nn.Module:
    """Hugging Face ``GPT2LMHeadModel`` (small): Conv1D weights are (in, out); lm_head is tied to wte."""
    d = 768

    def conv1d(n_in: int, n_out: int) -> nn.Module:
        return nn.ParameterDict({"weight": torch.empty(n_in, n_out), "bias": torch.empty(n_out)})

    def block() -> nn.Module:
        attn = _tree(c_attn=conv1d(d, 3 * d), c_proj=conv1d(d, d))
        mlp = _tree(c_fc=conv1d(d, 4 * d), c_proj=conv1d(4 * d, d))
        return _tree(ln_1=nn.LayerNorm(d), attn=attn, ln_2=nn.LayerNorm(d), mlp=mlp)

    h = nn.ModuleList(block() for _ in range(12))
    wte, wpe = _embedding(50257, d), _embedding(1024, d)
    return _tree(transformer=_tree(wte=wte, wpe=wpe, h=h, ln_f=nn.LayerNorm(d)))


def lstm_lm() -> nn.Module:
    """PyTorch word_language_model ``RNNModel`` on WikiText-2 (vocab 33278): LSTM, 2 layers, 1500 wide, tied.

    emsize = nhid = 1500 with ``--tied`` is the example's large configuration; it gives Espresso's
    10 tensors and 328 MiB exactly (untied it would be 11 tensors and 518 MiB at this width).
    """
    encoder, decoder = _embedding(33278, 1500), nn.Linear(1500, 33278)
    decoder.weight = encoder.weight
    return _tree(encoder=encoder, rnn=nn.LSTM(1500, 1500, 2), decoder=decoder)


def deepfm() -> nn.Module:
    """DeepFM on Criteo: first-order weights, FM embeddings (dim 16) shared with an MLP 400-400-400-1."""
    vocab = [min(c, _DEEPFM_BUCKETS) for c in _CRITEO_CARDINALITIES]
    mlp_in = len(vocab) * DEEPFM_DIM + CRITEO_DENSE
    mlp = [nn.Linear(mlp_in, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU()]
    return _tree(
        first_order=nn.ModuleList(_embedding(v, 1) for v in vocab),
        dense_linear=nn.Linear(CRITEO_DENSE, 1),  # first-order weights of the dense features, plus the global bias
        embedding=nn.ModuleList(_embedding(v, DEEPFM_DIM) for v in vocab),
        mlp=nn.Sequential(*mlp, nn.Linear(400, 1)),  # input: the 26 embeddings and the 13 dense features
    )

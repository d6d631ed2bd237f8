"""Sparse-gradient workloads for benchmarks and tests: a real LSTM language model and a Zipf generator.

``lm``: embedding gradients of a word-level LSTM LM trained on the Python stdlib's source text
(no download; natural row sparsity, frequency-ranked ids, hence range skew).
``zipf``: synthetic per-rank tensors with exact density and controllable skew and overlap.
"""

from __future__ import annotations

from zensync.workloads import lm, zipf
from zensync.workloads.zipf import zipf_gradient, zipf_gradients, zipf_items, zipf_sparse

__all__ = [
    "lm",
    "zipf",
    "zipf_gradient",
    "zipf_gradients",
    "zipf_items",
    "zipf_sparse",
]

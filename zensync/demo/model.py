"""The demo's model: a big input embedding over the corpus vocabulary, a small LSTM, a truncated decoder.

With the defaults (50,000 x 64 embedding, LSTM 64 -> 128, decoder 128 -> 2,001) the embedding holds
3.2 M of the 3.56 M parameters (90 %), and a step touches only the rows of the few hundred distinct
words in its batch: the natural sparsity the sparse strategies exploit. The decoder predicts the
``output_vocab_size - 1`` most frequent words (ids are frequency-ranked) plus one <unk> class, so the
dense part of the gradient stays small.
"""

from __future__ import annotations

import torch

from zensync.demo.config import DemoConfig
from zensync.workloads import lm

__all__ = ["DemoModel", "batch", "lm_config", "output_targets", "parameter_counts"]


class DemoModel(lm.LanguageModel):
    """Embedding(vocab_size, embed_dim) -> LSTM(hidden_size) -> Linear(output_vocab_size).

    The workload's ``LanguageModel`` with the demo's sizes (``lm_config``): built on the meta device
    and initialised from ``generator`` only, so every rank that passes the same seed holds identical
    weights (no draw from the global RNG).

    Args:
        config: Sizes.
        generator: Seeded generator of the initial weights.
        sparse_embedding: ``nn.Embedding(sparse=True)`` (the strategies named ``<strategy>+sparse``).
    """

    def __init__(self, config: DemoConfig, *, generator: torch.Generator, sparse_embedding: bool = False) -> None:
        super().__init__(lm_config(config, sparse_embedding), generator=generator)


def lm_config(config: DemoConfig, sparse_embedding: bool = False) -> lm.Config:
    """The ``zensync.workloads.lm`` config whose corpus and batches the demo uses."""
    return lm.Config(
        sparse_embedding=sparse_embedding,
        vocab_size=config.vocab_size,
        embed_dim=config.embed_dim,
        hidden_size=config.hidden_size,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        output_vocab_size=config.output_vocab_size,
        max_bytes=config.corpus_bytes,
        seed=config.seed,
    )


def output_targets(targets: torch.Tensor, output_vocab_size: int) -> torch.Tensor:
    """Map ids >= output_vocab_size - 1 (rarer words) to the decoder's <unk> class, output_vocab_size - 1."""
    return targets.clamp(max=output_vocab_size - 1)


def batch(corpus: torch.Tensor, config: DemoConfig, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (inputs, decoder targets) at ``step``: different text per rank, same schedule on reruns."""
    inputs, targets = lm.batch_for_rank(corpus, lm_config(config), rank, step)
    return inputs, output_targets(targets, config.output_vocab_size)


def parameter_counts(config: DemoConfig) -> dict[str, int]:
    """Parameters per module (embedding, lstm, decoder) and in total, from the sizes alone."""
    embedding = config.vocab_size * config.embed_dim
    lstm_params = 4 * config.hidden_size * (config.embed_dim + config.hidden_size + 2)
    decoder = config.output_vocab_size * (config.hidden_size + 1)
    return {"embedding": embedding, "lstm": lstm_params, "decoder": decoder, "total": embedding + lstm_params + decoder}

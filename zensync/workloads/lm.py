"""A real sparse-gradient workload with no download: a word-level LSTM language model on Python's stdlib.

The corpus is the text of the running interpreter's standard-library ``*.py`` files (site-packages
excluded), read in sorted path order up to a byte cap, so every machine with the same Python version
builds the same token stream. Words, identifiers, numbers and single punctuation characters are
tokens; the vocabulary is ranked by frequency (id 0 = most frequent) and words outside it map to
``<unk>``, which is ranked by its pooled count like any other word. This frequency order is what
puts most non-zero embedding rows at low ids: the range skew of Zen's LSTM (reference/zen.md 1.1,
C3; section 4 measures the same regime on gensim's head500).

Only the input embedding's gradient is sparse: a batch touches only the rows of the tokens it
contains. With ``tie_weights=True`` the decoder shares that matrix and its gradient becomes dense,
which is a useful control but not the Zen workload.

Example::

    config = Config(vocab_size=50_000, batch_size=20, seq_len=35)
    grads = embedding_gradients(config, num_ranks=4)  # 4 x (50_000, 64) float32
    density = (grads[0].abs().sum(1) != 0).float().mean()
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import pathlib
import re
import sysconfig
from collections.abc import Iterator

import torch
from torch import nn

from zensync.workloads._seeding import mix_seed

__all__ = [
    "UNK_TOKEN",
    "Config",
    "LanguageModel",
    "batch_for_rank",
    "build_vocabulary",
    "corpus_files",
    "embedding_gradients",
    "iter_embedding_gradients",
    "load_corpus",
    "tokenize",
    "vocabulary",
]

logger = logging.getLogger(__name__)

UNK_TOKEN = "<unk>"
"""Token that stands for every word outside the vocabulary."""

_TOKEN_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[^\sA-Za-z0-9_]")
"""Identifiers/words, digit runs, and any other single non-space character (punctuation, operators)."""
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Model, batch and corpus sizes of the LM workload."""

    vocab_size: int = 50_000
    """Rows of the embedding table; the vocab_size - 1 most frequent words plus ``<unk>``."""
    embed_dim: int = 64
    """Embedding width (elements per gradient row)."""
    hidden_size: int = 128
    """LSTM hidden width."""
    num_layers: int = 1
    """Stacked LSTM layers."""
    output_vocab_size: int | None = None
    """Classes of the decoder: the ``output_vocab_size - 1`` most frequent words plus one <unk>
    class (None: ``vocab_size``, the full vocabulary)."""
    tie_weights: bool = False
    """Share the embedding with the decoder (needs embed_dim == hidden_size; makes the gradient dense)."""
    sparse_embedding: bool = False
    """``nn.Embedding(sparse=True)``: the embedding's gradient is a sparse COO tensor (one entry per lookup)."""
    seq_len: int = 35
    """Tokens per training sequence (BPTT length)."""
    batch_size: int = 20
    """Sequences per rank per step."""
    max_bytes: int = 8_000_000
    """Cap on corpus bytes read from the stdlib (the last file is truncated at the cap)."""
    max_files: int = 100_000
    """Cap on the number of stdlib files read."""
    seed: int = 0
    """Seed of the batch positions (combined with rank and step)."""

    def __post_init__(self) -> None:
        _check_at_least("vocab_size", self.vocab_size, 2, "the vocabulary needs <unk> and at least one word")
        for name in ("embed_dim", "hidden_size", "num_layers", "seq_len", "batch_size", "max_files"):
            _check_at_least(name, getattr(self, name), 1, "it is a size")
        _check_at_least("max_bytes", self.max_bytes, 1024, "smaller corpora cannot fill a batch")
        if self.output_vocab_size is not None and not 2 <= self.output_vocab_size <= self.vocab_size:
            raise ValueError(
                f"output_vocab_size={self.output_vocab_size} must be in 2..vocab_size={self.vocab_size}: the "
                f"decoder predicts the most frequent words plus <unk>"
            )
        if self.tie_weights and self.sparse_embedding:
            raise ValueError("tie_weights=True makes the embedding's gradient dense: it excludes sparse_embedding=True")
        if self.tie_weights and self.output_vocab_size not in (None, self.vocab_size):
            raise ValueError("tie_weights=True needs the full vocabulary as output (output_vocab_size=None)")
        if self.tie_weights and self.embed_dim != self.hidden_size:
            raise ValueError(
                f"tie_weights=True needs embed_dim == hidden_size, got embed_dim={self.embed_dim} and "
                f"hidden_size={self.hidden_size}: the decoder reuses the embedding matrix"
            )


def _check_at_least(name: str, value: int, bound: int, reason: str) -> None:
    if value < bound:
        raise ValueError(f"Config.{name}={value} must be >= {bound}: {reason}")


# ---------------------------------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------------------------------


def corpus_files(max_files: int = 100_000) -> list[pathlib.Path]:
    """The stdlib ``*.py`` files in sorted relative-path order, site-packages excluded, at most ``max_files``."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts)]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return files[:max_files]


def tokenize(text: str) -> list[str]:
    """Split source text into words/identifiers, digit runs and single punctuation characters.

    Example::

        tokenize("x = foo(1)")  # ['x', '=', 'foo', '(', '1', ')']
    """
    return _TOKEN_RE.findall(text)


def build_vocabulary(tokens: list[str], vocab_size: int) -> dict[str, int]:
    """Word -> id, ranked by frequency (id 0 most frequent); ties broken by the word itself.

    The ``vocab_size - 1`` most frequent words keep their own id; the rest are pooled into
    ``UNK_TOKEN``, which takes the rank of its pooled count. Returns fewer than ``vocab_size``
    entries when the corpus has fewer distinct words.
    """
    counts = collections.Counter(tokens)
    counts.pop(UNK_TOKEN, None)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept, rare = ranked[: vocab_size - 1], ranked[vocab_size - 1 :]
    kept.append((UNK_TOKEN, sum(c for _, c in rare)))
    kept.sort(key=lambda kv: (-kv[1], kv[0]))
    return {word: i for i, (word, _) in enumerate(kept)}


def _read_text(max_bytes: int, max_files: int) -> str:
    parts, total = [], 0
    for path in corpus_files(max_files):
        data = path.read_bytes()[: max_bytes - total]
        parts.append(data.decode("utf-8", errors="replace"))
        total += len(data)
        if total >= max_bytes:
            break
    return "\n".join(parts)


@functools.lru_cache(maxsize=4)
def _tokenized(max_bytes: int, max_files: int, vocab_size: int) -> tuple[torch.Tensor, tuple[str, ...]]:
    tokens = tokenize(_read_text(max_bytes, max_files))
    vocab = build_vocabulary(tokens, vocab_size)
    unk = vocab[UNK_TOKEN]
    ids = torch.tensor([vocab.get(t, unk) for t in tokens], dtype=torch.long)
    words = tuple(sorted(vocab, key=vocab.__getitem__))
    logger.info("stdlib corpus: %s tokens, %s distinct words, vocabulary %s", len(tokens), len(set(tokens)), len(vocab))
    return ids, words


def load_corpus(config: Config) -> torch.Tensor:
    """The tokenized corpus as a 1-D int64 (LongTensor) of vocabulary ids (cached per process; do not modify).

    Example::

        ids = load_corpus(Config(max_bytes=1_000_000))
        ids.max() < 50_000  # True
    """
    ids, _ = _tokenized(config.max_bytes, config.max_files, config.vocab_size)
    if ids.numel() < config.seq_len + 2:
        raise ValueError(
            f"the corpus has {ids.numel()} tokens, fewer than seq_len + 2 = {config.seq_len + 2}: raise max_bytes"
        )
    return ids


def vocabulary(config: Config) -> tuple[str, ...]:
    """The vocabulary in id order (``vocabulary(config)[0]`` is the most frequent word)."""
    return _tokenized(config.max_bytes, config.max_files, config.vocab_size)[1]


# ---------------------------------------------------------------------------------------------------------------------
# Model and batches
# ---------------------------------------------------------------------------------------------------------------------


class LanguageModel(nn.Module):
    """Embedding -> LSTM -> Linear decoder over the vocabulary, initialised from a seeded generator.

    Every rank that builds it with the same ``generator`` seed holds identical weights, as in
    data-parallel training. By default the embedding's gradient is a dense (vocab_size, embed_dim)
    tensor whose untouched rows are exactly zero; with ``sparse_embedding`` it is a sparse COO tensor.

    Args:
        config: Sizes.
        generator: Seeded generator for the initial weights (fresh ``seed=0`` generator if None).
    """

    def __init__(self, config: Config, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = config
        # Build on the meta device and initialise explicitly: no draw from the global RNG.
        self.embedding = nn.Embedding(
            config.vocab_size, config.embed_dim, sparse=config.sparse_embedding, device="meta"
        )
        self.lstm = nn.LSTM(
            config.embed_dim, config.hidden_size, num_layers=config.num_layers, batch_first=True, device="meta"
        )
        self.decoder = nn.Linear(config.hidden_size, config.output_vocab_size or config.vocab_size, device="meta")
        self.to_empty(device="cpu")
        if config.tie_weights:
            self.decoder.weight = self.embedding.weight
        self.lstm.flatten_parameters()
        self.reset_parameters(generator if generator is not None else torch.Generator().manual_seed(0))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """Uniform(-0.1, 0.1) embedding and decoder, zero decoder bias, LSTM Uniform(+-1/sqrt(hidden))."""
        self.embedding.weight.uniform_(-0.1, 0.1, generator=generator)
        if not self.config.tie_weights:
            self.decoder.weight.uniform_(-0.1, 0.1, generator=generator)
        self.decoder.bias.zero_()
        bound = 1.0 / math.sqrt(self.config.hidden_size)
        for param in self.lstm.parameters():
            param.uniform_(-bound, bound, generator=generator)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq_len, vocab_size) for int64 ``inputs`` of shape (batch, seq_len)."""
        hidden, _ = self.lstm(self.embedding(inputs))
        return self.decoder(hidden)


def batch_for_rank(
    corpus: torch.Tensor,
    config: Config,
    rank: int,
    step: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's batch: ``batch_size`` sequences starting at random corpus positions.

    Args:
        corpus: Token ids from ``load_corpus``.
        config: Sizes and seed.
        rank: Rank whose batch this is (different ranks draw different positions).
        step: Training step (different steps draw different positions).
        generator: Source of the positions; if None, one seeded from (config.seed, rank, step), so a
            rank's batch does not depend on which other ranks were drawn before it.

    Returns:
        (inputs, targets), both int64 of shape (batch_size, seq_len); targets are inputs shifted by one token.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(mix_seed(config.seed, rank, step))
    num_starts = corpus.numel() - config.seq_len - 1
    starts = torch.randint(0, num_starts, (config.batch_size, 1), generator=generator)
    positions = starts + torch.arange(config.seq_len + 1)
    windows = corpus[positions]
    return windows[:, :-1], windows[:, 1:]


def iter_embedding_gradients(
    config: Config, num_ranks: int, step: int = 0, *, model_seed: int = 0
) -> Iterator[torch.Tensor]:
    """Yield each rank's embedding gradient in rank order, one at a time (see ``embedding_gradients``)."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1")
    corpus = load_corpus(config)
    model = LanguageModel(config, generator=torch.Generator().manual_seed(model_seed))
    loss_fn = nn.CrossEntropyLoss()
    for rank in range(num_ranks):
        # Step 1: same weights on every rank (one shared model), this rank's batch.
        inputs, targets = batch_for_rank(corpus, config, rank, step)
        model.zero_grad(set_to_none=True)
        # Step 2: forward + backward; only the input embedding's gradient is kept.
        logits = model(inputs)
        loss_fn(logits.reshape(-1, config.vocab_size), targets.reshape(-1)).backward()
        grad = model.embedding.weight.grad
        assert grad is not None and grad.layout == torch.strided
        yield grad.detach().clone()


def embedding_gradients(config: Config, num_ranks: int, step: int = 0, *, model_seed: int = 0) -> list[torch.Tensor]:
    """Per-rank dense gradients of the embedding weight after one forward+backward on each rank's batch.

    All ranks share one model initialised from ``model_seed`` (data-parallel training before the
    first sync); rank r trains on ``batch_for_rank(corpus, config, r, step)``.

    Args:
        config: Model, batch and corpus sizes.
        num_ranks: Number of ranks.
        step: Batch step (selects the batch positions).
        model_seed: Seed of the shared initial weights.

    Returns:
        ``num_ranks`` float32 tensors of shape (vocab_size, embed_dim); a row is non-zero iff its token
        occurs in that rank's inputs (all rows with ``tie_weights=True``).

    Example::

        grads = embedding_gradients(Config(), num_ranks=2)
        grads[0].shape  # torch.Size([50000, 64])
    """
    return list(iter_embedding_gradients(config, num_ranks, step, model_seed=model_seed))

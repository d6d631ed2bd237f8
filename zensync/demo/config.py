"""``DemoConfig``: everything one ``zensync demo`` run depends on (the CLI maps its flags 1:1 onto the fields)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from zensync.hooks import STRATEGIES as HOOK_STRATEGIES
from zensync.hooks.strategy import resolve_strategy
from zensync.testbed import parse_rate

__all__ = ["DEMO_FLAGS", "SPARSE_SUFFIX", "STRATEGIES", "TORCH_STRATEGIES", "DemoConfig", "split_strategy"]

TORCH_STRATEGIES = ("ddp", "fp16")
"""Baselines from torch itself: ``ddp`` = DDP's allreduce (torch's allreduce_hook, same numbers as no
hook), ``fp16`` = torch's fp16_compress_hook (lossy)."""
STRATEGIES = (*TORCH_STRATEGIES, *HOOK_STRATEGIES)
"""Named strategies of the demo; names other than the torch baselines go to ``zensync.register``, and
so do compressor specs (``topk:0.01``, ``powersgd:4``; lossy, so their parameters differ from DDP's)."""
DEFAULT_STRATEGIES = ("ddp", "fp16", "agsparse", "zen", "auto")
SPARSE_SUFFIX = "+sparse"
"""``<strategy>+sparse``: the same strategy on a model whose embedding is ``nn.Embedding(sparse=True)``
(``ddp+sparse``: torch's own sparse-gradient path, DDP's sparse allreduce; ``auto+sparse``: zensync's
hook on the COO gradients). fp16 and compressor specs take no suffix (they compress dense buckets)."""


def split_strategy(strategy: str) -> tuple[str, bool]:
    """(the strategy without ``+sparse``, whether the embedding's gradient is sparse)."""
    if strategy.endswith(SPARSE_SUFFIX):
        return strategy[: -len(SPARSE_SUFFIX)], True
    return strategy, False


DEMO_FLAGS = {
    "--workers": "workers",
    "--steps": "steps",
    "--warmup-steps": "warmup_steps",
    "--vocab-size": "vocab_size",
    "--output-vocab-size": "output_vocab_size",
    "--embed-dim": "embed_dim",
    "--hidden-size": "hidden_size",
    "--batch-size": "batch_size",
    "--seq-len": "seq_len",
    "--corpus-bytes": "corpus_bytes",
    "--lr": "lr",
    "--strategies": "strategies",
    "--net": "net",
    "--latency-s": "latency_s",
    "--bandwidth-bytes-per-s": "bandwidth_bytes_per_s",
    "--seed": "seed",
    "--out-dir": "out_dir",
    "--out": "out",
    "--timeout": "timeout_s",
}
"""Flag -> DemoConfig field of ``zensync demo`` (tests/unit/cli/test_cli.py pins both sides)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """One demo run: cluster, model, data, training length and outputs."""

    workers: int = 4
    """Worker processes (ranks); with ``net`` each is its own emulated host."""
    steps: int = 30
    """Timed training steps per strategy (after ``warmup_steps``)."""
    warmup_steps: int = 5
    """Untimed steps first (DDP's bucket rebuild, allocator and cache warm-up)."""
    vocab_size: int = 50_000
    """Rows of the input embedding: the corpus's most frequent words plus <unk> (the sparse-gradient table)."""
    output_vocab_size: int = 2001
    """Classes of the decoder: the output_vocab_size - 1 most frequent words plus one <unk> class."""
    embed_dim: int = 64
    """Embedding width."""
    hidden_size: int = 128
    """LSTM hidden width."""
    batch_size: int = 20
    """Sequences per worker per step."""
    seq_len: int = 35
    """Tokens per sequence."""
    corpus_bytes: int = 8_000_000
    """Bytes of Python stdlib source read as the corpus (tokenized once, by the parent)."""
    lr: float = 0.1
    """Learning rate of plain SGD (no momentum or weight decay: untouched embedding rows stay unchanged)."""
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    """Strategies to run, in order; 'ddp' is the baseline of speedups and parameter differences."""
    net: str | None = None
    """Link rate ('1gbit', '100mbit') of an emulated cluster (needs root); None: local processes on loopback."""
    latency_s: float | None = None
    """Per-message latency given to zensync's cost model; None: measured when the hook registers."""
    bandwidth_bytes_per_s: float | None = None
    """Per-rank bandwidth given to zensync's cost model; None: measured when the hook registers."""
    seed: int = 0
    """Seed of the initial weights (same on every rank) and of the batch positions."""
    out_dir: str | None = None
    """Where demo_<hardware>_<date>.{json,md,png} go (a _2, _3, ... suffix keeps earlier results of the day);
    None: experiments/results if it exists, else the cwd."""
    out: str | None = None
    """Write the results to exactly OUT.json, OUT.md and OUT.png instead (replacing them if they exist);
    excludes out_dir."""
    timeout_s: float = 600.0
    """Wall-clock limit of each strategy's launch; a hung worker fails the demo with every rank's stderr."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategies", tuple(self.strategies))
        for name, bound in (("workers", 1), ("steps", 1), ("embed_dim", 1), ("hidden_size", 1)):
            _check_at_least(name, getattr(self, name), bound)
        for name, bound in (("batch_size", 1), ("seq_len", 1), ("vocab_size", 2), ("corpus_bytes", 1024)):
            _check_at_least(name, getattr(self, name), bound)
        _check_at_least("warmup_steps", self.warmup_steps, 0)
        if not 2 <= self.output_vocab_size <= self.vocab_size:
            raise ValueError(
                f"output_vocab_size={self.output_vocab_size} must be in [2, vocab_size={self.vocab_size}]: "
                f"the decoder predicts a subset of the input vocabulary plus <unk>"
            )
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        for name in ("latency_s", "bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"DemoConfig.{name}={value!r} must be > 0 (or omitted to measure it)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be > 0 seconds")
        self._check_strategies()
        if self.out is not None and self.out_dir is not None:
            raise ValueError(f"out={self.out!r} and out_dir={self.out_dir!r}: give one (out names the files itself)")
        if self.net is not None:
            parse_rate(self.net)  # raises ValueError naming the rate and the valid units

    def _check_strategies(self) -> None:
        if not self.strategies:
            raise ValueError(f"strategies is empty; choose one or more of: {', '.join(STRATEGIES)}")
        unknown = [s for s in self.strategies if not _known(s)]
        if unknown:
            raise ValueError(
                f"strategies {unknown} unknown (valid: {', '.join(STRATEGIES)}, or a compressor spec such as "
                f"topk:0.01 or powersgd:4; ddp and zensync's lossless strategies also as <name>{SPARSE_SUFFIX}, "
                f"with nn.Embedding(sparse=True))"
            )
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies={list(self.strategies)} lists a strategy twice")

    def to_json(self) -> str:
        """The config as a JSON object (``from_json`` inverts it)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DemoConfig:
        """The config that ``to_json`` wrote."""
        fields: dict[str, Any] = json.loads(text)
        return cls(**fields)


def _check_at_least(name: str, value: int, bound: int) -> None:
    if not isinstance(value, int) or value < bound:
        raise ValueError(f"DemoConfig.{name}={value!r} must be an integer >= {bound}")


def _known(strategy: str) -> bool:
    base, sparse = split_strategy(strategy)
    if sparse:
        return base != "fp16" and base in STRATEGIES
    return base in STRATEGIES or _compressor_spec(base)


def _compressor_spec(text: str) -> bool:
    """Whether ``text`` is a compressor strategy of the hook (``zensync.register(ddp, strategy=text)``)."""
    try:
        return resolve_strategy(text).kind == "compress"
    except ValueError:
        return False

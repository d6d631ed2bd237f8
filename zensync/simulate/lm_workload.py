"""The embedded LM's sparse gradient as a ``zensync simulate`` workload (``zensync.workloads.lm``).

Rank r's non-zero rows are the distinct token ids of its batch at step 0 (``batch_for_rank``:
``batch_size`` sequences of ``seq_len`` tokens of the stdlib corpus, ids ranked by frequency): the
rows its input embedding's gradient touches, with the corpus' own overlap between ranks and skew
toward frequent (low) ids. Values are drawn as a Zipf workload's (uniform in [1, 2)): the sync's
sizes and times depend on which rows are non-zero, not on their values, and the LM's forward and
backward passes are not run. A vocabulary larger than the corpus' distinct words (about 39,000 at
the default 8 MB) leaves the rows beyond them zero on every rank.

Example::

    workload = LMWorkload(num_items=50_000, dim=64, batch_size=128)
    workload.items(3)  # rank 3's touched rows, sorted
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from zensync.workloads import lm

__all__ = ["LMWorkload", "RowWorkload", "dense_rows"]

_ITEM_DTYPE = torch.float32


def dense_rows(ids: torch.Tensor, num_items: int, dim: int, seed: int, rank: int) -> torch.Tensor:
    """A (num_items, dim) float32 gradient with values in [1, 2) at rows ``ids``, zero elsewhere
    (seeded by (seed, rank))."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.zeros(num_items, dim, dtype=_ITEM_DTYPE)
    x[ids] = torch.rand(ids.numel(), dim, generator=gen, dtype=_ITEM_DTYPE).add_(1.0)
    return x


class RowWorkload(abc.ABC):
    """A sparse gradient of ``num_items`` rows of ``dim`` float32: rank r's non-zero rows are
    ``items(r)``, its values ``dense_rows``'. The workloads subclass it as frozen dataclasses."""

    __slots__ = ()
    num_items: int
    dim: int
    seed: int

    @abc.abstractmethod
    def items(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s non-zero rows, sorted int64."""

    @property
    def item_bytes(self) -> int:
        return self.dim * _ITEM_DTYPE.itemsize

    def tensor(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s dense (num_items, dim) gradient: values in [1, 2) at its rows."""
        return dense_rows(self.items(rank), self.num_items, self.dim, self.seed, rank)

    def full_bytes(self, ranks: int) -> int:
        """Memory of every rank's dense tensor together (what a full run holds at least)."""
        return ranks * self.num_items * self.item_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class LMWorkload(RowWorkload):
    """The LM's embedding gradient: ``num_items`` vocabulary rows of ``dim`` float32 (module docstring)."""

    num_items: int = 50_000
    dim: int = 64
    batch_size: int = 20
    seq_len: int = 35
    seed: int = 0

    def __post_init__(self) -> None:
        self.config  # noqa: B018 - the LM's own checks (sizes >= 1, vocabulary >= 2), with its messages

    @property
    def config(self) -> lm.Config:
        return lm.Config(
            vocab_size=self.num_items, embed_dim=self.dim, batch_size=self.batch_size, seq_len=self.seq_len,
            seed=self.seed,
        )  # fmt: skip

    def items(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s touched rows, sorted int64."""
        config = self.config
        inputs, _ = lm.batch_for_rank(lm.load_corpus(config), config, rank, step=0)
        return inputs.unique()

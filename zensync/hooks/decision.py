"""What the hook does with one parameter in one step: a typed ``Decision``.

The decider (``hooks.decider``) makes one per parameter per step, identical on every rank; the
executor (``hooks.executor``) runs a bucket's decisions; the step record (``hooks.steplog``) shows
each one by its ``label``:

    dense                                   one fused allreduce with the bucket's other dense parameters
    zen, agsparse, sparcml, ...             that lossless sparse scheme (``zensync.sync``)
    compress:<spec>|<collective>|<level>    a compressor (``zensync.compress``) over a compressed
                                            collective, flat or two-level ("hier")

Example::

    Decision.compressed("topk:0.01", "allgather", "flat", fusion="fc.weight").label
    # 'compress:topk:0.01|allgather|flat'
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

__all__ = ["COMPRESSED_PREFIX", "DENSE", "Decision", "DecisionKind", "Level"]

COMPRESSED_PREFIX = "compress:"
"""Labels of compressed decisions start with this (the demo's report groups them by it)."""

Level = Literal["flat", "hier"]
"""A compressed collective over the whole group, or two-level (intra-node, then across nodes)."""


class DecisionKind(enum.Enum):
    """How a parameter is synchronized this step."""

    DENSE = "dense"
    """Averaged allreduce, fused with the bucket's other dense parameters."""
    SPARSE = "sparse"
    """A lossless sparse scheme, per parameter."""
    COMPRESSED = "compressed"
    """A compressor and its collective, per fusion group."""


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """One parameter's synchronization for one step (see the module docstring)."""

    kind: DecisionKind
    scheme: str = "dense"
    """DENSE: "dense"; SPARSE: the scheme's registry name; COMPRESSED: the compressed collective."""
    compressor: str | None = None
    """COMPRESSED: the compressor spec ("topk:0.01")."""
    level: Level = "flat"
    """COMPRESSED: flat or two-level."""
    fusion: str | None = None
    """COMPRESSED: parameters of one bucket with equal decisions and equal fusion key share one
    collective (a plan's fusion group, "bucket" for compressors that fuse, else the parameter's own
    name: PowerSGD)."""

    @classmethod
    def sparse(cls, scheme: str) -> Decision:
        return DENSE if scheme == "dense" else cls(DecisionKind.SPARSE, scheme)

    @classmethod
    def compressed(cls, compressor: str, collective: str, level: Level, *, fusion: str) -> Decision:
        return cls(DecisionKind.COMPRESSED, collective, compressor, level, fusion)

    @property
    def label(self) -> str:
        """The decision as the step record shows it ("dense", "zen", "compress:<spec>|<collective>|<level>")."""
        if self.kind is DecisionKind.COMPRESSED:
            return f"{COMPRESSED_PREFIX}{self.compressor}|{self.scheme}|{self.level}"
        return self.scheme

    @property
    def group_key(self) -> tuple[str, str | None]:
        """Compressed decisions with equal keys are fused into one collective."""
        return self.label, self.fusion


DENSE = Decision(DecisionKind.DENSE)
"""The dense decision (one instance: compare with ``is`` or ``==``)."""

"""What the hook remembers per parameter across steps: measurements, corrections and error feedback.

Everything here is keyed by parameter name (stable across DDP's bucket rebuild) and is the same on
every rank, except the measured times, which the decider averages over ranks before using them.
"""

from __future__ import annotations

import dataclasses
import math

from zensync.compress import CompressedSync

__all__ = ["ParamMemory", "ParamRecord", "blend_prior"]

_MAX_CORRECTION = 20.0
"""Bound on a correction factor, so one disturbed step cannot rule a scheme out for long."""
_SMOOTHING = 0.5
"""Weight of the newest measurement in a correction factor."""


@dataclasses.dataclass(slots=True)
class ParamRecord:
    """What the hook remembers about one parameter (keyed by its name)."""

    scheme: str = "dense"
    """Scheme chosen at the last decision."""
    mean_density: float = 1.0
    """Mean over ranks of the item density, last step."""
    gamma: float | None = None
    """Densification gamma_n measured by the last sparse sync of this parameter."""
    predicted_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Predicted time per candidate at the last decision."""
    measured_s: float = 0.0
    """Measured sync time of the last step (this rank)."""
    correction: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per scheme: measured / predicted time, averaged over ranks and smoothed over steps."""
    bytes_sent: int = 0
    bytes_recv: int = 0
    steps: int = 0
    """Steps this parameter was synchronized."""

    def as_dict(self) -> dict[str, object]:
        """The fields as a dict (the scalars as they are, the per-scheme dicts copied): ``dataclasses.asdict``'s
        result without its recursive deep copy (a checkpoint takes this every step)."""
        return {f.name: (dict(v) if isinstance(v := getattr(self, f.name), dict) else v) for f in _RECORD_FIELDS}

    def learn(self, measured_s: float) -> None:
        """Fold the rank-averaged measured time of the last scheme used into its correction factor.

        The alpha-beta model ignores local compute (hashing, sorting, decoding) and contention;
        scaling each scheme's prediction by how it actually did makes auto move away from a scheme
        that is slower than its formula says.
        """
        predicted = self.predicted_s.get(self.scheme)
        if not predicted or measured_s <= 0 or not math.isfinite(predicted):
            return
        ratio = min(_MAX_CORRECTION, max(1.0 / _MAX_CORRECTION, measured_s / predicted))
        previous = self.correction.get(self.scheme)
        smoothed = ratio if previous is None else (1 - _SMOOTHING) * previous + _SMOOTHING * ratio
        self.correction[self.scheme] = smoothed


def blend_prior(prior: dict[str, float], scheme: str, correction: float) -> None:
    """Fold one parameter's correction factor for ``scheme`` into the per-scheme prior (smoothed)."""
    previous = prior.get(scheme)
    prior[scheme] = correction if previous is None else (1 - _SMOOTHING) * previous + _SMOOTHING * correction


class ParamMemory:
    """Per-parameter records, the per-scheme correction prior, and the compressed syncs' error feedback."""

    __slots__ = ("compressed", "records", "scheme_correction")

    def __init__(self) -> None:
        self.records: dict[str, ParamRecord] = {}
        self.scheme_correction: dict[str, float] = {}
        """Per scheme: measured / predicted time over all parameters (prior for unmeasured ones)."""
        self.compressed: dict[tuple[str, str], CompressedSync] = {}
        """One CompressedSync (compressor + error-feedback memory) per (compressor spec, collective)."""

    def record(self, name: str) -> ParamRecord:
        """The record of parameter ``name``, created on first use."""
        record = self.records.get(name)
        if record is None:
            record = self.records[name] = ParamRecord()
        return record

    def compressed_sync(self, spec: str, collective: str) -> CompressedSync:
        """The CompressedSync of (compressor spec, collective), created on first use (it owns the EF memory)."""
        key = (spec, collective)
        sync = self.compressed.get(key)
        if sync is None:
            sync = self.compressed[key] = CompressedSync(spec, collective)
        return sync

    @property
    def compression_memory_bytes(self) -> int:
        """Bytes of error-feedback memory held by all compressed syncs."""
        return sum(sync.memory_bytes for sync in self.compressed.values())

    def restore(self, records: dict[str, ParamRecord], scheme_correction: dict[str, float]) -> None:
        """Replace the records and the prior (a loaded checkpoint; error feedback is not checkpointed)."""
        self.records = records
        self.scheme_correction = scheme_correction


_RECORD_FIELDS = dataclasses.fields(ParamRecord)

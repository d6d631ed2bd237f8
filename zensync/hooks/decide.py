"""Per-parameter scheme choice from the cost model, the measured density and the last measured gamma.

Inputs are identical on every rank (the non-zero counts are all-gathered, gamma comes from the
previous step's statistics, which every rank computed from the same data), so every rank makes the
same choice without further agreement.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from zensync.sync.cost import CostModel, TensorShape, independent_union, predict_time

__all__ = ["DENSE_DENSITY", "ParamRecord", "blend_prior", "choose_scheme", "measured_union"]

_MAX_CORRECTION = 20.0
"""Bound on a correction factor, so one disturbed step cannot rule a scheme out for long."""
EXPLORE_FACTOR = 3.0
"""An untried scheme is explored while predicted within this factor of the best expected time."""
DENSE_DENSITY = 0.9
"""At or above this mean item density a parameter is synced densely without consulting the model:
no sparse scheme moves much less than dense there, and fused into its bucket's allreduce it pays no
latency of its own."""
REFRESH_FACTOR = 1.5
"""A refresh re-measures the runner-up only while it is expected within this factor of the best."""
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
        return dataclasses.asdict(self)

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


def measured_union(shape: TensorShape, gamma: float) -> Callable[[int], float]:
    """union(m) consistent with a measured union gamma * K at m = n.

    Models each rank's items as drawn with per-item probability d' chosen so that the union of n
    ranks matches the measurement: union(m) = N * (1 - (1 - d')^m), never below K.
    """
    n, items, nnz = shape.world_size, shape.num_items, shape.nnz
    if items == 0 or nnz == 0:
        return lambda m: 0.0
    union_n = min(float(items), gamma * nnz)
    fraction = min(union_n / items, 1.0 - 1e-12)
    per_rank = 1.0 - (1.0 - fraction) ** (1.0 / n)
    return lambda m: max(nnz, items * (1.0 - (1.0 - per_rank) ** m)) if m > 1 else nnz


def choose_scheme(
    shape: TensorShape,
    candidates: Sequence[str],
    model: CostModel,
    previous: ParamRecord,
    margin: float,
    explore: bool = False,
    refresh: bool = False,
    prior: Mapping[str, float] | None = None,
    dense_s: float | None = None,
    insist: str | None = None,
) -> tuple[str, dict[str, float]]:
    """The candidate with the lowest expected time; keeps the previous choice within ``margin``.

    Expected time = alpha-beta prediction x the scheme's measured correction factor (``learn``),
    this parameter's own or, before it has one, ``prior`` (what other parameters measured); the
    returned dict holds the uncorrected predictions. Dense whenever the density is at least
    ``DENSE_DENSITY``. ``dense_s`` replaces the model's dense time (the
    hook passes the parameter's share of its bucket's fused allreduce). Hysteresis: a parameter whose
    density hovers at a crossover would otherwise flip every step.

    Measuring beats trusting the model (it ignores local compute and contention), so once the
    parameter has one measurement:

    - ``explore``: a candidate it never measured, expected within ``EXPLORE_FACTOR`` of the best, is
      tried instead (one per call, the most promising first);
    - ``refresh``: the best candidate other than the one it would keep is re-measured if expected
      within ``REFRESH_FACTOR`` of the best, so a correction measured at another density cannot
      stay stale.

    ``insist``: the scheme the user named as the strategy ("zen", ...). It is chosen for every
    parameter below ``DENSE_DENSITY``, whatever the model predicts (the measured choice is "auto"'s).
    """
    union = measured_union(shape, previous.gamma) if previous.gamma else independent_union(shape)
    predicted = {name: predict_time(name, shape, union, model) for name in candidates}
    if dense_s is not None and "dense" in predicted:
        predicted["dense"] = dense_s
    if "dense" in predicted and shape.num_items and shape.nnz >= DENSE_DENSITY * shape.num_items:
        return "dense", predicted
    if insist is not None:
        return insist, predicted
    prior = prior or {}
    expected = {name: t * previous.correction.get(name, prior.get(name, 1.0)) for name, t in predicted.items()}
    best = min(candidates, key=lambda name: expected[name])
    if explore and previous.correction:
        untried = [n for n in candidates if n not in previous.correction and n != previous.scheme]
        plausible = [n for n in untried if expected[n] <= EXPLORE_FACTOR * expected[best]]
        if plausible:
            return min(plausible, key=lambda name: expected[name]), predicted
    choice = _keep_or_switch(previous.scheme, best, expected, margin)
    if refresh and previous.correction:
        others = [n for n in candidates if n != choice and math.isfinite(expected[n])]
        runner_up = min(others, key=lambda name: expected[name], default=None)
        if runner_up is not None and expected[runner_up] <= REFRESH_FACTOR * expected[best]:
            return runner_up, predicted
    return choice, predicted


def _keep_or_switch(previous: str, best: str, expected: Mapping[str, float], margin: float) -> str:
    keep = previous in expected and math.isfinite(expected[previous])
    if keep and expected[previous] <= (1.0 + margin) * expected[best]:
        return previous
    return best

"""The one decider: each parameter's ``Decision`` for a step, identical on every rank.

Inputs are the same on every rank (the non-zero counts and the last step's measured times are
all-gathered, gamma comes from the previous step's statistics, the records are the same), so every
rank decides the same without further agreement. It merges three sources:

1. natural sparsity: dense or a lossless sparse scheme, by the alpha-beta cost model with measured
   corrections (``choose_scheme``; "auto" weighs ``AUTO_CANDIDATES``, a named scheme is insisted on
   below ``DENSE_DENSITY``);
2. a compressor strategy ("topk:0.01"): what would go dense is compressed instead;
3. a plan file: each parameter's option by name (missing ones stay dense, one warning).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

from zensync.cost import CostModel, TensorShape, independent_union, measured_union, predict_time
from zensync.hooks.config import HookConfig
from zensync.hooks.decision import DENSE, Decision, Level
from zensync.hooks.memory import ParamMemory, ParamRecord, blend_prior
from zensync.hooks.strategy import Strategy
from zensync.sync.base import ItemView
from zensync.types import index_dtype

__all__ = ["DENSE_DENSITY", "EXPLORE_FACTOR", "REFRESH_FACTOR", "Decider", "choose_scheme"]

logger = logging.getLogger(__name__)

EXPLORE_FACTOR = 3.0
"""An untried scheme is explored while predicted within this factor of the best expected time."""
DENSE_DENSITY = 0.9
"""At or above this mean item density a parameter is synced densely without consulting the model:
no sparse scheme moves much less than dense there, and fused into its bucket's allreduce it pays no
latency of its own."""
REFRESH_FACTOR = 1.5
"""A refresh re-measures the runner-up only while it is expected within this factor of the best."""
_CLEARLY_DENSE_FACTOR = 2.0
"""A bucket skips detection while every sparse candidate was predicted at least this much slower,
or while its dense parameters are at least ``DENSE_DENSITY`` dense."""


class Decider:
    """Decisions of one hook state (its configuration, strategy and per-parameter memory).

    Args:
        config: The hook options.
        strategy: The resolved strategy.
        memory: The per-parameter records (read and updated: choices, densities, corrections).
        two_level: Whether compressor strategies run two-level (the hook has a hierarchy).
    """

    __slots__ = ("_hier2_warned", "_plan_warned", "config", "memory", "strategy", "two_level")

    def __init__(self, config: HookConfig, strategy: Strategy, memory: ParamMemory, *, two_level: bool) -> None:
        self.config = config
        self.strategy = strategy
        self.memory = memory
        self.two_level = two_level
        self._plan_warned = False
        self._hier2_warned = False

    # -- what a step does at all --------------------------------------------------------------------
    def in_warmup(self, step: int) -> bool:
        return step < self.config.warmup_steps

    def compresses(self, step: int) -> bool:
        """Whether parameters that are not synced sparsely are compressed this step."""
        return self.strategy.kind in ("compress", "plan") and not self.in_warmup(step)

    def skips_detection(self, step: int, names: Sequence[str]) -> bool:
        """Whether a bucket is synced without counting its non-zeros this step (same on every rank)."""
        return self.in_warmup(step) or self.strategy.kind == "dense" or self._clearly_dense(step, names)

    def _clearly_dense(self, step: int, names: Sequence[str]) -> bool:
        """Skip detection for a bucket whose parameters all went dense by a wide margin last time.

        Such buckets (the layers of a dense model) are re-checked every ``recheck_every`` steps
        instead of paying a count pass and a small collective each step. The step counter and the
        records are the same on every rank, so every rank skips the same buckets.
        """
        if step % self.config.recheck_every == 0:
            return False
        for name in names:
            record = self.memory.records.get(name)
            if record is None or record.scheme != "dense" or "dense" not in record.predicted_s:
                return False
            if record.mean_density >= DENSE_DENSITY:
                continue
            fastest_sparse = min((t for s, t in record.predicted_s.items() if s != "dense"), default=math.inf)
            if fastest_sparse < _CLEARLY_DENSE_FACTOR * record.predicted_s["dense"]:
                return False
        return True

    # -- one bucket ---------------------------------------------------------------------------------
    def decide(
        self,
        step: int,
        names: Sequence[str],
        views: Sequence[ItemView] | None,
        totals: Sequence[int],
        measured_sum_us: Sequence[int],
        world_size: int,
        model: CostModel | None,
    ) -> list[Decision]:
        """One decision per parameter of a bucket.

        Args:
            step: The step counter (the same on every rank).
            names: The bucket's parameter names.
            views: The parameters' item views, or None when the bucket skipped detection.
            totals: Non-zero items summed over ranks, per parameter (detection only).
            measured_sum_us: Last step's sync time summed over ranks, microseconds (detection only).
            world_size: Ranks in the group.
            model: The alpha-beta model (detection only).
        """
        if views is None:
            decisions = [DENSE] * len(names)
        else:
            assert model is not None
            self._learn(names, measured_sum_us, world_size)
            decisions = self._natural(step, names, views, totals, world_size, model)
        if self.compresses(step):
            decisions = [self.compression_for(n) if d is DENSE else d for d, n in zip(decisions, names, strict=True)]
        return decisions

    def _learn(self, names: Sequence[str], measured_sum_us: Sequence[int], world_size: int) -> None:
        """Fold last step's rank-averaged measured times into the corrections (``adapt``)."""
        if not self.config.adapt:
            return
        for name, total_us in zip(names, measured_sum_us, strict=True):
            record = self.memory.record(name)
            record.learn(total_us / world_size * 1e-6)
            if record.scheme in record.correction:
                blend_prior(self.memory.scheme_correction, record.scheme, record.correction[record.scheme])

    def _natural(
        self,
        step: int,
        names: Sequence[str],
        views: Sequence[ItemView],
        totals: Sequence[int],
        world_size: int,
        model: CostModel,
    ) -> list[Decision]:
        """Dense or a sparse scheme per parameter, by the cost model and the measured density."""
        adapt = self.config.adapt
        strategy = self.strategy
        # A named sparse scheme ("zen") runs for every parameter the detector finds sparse; "auto" measures.
        insist = strategy.text if strategy.kind == "sparse" and strategy.text != "auto" else None
        refresh = adapt and step > 0 and step % self.config.explore_every == 0
        # Dense parameters share one fused allreduce: a parameter's dense cost is its share (by size)
        # of the bucket's allreduce, latency included, as its measured dense time is.
        bucket_numel = sum(v.x2d.numel() for v in views)
        bucket_dense_s = _fused_dense_s(bucket_numel, views[0].x2d.element_size(), world_size, model)
        decisions = []
        for name, view, total in zip(names, views, totals, strict=True):
            shape = TensorShape(
                world_size=world_size,
                num_items=view.num_items,
                item_bytes=view.item_bytes,
                index_bytes=index_dtype(view.num_items).itemsize,
                nnz=total / world_size,
            )
            record = self.memory.record(name)
            record.mean_density = shape.nnz / shape.num_items if shape.num_items else 0.0
            scheme, predicted = choose_scheme(
                shape,
                strategy.candidates,
                model,
                record,
                self.config.switch_margin,
                explore=adapt,
                refresh=refresh,
                prior=self.memory.scheme_correction,
                dense_s=bucket_dense_s * view.x2d.numel() / max(1, bucket_numel),
                insist=insist,
            )
            record.scheme, record.predicted_s = scheme, predicted
            decisions.append(Decision.sparse(scheme))
        return decisions

    # -- compression ----------------------------------------------------------------------------------
    def compression_for(self, name: str) -> Decision:
        """The decision for a parameter that is not synced sparsely this step: compressed, or dense."""
        strategy = self.strategy
        if strategy.kind == "compress":
            assert strategy.compressor is not None
            collective = self.config.compressed_scheme
            sync = self.memory.compressed_sync(strategy.compressor, collective)
            # Elementwise and selecting compressors take the whole bucket as one vector (one
            # compression, one collective, one residual, which the executor regroups by parameter
            # name when DDP rebuilds its buckets); PowerSGD factors each matrix of the bucket on
            # its own, all in the same rounds (flat allreduce only).
            level = self._level()
            fusion = "bucket" if sync.fuses(hierarchical=level == "hier") else name
            return Decision.compressed(strategy.compressor, collective, level, fusion=fusion)
        plan = strategy.plan
        if plan is None or not plan.has(name):
            if plan is not None and not self._plan_warned:
                logger.warning(
                    "zensync: parameter %s (and possibly others) is not in plan %s; synced densely", name, strategy.text
                )
                self._plan_warned = True
            return DENSE
        compression = plan.compression_for(name)
        if compression is None:
            return DENSE
        level = plan.option_for(name).level
        if level == "hier2" and not self._hier2_warned:
            logger.warning(
                "zensync: plan %s compresses intra-node phases (hier2); the hook runs them two-level with an "
                "uncompressed intra-node phase",
                strategy.text,
            )
            self._hier2_warned = True
        spec, collective = compression
        # Cupcake-style fusion: the plan's group.
        return Decision.compressed(
            spec, collective, "flat" if level == "flat" else "hier", fusion=str(plan.group_of(name))
        )

    def _level(self) -> Level:
        return "hier" if self.two_level else "flat"


def _fused_dense_s(numel: int, item_bytes: int, world_size: int, model: CostModel) -> float:
    """The model's time of one allreduce of ``numel`` elements (a bucket's fused dense parameters)."""
    bucket = TensorShape(
        world_size=world_size,
        num_items=numel,
        item_bytes=item_bytes,
        index_bytes=index_dtype(numel).itemsize,
        nnz=float(numel),
    )
    return predict_time("dense", bucket, lambda m: float(numel), model)


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
    ``DENSE_DENSITY``. ``dense_s`` replaces the model's dense time (the hook passes the parameter's
    share of its bucket's fused allreduce). Hysteresis: a parameter whose density hovers at a
    crossover would otherwise flip every step.

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
    union: Callable[[int], float] = (
        measured_union(shape, previous.gamma) if previous.gamma else independent_union(shape)
    )
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

"""The hook's per-parameter decision: cost-model choice, hysteresis, learning from measurements."""

from __future__ import annotations

import pytest

from zensync.cost import CostModel, TensorShape, independent_union, measured_union
from zensync.hooks.decider import REFRESH_FACTOR, choose_scheme
from zensync.hooks.memory import ParamRecord, blend_prior

GBIT = CostModel(latency_s=50e-6, bandwidth_bytes_per_s=1.25e8)
CANDIDATES = ("dense", "zen", "sparcml", "agsparse")


def _shape(density: float, n: int = 8) -> TensorShape:
    return TensorShape(world_size=n, num_items=100_000, item_bytes=256, index_bytes=4, nnz=density * 100_000)


def test_sparse_at_low_density_dense_at_high() -> None:
    assert choose_scheme(_shape(0.005), CANDIDATES, GBIT, ParamRecord(), 0.1)[0] != "dense"
    assert choose_scheme(_shape(0.9), CANDIDATES, GBIT, ParamRecord(), 0.1)[0] == "dense"


def test_recommendation_model_at_batch_1024_avoids_coo() -> None:
    """ml-100k at batch 1024 is ~40 % dense per rank (reference/zen.md 4): COO schemes lose to dense.

    Zen is allowed: its aggregated partitions are then pulled dense, so it moves (n-1)/n (K + M)
    against dense's 2 (n-1)/n M; whether its extra local work pays is left to the measurements.
    """
    shape = _shape(0.405, n=16)
    scheme, predicted = choose_scheme(shape, CANDIDATES, GBIT, ParamRecord(), 0.1)
    assert predicted["agsparse"] > predicted["dense"] and predicted["sparcml"] > predicted["dense"]
    assert scheme in ("dense", "zen")


def test_hysteresis_keeps_previous_choice_within_margin() -> None:
    shape = _shape(0.2)
    scheme, predicted = choose_scheme(shape, ("dense", "zen"), GBIT, ParamRecord(), 0.0)
    other = "dense" if scheme == "zen" else "zen"
    ratio = predicted[other] / predicted[scheme]
    keep = ParamRecord(scheme=other)
    assert choose_scheme(shape, ("dense", "zen"), GBIT, keep, ratio)[0] == other
    assert choose_scheme(shape, ("dense", "zen"), GBIT, keep, ratio * 0.99 - 1)[0] == scheme


def test_learning_moves_away_from_a_slow_scheme() -> None:
    record = ParamRecord()
    shape = _shape(0.01)
    first, predicted = choose_scheme(shape, CANDIDATES, GBIT, record, 0.1)
    record.scheme, record.predicted_s = first, predicted
    record.learn(predicted[first] * 20)  # measured 20x slower than its formula
    assert record.correction[first] == pytest.approx(20.0)
    assert choose_scheme(shape, CANDIDATES, GBIT, record, 0.1)[0] != first
    record.learn(predicted[first] * 2)  # smoothing: half old, half new
    assert record.correction[first] == pytest.approx(11.0)


def test_measured_union_matches_gamma_at_n() -> None:
    shape = _shape(0.01, n=16)
    union = measured_union(shape, gamma=5.0)
    assert union(16) == pytest.approx(5.0 * shape.nnz)
    assert union(1) == shape.nnz
    assert shape.nnz <= union(2) <= union(4) <= union(8) <= union(16)
    assert independent_union(shape)(1) == pytest.approx(shape.nnz)


def test_exploration_tries_an_unmeasured_scheme_once() -> None:
    record = ParamRecord()
    shape = _shape(0.01)
    first, predicted = choose_scheme(shape, CANDIDATES, GBIT, record, 0.1)
    record.scheme, record.predicted_s = first, predicted
    record.learn(predicted[first] * 1.05)  # within the switch margin: no switch without exploring
    tried = choose_scheme(shape, CANDIDATES, GBIT, record, 0.1, explore=True)[0]
    assert tried != first and tried not in record.correction
    assert choose_scheme(shape, CANDIDATES, GBIT, record, 0.1, explore=False)[0] == first
    record.correction = dict.fromkeys(CANDIDATES, 1.0)  # every scheme measured: nothing left to explore
    assert choose_scheme(shape, CANDIDATES, GBIT, record, 0.1, explore=True)[0] == first


def test_refresh_re_measures_a_close_runner_up_only() -> None:
    shape = _shape(0.2)
    record = ParamRecord(correction={"dense": 1.0, "zen": 1.0})
    choice, predicted = choose_scheme(shape, ("dense", "zen"), GBIT, record, 0.0)
    other = "dense" if choice == "zen" else "zen"
    record.scheme = choice
    close = predicted[other] / predicted[choice] <= REFRESH_FACTOR
    refreshed = choose_scheme(shape, ("dense", "zen"), GBIT, record, 0.0, refresh=True)[0]
    assert refreshed == (other if close else choice)
    # Make the runner-up look 1.2x / 2x the best through its correction factor.
    for factor, expect in ((1.2, other), (2.0, choice)):
        record.correction[other] = factor * predicted[choice] / predicted[other]
        assert choose_scheme(shape, ("dense", "zen"), GBIT, record, 0.0, refresh=True)[0] == expect
        assert choose_scheme(shape, ("dense", "zen"), GBIT, record, 0.0, refresh=False)[0] == choice


def test_prior_from_other_parameters_steers_an_unmeasured_one() -> None:
    shape = _shape(0.01)
    first = choose_scheme(shape, CANDIDATES, GBIT, ParamRecord(), 0.1)[0]
    prior = {first: 20.0}  # other parameters measured ``first`` 20x slower than its formula
    steered = choose_scheme(shape, CANDIDATES, GBIT, ParamRecord(), 0.1, prior=prior)[0]
    assert steered != first
    own = ParamRecord(correction={first: 1.0})  # the parameter's own measurement wins over the prior
    assert choose_scheme(shape, CANDIDATES, GBIT, own, 0.1, prior=prior)[0] == first


def test_blend_prior_smooths() -> None:
    prior: dict[str, float] = {}
    blend_prior(prior, "zen", 4.0)
    assert prior == {"zen": 4.0}
    blend_prior(prior, "zen", 2.0)
    assert prior == {"zen": pytest.approx(3.0)}


def test_dense_share_of_a_fused_bucket_replaces_the_model() -> None:
    """A small dense parameter fused with others pays no latency of its own: dense must win."""
    slow_links = CostModel(latency_s=5e-3, bandwidth_bytes_per_s=1e10)  # latency-bound
    shape = TensorShape(world_size=4, num_items=64, item_bytes=512, index_bytes=4, nnz=40.0)  # 62 % dense
    alone, predicted = choose_scheme(shape, CANDIDATES, slow_links, ParamRecord(), 0.1)
    assert alone != "dense"  # alone, a sparse scheme's 2 rounds beat the ring's 6
    share = predicted["dense"] * 0.05  # 5 % of a bucket's fused allreduce
    fused, fused_predicted = choose_scheme(shape, CANDIDATES, slow_links, ParamRecord(), 0.1, dense_s=share)
    assert fused == "dense" and fused_predicted["dense"] == share


def test_dense_at_high_density_whatever_the_model_says() -> None:
    slow_links = CostModel(latency_s=5e-3, bandwidth_bytes_per_s=1e10)
    shape = TensorShape(world_size=4, num_items=64, item_bytes=512, index_bytes=4, nnz=0.95 * 64)
    scheme, predicted = choose_scheme(shape, CANDIDATES, slow_links, ParamRecord(), 0.1, explore=True)
    assert min(predicted, key=lambda name: predicted[name]) != "dense"
    assert scheme == "dense"
    below = TensorShape(world_size=4, num_items=64, item_bytes=512, index_bytes=4, nnz=0.85 * 64)
    assert choose_scheme(below, CANDIDATES, slow_links, ParamRecord(), 0.1)[0] != "dense"

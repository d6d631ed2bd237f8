"""Unit tests of ``zensync.workloads``: the stdlib LM and the Zipf generator."""

from __future__ import annotations

import pytest
import torch

from zensync.workloads import lm, zipf, zipf_gradient, zipf_gradients, zipf_items, zipf_sparse

# A 1 MB corpus and 10k vocabulary keep the LM tests to a few seconds; the regime is the same.
SMALL_LM = lm.Config(vocab_size=10_000, max_bytes=1_000_000, embed_dim=16, hidden_size=32)
ROW_DENSITY_RANGE = (0.005, 0.06)
"""A 20 x 35 batch holds 700 tokens, of which a few hundred are distinct words: 0.5-6 % of 10k rows."""
SKEW_MIN = 3.0
"""Zipf s=1.1 puts far more than 3x the mean density into the first of 8 ranges (about 6x measured)."""


def _row_mask(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], -1).ne(0).any(dim=1)


def _range_skew(mask: torch.Tensor, num_ranges: int) -> float:
    densities = torch.stack([part.float().mean() for part in mask.tensor_split(num_ranges)])
    return float(densities.max() / mask.float().mean())


# ---------------------------------------------------------------------------------------------------------------------
# Zipf
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zipf_s", [0.0, 1.1, 3.0])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_zipf_density_is_exact(zipf_s: float, overlap: float) -> None:
    grads = zipf_gradients(10_007, 1, 3, density=0.013, zipf_s=zipf_s, overlap=overlap, seed=5)
    expected = round(0.013 * 10_007)
    assert [int(g.count_nonzero()) for g in grads] == [expected] * 3


def test_zipf_rows_are_fully_non_zero() -> None:
    grad = zipf_gradient(1, 500, 7, density=0.1, zipf_s=1.0, seed=2)
    assert grad.shape == (500, 7)
    mask = _row_mask(grad)
    assert int(mask.sum()) == 50
    assert bool(grad[mask].ne(0).all())


def test_zipf_skew_puts_non_zeros_at_low_ids() -> None:
    skewed = zipf_gradient(0, 200_000, density=0.01, zipf_s=1.1, seed=0).ne(0)
    uniform = zipf_gradient(0, 200_000, density=0.01, zipf_s=0.0, seed=0).ne(0)
    assert _range_skew(skewed, 8) > SKEW_MIN
    assert _range_skew(uniform, 8) < 1.3
    # Item 0 is the most likely id: with s=1.1 it is always drawn.
    assert bool(skewed[0])


def test_zipf_overlap_shares_the_pool() -> None:
    ids = [zipf_sparse(r, 100_000, density=0.01, zipf_s=0.0, overlap=0.5, seed=3)[0] for r in range(2)]
    common = torch.isin(ids[0], ids[1]).sum().item()
    # 500 pooled ids are common; independent uniform draws add about 1000 * 0.01 more.
    assert 500 <= common <= 540


def test_zipf_is_deterministic_and_world_size_independent() -> None:
    a = zipf_gradients(50_000, 1, 4, density=0.02, zipf_s=1.0, overlap=0.2, seed=9)
    b = zipf_gradients(50_000, 1, 2, density=0.02, zipf_s=1.0, overlap=0.2, seed=9)
    c = zipf_gradient(3, 50_000, density=0.02, zipf_s=1.0, overlap=0.2, seed=9)
    d = zipf_gradient(3, 50_000, density=0.02, zipf_s=1.0, overlap=0.2, seed=10)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[3], c)
    assert not torch.equal(c, d)
    assert not torch.equal(a[0], a[1])


def test_zipf_does_not_touch_the_global_rng() -> None:
    state = torch.get_rng_state()
    zipf_gradient(0, 1000, density=0.1, seed=0)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
)
def test_zipf_dtypes(dtype: torch.dtype) -> None:
    grad = zipf_gradient(0, 1000, 4, density=0.05, zipf_s=0.5, seed=1, dtype=dtype)
    assert grad.dtype == dtype
    assert int(_row_mask(grad).sum()) == 50
    assert bool(grad[_row_mask(grad)].ne(0).all())


def test_zipf_edge_densities() -> None:
    assert int(zipf_gradient(0, 100, density=0.0, seed=0).count_nonzero()) == 0
    assert int(zipf_gradient(0, 100, density=1.0, zipf_s=2.0, overlap=0.3, seed=0).count_nonzero()) == 100


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"density": 1.5}, "density=1.5"),
        ({"density": 0.1, "overlap": -0.1}, "overlap=-0.1"),
        ({"density": 0.1, "zipf_s": -1.0}, "zipf_s=-1.0"),
        ({"density": 0.1, "dtype": torch.bool}, "dtype=torch.bool"),
        ({"density": 0.1, "dtype": torch.uint8}, "dtype=torch.uint8"),
    ],
)
def test_zipf_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zipf_gradient(0, 100, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# LM
# ---------------------------------------------------------------------------------------------------------------------


def test_tokenize() -> None:
    assert lm.tokenize("x = foo_1(2, 'a')  # hi") == ["x", "=", "foo_1", "(", "2", ",", "'", "a", "'", ")", "#", "hi"]


def test_build_vocabulary_ranks_by_frequency_and_pools_rare_words() -> None:
    vocab = lm.build_vocabulary(["b", "a", "b", "c", "b", "a", "d", "e"], vocab_size=3)
    # b:3, a:2 keep their ids; c, d, e pool into <unk> with count 3, tied with b and ordered by text.
    assert vocab == {"<unk>": 0, "b": 1, "a": 2}


def test_corpus_loads_and_vocabulary_is_frequency_ranked() -> None:
    corpus = lm.load_corpus(SMALL_LM)
    assert corpus.dtype == torch.long and corpus.dim() == 1
    assert corpus.numel() > 100_000
    assert int(corpus.min()) >= 0 and int(corpus.max()) < SMALL_LM.vocab_size
    counts = torch.bincount(corpus, minlength=SMALL_LM.vocab_size)
    used = counts[: len(lm.vocabulary(SMALL_LM))]
    assert bool((used[:-1] >= used[1:]).all()), "ids must be ranked by frequency (id 0 most frequent)"
    assert lm.load_corpus(SMALL_LM) is corpus, "the tokenized corpus is cached per process"


def test_corpus_files_are_sorted_stdlib_sources() -> None:
    files = lm.corpus_files(max_files=50)
    assert len(files) == 50
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


def test_batches_differ_across_ranks_and_are_reproducible() -> None:
    corpus = lm.load_corpus(SMALL_LM)
    inputs0, targets0 = lm.batch_for_rank(corpus, SMALL_LM, rank=0, step=0)
    inputs1, _ = lm.batch_for_rank(corpus, SMALL_LM, rank=1, step=0)
    again, _ = lm.batch_for_rank(corpus, SMALL_LM, rank=0, step=0)
    assert inputs0.shape == (SMALL_LM.batch_size, SMALL_LM.seq_len)
    assert torch.equal(inputs0[:, 1:], targets0[:, :-1])
    assert torch.equal(inputs0, again) and not torch.equal(inputs0, inputs1)


def test_embedding_gradients_shape_and_row_density() -> None:
    grads = lm.embedding_gradients(SMALL_LM, num_ranks=3)
    corpus = lm.load_corpus(SMALL_LM)
    assert len(grads) == 3
    for rank, grad in enumerate(grads):
        assert grad.shape == (SMALL_LM.vocab_size, SMALL_LM.embed_dim) and grad.dtype == torch.float32
        mask = _row_mask(grad)
        density = float(mask.float().mean())
        assert ROW_DENSITY_RANGE[0] < density < ROW_DENSITY_RANGE[1]
        # Exactly the rows of the tokens in this rank's inputs are non-zero.
        inputs, _ = lm.batch_for_rank(corpus, SMALL_LM, rank=rank, step=0)
        assert torch.equal(mask.nonzero().view(-1), inputs.unique())
    assert _range_skew(_row_mask(grads[0]), 16) > SKEW_MIN


def test_embedding_gradients_are_deterministic() -> None:
    a = lm.embedding_gradients(SMALL_LM, num_ranks=2, model_seed=1)
    b = lm.embedding_gradients(SMALL_LM, num_ranks=2, model_seed=1)
    c = lm.embedding_gradients(SMALL_LM, num_ranks=2, model_seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


def test_tied_weights_make_the_gradient_dense() -> None:
    config = lm.Config(vocab_size=2_000, max_bytes=1_000_000, embed_dim=16, hidden_size=16, tie_weights=True)
    (grad,) = lm.embedding_gradients(config, num_ranks=1)
    assert float(_row_mask(grad).float().mean()) > 0.99


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 1}, "vocab_size=1"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"max_bytes": 10}, "max_bytes=10"),
        ({"tie_weights": True, "embed_dim": 8, "hidden_size": 16}, "embed_dim=8"),
    ],
)
def test_lm_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lm.Config(**kwargs)


@pytest.mark.parametrize(
    ("zipf_s", "density", "overlap", "min_draws"),
    [(0.0, 0.2, 0.0, 1 << 14), (1.1, 0.1, 0.3, 1 << 14), (1.1, 0.1, 0.3, 4), (3.0, 0.5, 0.2, 4)],
)
def test_zipf_items_draw_zipf_sparse_s_law(
    zipf_s: float, density: float, overlap: float, min_draws: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact count, the shared pool in every rank's ids, and each id's inclusion frequency over 600
    ranks within 4 standard errors of zipf_sparse's (both samplers are seeded: the comparison is
    deterministic). With batches of 4 draws the successive sampler runs several rounds, and at
    (3.0, 0.5) it exhausts the heavy ids and finishes with its fallback (counted below)."""
    num_items, ranks = 60, 600
    monkeypatch.setattr(zipf, "_MIN_DRAWS", min_draws)
    fallbacks = []
    real_sample = zipf._zipf_sample

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        fallbacks.append(1)
        return real_sample(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(zipf, "_zipf_sample", spy)
    k = round(density * num_items)
    pool = zipf._shared_pool(num_items, round(overlap * k), zipf_s, 5)
    fast = torch.zeros(num_items)
    slow = torch.zeros(num_items)
    for rank in range(ranks):
        ids = zipf_items(rank, num_items, density=density, zipf_s=zipf_s, overlap=overlap, seed=5)
        assert ids.numel() == k == ids.unique().numel()
        assert torch.equal(ids, ids.sort().values) and int(ids[0]) >= 0 and int(ids[-1]) < num_items
        assert bool(torch.isin(pool, ids).all())
        fast[ids] += 1
        slow[zipf_sparse(rank, num_items, density=density, zipf_s=zipf_s, overlap=overlap, seed=5)[0]] += 1
    p_fast, p_slow = fast / ranks, slow / ranks
    stderr = ((p_fast * (1 - p_fast) + p_slow * (1 - p_slow)) / ranks).sqrt().clamp_min(1e-3)
    assert bool(((p_fast - p_slow).abs() <= 4 * stderr + 1e-9).all()), (p_fast - p_slow).abs().max()
    again = zipf_items(3, num_items, density=density, zipf_s=zipf_s, overlap=overlap, seed=5)
    assert torch.equal(again, zipf_items(3, num_items, density=density, zipf_s=zipf_s, overlap=overlap, seed=5))
    if zipf_s == 3.0:  # beyond the zipf_sparse calls above (one per rank) and the pool's
        assert len(fallbacks) > ranks + 1

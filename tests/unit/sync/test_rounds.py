"""Collectives per call (``SyncStats.collectives``): what each scheme costs in rounds, and the fold
of Zen's per-owner counts into the call's agreement exchange."""

from __future__ import annotations

import pytest
import torch

import zensync

N = 4


def _inputs() -> list[torch.Tensor]:
    xs = []
    for rank in range(N):
        gen = torch.Generator().manual_seed(rank)
        x = torch.zeros(400, 3)
        x[torch.randperm(400, generator=gen)[:30]] = torch.randint(1, 5, (30, 3), generator=gen).float()
        xs.append(x)
    return xs


def _calls(scheme: str, calls: int, options: zensync.SyncOptions | None = None, coo: bool = False) -> list[dict]:
    xs = _inputs()
    expected = torch.stack(xs).sum(0)

    def body(t: zensync.Transport) -> list[dict]:
        out = []
        for _ in range(calls):
            stats = zensync.SyncStats()
            x = xs[t.rank].to_sparse(1) if coo else xs[t.rank]
            result = zensync.sparse_allreduce(x, t, scheme=scheme, stats=stats, options=options)
            assert torch.equal(result.to_dense() if coo else result, expected)
            out.append({k: (p.collectives, p.control_bytes_sent) for k, p in stats.phases.items()})
            out[-1]["total"] = stats.collectives
        return out

    return zensync.SimulatedWorld(N, timeout_s=30).run(body)


@pytest.mark.parametrize("coo", [False, True])
def test_zen_folds_its_push_counts_into_the_agreement_once_the_seed_is_known(coo: bool) -> None:
    for per_rank in _calls("zen", 3, coo=coo):
        first, *later = per_rank
        # First use of the group: the seed is agreed by this call, so the push exchanges its sizes.
        assert first == {"validate": (1, 0), "push": (2, 8 * (N - 1)), "pull": (2, 8 * (N - 1)), "total": 5}
        for call in later:  # the seed is the group's: counts travel with the descriptor
            assert call == {"validate": (1, 0), "push": (1, 0), "pull": (2, 8 * (N - 1)), "total": 4}


def test_an_explicit_seed_folds_from_the_first_call() -> None:
    for per_rank in _calls("sparse_ps", 2, options=zensync.SyncOptions(h0_seed=2**63 + 5)):
        assert all(call["push"] == (1, 0) and call["total"] == 4 for call in per_rank)


@pytest.mark.parametrize(("scheme", "total"), [("dense", 2), ("agsparse", 3)])
def test_other_schemes_count_their_collectives(scheme: str, total: int) -> None:
    # dense: validate + one allreduce; agsparse: validate + one all_gather_v (sizes + payload)
    for per_rank in _calls(scheme, 2):
        assert [call["total"] for call in per_rank] == [total, total]

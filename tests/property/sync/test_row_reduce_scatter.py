"""The row-sparse reduce-scatter equals the dense reduce-scatter, and moves only non-zero rows.

Inputs are integer-valued (|sum| <= 8 * 4 = 32, exact in every dtype), so the comparison with the
float64 sum of the ranks' blocks is exact whatever the summation order.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, given, settings

from tests.strategies import examples
from zensync.sync.row_reduce_scatter import INDEX_BYTES, imbalance, row_reduce_scatter
from zensync.transport import SimulatedWorld

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PROPERTY_SETTINGS = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _inputs(n: int, rows: int, width: int, density: float, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        values = torch.randint(-4, 5, (n, rows, width), generator=gen).to(torch.float64)
        keep = torch.rand(n, rows, 1, generator=gen) < density
        out.append((values * keep).to(dtype))
    return out


@PROPERTY_SETTINGS
@given(
    n=st.integers(1, 8),
    rows=st.integers(0, 40),
    width=st.integers(1, 5),
    density=st.floats(0.0, 1.0),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_row_reduce_scatter_equals_the_dense_sum_of_each_owners_block(n, rows, width, density, dtype, seed) -> None:
    xs = _inputs(n, rows, width, density, dtype, seed)
    results = SimulatedWorld(n).run(lambda t: row_reduce_scatter(xs[t.rank], t))
    total = torch.stack([x.double() for x in xs]).sum(0)
    for rank, result in enumerate(results):
        assert result.out.dtype == dtype and result.out.shape == (rows, width)
        assert torch.equal(result.out.double(), total[rank])
        # Each rank sends its non-zero rows of the other owners' blocks, index and values.
        nonzero = [int((xs[rank][j] != 0).any(1).sum()) for j in range(n)]
        assert list(result.rows_sent) == nonzero
        row_bytes = INDEX_BYTES + width * xs[rank].element_size()
        assert result.bytes_sent == row_bytes * sum(k for j, k in enumerate(nonzero) if j != rank)
        assert list(result.rows_received) == [int((xs[s][rank] != 0).any(1).sum()) for s in range(n)]


def test_imbalance_is_the_busiest_owner_over_the_mean() -> None:
    assert imbalance([5, 5, 5, 5]) == 1.0
    assert imbalance([20, 0, 0, 0]) == 4.0
    assert imbalance([0, 0]) == 1.0

"""The compressed reduce-scatter: each owner gets the sum of the senders' decompressed chunks, and
error feedback keeps exactly what compression dropped."""

from __future__ import annotations

import pytest
import torch

from zensync.compress import build
from zensync.compress.collectives.reduce_scatter import compressed_reduce_scatter, payload_bytes_sent
from zensync.compress.error_feedback import ErrorFeedback
from zensync.transport import SimulatedWorld

N, M = 4, 48


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(N, M, generator=gen, dtype=torch.float64).float() for _ in range(N)]


@pytest.mark.parametrize("spec", ["fp16", "topk:0.25", "qsgd:127", "randomk:0.25"])
def test_each_owner_gets_the_sum_of_the_senders_decompressed_chunks(spec: str) -> None:
    xs = _inputs(1)
    compressor = build(spec)

    def body(t):
        return compressed_reduce_scatter(xs[t.rank], t, compressor, None, name="w", step=3)

    outs = SimulatedWorld(N).run(body)
    for owner, out in enumerate(outs):
        # The reference: every sender's chunk for this owner through compress/decompress, in rank order.
        expected = torch.zeros(M)
        for sender in range(N):
            packed = compressor.compress(xs[sender][owner], name=f"w#{owner}", step=3)
            expected += compressor.decompress(packed)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert payload_bytes_sent(compressor, N, M, torch.float32) == (N - 1) * compressor.payload_bytes(M)


def test_error_feedback_keeps_what_compression_dropped_and_sends_it_later() -> None:
    xs = _inputs(2)
    compressor = build("topk:0.1")
    memories = [ErrorFeedback() for _ in range(N)]

    def step(t, k: int):
        return compressed_reduce_scatter(xs[t.rank], t, compressor, memories[t.rank], name="w", step=k)

    first = SimulatedWorld(N).run(lambda t: step(t, 0))
    for rank in range(N):
        residual = memories[rank].residual("w")
        # residual + transmitted == compensated input (the first step: the input itself)
        transmitted = torch.stack(
            [compressor.decompress(compressor.compress(row, name=f"w#{j}", step=0)) for j, row in enumerate(xs[rank])]
        )
        torch.testing.assert_close(residual + transmitted, xs[rank])
    # EF-SGD's identity: over K steps of the same input, what every owner received sums to K times
    # the true sum less what the senders' residuals still hold.
    steps = 20
    total = list(first)
    for k in range(1, steps):
        total = [a + b for a, b in zip(total, SimulatedWorld(N).run(lambda t, k=k: step(t, k)), strict=True)]
    exact = torch.stack(xs).sum(0)
    held = torch.stack([m.residual("w") for m in memories]).sum(0)
    for owner in range(N):
        torch.testing.assert_close(total[owner], steps * exact[owner] - held[owner], rtol=1e-5, atol=1e-4)


def test_chunk_shape_compresses_each_owners_block_of_rows_as_a_matrix() -> None:
    """PowerSGD factors each (12, 4) block: the owner gets the sum of the senders' P Q^T of theirs,
    and error feedback keeps each sender's block minus its P Q^T. PowerSGD keeps a Q per block: one
    compressor per rank, as in a real run."""
    xs = _inputs(3)
    compressors = [build("powersgd:1") for _ in range(N)]
    memories = [ErrorFeedback() for _ in range(N)]

    def body(t):
        return compressed_reduce_scatter(xs[t.rank], t, compressors[t.rank], memories[t.rank], name="w", step=0,
                                         chunk_shape=(12, 4))  # fmt: skip

    def transmitted(sender: int, owner: int) -> torch.Tensor:
        fresh = build("powersgd:1")  # the first step's Q: the same seeded draw on every rank
        return fresh.decompress(fresh.compress(xs[sender][owner].view(12, 4), name=f"w#{owner}", step=0)).reshape(-1)

    outs = SimulatedWorld(N).run(body)
    for owner, out in enumerate(outs):
        expected = torch.stack([transmitted(s, owner) for s in range(N)]).sum(0)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out, torch.stack(xs).sum(0)[owner], atol=1e-2)  # rank 1: lossy
    for rank in range(N):
        sent = torch.stack([transmitted(rank, j) for j in range(N)])
        torch.testing.assert_close(memories[rank].residual("w") + sent, xs[rank], rtol=1e-5, atol=1e-5)
    assert compressors[0].shaped_payload_bytes((12, 4)) == (12 + 4) * 1 * 4 < compressors[0].payload_bytes(48)
    with pytest.raises(ValueError, match="chunk_shape"):
        SimulatedWorld(N).run(
            lambda t: compressed_reduce_scatter(xs[t.rank], t, compressors[t.rank], None, name="v", step=0,
                                                chunk_shape=(5, 4))
        )  # fmt: skip

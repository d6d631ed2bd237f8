"""Compressed reduce-scatter: each owner's chunk crosses the wire compressed, in one all-to-all.

ZeRO++'s quantized gradients (qgZ) replace the reduce-scatter of ZeRO/FSDP by an all-to-all of
quantized chunks, each owner summing what it receives. Rank r of n holds ``x`` of shape (n, m), row
j being its contribution to owner j's chunk of the sum:

1. Error feedback (a memory given): ``c = x + e``, e the residual stored under ``name``.
2. Row j of c is compressed under ``"<name>#<j>"`` (the same name for every sender, so shared-seed
   compressors such as random-k draw the same indices on every rank).
3. One ``all_to_all_v`` of bytes: row j's payloads go to rank j.
4. Rank r decompresses the n payloads of its chunk and sums them in rank order
   (``Compressor.decompress_sum``).
5. Error feedback: ``e <- c - decompress(compress(c))`` row by row (``subtract_transmitted``), what
   this rank's compression dropped, added back at the next step (``ErrorFeedback.keep_remainder``:
   within a step that is later dropped, it is dropped too).

Bytes sent per rank: (n - 1) compressed rows, ``(n - 1) * payload_bytes(m)``, against
``(n - 1) * m * itemsize`` for a dense reduce-scatter; one round (plus the size exchange of
``all_to_all_v``). The sum of what owners receive tracks the sum of the gradients (EF-SGD); without a
memory the compressor's own bias stays.

Example::

    chunk = compressed_reduce_scatter(x, transport, build("qsgd:127"), memory, name="fc.weight", step=3)
"""

from __future__ import annotations

import math

import torch

from zensync.compress.base import Compressed, Compressor
from zensync.compress.collectives.base import unpack
from zensync.compress.error_feedback import ErrorFeedback
from zensync.transport import Transport
from zensync.transport.packing import pack

__all__ = ["compressed_reduce_scatter", "payload_bytes_sent"]


def compressed_reduce_scatter(
    x: torch.Tensor,
    transport: Transport,
    compressor: Compressor,
    memory: ErrorFeedback | None,
    *,
    name: str,
    step: int,
    chunk_shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Rank r's chunk (m elements, ``x``'s dtype) of the sum over ranks of ``x`` (n, m), compressed
    on the wire; see the module docstring. ``chunk_shape``: the shape each row is compressed in (a
    block of a matrix's rows, which PowerSGD factors); default flat.

    Raises:
        ValueError: If ``x`` is not 2-D with one row per rank, or ``chunk_shape`` does not hold m elements.
    """
    n, rank = transport.world_size, transport.rank
    if x.dim() != 2 or x.shape[0] != n:
        raise ValueError(f"compressed_reduce_scatter: x has shape {tuple(x.shape)}; expected (world_size={n}, m)")
    shape = chunk_shape if chunk_shape is not None else (x.shape[1],)
    if math.prod(shape) != x.shape[1]:
        raise ValueError(f"compressed_reduce_scatter: chunk_shape {shape} does not hold a row of {x.shape[1]}")
    # Step 1: error feedback.
    corrected = memory.compensate(name, x) if memory is not None else x
    chunks = [row.view(shape) for row in corrected]
    # Step 2: one compression per owner.
    with transport.timed("compress"):
        packed = [compressor.compress(chunk, name=f"{name}#{j}", step=step) for j, chunk in enumerate(chunks)]
        buffers = [pack(*p.payloads) for p in packed]
    # Step 3: one all-to-all of the payloads.
    received, counts = transport.all_to_all_v(torch.cat(buffers), [b.numel() for b in buffers])
    # Step 4: this rank's chunk, summed over the senders in rank order.
    with transport.timed("decompress"):
        parts = [unpack(buf, packed[rank]) for buf in received.split(counts)]
        out = compressor.decompress_sum(parts, torch.empty_like(chunks[rank])).reshape(-1)
    # Step 5: what compression dropped stays for the next step.
    if memory is not None:
        _keep_residual(memory, name, corrected, chunks, packed, compressor)
    return out


def _keep_residual(
    memory: ErrorFeedback,
    name: str,
    corrected: torch.Tensor,
    chunks: list[torch.Tensor],
    packed: list[Compressed],
    compressor: Compressor,
) -> None:
    """``corrected`` (``compensate``'s own tensor) minus what each row (``chunks``, its views)
    transmitted, kept under ``name``."""
    for chunk, part in zip(chunks, packed, strict=True):
        compressor.subtract_transmitted(chunk, part)
    memory.keep_remainder(name, corrected)


def payload_bytes_sent(compressor: Compressor, n: int, m: int, dtype: torch.dtype) -> int:
    """Payload bytes one rank sends in ``compressed_reduce_scatter`` of an (n, m) tensor (size exchange excluded)."""
    return (n - 1) * compressor.payload_bytes(m, dtype)

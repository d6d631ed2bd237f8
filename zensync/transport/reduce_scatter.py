"""Bandwidth-correct reduce-scatter from point-to-point steps: ring and recursive halving.

gloo has no real reduce-scatter: torch's ``reduce_scatter_tensor`` on gloo is an all-reduce whose
result is cut ("still 2x communication than a real reduce-scatter", pytorch PR #118911), so a rank
moves 2 (n - 1)/n of the tensor each way instead of (n - 1)/n. These two algorithms move the
minimum over any transport's ``send_recv``, following MPICH's (Thakur, Rabenseifner and Gropp 2005):

    ring                (n - 1) steps, each sending one chunk to the right neighbour
                        cost (n - 1) a + (n - 1)/n N b + (n - 1)/n N g
    halving             lg n steps (n a power of two), step k exchanging half of what is left
                        with the partner at distance n / 2^(k+1)
                        cost lg n a + (n - 1)/n N b + (n - 1)/n N g

(a: per-message latency, b: seconds per byte, g: seconds per byte summed, N: the tensor's bytes.)
Each step here is one ``send_recv``, whose size prefix adds 8 control bytes and a round trip.

Chunks are cut as ``torch.tensor_split(x, n)`` cuts them; rank r ends with the sum of chunk r.
Rank r sends every chunk but its own, once: ``numel - chunk_r`` elements, (n - 1)/n of the tensor
when n divides it. Received: every chunk but chunk r-1 (ring); the half kept at each step
(halving: n/2 + n/4 + ... + 1 chunks, again (n - 1)/n of the tensor when n divides it).

Sums are taken in the tensor's dtype, one partial sum per step (as gloo's and NCCL's rings add).

Example (4 ranks, 8 elements, every rank's x = arange(8))::

    chunk = await ring(x, rank, 4, send_recv)  # rank 1: tensor([8., 12.]) = 4 * x[2:4]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zensync.transport.handle import Handle

__all__ = [
    "ALGORITHMS",
    "CONTROL_BYTES_PER_STEP",
    "SIGNATURE_BYTES",
    "SendRecv",
    "Traffic",
    "bounds",
    "check_algorithm",
    "check_signatures",
    "check_summable",
    "halving",
    "ring",
    "signature",
]

ALGORITHMS = ("auto", "ring", "halving", "native")
"""``Transport.reduce_scatter``'s algorithms: ``auto`` lets the backend choose (its native one where
that is bandwidth-correct: MPI, NCCL; the ring from point-to-point on gloo and the simulated world)."""

CONTROL_BYTES_PER_STEP = 8
"""Each point-to-point step's size prefix (one int64 each way: ``Transport.send_recv``)."""

SendRecv = Callable[[torch.Tensor, int, int], Handle["torch.Tensor | None"]]
"""(uint8 payload, destination, source) -> handle of the uint8 payload received from source."""

Traffic = tuple[torch.Tensor, int, int, int, int]
"""(this rank's reduced chunk, payload bytes sent, payload bytes received, messages sent, control
bytes sent = received: the size prefixes of the point-to-point steps)."""


def bounds(numel: int, world_size: int) -> list[int]:
    """Chunk boundaries of ``numel`` elements cut into ``world_size`` as torch.tensor_split cuts:
    chunk j is [bounds[j], bounds[j + 1])."""
    base, extra = divmod(numel, world_size)
    return [j * base + min(j, extra) for j in range(world_size + 1)]


SIGNATURE_BYTES = 16
"""What each rank sends each other rank before the algorithm: its numel and dtype, two int64."""

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.complex64,
    torch.complex128,
)


def signature(x: torch.Tensor) -> list[int]:
    """(numel, dtype code) of a rank's input, compared across ranks by ``check_signatures``."""
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES) + x.element_size()
    return [x.numel(), code]


def check_signatures(signatures: list[list[int]]) -> None:
    """ValueError, the same on every rank, unless every rank passed the same numel and dtype."""
    if any(s != signatures[0] for s in signatures):

        def name(code: int) -> str:
            return str(_DTYPES[code]) if code < len(_DTYPES) else f"a {code - len(_DTYPES)}-byte dtype"

        seen = ", ".join(f"rank {r}: {numel} x {name(code)}" for r, (numel, code) in enumerate(signatures))
        raise ValueError(f"reduce_scatter needs the same tensor size and dtype on every rank; got {seen}")


def check_algorithm(algorithm: str, world_size: int) -> None:
    """ValueError for an unknown algorithm, or halving in a group whose size is not a power of two."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"reduce_scatter: algorithm={algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if algorithm == "halving" and world_size & (world_size - 1):
        raise ValueError(f"reduce_scatter(algorithm='halving') needs a power-of-two group size, got {world_size}")


def check_summable(dtype: torch.dtype) -> None:
    """TypeError for a dtype whose elementwise sum is not a sum (bool adds as logical or)."""
    if dtype == torch.bool:
        raise TypeError("reduce_scatter: cannot sum torch.bool (pass an integer or floating dtype)")


async def _exchange(
    send_recv: SendRecv, acc: torch.Tensor, send: tuple[int, int], recv: tuple[int, int], dst: int, src: int
) -> tuple[int, int]:
    """Send ``acc[send]`` to ``dst``, add what ``src`` sends into ``acc[recv]``; (bytes sent, received)."""
    payload = acc[send[0] : send[1]]
    got = await send_recv(payload.view(torch.uint8), dst, src)
    assert got is not None
    part = acc[recv[0] : recv[1]]
    if got.numel() != part.numel() * part.element_size():
        raise RuntimeError(
            f"reduce_scatter: rank {src} sent {got.numel()} bytes where {part.numel() * part.element_size()} "
            f"were expected: the ranks passed tensors of different sizes or dtypes"
        )
    if part.numel():
        part += got.view(acc.dtype)
    return payload.numel() * payload.element_size(), got.numel()


async def ring(x: torch.Tensor, rank: int, world_size: int, send_recv: SendRecv) -> Traffic:
    """Ring reduce-scatter of the contiguous 1-D ``x`` (module docstring).

    Step s (0 <= s < n-1): send the partial sum of chunk (r - s - 1) to rank r + 1, receive the
    partial sum of chunk (r - s - 2) from rank r - 1 and add this rank's own part of it. After n - 1
    steps chunk r holds every rank's part.
    """
    n, r = world_size, rank
    edges = bounds(x.numel(), n)
    acc = x.clone()
    sent = recv = messages = 0

    def chunk(j: int) -> tuple[int, int]:
        return edges[j % n], edges[j % n + 1]

    for step in range(n - 1):
        out, got = await _exchange(send_recv, acc, chunk(r - step - 1), chunk(r - step - 2), (r + 1) % n, (r - 1) % n)
        sent, recv, messages = sent + out, recv + got, messages + (out > 0)
    mine = acc[edges[r] : edges[r + 1]]
    return (mine.clone() if n > 1 else mine), sent, recv, messages, CONTROL_BYTES_PER_STEP * (n - 1)


async def halving(x: torch.Tensor, rank: int, world_size: int, send_recv: SendRecv) -> Traffic:
    """Recursive-halving reduce-scatter of the contiguous 1-D ``x``; ``world_size`` a power of two.

    The chunks [lo, hi) still to reduce start as all n; at distance d = n/2, n/4, ..., 1 a rank
    keeps the half of [lo, hi) that holds its own chunk, sends the other half to rank r xor d (which
    keeps that one) and adds the partner's copy of its own half. After lg n steps [lo, hi) = [r, r+1).

    Raises:
        ValueError: If ``world_size`` is not a power of two.
    """
    check_algorithm("halving", world_size)
    n, r = world_size, rank
    edges = bounds(x.numel(), n)
    acc = x.clone()
    lo, hi = 0, n
    sent = recv = messages = 0
    distance = n // 2
    while distance:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if (r & distance) == 0 else ((mid, hi), (lo, mid))
        partner = r ^ distance
        send_at, keep_at = (edges[give[0]], edges[give[1]]), (edges[keep[0]], edges[keep[1]])
        out, got = await _exchange(send_recv, acc, send_at, keep_at, partner, partner)
        sent, recv, messages = sent + out, recv + got, messages + (out > 0)
        lo, hi = keep
        distance //= 2
    mine = acc[edges[r] : edges[r + 1]]
    return (mine.clone() if n > 1 else mine), sent, recv, messages, CONTROL_BYTES_PER_STEP * (n.bit_length() - 1)

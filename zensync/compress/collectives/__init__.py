"""Collectives for compressed gradients (Espresso Table 2), flat or two-level, with error feedback.

One file per collective, each registered under its name (``register_collective``):

- ``allreduce`` (allreduce-compatible compressors: fp16, bf16, shared-seed random-k, PowerSGD):
  the payloads are summed by allreduce and decompressed once (``Compressor.allreduce_sync``).
- ``allgather`` (indivisible): every rank's payloads go to every rank; each rank decompresses
  the n approximations and sums them.
- ``alltoall_allgather`` (divisible; DeepSpeed's compressed allreduce): chunk j of every rank goes
  to rank j, which decompresses and sums them, adds its server-side error and re-compresses; every
  rank gathers the n re-compressed chunks.
- ``gather_broadcast`` (divisible with one root): rank 0 receives every rank's payloads, sums,
  adds its server error, re-compresses and broadcasts.

``hierarchy`` makes any of them two-level (``two_level``). ``CompressedSync`` pairs a compressor
with a collective and the error-feedback memories, as a coroutine (``sync_async``) or blocking
(``sync``).

Example::

    sync = CompressedSync("topk:0.01", scheme="allgather")
    out = sync.sync(grad, transport, name="fc.weight", step=3)  # approx. sum over ranks
"""

from __future__ import annotations

from zensync.compress.collectives import (  # noqa: F401 - register the collectives
    allgather,
    allreduce,
    alltoall_allgather,
    gather_broadcast,
)
from zensync.compress.collectives.base import (
    COMPRESSED_SCHEMES,
    Codec,
    CompressedCollective,
    Scheme,
    build_collective,
    collective_names,
    register_collective,
)
from zensync.compress.collectives.compressed_sync import CompressedSync
from zensync.compress.collectives.two_level import Hierarchy, hierarchy, two_level

__all__ = [
    "COMPRESSED_SCHEMES",
    "Codec",
    "CompressedCollective",
    "CompressedSync",
    "Hierarchy",
    "Scheme",
    "build_collective",
    "collective_names",
    "hierarchy",
    "register_collective",
    "two_level",
]

assert set(COMPRESSED_SCHEMES) == set(collective_names()), "COMPRESSED_SCHEMES and the registry disagree"

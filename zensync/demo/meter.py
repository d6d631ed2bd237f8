"""Per-step communication time and bytes of a DDP model, for torch's hooks and for zensync's.

torch's hooks (``ddp``, ``fp16``) run inside ``TorchHookMeter``, a comm hook that wraps them: it notes
when the hook is called and when each bucket's future completes, and reports per step the length of
the union of those intervals (the wall time during which some bucket was in flight; buckets queue
behind each other, so a plain sum would count the wait twice). zensync's hook runs its buckets one
after another on its lane (one job at a time), so its summed per-bucket time is the same kind of number. Their bytes are
*modelled*, not counted: a ring allreduce sends 2(n-1)/n of the bucket per worker, half of that for
fp16. zensync's hook *counts* its own bytes and time; ``ZenSyncMeter`` reads them from
``state.history``.

Each step also says which scheme synced how many parameters (``scheme_counts``): from the hook's step
record for zensync's strategies; for torch's hooks every parameter of every bucket, under the hook's
one scheme (``dense`` for allreduce, ``fp16`` for the fp16 compress hook).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import torch

from zensync.hooks import ZenSyncState
from zensync.transport import GradBucket

__all__ = ["TorchHookMeter", "ZenSyncMeter", "ring_bytes_per_rank", "timed_torch_hook", "union_length"]


def ring_bytes_per_rank(payload_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring allreduce of ``payload_bytes``: reduce-scatter + all-gather, 2(n-1)/n."""
    return 2.0 * (world_size - 1) / world_size * payload_bytes


class TorchHookMeter:
    """State of ``timed_torch_hook``: the wrapped torch hook and this step's running sums.

    Args:
        hook: A torch hook ``(process_group, bucket) -> Future`` (allreduce_hook, fp16_compress_hook).
        world_size: Ranks in the group.
        wire_bytes_per_element: Bytes per gradient element on the wire (4 for float32, 2 for fp16).
        scheme: What the hook does to every parameter, as the step records name it ('dense', 'fp16').
    """

    __slots__ = (
        "bytes_sent",
        "hook",
        "intervals",
        "num_params",
        "num_sparse",
        "scheme",
        "wire_bytes_per_element",
        "world_size",
    )

    def __init__(self, hook: Any, world_size: int, wire_bytes_per_element: int, scheme: str) -> None:
        self.hook = hook
        self.world_size = world_size
        self.wire_bytes_per_element = wire_bytes_per_element
        self.scheme = scheme
        self.intervals: list[tuple[float, float]] = []
        self.bytes_sent = 0.0
        self.num_params = 0
        self.num_sparse = 0
        """Parameters of sparse-gradient buckets (torch's sparse allreduce), counted as 'torch_sparse'."""

    def pop_step(self) -> dict[str, Any]:
        """This step's communication time (s, union of bucket intervals), modelled bytes and parameters
        per scheme, then reset."""
        counts = {self.scheme: self.num_params - self.num_sparse}
        if self.num_sparse:
            counts["torch_sparse"] = self.num_sparse
        out = {"comm_time_s": union_length(self.intervals), "bytes_sent": self.bytes_sent, "scheme_counts": counts}
        self.intervals, self.bytes_sent, self.num_params, self.num_sparse = [], 0.0, 0, 0
        return out


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals; overlaps counted once.

    Example::

        union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])  # 4.0
    """
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total


def timed_torch_hook(meter: TorchHookMeter, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Comm hook: run ``meter.hook`` on the bucket; add its duration and ring-model bytes to ``meter``."""
    buffer = bucket.buffer()
    if buffer.layout == torch.sparse_coo:  # gloo's sparse allreduce: an all-gather of the coalesced entries
        rows = int(torch.unique(buffer._indices()[0]).numel())
        row = math.prod(buffer.shape[1:])
        meter.bytes_sent += (meter.world_size - 1) * rows * (8 + row * buffer.element_size())
        meter.num_sparse += len(bucket.parameters())
    else:
        meter.bytes_sent += ring_bytes_per_rank(buffer.numel() * meter.wire_bytes_per_element, meter.world_size)
    start = time.perf_counter()
    meter.num_params += len(bucket.parameters())
    future = meter.hook(None, bucket)

    def _done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        meter.intervals.append((start, time.perf_counter()))
        return fut.value()

    return future.then(_done)


# DDP.register_comm_hook checks these annotations against the real types; this module's are strings.
timed_torch_hook.__annotations__ = {
    "state": TorchHookMeter,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


class ZenSyncMeter:
    """Reads zensync's own per-step record (counted bytes, comm time) from ``state.last_step()``."""

    __slots__ = ("_seen", "state")

    def __init__(self, state: ZenSyncState) -> None:
        self.state = state
        self._seen = 0

    def pop_step(self) -> dict[str, Any]:
        """The step record the hook finished since the last call: time, bytes, the scheme of each parameter
        (``schemes``) and the number of parameters per scheme (``scheme_counts``).

        Raises:
            RuntimeError: If the hook did not finish exactly one step since the last call.
        """
        finished = self.state.step - self._seen
        self._seen = self.state.step
        if finished != 1:
            raise RuntimeError(f"zensync hook finished {finished} steps during one training step (expected 1)")
        record = self.state.last_step()  # one record; ``history`` rebuilds them all
        assert record is not None  # a step finished
        sparse = sum(float(info.get("bytes_sent", 0)) for info in record["params"].values())
        schemes = {name: str(info["scheme"]) for name, info in record["params"].items()}
        return {
            "comm_time_s": float(record["comm_time_s"]),
            "bytes_sent": float(record["bytes_sent"]),  # every phase, sparse syncs included
            "sparse_param_bytes_sent": sparse,
            "schemes": schemes,
            "scheme_counts": dict(Counter(schemes.values())),
        }

"""What the emulated-cluster drivers read around a measured call: interface tx bytes and CPU time.

Sibling module of the drivers (experiments/ is not a package): they put this folder on sys.path.
"""

from __future__ import annotations

import pathlib
import resource
import time

import torch.distributed as dist

SETTLE_S = 0.3
"""Wait after a fencing barrier before reading the counter, so the barrier's own packets are out."""


def tx_bytes(iface: str | None) -> int:
    """Bytes the kernel has sent on ``iface`` (inside this host's namespace); 0 without an interface."""
    if not iface:
        return 0
    return int(pathlib.Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def fenced_tx(iface: str | None) -> int:
    """``tx_bytes`` after a barrier of the default group and ``SETTLE_S``: every rank reads at the same point."""
    dist.barrier()
    time.sleep(SETTLE_S)
    return tx_bytes(iface)


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process so far, all its threads (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

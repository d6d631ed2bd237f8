"""``LoopbackCluster``: the unshaped fallback (every host is 127.0.0.1), and ``make_cluster``.

Used when emulated clusters are not available (not root, no iproute2/tc, no namespaces): workers run
as plain local processes over the loopback interface, nothing limits their bandwidth, and interface
byte counters are not available (``counters()`` returns None).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from types import TracebackType

from zensync.testbed import netns
from zensync.testbed._procs import ClusterBase
from zensync.testbed.cluster import EmulatedCluster
from zensync.testbed.shaping import parse_rate, parse_time_s

__all__ = ["LoopbackCluster", "make_cluster"]

logger = logging.getLogger(__name__)


class LoopbackCluster(ClusterBase):
    """``num_hosts`` local processes on 127.0.0.1; same interface as ``EmulatedCluster``, no shaping.

    Args:
        num_hosts: Number of worker processes.
        rate, delay: Accepted for interface parity and validated, but not emulated (a warning says so).
    """

    interface = "lo"

    def __init__(self, num_hosts: int, rate: str | int | None = None, delay: str | float | None = None) -> None:
        if not isinstance(num_hosts, int) or num_hosts < 1:
            raise ValueError(f"num_hosts={num_hosts!r}: must be an int >= 1")
        super().__init__(num_hosts)
        self._run_id = netns.new_run_id(netns.new_prefix())
        if rate is not None:
            parse_rate(rate)  # validated for parity; not emulated
        self.rate_bits: int | None = None
        if delay is not None:
            parse_time_s(delay)
        if rate is not None or delay is not None:
            logger.warning("LoopbackCluster ignores rate=%r delay=%r: loopback traffic is not shaped", rate, delay)

    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process this cluster started and delete its run record."""
        self._kill_spawned()
        self._close_record()

    @property
    def run_id(self) -> str:
        """``<prefix>-<pid>``: the name of this run's record (made when the first worker starts)."""
        return self._run_id

    def host_ip(self, i: int) -> str:
        """Always 127.0.0.1."""
        self._check_host(i)
        return "127.0.0.1"

    def _wrap(self, i: int, argv: Sequence[str]) -> list[str]:
        return [str(a) for a in argv]

    def counters(self) -> None:
        """None: loopback is shared by all hosts, so per-host wire bytes cannot be told apart."""
        return None


def make_cluster(
    num_hosts: int,
    rate: str | int = "1gbit",
    delay: str | float | None = None,
    allow_fallback: bool = True,
    offload: bool = True,
) -> EmulatedCluster | LoopbackCluster:
    """An ``EmulatedCluster`` where this machine supports one, else (if allowed) a ``LoopbackCluster``.

    ``offload`` is passed to ``EmulatedCluster`` (GSO super-packets on the veths).

    Raises:
        RuntimeError: If emulation is unavailable (or ``delay`` needs netem that is missing) and
            ``allow_fallback`` is False; the message says why.
    """
    result = netns.probe()
    reason = result.reason
    if not reason and delay is not None and not result.netem:
        reason = "delay was requested but the kernel has no netem qdisc"
    if not reason:
        return EmulatedCluster(num_hosts, rate=rate, delay=delay, offload=offload)
    if not allow_fallback:
        raise RuntimeError(f"cannot emulate a cluster: {reason}")
    logger.warning(
        "cannot emulate a cluster (%s); falling back to loopback: links are NOT shaped and "
        "interface byte counters are unavailable",
        reason,
    )
    return LoopbackCluster(num_hosts, rate=rate, delay=delay)


def free_port() -> int:
    """A localhost TCP port that was free a moment ago (for a loopback group's MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

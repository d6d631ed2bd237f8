"""``EmulatedCluster``: one Linux network namespace per host, joined by a bridge, every link shaped.

Topology (nothing but the namespaces themselves is created in the root namespace)::

    ns <prefix>-<pid>-h0: lo, eth0 10.77.0.1/24 --veth--> <prefix>p0 -+
    ns <prefix>-<pid>-h1: lo, eth0 10.77.0.2/24 --veth--> <prefix>p1 -+- br0   (ns <prefix>-<pid>-sw)
    ...

Host egress (eth0) and switch-port egress are both shaped with tbf at ``rate`` (see
``zensync.testbed.shaping``), so communication is network-bound as on a real cluster. Hosts have
only the connected route of the subnet and IPv6 disabled, so they cannot reach any address outside
the subnet. Teardown (kill spawned processes, delete the namespaces, verify nothing with the prefix
remains) runs on exit, on exceptions, on SIGINT/SIGTERM (turned into exceptions that unwind the
``with`` block) and at interpreter exit. Against SIGKILL, which allows no teardown, entering first
removes the leftovers of dead runs and then records this run's namespaces, bridge and veths (and
later its workers and temp dirs) for the next start to find (``zensync.testbed.runs``).

Example::

    with EmulatedCluster(4, rate="1gbit") as cluster:
        results = cluster.run_workers(
            lambda r: [sys.executable, "worker.py"], lambda r: cluster.env_for_torch(r, 29500), timeout_s=120
        )
        tx_rx = cluster.counters()
"""

from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import logging
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

from zensync.testbed import netns
from zensync.testbed._procs import ClusterBase
from zensync.testbed.shaping import parse_rate, parse_time_s, tbf_commands

__all__ = ["EmulatedCluster"]

logger = logging.getLogger(__name__)

MAX_HOSTS = 250
"""Hosts get .1 to .num_hosts of the subnet; a /24 leaves room for 250 plus spare addresses."""
REPLACE_TIMEOUT_S = 30.0
"""How long ``replace_host`` waits for the old host's processes to exit and its link to go."""
_ACTIVE: set[EmulatedCluster] = set()
_LOCK = threading.Lock()
_PREVIOUS_SIGTERM: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Config:
    """Shape of an emulated cluster."""

    num_hosts: int
    """Hosts (namespaces), one worker each; at least 1."""
    rate: str | int = "1gbit"
    """Per-link rate in each direction: '1gbit', '100mbit', ... or bits/s."""
    delay: str | float | None = None
    """Optional one-way host-to-host latency ('2ms'), added with netem on host egress."""
    subnet: str = "10.77.0.0/24"
    """Private IPv4 subnet for host addresses; only used inside the namespaces."""
    offload: bool = True
    """Let veths carry 64 KB GSO super-packets (as a NIC with TSO would). Needed to reach 1 Gbit/s per
    link on few cores (2 cores, 4 hosts: 0.94 of rate with, 0.28 without), but interface counters
    then see one TCP/IP header per super-packet (~0.2 % overhead instead of a real wire's ~4-5 %).
    False caps segments at one packet (gso_max_segs 1): counted bytes match MTU-sized frames."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_hosts, int) or not 1 <= self.num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts={self.num_hosts!r}: must be an int in [1, {MAX_HOSTS}]")
        parse_rate(self.rate)
        if self.delay is not None:
            parse_time_s(self.delay)
        net = ipaddress.ip_network(self.subnet, strict=True)  # raises ValueError itself on bad input
        if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
            raise ValueError(f"subnet={self.subnet!r}: must be a private IPv4 network such as 10.77.0.0/24")
        if net.num_addresses - 2 < self.num_hosts:
            raise ValueError(
                f"subnet={self.subnet!r} has {net.num_addresses - 2} host addresses, "
                f"fewer than num_hosts={self.num_hosts}"
            )

    @property
    def rate_bits(self) -> int:
        """Link rate in bits per second."""
        return parse_rate(self.rate)

    @property
    def delay_s(self) -> float | None:
        """One-way delay in seconds, or None."""
        return None if self.delay is None else parse_time_s(self.delay)


class EmulatedCluster(ClusterBase):
    """``num_hosts`` hosts in network namespaces behind one bridge, links shaped to ``rate``.

    Args:
        num_hosts: Number of hosts.
        rate: Per-link rate each way ('1gbit', '100mbit', '2.5gbit', or bits/s).
        delay: Optional one-way latency ('2ms'); needs the kernel's netem qdisc.
        subnet: Private IPv4 subnet; host i gets its (i+1)-th address.
        offload: Allow GSO super-packets on the veths (see ``EmulatedCluster.Config.offload``).

    Raises:
        ValueError: On a bad argument (see ``EmulatedCluster.Config``).
    """

    Config = _Config
    interface = "eth0"

    def __init__(
        self,
        num_hosts: int,
        rate: str | int = "1gbit",
        delay: str | float | None = None,
        subnet: str = "10.77.0.0/24",
        offload: bool = True,
    ) -> None:
        self.config = _Config(num_hosts=num_hosts, rate=rate, delay=delay, subnet=subnet, offload=offload)
        super().__init__(num_hosts)
        self.rate_bits = self.config.rate_bits
        self.prefix = netns.new_prefix()
        self._run_id = netns.new_run_id(self.prefix)
        self.switch_ns = f"{self._run_id}-sw"
        self.host_ns = [f"{self._run_id}-h{i}" for i in range(num_hosts)]
        net = ipaddress.ip_network(subnet)
        self._ips = [str(net.network_address + i + 1) for i in range(num_hosts)]
        self._prefixlen = net.prefixlen
        self._created: list[str] = []
        self._rates: dict[int, str | int] = {}
        """Hosts reshaped by ``set_rate`` (a replaced host keeps its rate)."""
        self._state = "new"

    # -- context manager ---------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        if self._state != "new":
            raise RuntimeError(f"cluster {self.prefix} was already entered; make a new one")
        self._state = "active"
        _register(self)
        try:
            links = [(self.switch_ns, "br0", "bridge")]
            links += [(self.switch_ns, self._port(i), "veth") for i in range(self.num_hosts)]
            self._start_record(namespaces=[self.switch_ns, *self.host_ns], links=links)
            self._build()
        except BaseException:
            self.close(raise_on_leftover=False)
            raise
        logger.info(
            "emulated cluster %s up: %d hosts, %s per link, delay %s",
            self.prefix,
            self.num_hosts,
            self.config.rate,
            self.config.delay,
        )
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(raise_on_leftover=exc is None)

    def close(self, raise_on_leftover: bool = True) -> None:
        """Kill spawned processes and delete every namespace this cluster created (idempotent).

        Raises:
            RuntimeError: If a namespace or interface with this cluster's prefix remains afterwards
                (only logged when ``raise_on_leftover`` is False).
        """
        with _LOCK:
            if self._state == "closed":
                return
            self._state = "closed"
            _ACTIVE.discard(self)
        self._kill_spawned()
        for name in reversed(self._created):
            netns.delete_namespace(name)
        leftovers = [n for n in netns.list_namespaces() if n.startswith(self.run_id + "-")]
        leftovers += netns.root_links_with_prefix(self.prefix)
        _unregister_signals_if_idle()
        if not leftovers:
            self._close_record()
            return
        # The record stays: a cleanup after this process has exited removes what is left.
        message = f"teardown of emulated cluster {self.prefix} left behind: {leftovers}"
        logger.error(message)
        if raise_on_leftover:
            raise RuntimeError(message)

    @property
    def run_id(self) -> str:
        """``<prefix>-<pid>``: the start of every namespace name of this cluster, and its record's name."""
        return self._run_id

    def _port(self, i: int) -> str:
        """Switch-side veth of host ``i`` (at most 15 characters)."""
        return f"{self.prefix}p{i}"

    # -- setup ---------------------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        netns.run_cmd(["ip", "netns", "add", name])
        self._created.append(name)
        # No IPv6: hosts then send nothing (router solicitations, MLD) beyond the IPv4 subnet.
        for key in ("all", "default"):
            netns.run_cmd(
                ["ip", "netns", "exec", name, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"], check=False
            )

    def _build(self) -> None:
        """Step 1: switch ns with a bridge. Step 2: per host a ns, a veth into the bridge, addresses.
        Step 3: shape both directions of every link."""
        sw = self.switch_ns
        self._add_namespace(sw)
        netns.run_cmd(["ip", "-n", sw, "link", "add", "name", "br0", "type", "bridge"])
        netns.run_cmd(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i in range(self.num_hosts):
            self._add_host(i)

    def _add_host(self, i: int) -> None:
        """Host ``i``'s namespace, its veth into the bridge, its address, both directions shaped."""
        sw, host, port = self.switch_ns, self.host_ns[i], self._port(i)
        self._add_namespace(host)
        netns.run_cmd(
            ["ip", "-n", sw, "link", "add", "name", port, "type", "veth", "peer", "name", "eth0", "netns", host]
        )
        netns.run_cmd(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
        if not self.config.offload:  # one frame per skb, so counters see every packet's headers
            netns.run_cmd(["ip", "-n", sw, "link", "set", port, "gso_max_segs", "1"])
            netns.run_cmd(["ip", "-n", host, "link", "set", "eth0", "gso_max_segs", "1"])
        netns.run_cmd(["ip", "-n", host, "addr", "add", f"{self._ips[i]}/{self._prefixlen}", "dev", "eth0"])
        netns.run_cmd(["ip", "-n", host, "link", "set", "eth0", "up"])
        netns.run_cmd(["ip", "-n", host, "link", "set", "lo", "up"])
        self._shape(host, "eth0", self.config.delay_s)
        self._shape(sw, port, None)

    def replace_host(self, i: int) -> list[int]:
        """Remove host ``i`` as a machine fails: SIGKILL every process in its namespace and delete the
        namespace with its link; then build a fresh host at the same address and rate, as a
        replacement machine joins (nothing of the old one's processes or sockets survives). Returns
        the pids killed.
        """
        self._check_host(i)
        if self._state != "active":
            raise RuntimeError(f"cluster {self.prefix} is {self._state}; replace hosts inside its 'with' block")
        killed = netns.delete_namespace(self.host_ns[i])
        self._created.remove(self.host_ns[i])
        deadline = time.monotonic() + REPLACE_TIMEOUT_S  # the link goes once the killed processes exited
        while netns.run_cmd(["ip", "-n", self.switch_ns, "link", "show", self._port(i)], check=False).returncode == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {i}'s link {self._port(i)} outlived its namespace for {REPLACE_TIMEOUT_S} s")
            time.sleep(0.05)
        self._add_host(i)
        if i in self._rates:
            self.set_rate(i, self._rates[i])
        return killed

    def _shape(self, namespace: str, dev: str, delay_s: float | None) -> None:
        for argv in tbf_commands(dev, self.rate_bits, delay_s):
            result = netns.run_cmd(["tc", "-n", namespace, *argv[1:]], check=False)
            if result.returncode != 0 and "netem" in argv:
                raise RuntimeError(
                    f"delay={self.config.delay!r} needs the netem qdisc, which this kernel lacks "
                    f"(CONFIG_NET_SCH_NETEM): {result.stderr.strip()}; run with delay=None"
                )
            if result.returncode != 0:
                raise RuntimeError(f"tc failed in {namespace}: {' '.join(argv)}\n{result.stderr.strip()}")

    def set_rate(self, i: int, rate: str | int) -> None:
        """Reshape host ``i``'s link (its eth0 and its switch port) to ``rate`` each way (a slower host,
        such as a storage server behind a thinner link)."""
        self._check_host(i)
        bits = parse_rate(rate)
        self._rates[i] = rate
        for namespace, dev in ((self.host_ns[i], "eth0"), (self.switch_ns, self._port(i))):
            netns.run_cmd(["tc", "-n", namespace, "qdisc", "del", "dev", dev, "root"], check=False)
            for argv in tbf_commands(dev, bits, None):
                result = netns.run_cmd(["tc", "-n", namespace, *argv[1:]], check=False)
                if result.returncode != 0:
                    raise RuntimeError(f"tc failed in {namespace}: {' '.join(argv)}\n{result.stderr.strip()}")

    # -- queries -------------------------------------------------------------------------------------

    def host_ip(self, i: int) -> str:
        """IPv4 address of host ``i`` (10.77.0.(i+1) by default)."""
        self._check_host(i)
        return self._ips[i]

    def _wrap(self, i: int, argv: Sequence[str]) -> list[str]:
        if self._state != "active":
            raise RuntimeError(f"cluster {self.prefix} is {self._state}; start processes inside its 'with' block")
        return ["ip", "netns", "exec", self.host_ns[i], *[str(a) for a in argv]]

    def counters(self) -> list[tuple[int, int]]:
        """(tx_bytes, rx_bytes) of each host's eth0, read from the kernel inside its namespace.

        These are L2 bytes (Ethernet header + IP + TCP + payload) as the veth counts them,
        independent of any accounting by the processes that sent them.
        """
        return [netns.link_counters(host, "eth0") for host in self.host_ns]


# -- process-wide teardown on signals and at exit -----------------------------------------------------


def _register(cluster: EmulatedCluster) -> None:
    global _PREVIOUS_SIGTERM
    with _LOCK:
        _ACTIVE.add(cluster)
        install = _PREVIOUS_SIGTERM is None and threading.current_thread() is threading.main_thread()
    if install and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        # SIGINT already raises KeyboardInterrupt, which unwinds the with block; SIGTERM would kill
        # the process outright, so turn it into SystemExit to unwind the same way.
        _PREVIOUS_SIGTERM = signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _unregister_signals_if_idle() -> None:
    global _PREVIOUS_SIGTERM
    with _LOCK:
        restore = not _ACTIVE and _PREVIOUS_SIGTERM is not None
        previous, _PREVIOUS_SIGTERM = _PREVIOUS_SIGTERM, (None if restore else _PREVIOUS_SIGTERM)
    if restore and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


@atexit.register
def _close_all_at_exit() -> None:
    for cluster in list(_ACTIVE):
        cluster.close(raise_on_leftover=False)

"""Low-level namespace plumbing: the ``ip``/``tc`` runner, cluster names, probing and deletion.

Naming: a cluster's prefix is ``zs<pid % 10000><2 hex digits>`` (at most 8 characters, so switch
port names ``<prefix>p<i>`` fit Linux's 15-character interface names). Its run id is
``<prefix>-<pid>`` (the owner's full pid), and namespace names are ``<run id>-h<i>`` and
``<run id>-sw``: ``zensync.testbed.runs`` finds a run's record by them, and tells a namespace left
without a record by a dead process from a live one by the pid. Nothing is ever created in the root
namespace except the namespaces themselves (their names under /run/netns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess

__all__ = [
    "NAME_PATTERN",
    "Probe",
    "available",
    "delete_namespace",
    "link_counters",
    "list_namespaces",
    "new_prefix",
    "new_run_id",
    "probe",
    "root_links_with_prefix",
    "run_cmd",
]

NAME_PATTERN = re.compile(r"^(zs\d{1,4}[0-9a-f]{2})-(\d+)-(sw|h\d+|probe)$")
"""Namespace names this package creates: prefix, owner pid, role."""
_COUNTER = itertools.count(secrets.randbelow(256))
_CMD_TIMEOUT_S = 30.0


def new_prefix() -> str:
    """A fresh cluster prefix for this process, e.g. ``zs4242a7``."""
    return f"zs{os.getpid() % 10000}{next(_COUNTER) % 256:02x}"


def new_run_id(prefix: str) -> str:
    """The run id of a cluster with ``prefix`` owned by this process: ``<prefix>-<pid>``."""
    return f"{prefix}-{os.getpid()}"


def run_cmd(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run an ``ip``/``tc`` command; on failure raise ``RuntimeError`` quoting the command and stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed (exit {proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    proc = run_cmd(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def root_links_with_prefix(prefix: str) -> list[str]:
    """Interfaces in the root namespace whose name starts with ``prefix`` (there should be none)."""
    proc = run_cmd(["ip", "-o", "link", "show"], check=False)
    names = [line.split(":")[1].strip().split("@")[0] for line in proc.stdout.splitlines() if ":" in line]
    return [n for n in names if n.startswith(prefix)]


def delete_namespace(name: str) -> list[int]:
    """SIGKILL every process inside namespace ``name``, then delete it; returns the pids killed.

    The namespace (and its interfaces) is gone once the killed processes have exited.
    """
    killed = []
    for pid in run_cmd(["ip", "netns", "pids", name], check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
            killed.append(int(pid))
    run_cmd(["ip", "netns", "del", name], check=False)
    return killed


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """What this machine supports for emulated clusters."""

    root: bool
    ip: bool
    tc: bool
    netns: bool
    tbf: bool
    netem: bool
    reason: str
    """Empty when everything the testbed needs (netem aside) is there; else why not."""

    @property
    def ok(self) -> bool:
        """True when ``EmulatedCluster`` can run (netem is needed only for ``delay``)."""
        return not self.reason


def probe() -> Probe:
    """Check root, iproute2, tc, and (in a throwaway namespace) veth, tbf and netem support."""
    root = os.name == "posix" and hasattr(os, "geteuid") and os.geteuid() == 0
    has_ip, has_tc = shutil.which("ip") is not None, shutil.which("tc") is not None
    missing = [
        why
        for bad, why in [
            (not root, "not running as root (network namespaces and tc need CAP_NET_ADMIN)"),
            (not has_ip, "the 'ip' binary (iproute2) is not on PATH"),
            (not has_tc, "the 'tc' binary (iproute2) is not on PATH"),
        ]
        if bad
    ]
    if missing:
        return Probe(root, has_ip, has_tc, False, False, False, "; ".join(missing))
    name = f"{new_run_id(new_prefix())}-probe"
    try:
        made = run_cmd(["ip", "netns", "add", name], check=False)
        if made.returncode != 0:
            return Probe(
                root, True, True, False, False, False, f"cannot create a network namespace: {made.stderr.strip()}"
            )
        run_cmd(["ip", "-n", name, "link", "add", "name", "zsa", "type", "veth", "peer", "name", "zsb"])
        tbf = (
            run_cmd(
                [
                    "tc",
                    "-n",
                    name,
                    "qdisc",
                    "add",
                    "dev",
                    "zsa",
                    "root",
                    "handle",
                    "1:",
                    "tbf",
                    "rate",
                    "1mbit",
                    "burst",
                    "64kb",
                    "latency",
                    "50ms",
                ],
                check=False,
            ).returncode
            == 0
        )
        netem = (
            run_cmd(
                ["tc", "-n", name, "qdisc", "add", "dev", "zsb", "root", "netem", "delay", "1ms"], check=False
            ).returncode
            == 0
        )
    except RuntimeError as err:
        return Probe(root, True, True, True, False, False, f"cannot create a veth pair: {err}")
    finally:
        delete_namespace(name)
    reason = "" if tbf else "the kernel has no tbf qdisc (sch_tbf), so links cannot be shaped"
    return Probe(root, True, True, True, tbf, netem, reason)


def available() -> tuple[bool, str]:
    """(usable, explanation): whether ``EmulatedCluster`` can run here, and why not if it cannot."""
    result = probe()
    if not result.ok:
        return False, result.reason
    delay = "netem present: delay supported" if result.netem else "netem missing: delay=... unsupported"
    return True, f"root, iproute2, network namespaces, veth and tbf available; {delay}"


def link_counters(namespace: str, dev: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of ``dev`` inside ``namespace`` (64-bit kernel counters, L2 bytes)."""
    out = run_cmd(["ip", "-n", namespace, "-s", "-j", "link", "show", "dev", dev]).stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

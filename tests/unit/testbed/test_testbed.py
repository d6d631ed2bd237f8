"""Tests of zensync.testbed: rate parsing everywhere; namespaces, shaping, counters and teardown as root.

The netns tests build real 2-host clusters (100 Mbit/s links, addresses only in 10.77.0.0/24 inside
namespaces they create) and check that nothing with the cluster's prefix survives, also when the
body raises or workers time out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from zensync.testbed import (
    EmulatedCluster,
    LoopbackCluster,
    WorkerError,
    available,
    cleanup_stale,
    parse_rate,
)
from zensync.testbed.netns import list_namespaces, root_links_with_prefix

_AVAILABLE, _WHY = available() if sys.platform == "linux" else (False, "not Linux")
needs_netns = pytest.mark.skipif(not _AVAILABLE, reason=f"emulated clusters unavailable: {_WHY}")

PAYLOAD_BYTES = 5_000_000
RATE = "100mbit"
SHAPING_FLOOR = 0.8
"""The transfer must take at least this fraction of payload / rate: tbf's 64 KiB bucket lets ~1 %
through unshaped, and timing starts at the first byte, so a working shaper lands near 1.0."""


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("1gbit", 10**9),
        ("100mbit", 10**8),
        ("500kbit", 5 * 10**5),
        ("2.5gbit", 25 * 10**8),
        ("1GBit", 10**9),
        (1e9, 10**9),
        (12345678, 12345678),
        ("800", 800 * 1),
        ("10mbps", 8 * 10**7),
    ],
)
def test_parse_rate(text: str | float, bits: int) -> None:
    if bits < 8000:
        with pytest.raises(ValueError, match="below the minimum"):
            parse_rate(text)
    else:
        assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["1gbyte", "fast", "", "-5mbit", "1..2gbit", float("nan"), True])
def test_parse_rate_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="rate="):
        parse_rate(bad)  # type: ignore[arg-type]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_hosts"):
        EmulatedCluster(0)
    with pytest.raises(ValueError, match="subnet"):
        EmulatedCluster(2, subnet="8.8.8.0/24")
    with pytest.raises(ValueError, match="delay"):
        EmulatedCluster(2, delay="2 parsecs")


def test_loopback_run_workers_and_env() -> None:
    with LoopbackCluster(2) as cluster:
        assert cluster.counters() is None
        env = cluster.env_for_torch(1, 29999)
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo" and env["RANK"] == "1"
        results = cluster.run_workers(
            lambda r: [sys.executable, "-c", "import os; print(os.environ['ZS_X'])"],
            lambda r: {"ZS_X": f"r{r}"},
            timeout_s=30,
        )
    assert [r.stdout.strip() for r in results] == ["r0", "r1"]


def test_run_workers_with_ranks_per_host() -> None:
    """Consecutive ranks share a host; WORLD_SIZE and LOCAL_RANK count them."""
    with LoopbackCluster(2) as cluster:
        env = cluster.env_for_torch(3, 29999, ranks_per_host=2)
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
        with pytest.raises(ValueError, match="host index 2"):
            cluster.env_for_torch(4, 29999, ranks_per_host=2)
        results = cluster.run_workers(
            lambda r: [sys.executable, "-c", "import os; print(os.environ['ZS_X'])"],
            lambda r: {"ZS_X": f"r{r}"},
            timeout_s=30,
            ranks_per_host=2,
        )
    assert [r.stdout.strip() for r in results] == ["r0", "r1", "r2", "r3"]


def test_run_workers_polls_while_waiting() -> None:
    polls: list[float] = []
    with LoopbackCluster(1) as cluster:
        cluster.run_workers(
            lambda r: [sys.executable, "-c", "import time; time.sleep(1)"],
            timeout_s=30,
            on_poll=lambda: polls.append(time.monotonic()),
        )
    assert len(polls) >= 5  # every POLL_S (0.05 s) for at least the worker's 1 s


def _leftovers(prefix: str) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(prefix)] + root_links_with_prefix(prefix)


def _tool(*args: str) -> list[str]:
    return [sys.executable, "-m", "zensync.testbed._sockets", *args]


@pytest.mark.netns
@needs_netns
def test_shaped_transfer_counters_and_teardown() -> None:
    with EmulatedCluster(2, rate=RATE) as cluster:
        prefix = cluster.prefix
        assert len(list_namespaces()) >= 3 and not root_links_with_prefix(prefix)
        before = cluster.counters()
        common = ["--port", "5201", "--nbytes", str(PAYLOAD_BYTES)]
        server = cluster.popen(1, _tool("recv", "--bind", cluster.host_ip(1), *common), stdout=subprocess.PIPE)
        client = cluster.popen(0, _tool("send", "--host", cluster.host_ip(1), *common), stdout=subprocess.PIPE)
        sent = json.loads(client.communicate(timeout=30)[0])
        got = json.loads(server.communicate(timeout=30)[0])
        after = cluster.counters()
    min_seconds = PAYLOAD_BYTES * 8 / parse_rate(RATE)
    assert got["seconds"] >= SHAPING_FLOOR * min_seconds, (got, min_seconds)
    assert sent["seconds"] >= SHAPING_FLOOR * min_seconds, (sent, min_seconds)
    assert after[0][0] - before[0][0] >= PAYLOAD_BYTES  # host 0 tx
    assert after[1][1] - before[1][1] >= PAYLOAD_BYTES  # host 1 rx
    assert not _leftovers(prefix)


@pytest.mark.slow  # 5-10 s of namespace setup: the README's command stays under 6 minutes
@pytest.mark.netns
@needs_netns
def test_a_replaced_host_loses_its_processes_and_keeps_its_address_and_rate() -> None:
    with EmulatedCluster(2, rate=RATE) as cluster:
        prefix = cluster.prefix
        cluster.set_rate(1, "50mbit")
        old = cluster.popen(1, ["sleep", "60"])
        killed = cluster.replace_host(1)
        assert old.wait(timeout=10) == -9 and old.pid in killed  # SIGKILLed with its namespace
        common = ["--port", "5202", "--nbytes", str(PAYLOAD_BYTES)]
        server = cluster.popen(1, _tool("recv", "--bind", cluster.host_ip(1), *common), stdout=subprocess.PIPE)
        client = cluster.popen(0, _tool("send", "--host", cluster.host_ip(1), *common), stdout=subprocess.PIPE)
        client.communicate(timeout=60)
        got = json.loads(server.communicate(timeout=60)[0])
    # the new host answers at the old address, shaped at its set_rate
    assert got["seconds"] >= SHAPING_FLOOR * PAYLOAD_BYTES * 8 / parse_rate("50mbit")
    assert not _leftovers(prefix)


@pytest.mark.netns
@needs_netns
def test_teardown_when_body_raises() -> None:
    prefix = ""
    with pytest.raises(KeyError, match="boom"), EmulatedCluster(2, rate=RATE) as cluster:
        prefix = cluster.prefix
        cluster.popen(0, ["sleep", "60"])
        raise KeyError("boom")
    assert prefix and not _leftovers(prefix)


@pytest.mark.netns
@needs_netns
def test_run_workers_timeout_kills_everything() -> None:
    with EmulatedCluster(2, rate=RATE) as cluster:
        prefix = cluster.prefix
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"timed out after 2\.0 s") as info:
            cluster.run_workers(
                lambda r: [
                    sys.executable,
                    "-c",
                    "import sys,time; print('x', file=sys.stderr, flush=True); time.sleep(60)",
                ],
                timeout_s=2.0,
            )
        assert time.monotonic() - start < 15
        assert "--- rank 0" in str(info.value) and "--- rank 1" in str(info.value)
        for ns in cluster.host_ns:
            assert not subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.strip()
    assert not _leftovers(prefix)


@pytest.mark.netns
@needs_netns
def test_worker_failure_reports_stderr() -> None:
    with EmulatedCluster(2, rate=RATE) as cluster, pytest.raises(WorkerError, match="rank 1 exit 3") as info:
        cluster.run_workers(
            lambda r: [sys.executable, "-c", f"import sys; sys.stderr.write('oops{r}'); sys.exit({3 if r else 0})"],
            timeout_s=20,
        )
    assert "oops1" in str(info.value)


@pytest.mark.netns
@needs_netns
def test_sigterm_tears_down_and_cleanup_stale() -> None:
    code = (
        "import sys, time; from zensync.testbed import EmulatedCluster\n"
        "with EmulatedCluster(2, rate='100mbit') as c:\n"
        "    print(c.prefix, flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        prefix = proc.stdout.readline().strip() if proc.stdout else ""
        assert prefix.startswith("zs") and _leftovers(prefix)
        proc.terminate()
        assert proc.wait(timeout=20) == 128 + 15
        assert not _leftovers(prefix)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # a SIGKILLed owner leaves namespaces; cleanup_stale removes them
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    prefix = proc.stdout.readline().strip() if proc.stdout else ""
    proc.kill()
    proc.wait()
    assert _leftovers(prefix)
    removed = cleanup_stale().namespaces
    assert all(n.startswith("zs") for n in removed) and any(n.startswith(prefix + "-") for n in removed)
    assert not _leftovers(prefix)


def test_env_for_torch_emulated_without_entering() -> None:
    cluster = EmulatedCluster(3)
    env = cluster.env_for_torch(2, 29500)
    assert env == {
        "MASTER_ADDR": "10.77.0.1",
        "MASTER_PORT": "29500",
        "GLOO_SOCKET_IFNAME": "eth0",
        "RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "0",
    }
    assert cluster.host_ip(2) == "10.77.0.3" and os.getpid() % 10000 == int(cluster.prefix[2:-2])


def test_command_for_is_the_hosts_command_line() -> None:
    """What a launcher that starts the process itself (mpiexec's MPMD line) runs on host i."""
    cluster = LoopbackCluster(2)
    assert cluster.command_for(1, ["python", 3]) == ["python", "3"]  # loopback: the command as is
    with pytest.raises(ValueError, match="host index 2 out of range"):
        cluster.command_for(2, ["python"])

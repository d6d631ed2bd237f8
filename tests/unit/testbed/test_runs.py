"""Leftovers of SIGKILLed runs (zensync.testbed.runs): found and removed at the next start or by the CLI,
and only those: a live run's namespaces, workers, temp dirs and record survive every cleanup.

Owners run in subprocesses (a SIGKILL must hit a real process). The netns tests build real 2-host
clusters (addresses only in 10.77.0.0/24, inside namespaces they create); every test kills what it
started and runs ``cleanup_stale`` in a ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from zensync.testbed import EmulatedCluster, available, cleanup_stale
from zensync.testbed.netns import list_namespaces
from zensync.testbed.runs import ProcessId, RunRecord, state_dir

_AVAILABLE, _WHY = available() if sys.platform == "linux" else (False, "not Linux")
needs_netns = pytest.mark.skipif(not _AVAILABLE, reason=f"emulated clusters unavailable: {_WHY}")
needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")

_OWNER = """
import json, sys, time
from zensync.testbed import EmulatedCluster, LoopbackCluster
cluster = EmulatedCluster(2, rate="100mbit") if sys.argv[1] == "netns" else LoopbackCluster(2)
with cluster, cluster.temp_dir("zensync-test-") as tmp:
    worker = cluster.popen(0, ["sleep", "600"])
    print(json.dumps({"run_id": cluster.run_id, "tmp": str(tmp), "worker": worker.pid}), flush=True)
    time.sleep(600)
"""
"""A cluster owner: prints its run id, temp dir and worker pid once all exist, then waits to be killed."""


@contextlib.contextmanager
def _owner(kind):
    """Start an owner of kind 'netns' or 'loopback'; yield (process, its JSON line); kill it and clean up."""
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, kind], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, f"owner exited with {proc.wait(timeout=30)} before it was set up"
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        cleanup_stale()


def _leftovers(info):
    """What of the owner's run still exists, by kind."""
    found = {}
    namespaces = [n for n in list_namespaces() if n.startswith(info["run_id"] + "-")] if _AVAILABLE else []
    if namespaces:
        found["namespaces"] = namespaces
    if ProcessId.of(info["worker"]) is not None:
        found["worker"] = info["worker"]
    if os.path.exists(info["tmp"]):
        found["tmp"] = info["tmp"]
    if (state_dir() / f"{info['run_id']}.json").exists():
        found["record"] = info["run_id"]
    return found


def _cleanup_cli():
    done = subprocess.run(
        [sys.executable, "-m", "zensync.testbed", "cleanup"], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout


@needs_proc
def test_process_id_tells_a_recycled_pid_and_a_zombie_from_the_process():
    me = ProcessId.of(os.getpid())
    assert me is not None and me.alive()
    fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    assert me.start_ticks == int(fields[19])  # field 22 of stat
    assert not ProcessId(os.getpid(), me.start_ticks + 1).alive()  # same pid, other start: another process
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert ProcessId.of(child.pid) is not None
        child.kill()
        deadline = time.monotonic() + 10
        while pathlib.Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ProcessId.of(child.pid) is None  # killed, not yet reaped
    finally:
        child.kill()
        child.wait()
    assert ProcessId.of(child.pid) is None


@needs_proc
def test_cleanup_treats_a_recycled_owner_pid_as_dead_and_spares_a_recycled_worker_pid():
    # A record whose owner pid exists (this process) but started at another time: the owner died and
    # its pid was reused. Its worker is killed, its temp dir removed; a recorded worker pid that now
    # belongs to another process (this one, again with another start time) is not touched.
    me = ProcessId.of(os.getpid())
    worker = subprocess.Popen(["sleep", "600"], start_new_session=True)
    tmp = tempfile.mkdtemp(prefix="zensync-test-")
    run_id = f"zs0000ff-{os.getpid()}"
    record = RunRecord(run_id)
    try:
        record.add_worker(worker.pid)
        record.add_temp_dir(tmp)
        data = json.loads(record.path.read_text())
        data["owner"]["start_ticks"] = me.start_ticks - 1
        data["workers"].append({"pid": os.getpid(), "start_ticks": me.start_ticks - 1})
        record.path.write_text(json.dumps(data))
        report = cleanup_stale()
        assert run_id in report.runs and worker.pid in report.processes and tmp in report.temp_dirs
        assert worker.wait(timeout=10) == -signal.SIGKILL
        assert not os.path.exists(tmp) and not record.path.exists()
    finally:
        worker.kill()
        worker.wait()
        record.close()
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(tmp)


def test_temp_dirs_must_be_named_for_zensync():
    from zensync.testbed import LoopbackCluster

    with LoopbackCluster(1) as cluster, pytest.raises(ValueError, match="zensync-"), cluster.temp_dir("mine-"):
        pass


@pytest.mark.slow  # ~11 s; the default run keeps the emulated cluster's next-start cleanup
@needs_proc
def test_sigkilled_loopback_run_is_cleaned_up_and_a_live_one_kept():
    with _owner("loopback") as (proc, info):
        _cleanup_cli()
        assert set(_leftovers(info)) == {"worker", "tmp", "record"}  # live: untouched
        proc.kill()
        proc.wait()
        assert set(_leftovers(info)) == {"worker", "tmp", "record"}  # the worker has its own session
        out = _cleanup_cli()
        assert info["run_id"] in out and "1 process(es)" in out and "1 temp dir(s)" in out
        assert not _leftovers(info)


@pytest.mark.netns
@needs_netns
# "cli" runs in the slow tier: the default tier has "next start" here and the CLI's cleanup of a SIGKILLed
# loopback run (test_sigkilled_loopback_run_is_cleaned_up_and_a_live_one_kept).
@pytest.mark.parametrize("how", ["next start", pytest.param("cli", marks=pytest.mark.slow)])
def test_sigkilled_emulated_run_is_cleaned_up(how):
    with _owner("netns") as (proc, info):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = _leftovers(info)
        assert set(left) == {"namespaces", "worker", "tmp", "record"} and len(left["namespaces"]) == 3
        inside = subprocess.run(["ip", "netns", "pids", f"{info['run_id']}-h0"], capture_output=True, text=True)
        assert str(info["worker"]) in inside.stdout.split()
        if how == "cli":
            assert info["run_id"] in _cleanup_cli()
            assert not _leftovers(info)
        else:
            with EmulatedCluster(1, rate="100mbit") as cluster:
                assert not _leftovers(info)
                assert [n for n in list_namespaces() if n.startswith(cluster.run_id)]  # its own: built


@pytest.mark.slow  # ~9 s; the default run keeps the emulated cluster's next-start cleanup
@pytest.mark.netns
@needs_netns
def test_cleanup_from_another_process_leaves_a_live_run_alone():
    with _owner("netns") as (proc, info):
        before = _leftovers(info)
        assert set(before) == {"namespaces", "worker", "tmp", "record"}
        report = cleanup_stale()
        assert info["run_id"] not in report.runs
        assert not [n for n in report.namespaces if n.startswith(info["run_id"])]
        assert info["run_id"] not in _cleanup_cli()
        with EmulatedCluster(1, rate="100mbit"):  # a start cleans up too
            pass
        assert _leftovers(info) == before
        proc.terminate()  # its own teardown then removes everything, record included
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert not _leftovers(info)

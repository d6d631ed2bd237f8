"""The host's checkpoint agent and ``zensync launch`` / ``zensync agent``: the store directory is locked
against a second agent, removed when the agent stops (kept with keep_store), and the commands refuse
bad use in one line with exit status 2 (1 when the store is held)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

from zensync import cli
from zensync.cli.launch import _job_id
from zensync.resilience import ShardStore
from zensync.resilience.agent import AgentBusy, CheckpointAgent, default_root
from zensync.resilience.checkpointer import ROOT_ENV

AGENT_START_TIMEOUT_S = 60.0


def test_the_agent_locks_exports_and_removes_its_store(tmp_path) -> None:
    root = tmp_path / "store"
    with CheckpointAgent(root) as agent:
        assert agent.env() == {ROOT_ENV: str(root)} and agent.info()["pid"] == os.getpid()
        ShardStore(root).save(0, 1, {"w": __import__("torch").ones(3)})
        with pytest.raises(AgentBusy, match="held by another"):
            CheckpointAgent(root).start()
    assert not root.exists()  # the memory is given back
    with CheckpointAgent(root, keep_store=True):
        ShardStore(root).save(0, 1, {"w": __import__("torch").ones(3)})
    assert [v.step for v in ShardStore(root).versions(0)] == [1]


def test_the_job_id_names_the_store() -> None:
    none = argparse.Namespace(job_id=None)
    assert _job_id(argparse.Namespace(job_id="j1"), ["--rdzv-id", "x"]) == "j1"
    assert _job_id(none, ["--nnodes", "2", "--rdzv-id", "job42", "t.py"]) == "job42"
    assert _job_id(none, ["--rdzv_id=job7", "t.py"]) == "job7"
    assert str(default_root("a/b c")) == "/dev/shm/zensync-ckpt-a_b_c"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch"], "torchrun's arguments after --"),
        (["launch", "--"], "torchrun's arguments"),
        (["agent"], "--ckpt-root"),
    ],
)
def test_bad_use_exits_2_in_one_line(argv: list[str], message: str, capsys) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_held_store_fails_launch_with_exit_1(tmp_path, capsys) -> None:
    with CheckpointAgent(tmp_path / "store"):
        assert cli.main(["launch", "--ckpt-root", str(tmp_path / "store"), "--", "t.py"]) == 1
    assert "held by another zensync checkpoint agent" in capsys.readouterr().err


def test_zensync_agent_holds_the_store_until_sigterm(tmp_path) -> None:
    root = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "zensync", "agent", "--ckpt-root", str(root)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert "holding" in proc.stdout.readline()  # printed once the lock is held
        with pytest.raises(AgentBusy):
            CheckpointAgent(root).start()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(AGENT_START_TIMEOUT_S) == 0
    finally:
        proc.kill()
    deadline = time.monotonic() + AGENT_START_TIMEOUT_S
    while root.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not root.exists()

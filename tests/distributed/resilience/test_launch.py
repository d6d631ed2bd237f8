"""``zensync launch`` (torchrun + the host's checkpoint agent): a worker SIGKILLed at a random step is
restarted by torchrun, and both workers restore from the agent's shared memory; the final
parameters equal an uninterrupted run's, bit for bit (2 ranks: every sum is a + b). Only the step in
flight is run again. The agent removes the store when the job ends.

The same across 2 emulated hosts (network namespaces at 1 Gbit/s): one ``zensync launch`` per host
(its own agent and store), torchrun's c10d rendezvous on host 0, each host's shards replicated to
the other. A worker killed on one host restarts every worker on both hosts (torchrun's elastic
restart); each restores from its own host's agent."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zensync.testbed import EmulatedCluster, available

SCRIPT = Path(__file__).with_name("_train_under_launch.py")
STEPS = 8
LAUNCH_TIMEOUT_S = 240
_AVAILABLE, _WHY = available() if sys.platform == "linux" else (False, "not Linux")
_RDZV_PORT = 29771


def _launch(tmp_path: Path, name: str, kill_step: int, kill_rank: int) -> list[dict]:
    out, root = tmp_path / name, tmp_path / f"{name}-store"
    out.mkdir()
    command = [sys.executable, "-m", "zensync", "launch", "--ckpt-root", str(root), "--",
               "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
               str(SCRIPT), str(out), str(STEPS), str(kill_step), str(kill_rank)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=SCRIPT.parents[3])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not root.exists()  # the agent gave the memory back
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow  # two torchrun jobs, one restarted: about 40 s of process start-up on 2 cores
@pytest.mark.parametrize("seed", [0, 1])
def test_a_worker_killed_at_a_random_step_resumes_from_memory(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    kill_step, kill_rank = rng.randrange(1, STEPS - 1), rng.randrange(2)
    want = _launch(tmp_path, "uninterrupted", -1, 0)
    got = _launch(tmp_path, "killed", kill_step, kill_rank)
    for rank in range(2):
        assert want[rank]["restart"] == 0 and got[rank]["restart"] == 1
        recovery = got[rank]["recovery"]
        assert recovery["source"] == "local"
        # the step in flight is the only one run again: the newest step every rank saved is the one before
        assert recovery["step"] == kill_step - 1 and got[rank]["start"] == kill_step
        assert recovery["lost_steps"] <= 1  # the other rank may have saved the step in flight
        for step, loss in got[rank]["losses"].items():
            assert loss == want[rank]["losses"][step]
        for mine, theirs in zip(got[rank]["params"], want[rank]["params"], strict=True):
            assert torch.equal(mine, theirs)
        assert got[rank]["hook_step"] == STEPS


def _launch_on_hosts(cluster: EmulatedCluster, tmp_path: Path, name: str, kill_step: int, kill_rank: int) -> list[dict]:
    """One ``zensync launch`` per emulated host (1 worker each), torchrun's rendezvous store on host 0
    (``is_host``: a namespace's address is not its machine's hostname, which torchrun checks)."""
    out = tmp_path / name
    out.mkdir()
    procs = []
    for host in range(cluster.num_hosts):
        root = tmp_path / f"{name}-store{host}"
        command = [sys.executable, "-m", "zensync", "launch", "--ckpt-root", str(root), "--",
                   "--nnodes", str(cluster.num_hosts), "--nproc-per-node", "1", "--max-restarts", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.host_ip(0)}:{_RDZV_PORT}",
                   "--rdzv-id", name, "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", cluster.host_ip(host),
                   str(SCRIPT), str(out), str(STEPS), str(kill_step), str(kill_rank), "1"]  # fmt: skip
        env = {"GLOO_SOCKET_IFNAME": cluster.interface, "PYTHONPATH": str(SCRIPT.parents[3])}
        procs.append(cluster.popen(host, command, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    for host, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"host {host}: {text[-4000:]}"
        assert not (tmp_path / f"{name}-store{host}").exists()  # each agent gave its memory back
    return [torch.load(out / f"rank{r}.pt") for r in range(cluster.num_hosts)]


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not _AVAILABLE, reason=f"emulated clusters unavailable: {_WHY}")
def test_a_worker_killed_on_one_of_two_hosts_resumes_every_host_from_memory(tmp_path: Path) -> None:
    kill_step, kill_rank = 4, 1
    with EmulatedCluster(2, rate="1gbit") as cluster:
        want = _launch_on_hosts(cluster, tmp_path, "uninterrupted", -1, 0)
        got = _launch_on_hosts(cluster, tmp_path, "killed", kill_step, kill_rank)
    # torchrun counts a restart on the host whose worker failed; the other host's agent restarts its
    # worker for the new membership, counted (its worker failed first) or not (it saw the new round first)
    assert got[kill_rank]["restart"] == 1 and got[1 - kill_rank]["restart"] in (0, 1)
    for rank in range(2):
        assert want[rank]["restart"] == 0
        assert want[rank]["replicated"] and got[rank]["replicated"]  # each host's shard had its peer copy
        recovery = got[rank]["recovery"]
        assert recovery["source"] == "local"
        assert recovery["step"] == kill_step - 1 and got[rank]["start"] == kill_step
        for step, loss in got[rank]["losses"].items():
            assert loss == want[rank]["losses"][step]
        for mine, theirs in zip(got[rank]["params"], want[rank]["params"], strict=True):
            assert torch.equal(mine, theirs)
        assert got[rank]["hook_step"] == STEPS

"""``zensync launch`` (torchrun + the host's checkpoint agent): a worker SIGKILLed at a random step is
restarted by torchrun, and both workers restore from the agent's shared memory; the final
parameters equal an uninterrupted run's, bit for bit (2 ranks: every sum is a + b). Only the step in
flight is run again. The agent removes the store when the job ends."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("_train_under_launch.py")
STEPS = 8
LAUNCH_TIMEOUT_S = 240


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
